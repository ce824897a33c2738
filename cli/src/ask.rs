//! `mlxbc ask`: one question, streamed to stdout (or as JSON events).

use crate::{keep_alive, AskArgs};
use anyhow::Result;
use mlxbc_client::{ChatMessage, Client, ClientError, Constraint, GenerateRequest, MediaRef, Response, SamplingParams};
use std::io::{IsTerminal, Read, Write};

/// Reads image files with the user's own permissions (the daemon never opens
/// a path a client names); `-` is stdin.
pub fn read_media(paths: &[std::path::PathBuf]) -> Result<Vec<MediaRef>> {
    paths.iter().map(|p| read_file(p, "image").map(MediaRef::from_bytes)).collect()
}

/// Reads video files as [`read_media`] reads images.
pub fn read_videos(paths: &[std::path::PathBuf]) -> Result<Vec<MediaRef>> {
    paths.iter().map(|p| read_file(p, "video").map(MediaRef::video)).collect()
}

/// Reads audio clips as [`read_media`] reads images.
pub fn read_audio(paths: &[std::path::PathBuf]) -> Result<Vec<MediaRef>> {
    paths.iter().map(|p| read_file(p, "audio").map(MediaRef::audio)).collect()
}

fn read_file(p: &std::path::Path, what: &str) -> Result<Vec<u8>> {
    if p.as_os_str() == "-" {
        let mut b = Vec::new();
        std::io::stdin().lock().read_to_end(&mut b)?;
        return Ok(b);
    }
    std::fs::read(p).map_err(|e| anyhow::anyhow!("reading {what} {}: {e}", p.display()))
}

/// The prompt, with piped stdin appended (e.g. `git diff | mlxbc ask "..."`).
pub fn args_prompt(args: &AskArgs) -> Result<String> {
    let mut prompt = args.prompt.clone();
    let stdin = std::io::stdin();
    let stdin_is_an_image = args.image.iter().chain(&args.video).chain(&args.audio).any(|p| p.as_os_str() == "-");
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
pub fn ask_request(prompt: String, args: &AskArgs) -> Result<GenerateRequest> {
    let mut messages = Vec::new();
    if let Some(s) = &args.system {
        messages.push(ChatMessage::system(s.clone()));
    }
    let mut user = ChatMessage::user(prompt);
    user.media = read_media(&args.image)?;
    user.media.extend(read_videos(&args.video)?);
    user.media.extend(read_audio(&args.audio)?);
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
        session: args.session.clone(),
        constraint: constraint(args)?,
        tools: vec![],
        tool_choice: Default::default(),
        raw: None,
        logprobs: None,
        speculate: args.speculate.into(),
        draft: args.draft.clone(),
        draft_max: args.draft_max,
        adapter: args.adapter.clone(),
        kv: mlxbc_client::KvCacheSpec {
            bits: args.kv_bits,
            group_size: args.kv_group_size,
            start: args.quantized_kv_start,
            rotate: args.kv_rotate,
            key_bits: args.kv_key_bits,
        },
    })
}

/// The constraint `--json-schema`, `--json-object` or `--regex` asks for.
fn constraint(args: &AskArgs) -> Result<Option<Constraint>> {
    if let Some(path) = &args.json_schema {
        let text = std::fs::read_to_string(path)
            .map_err(|e| anyhow::anyhow!("reading the JSON schema {}: {e}", path.display()))?;
        serde_json::from_str::<serde_json::Value>(&text)
            .map_err(|e| anyhow::anyhow!("{} is not JSON: {e}", path.display()))?;
        return Ok(Some(Constraint::JsonSchema(text)));
    }
    if args.json_object {
        return Ok(Some(Constraint::JsonObject));
    }
    Ok(args.regex.clone().map(Constraint::Regex))
}

pub async fn ask(client: &mut Client, request: GenerateRequest, args: &AskArgs) -> Result<()> {
    // Until the first event (model load, image encoding, prefill) a spinner says we wait.
    let mut spinner = crate::progress::Spinner::start("thinking");
    let mut stream = client.generate(request).await?;
    let mut out = std::io::stdout().lock();
    let mut warnings = Vec::new();
    loop {
        let event = match stream.next_event().await {
            Ok(Some(Response::Started { .. })) if !args.json => {
                spinner.stop();
                continue;
            }
            Ok(Some(e)) => {
                spinner.stop();
                e
            }
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
        if let Response::Done { stats } = &event {
            warnings.extend(stats.warnings.iter().cloned());
        }
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
                        "images: {} hit, {} encoded | lookup {:.1} ms, preprocess {:.0} ms, encode {:.0} ms | prefix tokens reused {} | prefill {:.0} ms",
                        stats.encoder_hits, stats.encoder_misses, stats.lookup_ms, stats.preprocess_ms, stats.encode_ms, stats.prefix_tokens_reused, stats.prefill_ms
                    );
                }
                if args.verbose {
                    // A single token comes from the prefill: no decode step to time.
                    let decode = if stats.decode_tokens_per_s > 0.0 {
                        format!("{:.1} tok/s", stats.decode_tokens_per_s)
                    } else {
                        "- (no decode step)".to_string()
                    };
                    eprintln!(
                        "model {} | prompt {} tok | generated {} tok | ttft {:.0} ms (load {:.0} ms) | prefill {:.1} tok/s | decode {decode} | stop {:?}",
                        stats.model, stats.prompt_tokens, stats.generated_tokens, stats.time_to_first_token_ms, stats.load_ms,
                        stats.prefill_tokens_per_s, stats.stop_reason
                    );
                    eprintln!(
                        "prompt cache: {} tok reused ({} RAM, {} disk) | {} tok prefilled",
                        stats.prefix_tokens_reused,
                        stats.prefix_tokens_reused - stats.prompt_tokens_from_disk,
                        stats.prompt_tokens_from_disk,
                        stats.prefill_tokens_computed
                    );
                    if stats.draft_tokens > 0 {
                        eprintln!(
                            "speculation (prompt lookup): {} of {} drafted tokens accepted ({:.0}%)",
                            stats.accepted_draft_tokens,
                            stats.draft_tokens,
                            100.0 * f64::from(stats.accepted_draft_tokens) / f64::from(stats.draft_tokens)
                        );
                    }
                }
            }
            _ => {}
        }
    }
    if warnings.is_empty() {
        Ok(())
    } else {
        Err(crate::Warned(warnings).into())
    }
}

pub fn event_json(event: &Response) -> serde_json::Value {
    use serde_json::json;
    match event {
        Response::Started { model, prompt_tokens } => {
            json!({"event": "start", "model": model, "prompt_tokens": prompt_tokens})
        }
        Response::Token { text } => json!({"event": "token", "text": text}),
        // GenerationStats derives Serialize: every field, under its own name.
        Response::Done { stats } => json!({"event": "done", "stats": stats}),
        other => json!({"event": "other", "debug": format!("{other:?}")}),
    }
}
