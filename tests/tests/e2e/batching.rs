//! Many clients at once: the scheduler interleaves prefill with the
//! others' decode steps and decodes every sequence of a model in one batch.
//! What each request gets must not depend on what shares its batch.

use crate::helper::*;
use crate::vision::png;
use mlxbc_client::{ChatMessage, ErrorKind, GenerateRequest, GenerationStats, MediaRef, SamplingParams};
use std::time::Duration;

const QWEN3: &str = "tiny-qwen3";
const VLM: &str = "tiny-gemma3-vlm";

fn daemon_with(models: &[(&'static str, &str)]) -> Daemon {
    let mut opts = DaemonOptions::default();
    for (name, rel) in models {
        opts.models.push((name, fixture(rel)));
    }
    Daemon::start_with(opts)
}

/// Each request alone, one after another: what batching must reproduce.
async fn alone(d: &Daemon, requests: &[GenerateRequest]) -> Vec<(String, GenerationStats)> {
    let mut out = Vec::new();
    for r in requests {
        out.push(ask(&d.socket, r.clone()).await.unwrap());
    }
    out
}

/// The daemon's status once `ready` holds for it, or after 5 s.
async fn status_when(d: &Daemon, ready: impl Fn(&mlxbc_client::DaemonStatus) -> bool) -> mlxbc_client::DaemonStatus {
    let mut c = d.client().await;
    for _ in 0..250 {
        let s = c.status().await.unwrap();
        if ready(&s) {
            return s;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    c.status().await.unwrap()
}

fn sampled(model: Option<&str>, prompt: &str, seed: u64, max_tokens: u32) -> GenerateRequest {
    let mut r = greedy(model, prompt, max_tokens);
    r.sampling = SamplingParams { temperature: 0.9, top_k: 40, top_p: 0.95, seed: Some(seed) };
    r
}

/// SmolLM2 (real weights): prompts of different lengths arriving at
/// different times, a seeded sampled request among the greedy ones, and
/// different token limits; every greedy answer equals its answer alone,
/// token for token, and so does the seeded one's text.
#[tokio::test(flavor = "multi_thread")]
async fn greedy_ids_in_a_batch_equal_each_alone_across_lengths_arrivals_and_sampling() {
    let d = Daemon::start();
    let long = "Here is a list of things to remember: milk, eggs, bread, butter, apples, \
                oranges, coffee, tea, rice, beans, and a birthday card for Anna. What should I buy first?";
    let requests = vec![
        greedy(None, "Write a short poem about the sea.", 40),
        greedy(None, "What is 2 + 2?", 12),
        greedy(None, long, 24),
        sampled(None, "Tell me a story about a fox.", 7, 24),
        greedy(None, "Name three colors.", 20),
    ];
    let want = alone(&d, &requests).await;
    let got = together(&d, &requests, &[0, 150, 400, 250, 900]).await;
    for (i, ((t, s), (wt, ws))) in got.iter().zip(&want).enumerate() {
        assert_eq!(s.token_ids, ws.token_ids, "request {i}: ids in a batch differ from alone");
        assert_eq!(t, wt, "request {i}: text in a batch differs from alone");
        assert_eq!(s.stop_reason, ws.stop_reason, "request {i}");
    }
    // It was batched: two generations on one model decode in one batch.
    let mut c = d.client().await;
    let mut long = greedy(None, "Count from one to fifty in words.", 200);
    long.ignore_eos = true;
    let mut first = c.generate(long).await.unwrap();
    until_first_token(&mut first).await;
    let mut c2 = d.client().await;
    let mut second = c2.generate(greedy(None, "Say hello.", 30)).await.unwrap();
    until_first_token(&mut second).await;
    // Status is republished between engine steps: it may lag by one.
    let batched = |s: &mlxbc_client::DaemonStatus| s.sequences.iter().filter(|q| q.batch_size == 2).count() == 2;
    let status = status_when(&d, batched).await;
    drop((first, second));
    assert!(batched(&status), "two generations on one model decode in one batch: {:?}", status.sequences);
    assert!(status.reserved_kv_bytes > 0, "running generations reserve KV in the memory budget");
}

/// A seeded sampled answer is the same text alone and beside three others
/// (greedy and sampled with other seeds) that join and leave its batch.
#[tokio::test(flavor = "multi_thread")]
async fn a_seeded_sampled_answer_does_not_depend_on_its_batch() {
    let d = Daemon::start();
    let mine = sampled(None, "Describe a rainy afternoon.", 1234, 32);
    let (want, _) = ask(&d.socket, mine.clone()).await.unwrap();
    let requests = vec![
        greedy(None, "What is the capital of Italy?", 10),
        mine.clone(),
        sampled(None, "Describe a sunny morning.", 99, 40),
        greedy(None, "List four animals.", 16),
    ];
    let got = together(&d, &requests, &[0, 100, 100, 600]).await;
    assert_eq!(got[1].0, want, "the seeded answer changed with what shared its batch");
}

/// 64 clients at once over the socket (tiny Qwen3, eight prompts): every one
/// gets a complete answer equal to its prompt's answer alone.
#[tokio::test(flavor = "multi_thread")]
async fn sixty_four_concurrent_clients_all_get_complete_correct_answers() {
    let d = daemon_with(&[(QWEN3, "mlx/tiny-qwen3")]);
    let prompts: Vec<String> = (0..8).map(|i| format!("Question number {i}: {}", "why? ".repeat(i + 1))).collect();
    let request = |i: usize| {
        let mut r = greedy(Some(QWEN3), &prompts[i % 8], 16 + (i % 8) as u32);
        r.ignore_eos = true;
        r
    };
    let want = alone(&d, &(0..8).map(request).collect::<Vec<_>>()).await;
    let requests: Vec<GenerateRequest> = (0..64).map(request).collect();
    let delays: Vec<u64> = (0..64).map(|i| (i % 4) * 20).collect();
    let got = together(&d, &requests, &delays).await;
    for (i, (t, s)) in got.iter().enumerate() {
        let (wt, ws) = &want[i % 8];
        assert_eq!(s.generated_tokens, 16 + (i % 8) as u32, "client {i}: incomplete answer");
        assert_eq!(&s.token_ids, &ws.token_ids, "client {i}: ids differ from the prompt alone");
        assert_eq!(t, wt, "client {i}");
    }
    let status = status_when(&d, |s| s.sequences.is_empty()).await;
    assert!(status.sequences.is_empty(), "nothing left running: {:?}", status.sequences);
    assert_eq!(status.reserved_kv_bytes, 0, "every reservation was released");
}

/// Image requests join the text requests' batch on a vision model: their
/// prefill (with the image) is their own, their decode is batched, and
/// every answer equals its answer alone.
#[tokio::test(flavor = "multi_thread")]
async fn image_requests_decode_in_the_batch_and_match_alone() {
    let d = daemon_with(&[(VLM, "mlx/tiny-gemma3-vlm")]);
    let image = |seed: u32, q: &str| {
        let mut r = greedy(Some(VLM), q, 12);
        r.ignore_eos = true;
        let mut m = ChatMessage::user(q);
        m.media = vec![MediaRef::from_bytes(png(48, 40, seed))];
        r.messages = vec![m];
        r
    };
    let mut text = greedy(Some(VLM), "Say something about cats.", 20);
    text.ignore_eos = true;
    let requests = vec![text, image(3, "What is in this picture?"), image(4, "Describe it."), image(3, "Again?")];
    let want = alone(&d, &requests).await;
    let got = together(&d, &requests, &[0, 50, 100, 150]).await;
    for (i, ((_, s), (_, ws))) in got.iter().zip(&want).enumerate() {
        assert_eq!(s.token_ids, ws.token_ids, "request {i}: ids in a batch differ from alone");
    }
}

/// The memory budget counts generations' KV: with room for about one
/// reservation beside the model, a second request waits for admission
/// (it is not refused) and is answered once the first is done; a request
/// whose KV could never fit is refused at once with a clear error.
#[tokio::test(flavor = "multi_thread")]
async fn admission_waits_for_kv_room_and_refuses_what_can_never_fit() {
    let mut d = Daemon::start();
    d.client().await.load(SMOLLM2, None).await.unwrap();
    let model_mib = d.client().await.status().await.unwrap().loaded[0].memory_bytes >> 20;
    d.terminate();
    // SmolLM2 on CPU keeps 46 KiB of f32 KV per position: 1,200 positions
    // are ~55 MiB, so 90 MiB beside the model holds one such reservation.
    std::fs::write(d.home.path().join("config.toml"), format!("memory_budget_mib = {}\n", model_mib + 90)).unwrap();
    d.spawn(&[]);
    let mut big = greedy(None, "Count from one to fifty in words.", 1_000_000);
    big.ignore_eos = true;
    match ask(&d.socket, big).await {
        Err(mlxbc_client::ClientError::Daemon { kind, message }) => {
            assert_eq!(kind, ErrorKind::OutOfMemory, "{message}");
            assert!(message.contains("KV cache") && message.contains("max_tokens"), "{message}");
        }
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    // Each reserves ~55 MiB (the prompt plus max_tokens 1,150). The first
    // runs until its client leaves, which happens once the second was seen
    // waiting.
    let mut long = greedy(None, "Count from one to twenty in words.", 1_150);
    long.ignore_eos = true;
    let socket = d.socket.clone();
    let mut c = d.client().await;
    let mut running = c.generate(long).await.unwrap();
    until_first_token(&mut running).await;
    let waiter = tokio::spawn(ask(socket, greedy(None, "What is the capital of France?", 1_150)));
    let mut seen_waiting = false;
    for _ in 0..200 {
        let s = d.client().await.status().await.unwrap();
        if s.admission_queue == 1 && s.sequences.iter().any(|q| q.state == "waiting") {
            seen_waiting = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(seen_waiting, "the second request waits for KV room");
    drop(running); // the first client leaves: its reservation is released
    let (text, _) = waiter.await.unwrap().unwrap();
    assert!(text.contains("Paris"), "the waiting request is answered: {text:?}");
}

/// How a GPU's batches use quantized weights (issue "The GPU step at real
/// sizes"), forced on the CPU build: packed weights with dense copies for
/// batches, or expanded inside each batched step. `mlxbc ps` names the
/// choice and says "warming batches" until the idle engine has run the
/// batched paths at each size; every client of a burst gets its whole
/// answer; the dense copies are counted in the model's memory. (That a
/// batched step's numbers are the dense matmul's exactly, and within
/// rounding of the packed one's, is model::layers' unit test: greedy ids
/// of random tiny weights flip on such rounding.)
#[tokio::test(flavor = "multi_thread")]
async fn batches_use_dense_copies_or_expanded_weights_as_chosen_and_warm_while_idle() {
    const Q4: &str = "tiny-gemma4-4bit";
    let mut memory = Vec::new();
    for (mode, label) in [("dense", "packed + dense copies"), ("expand", "packed, expanded per batched step")] {
        let opts = DaemonOptions { models: vec![(Q4, fixture(&format!("mlx/{Q4}")))], args: Vec::new() };
        let mut d = Daemon::prepare(&opts);
        for (k, v) in [("MLXBC_WEIGHTS", "packed"), ("MLXBC_BATCH_WEIGHTS", mode), ("MLXBC_WARM_BATCHES", "2,8")] {
            d.extra_env.push((k.into(), v.into()));
        }
        d.spawn(&[]);
        let request = |i: usize| {
            let mut r = greedy(Some(Q4), ["Tell me about boats.", "Why is the sky blue?"][i % 2], 10);
            r.ignore_eos = true;
            r
        };
        ask(&d.socket, request(0)).await.unwrap();
        let warmed = |s: &mlxbc_client::DaemonStatus| s.loaded.iter().any(|m| m.batch_weights == label);
        let mut c = d.client().await;
        let mut status = c.status().await.unwrap();
        for _ in 0..600 {
            if warmed(&status) {
                break;
            }
            assert!(
                status.loaded.iter().all(|m| m.batch_weights == format!("{label} (warming batches)")),
                "{mode}: {:?}",
                status.loaded
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
            status = c.status().await.unwrap();
        }
        assert!(warmed(&status), "{mode}: still warming after 60 s: {:?}", status.loaded);
        let log = d.log_text();
        for rows in ["rows=2", "rows=8"] {
            let warmed = log.lines().any(|l| l.contains("batched paths warmed") && l.trim_end().ends_with(rows));
            assert!(warmed, "{mode}: no warm-up at {rows}");
        }
        memory.push(status.loaded[0].memory_bytes);
        let got = together(&d, &(0..8).map(request).collect::<Vec<_>>(), &[0; 8]).await;
        for (i, (_, s)) in got.iter().enumerate() {
            assert_eq!(s.generated_tokens, 10, "{mode}: client {i} got an incomplete answer");
        }
    }
    assert!(memory[0] > memory[1] * 3 / 2, "dense copies are made at load and counted: {memory:?} bytes");
}
