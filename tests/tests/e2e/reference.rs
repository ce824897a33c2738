//! Greedy token ids against mlx-lm on identical weights
//! (tests/fixtures/reference, made by scripts/goldens/mlx_lm_reference.py).

use crate::helper::*;
use mlxbc_client::{ChatMessage, Role};
use std::path::PathBuf;

pub(crate) fn golden(name: &str) -> serde_json::Value {
    mlxbc_test_support::reference_json(&format!("{name}.json"))
}

pub(crate) fn check_weights(dir: &std::path::Path, golden: &serde_json::Value) {
    mlxbc_test_support::check_weights(dir, golden["weights_sha256"].as_str().unwrap());
}

/// A golden case's `messages` (system and user turns) as the client sends them.
pub(crate) fn messages_of(case: &serde_json::Value) -> Vec<ChatMessage> {
    case["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| ChatMessage {
            role: if m["role"] == "system" { Role::System } else { Role::User },
            content: m["content"].as_str().unwrap().into(),
            media: vec![],
            tool_calls: vec![],
            tool_call_id: None,
        })
        .collect()
}

async fn assert_matches_reference(model: &'static str, path: PathBuf, golden: serde_json::Value) {
    assert_matches_reference_in(model, path, golden, "compiled").await
}

/// Each golden case through a daemon whose decode steps are built `mode`
/// (MLXBC_DECODE): the compiled step and the eager one must both give the
/// reference's ids, including the case whose decode crosses the point where
/// the KV buffers grow (256 positions).
async fn assert_matches_reference_in(model: &'static str, path: PathBuf, golden: serde_json::Value, mode: &str) {
    let opts = DaemonOptions { models: vec![(model, path)], args: vec![] };
    let mut d = Daemon::prepare(&opts);
    d.extra_env.push(("MLXBC_DECODE".into(), mode.into()));
    d.spawn(&opts.args);
    for case in golden["cases"].as_array().unwrap() {
        let messages = messages_of(case);
        let mut req = greedy(Some(model), "", case["max_tokens"].as_u64().unwrap() as u32);
        req.messages = messages;
        let (_, stats) = ask(&d.socket, req).await.unwrap();
        let want: Vec<u32> =
            case["generated_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        assert_eq!(stats.prompt_tokens as usize, case["prompt_ids"].as_array().unwrap().len());
        assert_eq!(
            stats.token_ids, want,
            "{model} ({mode} decode): greedy ids differ from mlx-lm for {}",
            case["messages"]
        );
    }
    // The daemon logs which way each generation's steps were built.
    let logged = if mode == "eager" { "decode (Eager)" } else { "decode (Compiled)" };
    assert!(d.log_text().contains(logged), "{model}: no {logged:?} in the daemon log");
}

#[tokio::test(flavor = "multi_thread")]
async fn smollm2_gguf_matches_mlx_lm() {
    // The GGUF file and the MLX directory made from it hold the same weights,
    // so both paths must reproduce the same reference ids.
    assert_matches_reference(SMOLLM2, fixture(&format!("models/{SMOLLM2}")), golden("smollm2-mlx")).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn smollm2_gguf_eager_decode_matches_mlx_lm() {
    let golden = golden("smollm2-mlx");
    assert_matches_reference_in(SMOLLM2, fixture(&format!("models/{SMOLLM2}")), golden, "eager").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn smollm2_mlx_directory_matches_mlx_lm() {
    let dir = fixture("mlx/smollm2-mlx");
    let g = golden("smollm2-mlx");
    check_weights(&dir, &g);
    assert_matches_reference("smollm2-mlx", dir, g).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn tiny_qwen2_matches_mlx_lm() {
    let dir = fixture("mlx/tiny-qwen2");
    let g = golden("tiny-qwen2");
    check_weights(&dir, &g);
    assert_matches_reference("tiny-qwen2", dir, g).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn tiny_qwen3_matches_mlx_lm() {
    let dir = fixture("mlx/tiny-qwen3");
    let g = golden("tiny-qwen3");
    check_weights(&dir, &g);
    assert_matches_reference("tiny-qwen3", dir, g).await;
}

const QWEN25: &str = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";

/// Real Qwen2.5-Coder-0.5B weights in a Q4_K_M GGUF (Q5_0, Q4_K, Q6_K and
/// Q8_0 blocks, which MLX's own GGUF loader cannot read) through the daemon's
/// reader: greedy ids equal mlx-lm's on the directory mlxbc-gguf-to-mlx wrote
/// from the same file (scripts/goldens/mlx_lm_reference.py).
#[tokio::test(flavor = "multi_thread")]
async fn qwen25_q4_k_m_gguf_matches_mlx_lm() {
    let g = golden("qwen25-0.5b");
    let gguf = fixture(&format!("models/{QWEN25}"));
    assert_matches_reference(QWEN25, gguf, g).await;
}

/// The exporter's directory, served by the daemon, gives the same ids: what
/// mlx-lm ran is what the daemon computes with.
#[tokio::test(flavor = "multi_thread")]
async fn qwen25_exported_directory_matches_mlx_lm() {
    let out = tempfile::tempdir().unwrap();
    let dir = out.path().join("qwen25-mlx");
    mlxbc_daemon::families::llama::export::gguf_to_mlx_dir(
        &fixture(&format!("models/{QWEN25}")),
        &dir,
        mlx_rs::Dtype::Float32,
    )
    .unwrap();
    assert_matches_reference("qwen25-mlx", dir, golden("qwen25-0.5b")).await;
}

/// Qwen2.5-VL and Qwen3-VL (deepstack, interleaved multimodal rope) through the real daemon — image bytes over the socket, the
/// daemon's processor, tower, splice and multimodal positions — against
/// `mlx_vlm.generate` on the same fixture directory and image
/// (tests/fixtures/reference/vlm-pipeline.json, scripts/goldens/mlx_vlm_pipeline.py).
/// Gemma 3 is checked up to the prompt here: mlx-vlm feeds it a doubled BOS
/// and attends causally over the image, so its ids are not Gemma's; the
/// daemon's greedy ids on mlx-vlm's exact inputs are checked in
/// daemon/tests/vision_towers.rs.
#[tokio::test(flavor = "multi_thread")]
async fn fixture_vlms_through_the_daemon_match_mlx_vlm_generate() {
    let g = golden("vlm-pipeline");
    let image = std::fs::read(workspace().join("tests/fixtures/reference").join(g["image"].as_str().unwrap())).unwrap();
    let families = ["tiny-qwen25-vl", "tiny-qwen3-vl", "tiny-gemma3-vlm"];
    for family in families {
        check_weights(&fixture(&format!("mlx/{family}")), &g[family]);
    }
    let d = Daemon::start_with(DaemonOptions {
        models: families.iter().map(|f| (*f, fixture(&format!("mlx/{f}")))).collect(),
        args: vec![],
    });
    for family in families {
        let want = &g[family];
        let mut req = greedy(Some(family), "", want["generated_ids"].as_array().unwrap().len() as u32);
        req.messages = vec![ChatMessage {
            role: Role::User,
            content: g["question"].as_str().unwrap().into(),
            media: vec![mlxbc_client::MediaRef::from_bytes(image.clone())],
            tool_calls: vec![],
            tool_call_id: None,
        }];
        let (_, stats) = ask(&d.socket, req).await.unwrap();
        let their_prompt = want["prompt_ids"].as_array().unwrap().len();
        if family != "tiny-gemma3-vlm" {
            assert_eq!(stats.prompt_tokens as usize, their_prompt);
            let ids: Vec<u32> = serde_json::from_value(want["generated_ids"].clone()).unwrap();
            assert_eq!(stats.token_ids, ids, "{family}: greedy ids differ from mlx-vlm generate");
        } else {
            assert_eq!(stats.prompt_tokens as usize, their_prompt - 1, "{family}: one BOS, not mlx-vlm's two");
        }
    }
}

/// Log-probabilities against mlx-lm's (`generate_step`'s log-softmax) on
/// the same weights (scripts/goldens/mlx_lm_logprobs.py): each greedy
/// token's and the top 5 alternatives within 1e-3 nats, the alternatives'
/// order wherever their values are not within that of each other; both
/// prompts at once, so the rows also go through a batched step.
#[tokio::test(flavor = "multi_thread")]
async fn smollm2_logprobs_match_mlx_lm() {
    let golden = golden("smollm2-mlx-logprobs");
    let dir = fixture("mlx/smollm2-mlx");
    check_weights(&dir, &golden);
    let d = Daemon::start_with(DaemonOptions { models: vec![("smollm2-mlx", dir)], args: vec![] });
    let top = golden["top"].as_u64().unwrap() as u8;
    let cases = golden["cases"].as_array().unwrap();
    let asks = cases.iter().map(|case| {
        let mut req = greedy(Some("smollm2-mlx"), case["messages"][0]["content"].as_str().unwrap(), 0);
        req.max_tokens = case["steps"].as_array().unwrap().len() as u32;
        req.logprobs = Some(top);
        ask(&d.socket, req)
    });
    let answers = futures::future::join_all(asks).await;
    const TOLERANCE: f32 = 1e-3;
    for (case, answer) in cases.iter().zip(answers) {
        let (_, stats) = answer.unwrap();
        let steps = case["steps"].as_array().unwrap();
        assert_eq!(stats.logprobs.len(), steps.len(), "one entry per generated token");
        for (i, (got, want)) in stats.logprobs.iter().zip(steps).enumerate() {
            assert_eq!(got.token.id as u64, want["id"].as_u64().unwrap(), "token {i}");
            let lp = want["logprob"].as_f64().unwrap() as f32;
            assert!((got.logprob - lp).abs() < TOLERANCE, "token {i}: {} vs mlx-lm {lp}", got.logprob);
            let want_top: Vec<(u32, f32)> = want["top"]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| (p[0].as_u64().unwrap() as u32, p[1].as_f64().unwrap() as f32))
                .collect();
            assert_eq!(got.top.len(), want_top.len());
            for (j, ((t, v), (want_id, want_v))) in got.top.iter().zip(&want_top).enumerate() {
                assert!((v - want_v).abs() < TOLERANCE, "token {i} alternative {j}: {v} vs {want_v}");
                let tied = want_top.iter().any(|(id, w)| id != want_id && (w - want_v).abs() < TOLERANCE);
                assert!(tied || t.id == *want_id, "token {i} alternative {j}: id {} vs mlx-lm {want_id}", t.id);
            }
            assert!(got.logprob <= 0.0 && got.top[0].1 >= got.logprob - TOLERANCE);
        }
    }
}

/// `r` through the daemon; a failure panics with the daemon's log.
pub async fn ask_ok(d: &Daemon, r: mlxbc_client::GenerateRequest) -> mlxbc_client::GenerationStats {
    ask(&d.socket, r).await.unwrap_or_else(|e| panic!("{e}\n{}", d.log_text())).1
}

/// `stats` are golden case `case` of `family`'s (a reference script's
/// `{family: {case: {prompt_ids, generated_ids}}}`): its prompt length and
/// greedy ids.
pub fn assert_golden(
    g: &serde_json::Value,
    family: &str,
    case: &str,
    stats: &mlxbc_client::GenerationStats,
    how: &str,
) {
    let want = &g[family][case];
    let ids: Vec<u32> = serde_json::from_value(want["generated_ids"].clone()).unwrap();
    assert_eq!(stats.prompt_tokens as usize, want["prompt_ids"].as_array().unwrap().len(), "{family} {case} ({how})");
    assert_eq!(stats.token_ids, ids, "{family} {case} ({how}): greedy ids differ from mlx-vlm generate: {stats:?}");
}
