//! `mlxbc`: ask questions and manage the mlxbcd daemon from a shell.
//!
//! Exit codes: 0 success (also when stdout is closed early, e.g. `| head`),
//! 1 other errors, 2 bad usage, 3 daemon unreachable or could not start,
//! 4 the daemon refused the request (unknown model, prompt too long, ...),
//! 130 interrupted by Ctrl-C.

use anyhow::Result;
use clap::{Parser, Subcommand};
use mlxbc_client::{
    CacheCommand, ChatMessage, Client, ClientError, GenerateRequest, KeepAlive, MediaRef, Response, SamplingParams,
    Settings,
};
use std::io::{IsTerminal, Read, Write};
use std::process::ExitCode;

/// Talk to mlxbcd, the resident MLX model server.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Cli {
    /// Socket of the daemon (default: from settings or MLXBC_SOCKET).
    #[arg(long, global = true)]
    socket: Option<std::path::PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Ask a question; the answer streams to stdout. Piped stdin is appended to the prompt.
    Ask(AskArgs),
    /// List the models the daemon can serve.
    Models,
    /// Show loaded models.
    Ps,
    /// Show the daemon's status.
    Status,
    /// Load a model now.
    Load {
        model: String,
        /// How long it stays loaded when idle: 30m, 0, forever.
        #[arg(long)]
        keep_alive: Option<String>,
    },
    /// Unload a model now.
    Unload { model: String },
    /// Stop the daemon.
    Stop,
    /// Inspect or maintain the encoder-feature store.
    Cache {
        #[command(subcommand)]
        command: CacheCmd,
    },
    /// Encode images ahead of time, so the first question about them is already a hit.
    Prefetch {
        /// Vision-language model whose tower encodes them.
        #[arg(long, short)]
        model: Option<String>,
        /// Image files.
        #[arg(required = true)]
        files: Vec<std::path::PathBuf>,
    },
}

#[derive(Subcommand, Debug, Clone, Copy)]
enum CacheCmd {
    /// Entries, sizes, hits and misses.
    Stats,
    /// Every stored feature entry.
    Ls,
    /// Remove every entry.
    Clear,
    /// Read every entry and drop damaged ones.
    Verify,
}

#[derive(clap::Args, Debug)]
struct AskArgs {
    /// The question.
    prompt: String,
    /// An image to ask about (repeatable, in order; `-` reads stdin).
    #[arg(long, short = 'i')]
    image: Vec<std::path::PathBuf>,
    /// Model name, alias or path (default: the configured default model).
    #[arg(long, short)]
    model: Option<String>,
    /// A system prompt.
    #[arg(long, short)]
    system: Option<String>,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, short, default_value_t = 0.0)]
    temperature: f32,
    /// Keep only the k most likely tokens (0: off).
    #[arg(long, default_value_t = 0)]
    top_k: u32,
    /// Nucleus sampling mass (1: off).
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Most tokens to generate.
    #[arg(long, short = 'n', default_value_t = 512)]
    max_tokens: u32,
    /// Seed for reproducible sampling.
    #[arg(long)]
    seed: Option<u64>,
    /// Stop before this text (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// How long the model stays loaded afterwards: 30m, 0, forever.
    #[arg(long)]
    keep_alive: Option<String>,
    /// Print one JSON object per event instead of text.
    #[arg(long)]
    json: bool,
    /// Keep generating past end-of-sequence (for benchmarks).
    #[arg(long)]
    ignore_eos: bool,
    /// Print statistics to stderr.
    #[arg(long, short)]
    verbose: bool,
}

const EXIT_UNREACHABLE: u8 = 3;
const EXIT_REFUSED: u8 = 4;
const EXIT_INTERRUPTED: u8 = 130;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("mlxbc: {e}");
            return ExitCode::FAILURE;
        }
    };
    let outcome = runtime.block_on(async {
        tokio::select! {
            r = run(cli) => r,
            _ = tokio::signal::ctrl_c() => Err(anyhow::Error::new(Interrupted)),
        }
    });
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => exit_for(&e),
    }
}

#[derive(Debug, thiserror::Error)]
#[error("interrupted")]
struct Interrupted;

fn exit_for(e: &anyhow::Error) -> ExitCode {
    if e.downcast_ref::<Interrupted>().is_some() {
        // Dropping the connection (the runtime is gone) cancels the generation.
        return ExitCode::from(EXIT_INTERRUPTED);
    }
    if let Some(io) = e.downcast_ref::<std::io::Error>() {
        if io.kind() == std::io::ErrorKind::BrokenPipe {
            return ExitCode::SUCCESS;
        }
    }
    eprintln!("mlxbc: {e:#}");
    match e.downcast_ref::<ClientError>() {
        Some(ClientError::Unreachable { .. } | ClientError::Spawn { .. } | ClientError::DaemonExited { .. }) => {
            ExitCode::from(EXIT_UNREACHABLE)
        }
        Some(ClientError::Daemon { .. } | ClientError::ProtocolMismatch(_)) => ExitCode::from(EXIT_REFUSED),
        _ => ExitCode::FAILURE,
    }
}

fn settings(cli: &Cli) -> Result<Settings> {
    let mut s = Settings::from_env()?;
    if let Some(sock) = &cli.socket {
        s.socket = sock.clone();
    }
    Ok(s)
}

fn keep_alive(text: &Option<String>) -> Result<Option<KeepAlive>> {
    text.as_deref().map(KeepAlive::parse).transpose().map_err(anyhow::Error::msg)
}

async fn run(cli: Cli) -> Result<()> {
    let settings = settings(&cli)?;
    match cli.command {
        Command::Ask(args) => {
            let request = ask_request(args_prompt(&args)?, &args)?;
            let mut client = Client::connect_or_start(&settings).await?;
            ask(&mut client, request, &args).await
        }
        Command::Stop => match Client::connect(&settings.socket).await {
            Ok(mut c) => Ok(c.shutdown().await?),
            Err(ClientError::Unreachable { .. }) => {
                eprintln!("mlxbc: no daemon is running at {}", settings.socket.display());
                Ok(())
            }
            Err(e) => Err(e.into()),
        },
        command => {
            let mut client = Client::connect_or_start(&settings).await?;
            manage(&mut client, command).await
        }
    }
}

/// Reads image files with the user's own permissions (the daemon never opens
/// a path a client names); `-` is stdin.
fn read_media(paths: &[std::path::PathBuf]) -> Result<Vec<MediaRef>> {
    paths
        .iter()
        .map(|p| {
            let bytes = if p.as_os_str() == "-" {
                let mut b = Vec::new();
                std::io::stdin().lock().read_to_end(&mut b)?;
                b
            } else {
                std::fs::read(p).map_err(|e| anyhow::anyhow!("reading image {}: {e}", p.display()))?
            };
            Ok(MediaRef::from_bytes(bytes))
        })
        .collect()
}

/// The prompt, with piped stdin appended (e.g. `git diff | mlxbc ask "..."`).
fn args_prompt(args: &AskArgs) -> Result<String> {
    let mut prompt = args.prompt.clone();
    let stdin = std::io::stdin();
    let stdin_is_an_image = args.image.iter().any(|p| p.as_os_str() == "-");
    if !stdin.is_terminal() && !stdin_is_an_image {
        let mut piped = String::new();
        stdin.lock().read_to_string(&mut piped)?;
        if !piped.trim().is_empty() {
            prompt.push_str("\n\n");
            prompt.push_str(piped.trim_end());
        }
    }
    Ok(prompt)
}

/// The one conversion from CLI arguments to a request.
fn ask_request(prompt: String, args: &AskArgs) -> Result<GenerateRequest> {
    let mut messages = Vec::new();
    if let Some(s) = &args.system {
        messages.push(ChatMessage::system(s.clone()));
    }
    let mut user = ChatMessage::user(prompt);
    user.images = read_media(&args.image)?;
    messages.push(user);
    Ok(GenerateRequest {
        model: args.model.clone(),
        messages,
        sampling: SamplingParams {
            temperature: args.temperature,
            top_k: args.top_k,
            top_p: args.top_p,
            seed: args.seed,
        },
        max_tokens: args.max_tokens,
        stop: args.stop.clone(),
        keep_alive: keep_alive(&args.keep_alive)?,
        ignore_eos: args.ignore_eos,
    })
}

async fn ask(client: &mut Client, request: GenerateRequest, args: &AskArgs) -> Result<()> {
    let mut stream = client.generate(request).await?;
    let mut out = std::io::stdout().lock();
    loop {
        let event = match stream.next_event().await {
            Ok(Some(e)) => e,
            Ok(None) => break,
            Err(ClientError::Daemon { kind, message }) if args.json => {
                writeln!(
                    out,
                    "{}",
                    serde_json::json!({"event": "error", "kind": format!("{kind:?}"), "message": message})
                )?;
                return Err(ClientError::Daemon { kind, message }.into());
            }
            Err(e) => return Err(e.into()),
        };
        if args.json {
            writeln!(out, "{}", event_json(&event))?;
            out.flush()?;
            continue;
        }
        match event {
            Response::Token { text } => {
                out.write_all(text.as_bytes())?;
                out.flush()?;
            }
            Response::Done { stats } => {
                writeln!(out)?;
                if args.verbose && stats.encoder_hits + stats.encoder_misses > 0 {
                    eprintln!(
                        "images: {} hit, {} encoded | lookup {:.1} ms, encode {:.0} ms | prefix tokens reused {} | prefill {:.0} ms",
                        stats.encoder_hits, stats.encoder_misses, stats.lookup_ms, stats.encode_ms, stats.prefix_tokens_reused, stats.prefill_ms
                    );
                }
                if args.verbose {
                    eprintln!(
                        "model {} | prompt {} tok | generated {} tok | ttft {:.0} ms (load {:.0} ms) | prefill {:.1} tok/s | decode {:.1} tok/s | stop {:?}",
                        stats.model, stats.prompt_tokens, stats.generated_tokens, stats.time_to_first_token_ms, stats.load_ms,
                        stats.prefill_tokens_per_s, stats.decode_tokens_per_s, stats.stop_reason
                    );
                }
            }
            _ => {}
        }
    }
    Ok(())
}

fn event_json(event: &Response) -> serde_json::Value {
    use serde_json::json;
    match event {
        Response::Started { model, prompt_tokens } => {
            json!({"event": "start", "model": model, "prompt_tokens": prompt_tokens})
        }
        Response::Token { text } => json!({"event": "token", "text": text}),
        Response::Done { stats } => json!({"event": "done", "stats": {
            "model": stats.model, "prompt_tokens": stats.prompt_tokens, "generated_tokens": stats.generated_tokens,
            "time_to_first_token_ms": stats.time_to_first_token_ms, "load_ms": stats.load_ms,
            "prefill_tokens_per_s": stats.prefill_tokens_per_s, "decode_tokens_per_s": stats.decode_tokens_per_s,
            "stop_reason": format!("{:?}", stats.stop_reason), "token_ids": stats.token_ids,
            "encoder_hits": stats.encoder_hits, "encoder_misses": stats.encoder_misses, "encode_ms": stats.encode_ms,
            "lookup_ms": stats.lookup_ms, "prefix_tokens_reused": stats.prefix_tokens_reused, "prefill_ms": stats.prefill_ms}}),
        other => json!({"event": "other", "debug": format!("{other:?}")}),
    }
}

fn gib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

async fn manage(client: &mut Client, command: Command) -> Result<()> {
    let mut out = std::io::stdout().lock();
    match command {
        Command::Models => {
            writeln!(out, "{:<40} {:<6} {:>12} {:<7} ALIASES", "NAME", "FORMAT", "SIZE", "LOADED")?;
            for m in client.list_models().await? {
                writeln!(
                    out,
                    "{:<40} {:<6} {:>12} {:<7} {}",
                    m.name,
                    m.format,
                    gib(m.size_bytes),
                    if m.loaded { "yes" } else { "" },
                    m.aliases.join(",")
                )?;
            }
        }
        Command::Ps => {
            let s = client.status().await?;
            writeln!(
                out,
                "{:<40} {:<6} {:>12} {:<10} {:>10} {:>8}",
                "NAME", "ARCH", "MEMORY", "KEEP", "UNLOAD IN", "IDLE"
            )?;
            for m in s.loaded {
                let until = m.expires_in_s.map_or("never".into(), |s| format!("{s}s"));
                writeln!(
                    out,
                    "{:<40} {:<6} {:>12} {:<10} {:>10} {:>7}s",
                    m.name,
                    m.architecture,
                    gib(m.memory_bytes),
                    m.keep_alive.to_string(),
                    until,
                    m.idle_s
                )?;
            }
        }
        Command::Status => {
            let s = client.status().await?;
            writeln!(out, "mlxbcd {} (protocol {}), pid {}, up {}s", s.daemon_version, s.protocol, s.pid, s.uptime_s)?;
            writeln!(out, "socket:   {}", client.socket().display())?;
            writeln!(out, "device:   {} (BLAS: {})", s.device, s.blas)?;
            writeln!(
                out,
                "memory:   MLX active {}, peak {}, RSS {}",
                gib(s.mlx_active_bytes),
                gib(s.mlx_peak_bytes),
                gib(s.rss_bytes)
            )?;
            writeln!(out, "loaded:   {}", s.loaded.iter().map(|m| m.name.as_str()).collect::<Vec<_>>().join(", "))?;
            writeln!(out, "queue:    {} waiting; {} requests served", s.queued_jobs, s.requests_served)?;
        }
        Command::Load { model, keep_alive: ka } => {
            let (name, ms, bytes) = client.load(&model, keep_alive(&ka)?).await?;
            writeln!(out, "loaded {name} in {ms} ms ({})", gib(bytes))?;
        }
        Command::Unload { model } => {
            let was = client.unload(&model).await?;
            writeln!(out, "{}", if was { format!("unloaded {model}") } else { format!("{model} was not loaded") })?;
        }
        Command::Cache { command } => {
            let cmd = match command {
                CacheCmd::Stats => CacheCommand::Stats,
                CacheCmd::Ls => CacheCommand::List,
                CacheCmd::Clear => CacheCommand::Clear,
                CacheCmd::Verify => CacheCommand::Verify,
            };
            let r = client.cache(cmd).await?;
            for e in &r.listing {
                writeln!(out, "{}  tower {}  {}", e.content, e.tower, gib(e.bytes))?;
            }
            match command {
                CacheCmd::Clear => writeln!(out, "removed {} entries", r.removed)?,
                CacheCmd::Verify => writeln!(out, "{} entries ok, {} damaged entries removed", r.entries, r.removed)?,
                CacheCmd::Ls => {}
                CacheCmd::Stats => {
                    writeln!(out, "store:     {}", r.path)?;
                    writeln!(
                        out,
                        "entries:   {} ({} of {} on disk; {} in RAM, {})",
                        r.entries,
                        gib(r.disk_bytes),
                        gib(r.disk_budget_bytes),
                        r.ram_entries,
                        gib(r.ram_bytes)
                    )?;
                    writeln!(
                        out,
                        "hits:      {} RAM, {} disk; misses {}; evictions {}; corrupt {}",
                        r.ram_hits, r.disk_hits, r.misses, r.evictions, r.corrupt
                    )?;
                }
            }
        }
        Command::Prefetch { model, files } => {
            let (encoded, cached) = client.prefetch(model.as_deref(), read_media(&files)?).await?;
            writeln!(out, "{encoded} encoded, {cached} already stored")?;
        }
        Command::Ask(_) | Command::Stop => unreachable!("handled in run"),
    }
    Ok(())
}
