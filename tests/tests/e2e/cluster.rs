//! A model split over a group of daemons: every rank a real `mlxbcd`
//! process with its own home and model store, joined through MLX's ring
//! backend over loopback. What a split model answers must be what one
//! daemon answers; a rank that dies or hangs must cost its requests a
//! clear error in bounded time and nothing else.

use crate::helper::*;
use mlxbc_client::{ChatMessage, Constraint, ErrorKind, GenerateRequest, GenerationStats, MediaRef};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const QWEN25: &str = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";

/// Every rank of a test group shares this machine's cores: one BLAS
/// thread each, or OpenBLAS's spinning threads of one rank starve the
/// others (8x slower steps on 2 cores; each rank of a real group has a
/// machine of its own).
const ONE_BLAS_THREAD: &str = "1";

/// A worker rank: a daemon with no socket.
struct Worker {
    child: Option<Child>,
    home: tempfile::TempDir,
    rank: usize,
}

impl Worker {
    fn pid(&self) -> i32 {
        self.child.as_ref().expect("running").id() as i32
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(self.home.path().join("worker.log")).unwrap_or_default()
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Rank 0 (a daemon with a socket) and its workers.
struct Group {
    rank0: Daemon,
    workers: Vec<Worker>,
    hostfile: PathBuf,
    _dir: tempfile::TempDir,
}

/// Rank 0's arguments in a group.
fn rank0_args(hostfile: &Path) -> [String; 4] {
    ["--hostfile".into(), hostfile.display().to_string(), "--rank".into(), "0".into()]
}

/// A free loopback port (bound, then released for MLX to bind).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn store(home: &Path, models: &[(&str, PathBuf)]) {
    let dir = home.join("models");
    std::fs::create_dir_all(&dir).unwrap();
    for (name, target) in models {
        std::os::unix::fs::symlink(target, dir.join(name)).unwrap();
    }
}

fn spawn_worker(hostfile: &Path, rank: usize, home: tempfile::TempDir) -> Worker {
    let log = std::fs::File::create(home.path().join("worker.log")).unwrap();
    let child = Command::new(binary("mlxbcd"))
        .env("MLXBC_HOME", home.path())
        .env("MLXBC_LOG", "info")
        .env("OPENBLAS_NUM_THREADS", ONE_BLAS_THREAD)
        .env_remove("MLXBC_SOCKET")
        .args(["--hostfile", hostfile.to_str().unwrap(), "--rank", &rank.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
    Worker { child: Some(child), home, rank }
}

impl Group {
    /// `ranks` daemons; `models` in every store; rank 0 splits `sharded`.
    fn start(ranks: usize, models: &[(&str, PathBuf)], sharded: &[&str], config: &str) -> Self {
        let dir = tempfile::Builder::new().prefix("mlxbc-group").tempdir_in("/tmp").unwrap();
        let hostfile = dir.path().join("hosts.json");
        let entries: Vec<String> = (0..ranks).map(|_| format!("[\"127.0.0.1:{}\"]", free_port())).collect();
        std::fs::write(&hostfile, format!("[{}]", entries.join(", "))).unwrap();
        let workers = (1..ranks)
            .map(|r| {
                let home = tempfile::Builder::new().prefix("mlxbc-worker").tempdir_in("/tmp").unwrap();
                store(home.path(), models);
                spawn_worker(&hostfile, r, home)
            })
            .collect();
        let opts =
            DaemonOptions { models: models.iter().map(|(n, p)| (leak(n), p.clone())).collect(), ..Default::default() };
        let mut rank0 = Daemon::prepare(&opts);
        rank0.extra_env.push(("OPENBLAS_NUM_THREADS".into(), ONE_BLAS_THREAD.into()));
        let names: Vec<String> = sharded.iter().map(|n| format!("{n:?}")).collect();
        std::fs::write(
            rank0.home.path().join("config.toml"),
            format!("{config}\n[cluster]\nsharded = [{}]\nstep_timeout = \"5s\"\n", names.join(", ")),
        )
        .unwrap();
        rank0.spawn(&rank0_args(&hostfile));
        let g = Group { rank0, workers, hostfile, _dir: dir };
        g.wait_formed(Duration::from_secs(60));
        g
    }

    /// Stops every rank and starts them again on the same homes (stores,
    /// feature store, prompt cache), as a reboot of every host would.
    fn restart_all(&mut self) {
        self.rank0.terminate();
        for w in &mut self.workers {
            if let Some(mut c) = w.child.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
        for i in 0..self.workers.len() {
            let home = std::mem::replace(&mut self.workers[i].home, tempfile::tempdir().unwrap());
            self.workers[i] = spawn_worker(&self.hostfile, i + 1, home);
        }
        self.rank0.spawn(&rank0_args(&self.hostfile));
        self.wait_formed(Duration::from_secs(60));
    }

    fn wait_formed(&self, within: Duration) {
        let deadline = Instant::now() + within;
        let socket = self.rank0.socket.clone();
        loop {
            // Its own thread and runtime: callers may be inside one.
            let socket = socket.clone();
            let state = std::thread::spawn(move || {
                tokio::runtime::Runtime::new().unwrap().block_on(async {
                    let mut c = mlxbc_client::Client::connect(&socket).await.unwrap();
                    c.status().await.unwrap().cluster.map(|c| c.state)
                })
            })
            .join()
            .unwrap();
            if state.as_deref() == Some("formed") {
                return;
            }
            if Instant::now() > deadline {
                panic!("the group did not form: {state:?}\n{}\n{}", self.rank0.log_text(), self.worker_logs());
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn worker_logs(&self) -> String {
        self.workers.iter().map(|w| format!("--- rank {}:\n{}", w.rank, w.log_text())).collect()
    }
}

fn kind_of(e: &mlxbc_client::ClientError) -> Option<ErrorKind> {
    match e {
        mlxbc_client::ClientError::Daemon { kind, .. } => Some(*kind),
        _ => None,
    }
}

fn leak(s: &str) -> &'static str {
    Box::leak(s.to_string().into_boxed_str())
}

fn smollm2() -> (&'static str, PathBuf) {
    (SMOLLM2, fixture(&format!("models/{SMOLLM2}")))
}

fn qwen25() -> (&'static str, PathBuf) {
    (QWEN25, fixture(&format!("models/{QWEN25}")))
}

/// Token ids of greedy answers from a daemon, one request at a time.
async fn ids(socket: &Path, model: &str, prompts: &[String], max_tokens: u32) -> Vec<Vec<u32>> {
    let mut out = Vec::new();
    for p in prompts {
        let (_, stats) = ask(socket, greedy(Some(model), p, max_tokens)).await.unwrap();
        out.push(stats.token_ids);
    }
    out
}

/// A request whose answer copies its prompt (drafts are accepted).
const QUOTE: &str =
    "Repeat this sentence exactly, twice: The quick brown fox jumps over the lazy dog near the river bank.";

/// A prompt of more than 2000 tokens (mlx #4342's threshold for a
/// corrupting tensor-parallel prefill over JACCL).
fn long_prompt() -> String {
    facts_prompt(140)
}

/// A prompt of `n` facts and a question (about 18 tokens a fact).
fn facts_prompt(n: usize) -> String {
    let facts: String =
        (0..n).map(|i| format!("Fact {i}: the box number {i} holds {} red marbles. ", i * 7 % 31)).collect();
    format!("{facts}\nHow many red marbles does box 12 hold? Answer with the number.")
}

/// A prompt of about 1,600 tokens, inside the tiny fixtures' context of 2,048.
fn tiny_long_prompt() -> String {
    facts_prompt(90)
}

fn prompts() -> Vec<String> {
    vec![
        "Name three colors and say one thing about each.".into(),
        "Write a haiku about the sea.".into(),
        "What is 17 times 3? Explain step by step.".into(),
    ]
}

/// Every family that splits, on its tiny random-weight fixture, with the
/// per-position media inputs the plan carries: Gemma 4 (dense; an image,
/// whose positions attend both ways), Gemma 4's mixture of experts
/// (experts split), Qwen3.5 (Gated DeltaNet replicated), Gemma 3 (an
/// image), Qwen2.5-VL (multimodal rope) and Qwen3-VL (deepstack).
const TINY: [&str; 7] = [
    "tiny-qwen3",
    "tiny-gemma4",
    "tiny-gemma4-moe",
    "tiny-qwen3_5",
    "tiny-gemma3-vlm",
    "tiny-qwen25-vl",
    "tiny-qwen3-vl",
];

/// Which tiny models also answer a prompt over 2k tokens, asked again
/// after the group restarts (a plain decoder, and one with recurrent
/// states whose checkpoints every rank keeps).
const CACHED: [&str; 2] = ["tiny-qwen3", "tiny-qwen3_5"];

/// Which tiny models also take an image.
const SEEING: [&str; 4] = ["tiny-gemma4", "tiny-gemma3-vlm", "tiny-qwen25-vl", "tiny-qwen3-vl"];

fn picture() -> Vec<u8> {
    std::fs::read(workspace().join("tests/fixtures/reference/vlm-pipeline-432x336.png")).unwrap()
}

/// The requests each tiny model answers: a text prompt, an image prompt
/// where it sees.
fn tiny_requests(model: &str) -> Vec<GenerateRequest> {
    let mut out = vec![greedy(Some(model), "Write a short poem about autumn leaves.", 10)];
    if model == "tiny-qwen3" {
        // A quantized KV cache, each rank quantizing its own heads.
        let mut r = greedy(Some(model), "Write a short poem about autumn leaves.", 10);
        r.kv = mlxbc_client::KvCacheSpec { bits: Some(8), group_size: Some(32), ..Default::default() };
        r.logprobs = Some(0);
        out.push(r);
    }
    if CACHED.contains(&model) {
        out.push(greedy(Some(model), &tiny_long_prompt(), 4));
    }
    if SEEING.contains(&model) {
        let mut r = greedy(Some(model), "What is in this picture?", 8);
        let mut m = ChatMessage::user("What is in this picture?");
        m.media = vec![MediaRef::from_bytes(picture())];
        r.messages = vec![m];
        out.push(r);
    }
    out
}

async fn answers(socket: &Path, requests: &[GenerateRequest]) -> Vec<GenerationStats> {
    let mut out = Vec::new();
    for r in requests {
        out.push(ask(socket, r.clone()).await.unwrap_or_else(|e| panic!("{:?}: {e}", r.model)).1);
    }
    out
}

#[tokio::test(flavor = "multi_thread")]
async fn every_family_split_over_two_ranks_answers_as_one_daemon_and_keeps_its_stores_over_a_restart() {
    let models: Vec<(&str, PathBuf)> = TINY.iter().map(|m| (*m, fixture(&format!("mlx/{m}")))).collect();
    let requests: Vec<GenerateRequest> = TINY.iter().flat_map(|m| tiny_requests(m)).collect();
    let one = Daemon::start_with(DaemonOptions { models: models.clone(), args: vec![] });
    let want = answers(&one.socket, &requests).await;
    drop(one);

    let mut g = Group::start(2, &models, &TINY, "");
    let mut cuts = std::collections::HashMap::new();
    let mut got = Vec::new();
    for m in TINY {
        let mine: Vec<_> = requests.iter().filter(|r| r.model.as_deref() == Some(m)).cloned().collect();
        got.extend(answers(&g.rank0.socket, &mine).await);
        // While it is resident (rank 0 holds a few models at a time).
        let c = g.rank0.client().await.status().await.unwrap().cluster.unwrap();
        let how = c.models.iter().find(|(n, _)| n == m).map(|(_, h)| h.clone());
        cuts.insert(m, how.unwrap_or_else(|| panic!("{m} is not listed as split: {:?}", c.models)));
    }
    for (r, (w, s)) in requests.iter().zip(want.iter().zip(&got)) {
        let what = format!("{:?} ({} media)", r.model, r.messages.first().map_or(0, |m| m.media.len()));
        assert_eq!(w.token_ids, s.token_ids, "{what}: 2 ranks answer otherwise than one daemon");
        // A quantized cache on every rank: log-probabilities as one daemon's
        // 8-bit ones, closer than 8-bit ones are to full precision.
        for (a, b) in w.logprobs.iter().zip(&s.logprobs) {
            assert!((a.logprob - b.logprob).abs() < 1e-4, "{what}: {} vs one daemon's {}", b.logprob, a.logprob);
        }
    }
    eprintln!("{cuts:#?}");
    assert!(cuts["tiny-gemma4-moe"].contains("experts split"), "{cuts:?}");
    assert!(cuts["tiny-qwen3_5"].contains("Gated DeltaNet) layers replicated"), "{cuts:?}");
    assert!(cuts["tiny-qwen3"].contains("attention heads split"), "{cuts:?}");
    assert!(cuts["tiny-gemma4"].contains("attention heads replicated"), "1 KV head: {cuts:?}");
    assert!(cuts["tiny-gemma3-vlm"].contains("vocabulary replicated"), "262145 tokens: {cuts:?}");

    // The long prompts again: every rank restores its shard of the prefix.
    let long = |m: &str| greedy(Some(m), &tiny_long_prompt(), 4);
    let want_of = |r: &GenerateRequest| &want[requests.iter().position(|x| x == r).unwrap()];
    for m in CACHED {
        let (_, s) = ask(&g.rank0.socket, long(m)).await.unwrap();
        assert_eq!(s.token_ids, want_of(&long(m)).token_ids, "{m}: from the prompt cache");
        assert!(s.prefix_tokens_reused >= 1024, "{m}: the long prompt again reused {s:?}");
    }
    // Let the blocks reach every rank's disk.
    std::thread::sleep(Duration::from_secs(2));

    // Every host restarts: rank 0's feature store still holds the image,
    // and every rank's disk its shard of the long prompts' blocks.
    g.restart_all();
    for m in CACHED {
        let (_, s) = ask(&g.rank0.socket, long(m)).await.unwrap();
        assert_eq!(s.token_ids, want_of(&long(m)).token_ids, "{m}: from the disks after the restart");
        assert!(s.prefix_tokens_reused >= 1024, "{m}: after the restart, reused {s:?}");
    }
    // Each rank's step time reaches the status (reported every 10 s).
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let c = g.rank0.client().await.status().await.unwrap().cluster.unwrap();
        if c.ranks.len() == 2 && c.ranks.iter().all(|r| r.step_ms > 0.0) {
            break;
        }
        assert!(Instant::now() < deadline, "no step time per rank: {:?}", c.ranks);
        ask(&g.rank0.socket, greedy(Some("tiny-qwen3"), "hi", 2)).await.unwrap();
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let image = tiny_requests("tiny-gemma4").pop().unwrap();
    let (_, s) = ask(&g.rank0.socket, image.clone()).await.unwrap();
    let i = requests.iter().position(|r| r == &image).unwrap();
    assert_eq!(s.token_ids, want[i].token_ids, "after the restart");
    assert_eq!((s.encoder_hits, s.encoder_misses), (1, 0), "the image's features after the restart: {s:?}");
}

/// SmolLM2 split over 2 and over 4 ranks answers with the same greedy ids
/// as one daemon alone, long prompt included, and the status says how the
/// model is cut (its 9 query heads and 3 KV heads divide by neither, so
/// attention is replicated; its MLP and vocabulary are split).
#[tokio::test(flavor = "multi_thread")]
async fn smollm2_split_over_two_and_four_ranks_answers_as_one_daemon() {
    let one = Daemon::start();
    let want = ids(&one.socket, SMOLLM2, &prompts(), 16).await;
    let want_long = ids(&one.socket, SMOLLM2, &[long_prompt()], 4).await;
    let mut quote = greedy(Some(SMOLLM2), QUOTE, 32);
    quote.speculate = mlxbc_client::Speculation::Off;
    let (_, want_quote) = ask(&one.socket, quote.clone()).await.unwrap();
    drop(one);
    // Four ranks on this machine's two cores spin in each other's way
    // inside MLX's collectives (~1 s a step): fewer tokens there.
    for (ranks, prompts_here, tokens) in [(2, 3, 16), (4, 1, 8)] {
        let g = Group::start(ranks, &[smollm2()], &[SMOLLM2], "");
        let got = ids(&g.rank0.socket, SMOLLM2, &prompts()[..prompts_here], tokens).await;
        for (i, (w, g2)) in want.iter().zip(&got).enumerate() {
            assert_eq!(&w[..tokens as usize], &g2[..], "{ranks} ranks, prompt {i}: the ids differ from one daemon's");
        }
        if ranks == 2 {
            let long = ids(&g.rank0.socket, SMOLLM2, &[long_prompt()], 4).await;
            assert_eq!(long, want_long, "2 ranks, a prompt over 2k tokens");
            let (_, stats) = ask(&g.rank0.socket, greedy(Some(SMOLLM2), &long_prompt(), 1)).await.unwrap();
            assert!(stats.prompt_tokens > 2000, "the long prompt is {} tokens", stats.prompt_tokens);
            // Speculation on a split model: the verify pass is a sharded
            // pass, and the cut back past rejected drafts is journaled.
            quote.speculate = mlxbc_client::Speculation::Ngram;
            let (_, drafted) = ask(&g.rank0.socket, quote.clone()).await.unwrap();
            assert_eq!(drafted.token_ids, want_quote.token_ids, "2 ranks, drafting: the ids differ");
            assert!(drafted.accepted_draft_tokens > 0, "a quotation's drafts are accepted: {drafted:?}");
            let (_, again) = ask(&g.rank0.socket, quote.clone()).await.unwrap();
            assert_eq!(again.token_ids, want_quote.token_ids, "2 ranks, drafting again on the trimmed caches");
        }
        let status = g.rank0.client().await.status().await.unwrap();
        let c = status.cluster.expect("rank 0 reports its group");
        assert_eq!(c.ranks.len(), ranks, "{c:?}");
        let (_, how) = c.models.iter().find(|(m, _)| m == SMOLLM2).expect("the split model is listed");
        assert!(how.contains("attention heads replicated") && how.contains("MLP split"), "{how}");
        assert!(c.calls > 0 && c.all_sum_us > 0.0, "{c:?}");
        let text = String::from_utf8(g.rank0.cli().arg("status").output().unwrap().stdout).unwrap();
        for r in 0..ranks {
            assert!(text.contains(&format!("rank {r} ")), "`mlxbc status` lacks rank {r}:\n{text}");
        }
    }
}

/// Qwen2.5-Coder-0.5B (Q4_K_M): 2 KV heads cannot be split over 4 ranks,
/// so they are replicated (the status says so) and the ids equal one
/// daemon's; over 2 ranks every part is split and each rank holds at most
/// 60% of what one daemon holds.
#[tokio::test(flavor = "multi_thread")]
async fn qwen25_kv_heads_replicated_on_four_ranks_and_two_ranks_hold_under_sixty_percent() {
    let one = Daemon::start_with(DaemonOptions { models: vec![qwen25()], args: vec![] });
    let prompts = &prompts()[..2];
    let want = ids(&one.socket, QWEN25, prompts, 12).await;
    let one_rss = one.client().await.status().await.unwrap().rss_bytes;
    drop(one);

    let g = Group::start(4, &[qwen25()], &[QWEN25], "");
    let four = ids(&g.rank0.socket, QWEN25, &prompts[..1], 6).await;
    assert_eq!(four[0][..], want[0][..6], "4 ranks");
    let c = g.rank0.client().await.status().await.unwrap().cluster.unwrap();
    let (_, how) = c.models.iter().find(|(m, _)| m == QWEN25).unwrap();
    assert!(how.contains("attention heads replicated") && how.contains("vocabulary split"), "{how}");
    drop(g);

    let g = Group::start(2, &[qwen25()], &[QWEN25], "");
    assert_eq!(ids(&g.rank0.socket, QWEN25, prompts, 12).await, want, "2 ranks");
    let c = g.rank0.client().await.status().await.unwrap().cluster.unwrap();
    let (_, how) = c.models.iter().find(|(m, _)| m == QWEN25).unwrap();
    assert!(how.contains("attention heads split"), "{how}");
    let rank0_rss = g.rank0.client().await.status().await.unwrap().rss_bytes;
    let worker_rss = rss_of(g.workers[0].pid());
    for (who, rss) in [("rank 0", rank0_rss), ("rank 1", worker_rss)] {
        let share = rss as f64 / one_rss as f64;
        eprintln!("{who}: {} MiB, {:.0}% of one daemon's {} MiB", rss >> 20, share * 100.0, one_rss >> 20);
        assert!(share <= 0.60, "{who} holds {:.0}% of one daemon's memory", share * 100.0);
    }
}

fn rss_of(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
}

/// 16 clients at once on a 2-rank group (one batch) get what each gets
/// alone; a JSON-schema-constrained answer validates; logprobs come back.
#[tokio::test(flavor = "multi_thread")]
async fn sixteen_clients_together_equal_each_alone_and_constraints_hold() {
    let g = Group::start(2, &[smollm2()], &[SMOLLM2], "");
    let requests: Vec<GenerateRequest> =
        (0..16).map(|i| greedy(Some(SMOLLM2), &format!("Count from {i} to {}.", i + 5), 12)).collect();
    let mut alone = Vec::new();
    for r in &requests {
        alone.push(ask(&g.rank0.socket, r.clone()).await.unwrap().1.token_ids);
    }
    let tasks: Vec<_> = requests
        .iter()
        .map(|r| {
            let (socket, r) = (g.rank0.socket.clone(), r.clone());
            tokio::spawn(async move { ask(socket, r).await.unwrap().1.token_ids })
        })
        .collect();
    for (i, t) in tasks.into_iter().enumerate() {
        assert_eq!(t.await.unwrap(), alone[i], "request {i} in a batch of 16");
    }
    let log = g.rank0.log_text();
    assert!(log.contains("rows on average"), "no batched decode was logged");

    let schema = r#"{"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer"}},"required":["name","age"]}"#;
    let mut r = greedy(Some(SMOLLM2), "Give a person's name and age as JSON.", 48);
    r.constraint = Some(Constraint::JsonSchema(schema.into()));
    r.logprobs = Some(2);
    let (text, stats) = ask(&g.rank0.socket, r).await.unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    assert!(v["name"].is_string() && v["age"].is_i64(), "{text}");
    assert_eq!(stats.logprobs.len(), stats.token_ids.len());
    assert!(stats.logprobs.iter().all(|l| l.logprob <= 0.0 && l.top.len() == 2));
}

/// Starts a long answer, sends the worker `signal` once tokens stream,
/// and checks the answer ends in `RankStopped` within 10 s (the group's
/// step timeout is 5 s); returns the error's text.
async fn stopped_within_ten_seconds(g: &Group, prompt: &str, signal: i32) -> String {
    let mut c = g.rank0.client().await;
    let mut stream = c.generate(greedy(Some(SMOLLM2), prompt, 2000)).await.unwrap();
    until_first_token(&mut stream).await;
    let t = Instant::now();
    unsafe { libc::kill(g.workers[0].pid(), signal) };
    let outcome =
        tokio::time::timeout(Duration::from_secs(30), stream.collect_text()).await.expect("no answer in 30 s");
    let err = outcome.expect_err("the generation went on without its worker");
    eprintln!("signal {signal}: the client's error after {:?}", t.elapsed());
    assert!(t.elapsed() < Duration::from_secs(10), "the error took {:?}", t.elapsed());
    assert!(matches!(kind_of(&err), Some(ErrorKind::RankStopped)), "{err:?}");
    err.to_string()
}

/// kill -9 of a worker mid-generation: the client's error names the rank
/// within the step timeout; a model rank 0 serves alone answers at once;
/// the worker started again, the group re-forms and the split model
/// answers with the same ids.
#[tokio::test(flavor = "multi_thread")]
async fn a_killed_worker_fails_its_requests_fast_and_the_group_reforms() {
    let tiny = ("tiny-qwen3", fixture("mlx/tiny-qwen3"));
    let mut g = Group::start(2, &[smollm2(), tiny.clone()], &[SMOLLM2], "");
    let prompt = "Tell a long story about a lighthouse keeper.";
    let (_, before) = ask(&g.rank0.socket, greedy(Some(SMOLLM2), prompt, 20)).await.unwrap();

    let text = stopped_within_ten_seconds(&g, prompt, libc::SIGKILL).await;
    assert!(text.contains("rank 1 (127.0.0.1) stopped answering"), "{text}");

    // Rank 0's own model answers right away.
    let t = Instant::now();
    ask(&g.rank0.socket, greedy(Some("tiny-qwen3"), "hello", 4)).await.unwrap();
    assert!(t.elapsed() < Duration::from_secs(10), "the local model waited {:?}", t.elapsed());
    // The split model says why it cannot answer while its rank is gone.
    let err = ask(&g.rank0.socket, greedy(Some(SMOLLM2), "hi", 4)).await.unwrap_err();
    assert!(matches!(kind_of(&err), Some(ErrorKind::RankStopped)), "{err:?}");

    // The worker comes back: the group re-forms by itself.
    let home = std::mem::replace(&mut g.workers[0].home, tempfile::tempdir().unwrap());
    g.workers[0].child = None;
    g.workers[0] = spawn_worker(&g.hostfile, 1, home);
    g.wait_formed(Duration::from_secs(60));
    let (_, after) = ask(&g.rank0.socket, greedy(Some(SMOLLM2), prompt, 20)).await.unwrap();
    assert_eq!(after.token_ids, before.token_ids, "the re-formed group answers otherwise");
}

/// A worker that stops answering (SIGSTOP: a hung host) costs the
/// requests in flight an error within the step timeout, and `mlxbc
/// cluster restart` after it resumes forms the group again.
#[tokio::test(flavor = "multi_thread")]
async fn a_hung_worker_is_cut_off_within_the_step_timeout() {
    let g = Group::start(2, &[smollm2()], &[SMOLLM2], "");
    ask(&g.rank0.socket, greedy(Some(SMOLLM2), "hi", 2)).await.unwrap();
    stopped_within_ten_seconds(&g, "Tell a long story.", libc::SIGSTOP).await;
    unsafe { libc::kill(g.workers[0].pid(), libc::SIGCONT) };
    let out = g.rank0.cli().args(["cluster", "restart"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    g.wait_formed(Duration::from_secs(60));
    ask(&g.rank0.socket, greedy(Some(SMOLLM2), "hi", 2)).await.unwrap();
}

/// A worker whose store holds other weights under the model's name is
/// refused at load, in a sentence naming the rank and its file.
#[tokio::test(flavor = "multi_thread")]
async fn a_worker_with_other_weights_is_refused_by_name() {
    let dir = tempfile::Builder::new().prefix("mlxbc-group").tempdir_in("/tmp").unwrap();
    let hostfile = dir.path().join("hosts.json");
    std::fs::write(&hostfile, format!("[[\"127.0.0.1:{}\"], [\"127.0.0.1:{}\"]]", free_port(), free_port())).unwrap();
    let home = tempfile::Builder::new().prefix("mlxbc-worker").tempdir_in("/tmp").unwrap();
    // The worker's "SmolLM2" is Qwen2.5's file.
    store(home.path(), &[(SMOLLM2, fixture(&format!("models/{QWEN25}")))]);
    let _worker = spawn_worker(&hostfile, 1, home);
    let mut rank0 = Daemon::prepare(&DaemonOptions::default());
    std::fs::write(rank0.home.path().join("config.toml"), format!("[cluster]\nsharded = [{SMOLLM2:?}]\n")).unwrap();
    rank0.spawn(&["--hostfile".into(), hostfile.display().to_string(), "--rank".into(), "0".into()]);
    let g = Group { rank0, workers: vec![], hostfile, _dir: dir };
    g.wait_formed(Duration::from_secs(60));
    let err = ask(&g.rank0.socket, greedy(Some(SMOLLM2), "hi", 2)).await.unwrap_err();
    let text = err.to_string();
    assert!(matches!(kind_of(&err), Some(ErrorKind::ModelLoad)), "{err:?}");
    assert!(text.contains("rank 1 (127.0.0.1) refused") && text.contains("other weights"), "{text}");
    assert!(text.contains(SMOLLM2), "{text}");
}
