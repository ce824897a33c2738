//! A quantized KV cache against mlx-lm's `QuantizedKVCache` on identical
//! weights (tests/fixtures/reference/kv-quantized.json, made by
//! scripts/goldens/mlx_lm_kv_quantized.py): greedy ids exactly and each
//! token's log-probability within 1e-3 for 8 and 4 bits and a start past
//! the prompt, on SmolLM2 and the tiny Qwen3 (grouped-query heads); the
//! same through the CLI's `--kv-bits`, several at once (batched together
//! when quantized alike, apart from full-precision rows), and refusals
//! with a sentence.

use crate::helper::*;
use crate::reference::{check_weights, golden};
use mlxbc_client::{GenerateRequest, KvCacheSpec};

fn request(model: &str, case: &serde_json::Value, max_tokens: u32) -> GenerateRequest {
    let mut req = greedy(Some(model), "", max_tokens);
    req.messages = crate::reference::messages_of(case);
    let kv = &case["kv"];
    if !kv.is_null() {
        req.kv = KvCacheSpec {
            bits: Some(kv["bits"].as_u64().unwrap() as u8),
            group_size: Some(kv["group_size"].as_u64().unwrap() as u16),
            start: Some(kv["start"].as_u64().unwrap() as u32),
            // mlx-lm's arithmetic (no rotation).
            rotate: Some(false),
            key_bits: None,
        };
    }
    req.logprobs = Some(0);
    req
}

/// Every case of `name` (served as `served`), all at once: the quantized
/// cases of one setting share a batch, the others decode beside them.
async fn assert_cases(d: &Daemon, name: &str, served: &str, golden: &serde_json::Value) -> (usize, usize) {
    let cases = golden["models"][name]["cases"].as_array().unwrap();
    let max = golden["max_tokens"].as_u64().unwrap() as u32;
    let asks = cases.iter().map(|c| ask(&d.socket, request(served, c, max)));
    let answers = futures::future::join_all(asks).await;
    let (mut same, mut quantized) = (0, 0);
    for (i, (case, answer)) in cases.iter().zip(answers).enumerate() {
        let (_, stats) = answer.unwrap_or_else(|e| panic!("{name} case {i}: {e}\n{}", d.log_text()));
        let want: Vec<u32> = serde_json::from_value(case["generated_ids"].clone()).unwrap();
        assert_eq!(stats.prompt_tokens as u64, case["prompt_tokens"].as_u64().unwrap());
        assert_eq!(stats.token_ids, want, "{name} case {i} (kv {}): greedy ids differ from mlx-lm", case["kv"]);
        // The first token within 1e-3 nats; later ones within 0.05: a key
        // that differs from mlx-lm's in its last bits (its projections are
        // one fused product here) can round to the neighbouring quantized
        // value, a step of 1/255 (8 bits) or 1/15 (4 bits) of its group's
        // range, and the difference carries on.
        for (j, (got, want)) in stats.logprobs.iter().zip(case["logprobs"].as_array().unwrap()).enumerate() {
            let want = want.as_f64().unwrap() as f32;
            let tolerance = if j == 0 { 1e-3 } else { 0.05 };
            assert!(
                (got.logprob - want).abs() < tolerance,
                "{name} case {i} token {j}: {} vs mlx-lm {want}",
                got.logprob
            );
        }
        // How many quantized answers equal the full-precision one (the next
        // full-precision case of the same prompt: every 4th).
        if !case["kv"].is_null() {
            quantized += 1;
            let full = &cases[i - i % 4 + 3]["generated_ids"];
            same += usize::from(case["generated_ids"] == *full);
        }
    }
    (same, quantized)
}

/// mlx-lm's answers made on the OpenBLAS kernels this machine's mlxbcd
/// runs where they were made for them (`kv-quantized.<kernels>.json`:
/// `skylakex`, made with `OPENBLAS_CORETYPE=SkylakeX` on a Sapphire Rapids
/// Xeon), else `kv-quantized.json` (made on an AMD EPYC, OpenBLAS's Zen
/// kernels). An 8-bit cache's greedy ids part at near ties between kernel
/// sets: SmolLM2's case 8 differs from token 15 between these two, in
/// mlx-lm and mlxbcd alike (daemon/src/blas_core.rs picks the kernels).
fn kv_golden() -> serde_json::Value {
    let out = std::process::Command::new(binary("mlxbcd")).arg("--openblas-core").output().expect("running mlxbcd");
    let kernels = String::from_utf8_lossy(&out.stdout).trim().to_lowercase();
    let own = format!("kv-quantized.{kernels}");
    if !kernels.is_empty() && mlxbc_test_support::reference_path(&format!("{own}.json")).exists() {
        golden(&own)
    } else {
        golden("kv-quantized")
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn quantized_kv_caches_match_mlx_lm_alone_and_batched() {
    let g = kv_golden();
    let (smol, tiny) = (fixture("mlx/smollm2-mlx"), fixture("mlx/tiny-qwen3"));
    check_weights(&smol, &g["models"]["smollm2-mlx"]);
    check_weights(&tiny, &g["models"]["tiny-qwen3"]);
    let mut d = Daemon::prepare(&DaemonOptions {
        models: vec![("smollm2-mlx", smol), ("tiny-qwen3", tiny), (SMOLLM2, fixture(&format!("models/{SMOLLM2}")))],
        args: vec![],
    });
    // Every prompt computed, as mlx-lm computes it: a prefix reused from the
    // prompt cache is quantized already, so the prompt's tail attends to
    // quantized keys where a cold prefill attends to full-precision ones
    // (tests/tests/e2e/prompt_cache.rs covers reuse).
    std::fs::write(d.home.path().join("config.toml"), "prompt_cache_ram_mib = 0\nprompt_cache_mib = 0\n").unwrap();
    d.spawn(&[]);
    // One at a time first (each alone in its batch), then all at once.
    let cases = g["models"]["smollm2-mlx"]["cases"].as_array().unwrap();
    for (i, case) in cases.iter().enumerate().filter(|(_, c)| !c["kv"].is_null()) {
        let (_, stats) = ask(&d.socket, request("smollm2-mlx", case, 32)).await.unwrap();
        let want: Vec<u32> = serde_json::from_value(case["generated_ids"].clone()).unwrap();
        assert_eq!(stats.token_ids, want, "smollm2 case {i} alone (kv {})", case["kv"]);
    }
    let (same, quantized) = assert_cases(&d, "smollm2-mlx", "smollm2-mlx", &g).await;
    eprintln!("SmolLM2: {same} of {quantized} quantized answers equal the full-precision ones");
    assert_cases(&d, "tiny-qwen3", "tiny-qwen3", &g).await;
    // The GGUF file holds the same weights as the MLX directory.
    assert_cases(&d, "smollm2-mlx", SMOLLM2, &g).await;

    // The CLI: --kv-bits.
    let case = &cases[0];
    let out = d
        .cli()
        .args(["ask", "-m", "smollm2-mlx", "--temperature", "0", "--max-tokens", "32", "--kv-bits", "8"])
        .args(["--kv-rotate", "false", "--json"])
        .arg(case["messages"][0]["content"].as_str().unwrap())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    let ids: Vec<u32> = serde_json::from_value(case["generated_ids"].clone()).unwrap();
    let want = serde_json::to_string(&ids).unwrap();
    assert!(text.replace(' ', "").contains(&want), "{text}");

    // The default (rotated before quantizing) answers the first prompt as
    // full precision does.
    let mut req = request("smollm2-mlx", &cases[3], 32);
    req.kv = KvCacheSpec { bits: Some(8), ..Default::default() };
    let (_, stats) = ask(&d.socket, req).await.unwrap();
    assert_eq!(stats.token_ids, serde_json::from_value::<Vec<u32>>(cases[3]["generated_ids"].clone()).unwrap());

    // 8-bit keys with 4-bit values (llama.cpp's -ctk q8_0 -ctv q4_0) answer
    // the whole length asked.
    let mut req = request("smollm2-mlx", &cases[3], 32);
    req.kv = KvCacheSpec { bits: Some(4), key_bits: Some(8), ..Default::default() };
    let (text, stats) = ask(&d.socket, req).await.unwrap();
    assert!(!text.is_empty() && stats.token_ids.len() <= 32, "{text}");

    // Refusals, each with a sentence; the daemon keeps serving.
    for (kv, says) in [
        (KvCacheSpec { bits: Some(7), ..Default::default() }, "kv_bits 7"),
        (KvCacheSpec { bits: Some(4), key_bits: Some(7), ..Default::default() }, "kv_key_bits 7"),
        (KvCacheSpec { bits: Some(8), group_size: Some(48), ..Default::default() }, "kv_group_size 48"),
        (KvCacheSpec { bits: Some(4), group_size: Some(128), ..Default::default() }, "does not divide"),
    ] {
        let mut req = request("smollm2-mlx", case, 4);
        req.kv = kv;
        let e = ask(&d.socket, req).await.expect_err("refused");
        assert!(e.to_string().contains(says), "{e}");
    }
    let (text, _) = ask(&d.socket, greedy(Some(SMOLLM2), "Say hi.", 4)).await.unwrap();
    assert!(!text.is_empty());
}
