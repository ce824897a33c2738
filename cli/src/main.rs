//! `mlxbc`: ask questions and manage the mlxbcd daemon from a shell.
//!
//! Exit codes: 0 success (also when stdout is closed early, e.g. `| head`),
//! 1 other errors, 2 bad usage, 3 daemon unreachable or could not start,
//! 4 the daemon refused the request (unknown model, prompt too long, ...),
//! 130 interrupted by Ctrl-C.

mod ask;
mod chat;
mod embed;
mod manage;
mod prefetch;
mod progress;
mod pull;
mod rerank;
mod service;
mod transcribe;

use anyhow::Result;
use clap::{Parser, Subcommand};
use mlxbc_client::{Client, ClientError, KeepAlive, Settings};
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
pub(crate) enum Command {
    /// Ask a question; the answer streams to stdout. Piped stdin is appended to the prompt.
    Ask(Box<AskArgs>),
    /// A conversation: interactive with line editing, or one turn per line of piped stdin.
    Chat(ChatArgs),
    /// Transcribe audio files with a speech model (Whisper): text, JSON, SRT or WebVTT.
    Transcribe(transcribe::TranscribeArgs),
    /// Embed texts with an embedding model: a JSON array (or .npy row) per text.
    Embed(embed::EmbedArgs),
    /// Order documents by a reranker's relevance to a query, most relevant first.
    Rerank(rerank::RerankArgs),
    /// List the daemon's named conversations, show one, or forget one.
    Sessions {
        #[command(subcommand)]
        command: Option<SessionsCmd>,
    },
    /// Print a shell completion script: `mlxbc completions bash > /etc/bash_completion.d/mlxbc`.
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Fetch a model from the Hugging Face hub (HF_ENDPOINT honoured) into the shared HF cache.
    Pull {
        /// Repository, e.g. mlx-community/gemma-3-4b-it-4bit.
        repo: String,
        /// Branch, tag or commit.
        #[arg(long, default_value = "main")]
        revision: String,
        /// Only files matching this glob (repeatable), e.g. '*Q4_K_M.gguf'.
        #[arg(long)]
        include: Vec<String>,
    },
    /// List the models the daemon can serve.
    Models,
    /// Show loaded models.
    Ps,
    /// Show the daemon's status.
    Status {
        /// Everything as one JSON object: the status, the counters
        /// `/metrics` exports, and the stores' statistics.
        #[arg(long)]
        json: bool,
    },
    /// Load a model now.
    Load {
        model: String,
        /// How long it stays loaded when idle: 30m, 0, forever.
        #[arg(long)]
        keep_alive: Option<String>,
        /// Split it over the daemon's group (docs/distributed.md).
        #[arg(long)]
        sharded: bool,
    },
    /// The group of daemons this one leads (docs/distributed.md).
    Cluster {
        #[command(subcommand)]
        verb: ClusterCmd,
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
        #[arg(long, short, value_parser = crate::model_arg)]
        model: Option<String>,
        /// Image files.
        #[arg(required = true)]
        files: Vec<std::path::PathBuf>,
    },
    /// Install and drive the login service (launchd LaunchAgent / systemd user units).
    Service {
        #[command(subcommand)]
        verb: ServiceCmd,
        /// Print the files and commands instead of writing and running them.
        #[arg(long, global = true)]
        dry_run: bool,
        /// `logs`: keep printing new lines.
        #[arg(long, short, global = true)]
        follow: bool,
    },
}

#[derive(Subcommand, Debug, Clone, Copy)]
enum ClusterCmd {
    /// Form the group again now (after a worker came back, or was fixed).
    Restart,
}

#[derive(Subcommand, Debug, Clone, Copy)]
enum ServiceCmd {
    /// Write the service definition and start it at every login (socket-activated).
    Install,
    /// Stop the service and remove its definition.
    Uninstall,
    /// Start the daemon now.
    Start,
    /// Stop the daemon (the socket keeps listening; the next client starts it again).
    Stop,
    /// What the service manager says about it.
    Status,
    /// The daemon's log.
    Logs,
}

#[derive(Subcommand, Debug, Clone)]
pub(crate) enum SessionsCmd {
    /// Every session (the default).
    Ls,
    /// One session's messages.
    Show { name: String },
    /// Forget a session.
    Rm { name: String },
}

#[derive(clap::Args, Debug)]
pub(crate) struct ChatArgs {
    /// Model name, alias or path (default: the configured default model).
    #[arg(long, short, value_parser = crate::model_arg)]
    model: Option<String>,
    /// A system prompt (sent with the first turn).
    #[arg(long, short)]
    system: Option<String>,
    /// Keep the conversation in the daemon under this name, across restarts.
    #[arg(long)]
    session: Option<String>,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, short, default_value_t = 0.0)]
    temperature: f32,
    /// Most tokens per answer.
    #[arg(long, short = 'n', default_value_t = 1024)]
    max_tokens: u32,
}

#[derive(Subcommand, Debug, Clone, Copy)]
pub(crate) enum CacheCmd {
    /// Entries, sizes, hits and misses (the feature store and the prompt cache).
    Stats,
    /// Every stored feature entry.
    Ls,
    /// Remove every entry (with --prompts: every prompt KV block instead).
    Clear {
        /// Clear the prompt cache (RAM and disk), not the feature store.
        #[arg(long)]
        prompts: bool,
    },
    /// Read every entry and drop damaged ones.
    Verify,
}

/// `mlxbc ask --speculate`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SpeculateArg {
    Auto,
    Off,
    Ngram,
    Draft,
}

impl From<SpeculateArg> for mlxbc_client::Speculation {
    fn from(a: SpeculateArg) -> Self {
        match a {
            SpeculateArg::Auto => Self::Auto,
            SpeculateArg::Off => Self::Off,
            SpeculateArg::Ngram => Self::Ngram,
            SpeculateArg::Draft => Self::Draft,
        }
    }
}

#[derive(clap::Args, Debug)]
pub(crate) struct AskArgs {
    /// The question.
    prompt: String,
    /// An image to ask about (repeatable, in order; `-` reads stdin).
    #[arg(long, short = 'i')]
    image: Vec<std::path::PathBuf>,
    /// A video to ask about (repeatable; after the images): MP4, MOV, WebM
    /// and whatever else ffmpeg reads on the daemon's machine, or an
    /// animated GIF/WebP. Frames are sampled by the model's video settings.
    #[arg(long)]
    video: Vec<std::path::PathBuf>,
    /// An audio clip to ask about (repeatable; after the videos): WAV,
    /// FLAC, MP3 or OGG, for a model that hears (Gemma 4 E2B/E4B). To turn
    /// speech into text, `mlxbc transcribe` with a speech model.
    #[arg(long)]
    audio: Vec<std::path::PathBuf>,
    /// Model name, alias or path (default: the configured default model).
    #[arg(long, short, value_parser = crate::model_arg)]
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
    /// Speculative decoding: auto (the daemon's setting), off, ngram
    /// (drafts from the prompt: faster code edits and quotations, the same
    /// answer) or draft (a draft model's drafts: --draft, or the model's in
    /// config.toml).
    #[arg(long, value_enum, default_value_t = SpeculateArg::Auto)]
    speculate: SpeculateArg,
    /// A draft model for speculative decoding: a smaller model with the
    /// same tokenizer, loaded beside the model.
    #[arg(long, value_name = "MODEL")]
    draft: Option<String>,
    /// The most tokens drafted a step, 1 to 8 (as llama.cpp's
    /// --draft-max). Default: up to 8, as the daemon chooses.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u8).range(1..=8))]
    draft_max: Option<u8>,
    /// Answer under this LoRA adapter (a directory `mlx_lm lora` wrote, in
    /// the models directory or a path), loaded beside the model.
    #[arg(long, value_name = "DIR")]
    adapter: Option<String>,
    /// Keep the KV cache quantized to 8 or 4 bits (longer contexts in the
    /// same memory); 16: full precision. Default: the model's setting.
    #[arg(long, value_name = "BITS")]
    kv_bits: Option<u8>,
    /// Values per quantization group of the KV cache (32, 64, 128).
    #[arg(long, value_name = "N")]
    kv_group_size: Option<u16>,
    /// Positions kept in full precision before the KV cache is quantized.
    #[arg(long, value_name = "N")]
    quantized_kv_start: Option<u32>,
    /// Rotate keys and values by a Hadamard matrix before quantizing them
    /// (default true; false: mlx-lm's arithmetic exactly).
    #[arg(long, value_name = "BOOL")]
    kv_rotate: Option<bool>,
    /// The keys' bits when they differ from the values' (--kv-bits): 8-bit
    /// keys with 4-bit values keep the keys' outlier channels.
    #[arg(long, value_name = "BITS")]
    kv_key_bits: Option<u8>,
    /// Continue (or start) a conversation the daemon keeps under this name.
    #[arg(long)]
    session: Option<String>,
    /// The answer is JSON valid under this JSON Schema file (enforced while
    /// generating).
    #[arg(long, value_name = "FILE", conflicts_with_all = ["regex", "json_object"])]
    json_schema: Option<std::path::PathBuf>,
    /// The answer is a JSON object.
    #[arg(long, conflicts_with = "regex")]
    json_object: bool,
    /// The whole answer matches this regular expression.
    #[arg(long, value_name = "REGEX")]
    regex: Option<String>,
    /// Print statistics to stderr.
    #[arg(long, short)]
    verbose: bool,
}

const EXIT_UNREACHABLE: u8 = 3;
const EXIT_REFUSED: u8 = 4;
const EXIT_WARNED: u8 = 5;
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

/// The answer was given, but something after it failed (e.g. the session
/// turn could not be saved): each warning is printed and the exit code is 5.
#[derive(Debug, thiserror::Error)]
#[error("{}", .0.iter().map(|w| format!("warning: {w}")).collect::<Vec<_>>().join("\nmlxbc: "))]
pub struct Warned(pub Vec<String>);

/// A keep-alive as people write it: `30m`, `1h30m`, `45s`, `forever`.
pub fn human_duration(k: mlxbc_client::KeepAlive) -> String {
    match k {
        mlxbc_client::KeepAlive::Seconds(s) if s < 100 * 365 * 24 * 3600 => {
            let (h, m, s) = (s / 3600, s / 60 % 60, s % 60);
            let mut out = String::new();
            if h > 0 {
                out += &format!("{h}h");
            }
            if m > 0 {
                out += &format!("{m}m");
            }
            if s > 0 || out.is_empty() {
                out += &format!("{s}s");
            }
            out
        }
        _ => "forever".into(),
    }
}

/// Some of what was asked was refused by the daemon (e.g. some files of a
/// prefetch); each was named already. The exit code is 4.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Refused(pub String);

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
        Some(
            ClientError::Unreachable { .. }
            | ClientError::Spawn { .. }
            | ClientError::DaemonExited { .. }
            | ClientError::HandshakeTimeout { .. },
        ) => ExitCode::from(EXIT_UNREACHABLE),
        Some(ClientError::Disconnected) => {
            if let Ok(s) = Settings::from_env() {
                eprintln!(
                    "mlxbc: its log: {} (or `mlxbc service logs` when it runs as a service)",
                    mlxbc_client::log_path(&s).display()
                );
            }
            ExitCode::from(EXIT_UNREACHABLE)
        }
        Some(ClientError::Daemon { .. } | ClientError::ProtocolMismatch(_)) => ExitCode::from(EXIT_REFUSED),
        _ if e.downcast_ref::<Warned>().is_some() => ExitCode::from(EXIT_WARNED),
        _ if e.downcast_ref::<Refused>().is_some() => ExitCode::from(EXIT_REFUSED),
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

pub(crate) fn keep_alive(text: &Option<String>) -> Result<Option<KeepAlive>> {
    text.as_deref().map(KeepAlive::parse).transpose().map_err(anyhow::Error::msg)
}

/// A `--model` value as the daemon should see it: a relative path that
/// exists here (it has a `/` or starts with `.`) becomes absolute, since
/// the daemon resolves names from its own directory, not the shell's; names
/// and aliases pass unchanged.
pub(crate) fn model_arg(value: &str) -> Result<String, String> {
    let path = std::path::Path::new(value);
    let looks_like_path = value.contains('/') || value.starts_with('.');
    if path.is_relative() && looks_like_path && path.exists() {
        let absolute = std::fs::canonicalize(path).map_err(|e| format!("{value}: {e}"))?;
        return absolute.to_str().map(String::from).ok_or_else(|| format!("{value}: not a UTF-8 path"));
    }
    Ok(value.to_string())
}

async fn run(cli: Cli) -> Result<()> {
    let settings = settings(&cli)?;
    match cli.command {
        Command::Ask(args) => {
            let request = ask::ask_request(ask::args_prompt(&args)?, &args)?;
            let mut client = Client::connect_or_start(&settings).await?;
            ask::ask(&mut client, request, &args).await
        }
        Command::Stop => match Client::connect(&settings.socket).await {
            Ok(mut c) => Ok(c.shutdown().await?),
            Err(ClientError::Unreachable { .. }) => {
                eprintln!("mlxbc: no daemon is running at {}", settings.socket.display());
                Ok(())
            }
            Err(e) => Err(e.into()),
        },
        Command::Service { verb, dry_run, follow } => service::run(verb, &settings, dry_run, follow),
        Command::Completions { shell } => {
            use clap::CommandFactory;
            clap_complete::generate(shell, &mut Cli::command(), "mlxbc", &mut std::io::stdout());
            Ok(())
        }
        Command::Pull { repo, revision, include } => pull::run(&repo, &revision, &include).await,
        Command::Chat(args) => {
            let mut client = Client::connect_or_start(&settings).await?;
            chat::run(&mut client, &args, &settings.paths.home.join("chat_history")).await
        }
        Command::Transcribe(args) => {
            let mut client = Client::connect_or_start(&settings).await?;
            transcribe::run(&mut client, &args).await
        }
        Command::Embed(args) => {
            let mut client = Client::connect_or_start(&settings).await?;
            embed::run(&mut client, &args).await
        }
        Command::Rerank(args) => {
            let mut client = Client::connect_or_start(&settings).await?;
            rerank::run(&mut client, &args).await
        }
        command => {
            let mut client = Client::connect_or_start(&settings).await?;
            manage::manage(&mut client, command).await
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_relative_model_path_that_exists_is_sent_absolute_and_names_pass_unchanged() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("my-model")).unwrap();
        std::env::set_current_dir(dir.path()).unwrap();
        let sent = super::model_arg("./my-model").unwrap();
        assert_eq!(std::path::Path::new(&sent), std::fs::canonicalize(dir.path().join("my-model")).unwrap());
        assert_eq!(super::model_arg("my-model").unwrap(), "my-model", "a plain name stays a name");
        assert_eq!(super::model_arg("./not-there").unwrap(), "./not-there", "the daemon says it is unknown");
        assert_eq!(super::model_arg("smollm2").unwrap(), "smollm2");
    }
}
