//! mlxbcd's side of `scripts/bench`: boots the real daemon on a temp socket
//! with the given model and measures, through the client library, what a user
//! feels. Prints one JSON object (scripts/bench makes the table).
//!
//! Usage: mlxbc-bench MODEL_PATH PROMPT_TOKENS DECODE_TOKENS
//!        mlxbc-bench --image VLM_DIR IMAGE_FILE
//!        mlxbc-bench --video VLM_DIR CLIP_FILE
//!        mlxbc-bench --audio VLM_DIR WAV_FILE
//!        mlxbc-bench --queued-images VLM_DIR [N=8]
//!        mlxbc-bench --concurrency MODEL CLIENTS,... TOKENS LONG_TOKENS
//!        mlxbc-bench --prompts MODEL SYSTEM_TOKENS TURNS TURN_TOKENS ANSWER_TOKENS LONG_TOKENS

use anyhow::{bail, Context, Result};
use mlxbc_client::{Client, GenerateRequest, Response};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// The prompt length warm time to first token is measured at.
const TTFT_PROMPT_TOKENS: u32 = 50;

/// A count from the environment, or `default`.
fn env_count(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

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

/// Runs a generation and also measures decode as the client sees it: tokens
/// after the first, over the time from the first token to `Done`. Against the
/// engine's own decode rate this is the per-token cost of the socket (framing,
/// writes, the client's reads).
async fn timed_decode(client: &mut Client, req: GenerateRequest) -> Result<(mlxbc_client::GenerationStats, f64)> {
    let mut first = None;
    let mut stream = client.generate(req).await?;
    while let Some(ev) = stream.next_event().await? {
        match ev {
            Response::Token { .. } if first.is_none() => first = Some(Instant::now()),
            Response::Done { stats } => {
                let span = first.map_or(0.0, |t| t.elapsed().as_secs_f64());
                let rate = if span > 0.0 { (stats.generated_tokens.saturating_sub(1)) as f64 / span } else { 0.0 };
                return Ok((stats, rate));
            }
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

/// A daemon in a temp home serving `model`.
struct Bench {
    daemon: std::process::Child,
    home: tempfile::TempDir,
    name: String,
}

impl Bench {
    fn start(model: &std::path::Path, home: Option<tempfile::TempDir>) -> Result<Self> {
        let home = match home {
            Some(h) => h,
            None => {
                let h = tempfile::Builder::new().prefix("mlxbc-bench").tempdir_in("/tmp")?;
                std::fs::create_dir(h.path().join("models"))?;
                h
            }
        };
        // MLXBC_BENCH_PREFILL_CHUNK: the daemon's prefill chunk (else its
        // default for the device), for scripts/bench --chunks.
        if let Ok(chunk) = std::env::var("MLXBC_BENCH_PREFILL_CHUNK") {
            std::fs::write(home.path().join("config.toml"), format!("prefill_chunk = {}\n", chunk.parse::<usize>()?))?;
        }
        let name = model.file_name().unwrap().to_string_lossy().to_string();
        let link = home.path().join("models").join(&name);
        if !link.exists() {
            std::os::unix::fs::symlink(model, &link)?;
        }
        let exe = std::env::current_exe()?;
        let daemon = std::process::Command::new(exe.parent().unwrap().join("mlxbcd"))
            .env("MLXBC_HOME", home.path())
            // MLXBC_BENCH_LOG=info shows the daemon's per-request decode
            // profile (host time queueing steps vs waiting for tokens).
            .env("MLXBC_LOG", std::env::var("MLXBC_BENCH_LOG").unwrap_or_else(|_| "warn".into()))
            .env_remove("MLXBC_SOCKET")
            .spawn()
            .context("starting mlxbcd")?;
        Ok(Self { daemon, home, name })
    }

    async fn client(&self) -> Client {
        loop {
            match Client::connect(&self.home.path().join("mlxbcd.sock")).await {
                Ok(c) => return c,
                Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
    }

    async fn stop(mut self) -> tempfile::TempDir {
        self.client().await.shutdown().await.ok();
        let _ = self.daemon.wait();
        self.home
    }
}

/// Text of about `tokens` tokens (numbered facts, ~20 tokens each in the
/// SmolLM2 and Qwen tokenizers: digits are single tokens), `tag`
/// making it unique.
fn facts(tag: &str, tokens: usize) -> String {
    (0..tokens.div_ceil(20)).map(|i| format!("Fact {tag}{i}: item {i} weighs {} grams. ", i * 7 + 3)).collect()
}

/// `scripts/bench prompts`: an agent loop (a system prompt, then turns that
/// each append a user message and the answer), each turn asked of a daemon
/// with the prompt cache and of one without (interleaved), time to first
/// token per turn; then a long prefix served from disk after a restart
/// against its cold prefill; then misses with and without the cache.
async fn prompts_bench(
    model: &std::path::Path,
    system_tokens: usize,
    turns: usize,
    turn_tokens: usize,
    answer_tokens: usize,
    long_tokens: usize,
) -> Result<()> {
    use mlxbc_client::{ChatMessage, Role};
    let model = model.canonicalize()?;
    let cold_home = tempfile::Builder::new().prefix("mlxbc-bench").tempdir_in("/tmp")?;
    std::fs::create_dir(cold_home.path().join("models"))?;
    std::fs::write(cold_home.path().join("config.toml"), "prompt_cache_ram_mib = 0\nprompt_cache_mib = 0\n")?;
    let mut cold = Bench::start(&model, Some(cold_home))?;
    let mut cached = Bench::start(&model, None)?;
    let name = cached.name.clone();
    let request = |messages: Vec<ChatMessage>, max_tokens: usize| {
        let mut r = GenerateRequest::ask("");
        r.messages = messages;
        r.model = Some(name.clone());
        r.max_tokens = max_tokens as u32;
        r.ignore_eos = true;
        r
    };
    // Load both models first.
    timed(&mut cold.client().await, request(vec![ChatMessage::user("hi")], 1)).await?;
    timed(&mut cached.client().await, request(vec![ChatMessage::user("hi")], 1)).await?;
    let mut messages = vec![ChatMessage { role: Role::System, ..ChatMessage::user(facts("s", system_tokens)) }];
    let mut rows = Vec::new();
    for turn in 1..=turns {
        messages.push(ChatMessage::user(format!(
            "{}Question {turn}: what does item {turn} weigh?",
            facts(&format!("t{turn}-"), turn_tokens)
        )));
        let (with_ms, with) = match timed(&mut cached.client().await, request(messages.clone(), answer_tokens)).await {
            Ok(made) => made,
            Err(e) => {
                // A loop longer than the model's context ends there.
                eprintln!("turn {turn}: {e}; the loop ends here");
                break;
            }
        };
        // MLXBC_BENCH_COLD_TURNS=0: the loop on the cached daemon only (a
        // long loop's cold turns take many minutes on a small CPU).
        let (without_ms, without) = if std::env::var("MLXBC_BENCH_COLD_TURNS").is_ok_and(|v| v == "0") {
            (f64::NAN, with.clone())
        } else {
            timed(&mut cold.client().await, request(messages.clone(), answer_tokens)).await?
        };
        rows.push(serde_json::json!({
            "turn": turn, "prompt_tokens": with.prompt_tokens, "ttft_cached_ms": with_ms,
            "ttft_cold_ms": if without_ms.is_nan() { serde_json::Value::Null } else { without_ms.into() },
            "reused": with.prefix_tokens_reused, "prefilled": with.prefill_tokens_computed,
            "ids_equal": if without_ms.is_nan() { serde_json::Value::Null } else { (with.token_ids == without.token_ids).into() },
            // Where the answers part, when they do (None: equal).
            "ids_part_at": with.token_ids.iter().zip(&without.token_ids).position(|(a, b)| a != b),
        }));
        // The answer as the next turn sends it back: generated tokens are
        // not cached (only prompts), so its text only has to be new.
        let answer =
            format!("Item {turn} weighs {} grams, as fact t{turn} says; {}", turn * 7 + 3, facts("a", answer_tokens));
        messages.push(ChatMessage { role: Role::Assistant, ..ChatMessage::user(answer) });
    }
    // A long prefix on disk after a restart, against its cold prefill: each
    // round restarts both daemons (a fresh process pays its first use of each
    // shape, e.g. a GPU's run-time kernel compiles, with or without the
    // cache), warms each with one short request, then asks the long prompt,
    // in alternating order; medians over the rounds.
    let long = vec![
        ChatMessage { role: Role::System, ..ChatMessage::user(facts("L", long_tokens)) },
        ChatMessage::user("Which item weighs titanic?"),
    ];
    timed(&mut cached.client().await, request(long.clone(), 1)).await?;
    let rounds = env_count("MLXBC_BENCH_DISK_ROUNDS", 3);
    let (mut disk_ms, mut long_cold_ms) = (Vec::new(), Vec::new());
    let (mut disk, mut long_cold) = (None, None);
    for round in 0..rounds {
        let home = cached.stop().await;
        cached = Bench::start(&model, Some(home))?;
        let home = cold.stop().await;
        cold = Bench::start(&model, Some(home))?;
        timed(&mut cached.client().await, request(vec![ChatMessage::user("hi")], 1)).await?;
        timed(&mut cold.client().await, request(vec![ChatMessage::user("hi")], 1)).await?;
        let (d, c) = if round % 2 == 0 {
            let d = timed(&mut cached.client().await, request(long.clone(), 1)).await?;
            (d, timed(&mut cold.client().await, request(long.clone(), 1)).await?)
        } else {
            let c = timed(&mut cold.client().await, request(long.clone(), 1)).await?;
            (timed(&mut cached.client().await, request(long.clone(), 1)).await?, c)
        };
        disk_ms.push(d.0);
        long_cold_ms.push(c.0);
        disk = Some(d.1);
        long_cold = Some(c.1);
    }
    let (disk, long_cold) = (disk.expect("one round"), long_cold.expect("one round"));
    // Misses: prompts neither daemon has seen, interleaved.
    let (mut miss_with, mut miss_without) = (Vec::new(), Vec::new());
    // Order alternates, so neither daemon always runs right after the other.
    for i in 0..env_count("MLXBC_BENCH_MISSES", 9) {
        let fresh = vec![ChatMessage::user(facts(&format!("m{i}-"), 300))];
        if i % 2 == 0 {
            miss_with.push(timed(&mut cached.client().await, request(fresh.clone(), 1)).await?.0);
            miss_without.push(timed(&mut cold.client().await, request(fresh, 1)).await?.0);
        } else {
            miss_without.push(timed(&mut cold.client().await, request(fresh.clone(), 1)).await?.0);
            miss_with.push(timed(&mut cached.client().await, request(fresh, 1)).await?.0);
        }
    }
    println!(
        "{}",
        serde_json::json!({
            "model": name, "system_tokens": system_tokens, "turn_tokens": turn_tokens, "answer_tokens": answer_tokens,
            "turns": rows,
            "disk": {"prompt_tokens": disk.prompt_tokens, "from_disk": disk.prompt_tokens_from_disk, "ttft_disk_ms": median(disk_ms.clone()),
                     "ttft_cold_ms": median(long_cold_ms.clone()), "rounds_disk_ms": disk_ms, "rounds_cold_ms": long_cold_ms,
                     "ids_equal": disk.token_ids == long_cold.token_ids},
            "miss": {"ttft_cached_ms": median(miss_with.clone()), "ttft_cold_ms": median(miss_without.clone()),
                     "pairs_cached_ms": miss_with, "pairs_cold_ms": miss_without},
        })
    );
    cached.stop().await;
    cold.stop().await;
    Ok(())
}

/// Which medium `image_bench` sends.
#[derive(Clone, Copy, PartialEq)]
enum Medium {
    Image,
    Video,
    Audio,
}

/// The image section: time to first token for a new image (or clip: every
/// frame or group new) (miss), a RAM hit, a prefix hit, and an SSD hit after
/// a restart, with the encoder's share. `MLXBC_BENCH_ROUNDS` rounds (3), each
/// on a variant of the medium of the same shape (a new content hash), rounds
/// interleaved case by case; each row is the median of its rounds. A clip
/// has no variant here: one round.
async fn image_bench(model: &std::path::Path, file: &std::path::Path, medium: Medium) -> Result<()> {
    let model = model.canonicalize()?;
    let bytes = std::fs::read(file)?;
    let rounds = if variant(&bytes, medium, 1).is_some() { env_count("MLXBC_BENCH_ROUNDS", 3).max(1) } else { 1 };
    let inputs: Vec<Vec<u8>> = (0..rounds)
        .map(|k| if k == 0 { Some(bytes.clone()) } else { variant(&bytes, medium, k) })
        .collect::<Option<_>>()
        .context("a variant of the medium")?;
    let media = |bytes: Vec<u8>| match medium {
        Medium::Image => mlxbc_client::MediaRef::from_bytes(bytes),
        Medium::Video => mlxbc_client::MediaRef::video(bytes),
        Medium::Audio => mlxbc_client::MediaRef::audio(bytes),
    };
    let b = Bench::start(&model, None)?;
    let mut c = b.client().await;
    let name = b.name.clone();
    let ask = |system: &str, bytes: &[u8]| {
        let question = if medium == Medium::Audio { "What is in this clip?" } else { "What is in this picture?" };
        let mut r = GenerateRequest::ask(question);
        let mut user = r.messages.pop().unwrap();
        user.media = vec![media(bytes.to_vec())];
        // A different system prompt changes the prefix, so only the encoder cache can hit.
        r.messages = vec![mlxbc_client::ChatMessage::system(system), user];
        r.model = Some(name.clone());
        r.max_tokens = 1;
        r
    };
    let warm_up = GenerateRequest { model: Some(b.name.clone()), max_tokens: 1, ..GenerateRequest::ask("warm up") };
    timed(&mut c, warm_up.clone()).await?;
    // The encoder's first run pays for allocation and page faults; one more
    // variant takes them, so that a miss is a warm miss, as mlx-vlm's encoder
    // time (a median after a warm-up) is. A clip's miss is a first run.
    if let Some(warm) = variant(&bytes, medium, rounds) {
        timed(&mut c, ask("W", &warm)).await?;
    }
    let mut cases: [Vec<(f64, mlxbc_client::GenerationStats)>; 4] = Default::default();
    for (k, input) in inputs.iter().enumerate() {
        cases[0].push(timed(&mut c, ask(&format!("A{k}"), input)).await?);
        cases[1].push(timed(&mut c, ask(&format!("B{k}"), input)).await?);
        cases[2].push(timed(&mut c, ask(&format!("B{k}"), input)).await?);
    }
    drop(c);
    let home = b.stop().await;
    let b = Bench::start(&model, Some(home))?;
    let mut c = b.client().await;
    timed(&mut c, warm_up).await?;
    for (k, input) in inputs.iter().enumerate() {
        cases[3].push(timed(&mut c, ask(&format!("C{k}"), input)).await?);
    }
    drop(c);
    b.stop().await;
    let miss = if medium == Medium::Image { "miss (new image)" } else { "miss (new clip)" };
    let labels = [miss, "RAM hit", "prefix hit", "SSD hit (after restart)"];
    let rows: Vec<_> = labels
        .iter()
        .zip(&cases)
        .map(|(label, runs)| {
            let m = |f: &dyn Fn(&(f64, mlxbc_client::GenerationStats)) -> f64| median(runs.iter().map(f).collect());
            serde_json::json!({"case": label, "rounds": runs.len(), "ttft_ms": m(&|r| r.0),
                               "encode_ms": m(&|r| r.1.encode_ms), "lookup_ms": m(&|r| r.1.lookup_ms),
                               "preprocess_ms": m(&|r| r.1.preprocess_ms), "prefill_ms": m(&|r| r.1.prefill_ms),
                               "hits": runs[0].1.encoder_hits, "misses": runs[0].1.encoder_misses,
                               "prefix_reused": runs[0].1.prefix_tokens_reused})
        })
        .collect();
    println!("{}", serde_json::Value::Array(rows));
    Ok(())
}

/// Variant `k` (1, 2, ...) of a medium: the same shape, new content (so a
/// new content hash). An image with every channel shifted by 37k (wrapping),
/// re-encoded as PNG; a WAV with its 16-bit samples scaled by (-0.9)^k. None
/// for a clip (no encoder here to write one).
fn variant(bytes: &[u8], medium: Medium, k: usize) -> Option<Vec<u8>> {
    match medium {
        Medium::Image => {
            let mut img = image::load_from_memory(bytes).ok()?.to_rgb8();
            for p in img.pixels_mut() {
                p.0 = p.0.map(|v| v.wrapping_add((37 * k % 256) as u8));
            }
            let mut out = std::io::Cursor::new(Vec::new());
            img.write_to(&mut out, image::ImageFormat::Png).ok()?;
            Some(out.into_inner())
        }
        Medium::Audio => {
            // 16-bit PCM after the "data" chunk header (what the bench's clips hold).
            let data = bytes.windows(4).position(|w| w == b"data")? + 8;
            let gain = (-0.9f32).powi(k as i32);
            let mut out = bytes.to_vec();
            for s in out.get_mut(data..)?.chunks_exact_mut(2) {
                let v = (i16::from_le_bytes([s[0], s[1]]) as f32 * gain) as i16;
                s.copy_from_slice(&v.to_le_bytes());
            }
            Some(out)
        }
        Medium::Video => None,
    }
}

/// A `side`x`side` PNG no store has seen: smooth gradients plus a seeded
/// pattern, so it compresses like a photo-sized screenshot, not like noise.
fn fresh_png(side: u32, seed: u32) -> Vec<u8> {
    let img = image::RgbImage::from_fn(side, side, |x, y| {
        let v = (x.wrapping_mul(7) ^ y.wrapping_mul(13)).wrapping_add(seed.wrapping_mul(2_654_435_761));
        image::Rgb([(x * 255 / side) as u8, (y * 255 / side) as u8, (v >> 3) as u8])
    });
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png).expect("PNG encoding in memory");
    out.into_inner()
}

/// `n` requests with new 1024x1024 images sent while another client's long
/// generation runs: what the engine spends per image request (the daemon's
/// own stats: decode and resize, tower, prefill), how long the running
/// generation's decode took, and the wall time until every image answered.
async fn queued_images_bench(model: &std::path::Path, n: usize) -> Result<()> {
    let model = model.canonicalize()?;
    let images: Vec<Vec<u8>> = (0..n).map(|i| fresh_png(1024, i as u32 + std::process::id())).collect();
    let b = Bench::start(&model, None)?;
    let name = b.name.clone();
    let mut c = b.client().await;
    // Warm up the model, the tower and MLX's kernels with an image of the same size.
    let warm = mlxbc_client::MediaRef::from_bytes(fresh_png(1024, u32::MAX));
    let ask_image = |media: mlxbc_client::MediaRef| {
        let mut r = GenerateRequest::ask("What is in this picture?");
        r.messages[0].media = vec![media];
        r.model = Some(name.clone());
        r.max_tokens = 1;
        r
    };
    timed(&mut c, ask_image(warm)).await?;
    let mut long = GenerateRequest::ask("Write a long story about a fox.");
    long.model = Some(name.clone());
    long.max_tokens = 600;
    long.ignore_eos = true;
    let (_, alone) = timed(&mut c, long.clone()).await?;
    let mut runner = b.client().await;
    let mut stream = runner.generate(long).await?;
    // Wait for the long generation's first token, then queue the images behind it.
    while !matches!(stream.next_event().await?, Some(Response::Token { .. })) {}
    let t = Instant::now();
    let mut tasks = Vec::new();
    for bytes in images {
        let mut client = b.client().await;
        let req = ask_image(mlxbc_client::MediaRef::from_bytes(bytes));
        tasks.push(tokio::spawn(async move {
            let r = timed(&mut client, req).await;
            (r, Instant::now())
        }));
    }
    let running = loop {
        match stream.next_event().await? {
            Some(Response::Done { stats }) => break stats,
            Some(_) => {}
            None => bail!("the long generation ended without Done"),
        }
    };
    let mut rows = Vec::new();
    let mut last = t;
    for task in tasks {
        let (r, done_at) = task.await?;
        let (ttft, s) = r?;
        last = last.max(done_at);
        rows.push(serde_json::json!({"ttft_ms": ttft, "encode_ms": s.encode_ms, "lookup_ms": s.lookup_ms,
            "preprocess_ms": s.preprocess_ms, "prefill_ms": s.prefill_ms, "misses": s.encoder_misses}));
    }
    let out = serde_json::json!({
        "images": n,
        "requests": rows,
        "all_answered_ms": last.duration_since(t).as_secs_f64() * 1000.0,
        "running_decode_tps": running.decode_tokens_per_s,
        "alone_decode_tps": alone.decode_tokens_per_s,
    });
    drop(stream);
    drop((c, runner));
    b.stop().await;
    println!("{out}");
    Ok(())
}

fn percentile(mut v: Vec<f64>, p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// N clients at once, each on its own connection, each asking for `tokens`
/// tokens (EOS ignored): total tok/s over the wall time, per-stream tok/s,
/// client-side first-token p50/p99. Then a short question sent while a
/// `long_tokens` generation runs: its first-token time (client side) against its own
/// prefill time and the long stream's decode step.
async fn concurrency_bench(model: &std::path::Path, clients: &[usize], tokens: u32, long_tokens: u32) -> Result<()> {
    let model = model.canonicalize()?;
    let b = Bench::start(&model, None)?;
    let name = b.name.clone();
    let ask = |i: usize, n: u32| {
        let mut r = GenerateRequest::ask(format!("Tell me about the number {i}."));
        r.model = Some(name.clone());
        r.max_tokens = n;
        r.ignore_eos = true;
        r
    };
    let mut c = b.client().await;
    timed(&mut c, ask(0, 4)).await?; // load and warm up
                                     // MLXBC_BENCH_CHECK_IDS=1: each client's prompt alone first, so every
                                     // batched answer can be compared with it token for token (where batched
                                     // matrix products change the last bits enough to flip an id, this
                                     // counts how often and how early).
    let check_ids = std::env::var("MLXBC_BENCH_CHECK_IDS").is_ok_and(|v| v == "1");
    let most = clients.iter().copied().max().unwrap_or(0);
    let mut alone_ids = Vec::new();
    if check_ids {
        for i in 0..most {
            let (_, s) = timed(&mut c, ask(i + 1, tokens)).await?;
            alone_ids.push(s.token_ids);
        }
    }
    let mut rows = Vec::new();
    for &n in clients {
        // A short warm-up round at this batch size first: a GPU compiles
        // kernels for each new shape on first use (seconds, once per daemon).
        let warm: Vec<_> = (0..n)
            .map(|i| {
                let socket = b.home.path().join("mlxbcd.sock");
                let req = ask(i + 1, 8);
                tokio::spawn(async move { timed(&mut Client::connect(&socket).await?, req).await })
            })
            .collect();
        for w in warm {
            w.await??;
        }
        let mut conns = Vec::new();
        for _ in 0..n {
            conns.push(b.client().await);
        }
        let t = Instant::now();
        let tasks: Vec<_> = conns
            .into_iter()
            .enumerate()
            .map(|(i, mut client)| {
                let req = ask(i + 1, tokens);
                tokio::spawn(async move {
                    let r = timed_decode(&mut client, req.clone()).await;
                    (r, t.elapsed().as_secs_f64())
                })
            })
            .collect();
        let mut ttft = Vec::new();
        let (mut generated, mut per_stream, mut wall) = (0u64, Vec::new(), 0.0f64);
        let (mut same, mut first_diff) = (0usize, Vec::new());
        for (i, task) in tasks.into_iter().enumerate() {
            let (r, done) = task.await?;
            let (stats, client_tps) = r?;
            if let Some(want) = alone_ids.get(i) {
                match stats.token_ids.iter().zip(want).position(|(a, b)| a != b) {
                    None if stats.token_ids.len() == want.len() => same += 1,
                    at => first_diff.push(at.unwrap_or(want.len().min(stats.token_ids.len()))),
                }
            }
            // First token as the daemon counts it: from receipt of the request.
            ttft.push(stats.time_to_first_token_ms);
            generated += stats.generated_tokens as u64;
            per_stream.push(client_tps);
            wall = wall.max(done);
        }
        rows.push(serde_json::json!({
            "clients": n, "total_tps": generated as f64 / wall, "per_stream_tps": median(per_stream),
            "ttft_p50_ms": percentile(ttft.clone(), 0.5), "ttft_p99_ms": percentile(ttft, 0.99), "wall_s": wall,
            "ids_equal_alone": if check_ids { serde_json::json!(same) } else { serde_json::Value::Null },
            "first_differing_token": first_diff,
        }));
    }
    // A short question during a long answer.
    let mut runner = b.client().await;
    let mut stream = runner.generate(ask(1000, long_tokens)).await?;
    let mut seen = 0;
    while seen < 8 {
        if let Some(Response::Token { .. }) = stream.next_event().await? {
            seen += 1;
        }
    }
    let mut short = b.client().await;
    let (short_ttft, short_stats) = timed(&mut short, ask(7, 8)).await?;
    let long = loop {
        match stream.next_event().await? {
            Some(Response::Done { stats }) => break stats,
            Some(_) => {}
            None => bail!("the long generation ended without Done"),
        }
    };
    drop(stream);
    let out = serde_json::json!({
        "rows": rows,
        "short_during_long": {
            "short_ttft_ms": short_ttft, "short_prefill_ms": short_stats.prefill_ms,
            "long_decode_step_ms": 1000.0 / long.decode_tokens_per_s.max(1e-9), "long_tokens": long_tokens,
        },
    });
    drop((c, runner, short));
    b.stop().await;
    println!("{out}");
    Ok(())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() == 6 && args[1] == "--concurrency" {
        let clients: Vec<usize> = args[3].split(',').map(|n| n.parse()).collect::<Result<_, _>>()?;
        return concurrency_bench(std::path::Path::new(&args[2]), &clients, args[4].parse()?, args[5].parse()?).await;
    }
    if args.len() == 8 && args[1] == "--prompts" {
        let n: Vec<usize> = args[3..8].iter().map(|a| a.parse()).collect::<Result<_, _>>()?;
        return prompts_bench(std::path::Path::new(&args[2]), n[0], n[1], n[2], n[3], n[4]).await;
    }
    if args.len() >= 3 && args[1] == "--queued-images" {
        let n = args.get(3).map(|n| n.parse()).transpose()?.unwrap_or(8);
        return queued_images_bench(std::path::Path::new(&args[2]), n).await;
    }
    if args.len() == 4 && matches!(args[1].as_str(), "--image" | "--video" | "--audio") {
        let medium = match args[1].as_str() {
            "--image" => Medium::Image,
            "--video" => Medium::Video,
            _ => Medium::Audio,
        };
        return image_bench(std::path::Path::new(&args[2]), std::path::Path::new(&args[3]), medium).await;
    }
    if args.len() != 4 {
        bail!("usage: mlxbc-bench MODEL_PATH PROMPT_TOKENS DECODE_TOKENS");
    }
    let model = PathBuf::from(&args[1]).canonicalize().context("model path")?;
    let (n_prompt, n_decode): (u32, u32) = (args[2].parse()?, args[3].parse()?);
    let bench = Bench::start(&model, None)?;
    let mut client = bench.client().await;
    let name = bench.name.clone();
    let ask = |content: String, max_tokens: u32| {
        let mut r = GenerateRequest::ask(content);
        r.model = Some(name.clone());
        r.max_tokens = max_tokens;
        r.ignore_eos = true;
        r
    };
    let short = "What is the capital of France?".to_string();
    let (cold_ms, _) = timed(&mut client, ask(short.clone(), 1)).await?; // loads the model
                                                                         // Grow filler text until the templated prompt is `n` tokens long.
    let (_, probe) = timed(&mut client, ask(short.clone(), 1)).await?;
    let overhead = probe.prompt_tokens - 7; // the 7 tokens of `short`
    let prompt_of = async |n: u32, client: &mut Client| -> Result<(String, mlxbc_client::GenerationStats)> {
        let mut filler = String::new();
        let mut words = 0;
        loop {
            let (_, s) = timed(client, ask(filler.clone(), 1)).await?;
            if s.prompt_tokens >= n {
                return Ok((filler, s));
            }
            for _ in 0..(n - s.prompt_tokens.max(overhead)).max(1) {
                filler.push_str(if words % 2 == 0 { " fox" } else { " dog" });
                words += 1;
            }
        }
    };
    let (ttft_prompt, ttft_stats) = prompt_of(TTFT_PROMPT_TOKENS, &mut client).await?;
    let mut ttft = Vec::new();
    for _ in 0..5 {
        // A request as users send it (more than one token): the first token's
        // time includes whatever the engine does before sending it.
        ttft.push(timed(&mut client, ask(ttft_prompt.clone(), 16)).await?.0);
    }
    let (filler, long_stats) = prompt_of(n_prompt, &mut client).await?;
    let mut prefill = vec![long_stats.prefill_tokens_per_s];
    for _ in 0..2 {
        prefill.push(timed(&mut client, ask(filler.clone(), 1)).await?.1.prefill_tokens_per_s);
    }
    let (decode, client_decode_tps) = timed_decode(&mut client, ask(short.clone(), n_decode + 1)).await?;
    let ipc_overhead_pct = (decode.decode_tokens_per_s / client_decode_tps - 1.0) * 100.0;
    let status = client.status().await?;
    let out = serde_json::json!({
        "cold_first_request_ms": cold_ms,
        "ttft_ms": median(ttft),
        "ttft_prompt_tokens": ttft_stats.prompt_tokens,
        "prefill_tps": median(prefill),
        "prompt_tokens": long_stats.prompt_tokens,
        "decode_tps": decode.decode_tokens_per_s,
        "client_decode_tps": client_decode_tps,
        "ipc_overhead_pct": ipc_overhead_pct,
        "decode_tokens": decode.generated_tokens - 1,
        "peak_rss_bytes": peak_rss(bench.daemon.id()),
        "blas": client.daemon_blas,
        "device": status.device,
        "mlx_peak_bytes": status.mlx_peak_bytes,
        "model_bytes": status.loaded.iter().map(|m| m.memory_bytes).sum::<u64>(),
    });
    drop(client);
    bench.stop().await;
    println!("{out}");
    Ok(())
}
