//! mlxbcd's side of `scripts/bench`: boots the real daemon on a temp socket
//! with the given model and measures, through the client library, what a user
//! feels. Prints one JSON object (scripts/bench makes the table).
//!
//! Usage: mlxbc-bench MODEL_PATH PROMPT_TOKENS DECODE_TOKENS

use anyhow::{bail, Context, Result};
use mlxbc_client::{Client, GenerateRequest, Response};
use std::path::PathBuf;
use std::time::{Duration, Instant};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Client-side time to the first token, and the daemon's statistics.
async fn timed(client: &mut Client, req: GenerateRequest) -> Result<(f64, mlxbc_client::GenerationStats)> {
    let t = Instant::now();
    let mut first = None;
    let mut stream = client.generate(req).await?;
    while let Some(ev) = stream.next_event().await? {
        match ev {
            Response::Token { .. } if first.is_none() => first = Some(t.elapsed().as_secs_f64() * 1000.0),
            Response::Done { stats } => return Ok((first.unwrap_or(stats.time_to_first_token_ms), stats)),
            _ => {}
        }
    }
    bail!("stream ended without Done")
}

fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 4 {
        bail!("usage: mlxbc-bench MODEL_PATH PROMPT_TOKENS DECODE_TOKENS");
    }
    let model = PathBuf::from(&args[1]).canonicalize().context("model path")?;
    let (n_prompt, n_decode): (u32, u32) = (args[2].parse()?, args[3].parse()?);
    let home = tempfile::Builder::new().prefix("mlxbc-bench").tempdir_in("/tmp")?;
    std::fs::create_dir(home.path().join("models"))?;
    let name = model.file_name().unwrap().to_string_lossy().to_string();
    std::os::unix::fs::symlink(&model, home.path().join("models").join(&name))?;
    let exe = std::env::current_exe()?;
    let mut daemon = std::process::Command::new(exe.parent().unwrap().join("mlxbcd"))
        .env("MLXBC_HOME", home.path())
        .env("MLXBC_LOG", "warn")
        .env_remove("MLXBC_SOCKET")
        .spawn()
        .context("starting mlxbcd")?;
    let socket = home.path().join("mlxbcd.sock");
    let mut client = loop {
        match Client::connect(&socket).await {
            Ok(c) => break c,
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    };
    let ask = |content: String, max_tokens: u32| {
        let mut r = GenerateRequest::ask(content);
        r.model = Some(name.clone());
        r.max_tokens = max_tokens;
        r.ignore_eos = true;
        r
    };
    let short = "What is the capital of France?".to_string();
    let (cold_ms, _) = timed(&mut client, ask(short.clone(), 1)).await?; // loads the model
    let mut ttft = Vec::new();
    for _ in 0..5 {
        ttft.push(timed(&mut client, ask(short.clone(), 1)).await?.0);
    }
    // Grow filler text until the templated prompt is n_prompt tokens long.
    let (_, probe) = timed(&mut client, ask(short.clone(), 1)).await?;
    let overhead = probe.prompt_tokens - 7; // the 7 tokens of `short`
    let mut filler = String::new();
    let mut words = 0;
    let long_stats = loop {
        let (_, s) = timed(&mut client, ask(filler.clone(), 1)).await?;
        if s.prompt_tokens >= n_prompt {
            break s;
        }
        let missing = n_prompt - s.prompt_tokens.max(overhead);
        for _ in 0..missing.max(1) {
            filler.push_str(if words % 2 == 0 { " fox" } else { " dog" });
            words += 1;
        }
    };
    let mut prefill = vec![long_stats.prefill_tokens_per_s];
    for _ in 0..2 {
        prefill.push(timed(&mut client, ask(filler.clone(), 1)).await?.1.prefill_tokens_per_s);
    }
    let (_, decode) = timed(&mut client, ask(short.clone(), n_decode + 1)).await?;
    let out = serde_json::json!({
        "cold_first_request_ms": cold_ms,
        "ttft_ms": median(ttft),
        "prefill_tps": median(prefill),
        "prompt_tokens": long_stats.prompt_tokens,
        "decode_tps": decode.decode_tokens_per_s,
        "decode_tokens": decode.generated_tokens - 1,
        "peak_rss_bytes": peak_rss(daemon.id()),
        "blas": client.daemon_blas,
    });
    client.shutdown().await.ok();
    let _ = daemon.wait();
    println!("{out}");
    Ok(())
}
