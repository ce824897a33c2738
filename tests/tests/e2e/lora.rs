//! LoRA adapters trained here with mlx-lm's own trainer on the fixture
//! SmolLM2 (f32; scripts/fixtures/lora_reference.py: a parrot's and a
//! pirate's answers, 30 steps each) served on the resident base: greedy ids
//! exactly mlx-lm's with `adapter_path` (and the fused model's, served as a
//! model), each alone and all at once (rows of both adapters and the bare
//! base in one batch), the adapters listed and shown in
//! `mlxbc ps`; a DoRA adapter (magnitudes) likewise; and refusals with a
//! sentence: another base, a broken
//! file, an unknown adapter (a 404 in OpenAI's and ollama's shapes).

use crate::helper::*;
use mlxbc_client::GenerateRequest;

fn reference() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixture("lora/reference.json")).unwrap_or_else(|e| {
        panic!("the LoRA fixture is missing ({e}): run scripts/test-fixtures (it trains the adapters)")
    }))
    .unwrap()
}

fn request(model: &str, adapter: Option<&str>, prompt: &str, max_tokens: u32) -> GenerateRequest {
    let mut r = greedy(Some(model), prompt, max_tokens);
    r.adapter = adapter.map(String::from);
    r
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    serde_json::from_value(v.clone()).unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn adapters_answer_as_mlx_lm_alone_and_batched_with_each_other_and_the_base() {
    let g = reference();
    let prompts: Vec<String> = serde_json::from_value(g["prompts"].clone()).unwrap();
    let max = g["max_tokens"].as_u64().unwrap() as u32;
    assert_ne!(g["ids"]["parrot"], g["ids"]["base"], "the parrot adapter must change the answers");
    assert_ne!(g["ids"]["pirate"], g["ids"]["parrot"], "the two adapters must answer differently");
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let d = Daemon::start_with(DaemonOptions {
        models: vec![
            ("smollm2-mlx", fixture("lora/base")),
            ("parrot-fused", fixture("lora/parrot-fused")),
            ("tiny-qwen3", fixture("mlx/tiny-qwen3")),
            ("parrot", fixture("lora/parrot")),
            ("pirate", fixture("lora/pirate")),
            ("dora", fixture("lora/dora")),
            ("dora-scaled", fixture("lora/dora-scaled")),
        ],
        args: vec!["--http".into(), format!("127.0.0.1:{port}")],
    });
    assert_ne!(g["ids"]["dora"], g["ids"]["base"], "the DoRA adapter must change the answers");
    assert_ne!(g["ids"]["dora-scaled"], g["ids"]["dora"], "the DoRA magnitudes must change the answers");
    let cases: Vec<(Option<&str>, &str)> = vec![
        (None, "base"),
        (Some("parrot"), "parrot"),
        (Some("pirate"), "pirate"),
        (Some("dora"), "dora"),
        (Some("dora-scaled"), "dora-scaled"),
    ];
    // Alone.
    for (adapter, key) in &cases {
        for (i, p) in prompts.iter().enumerate() {
            let (_, stats) = ask(&d.socket, request("smollm2-mlx", *adapter, p, max)).await.unwrap();
            assert_eq!(stats.token_ids, ids(&g["ids"][key][i]), "{key}, prompt {i}, alone");
        }
    }
    // All at once: three adapters' rows (the base's among them) in flight together.
    let socket = &d.socket;
    let asks = cases.iter().flat_map(|(adapter, key)| {
        prompts
            .iter()
            .enumerate()
            .map(move |(i, p)| async move { (key, i, ask(socket, request("smollm2-mlx", *adapter, p, max)).await) })
    });
    for (key, i, answer) in futures::future::join_all(asks).await {
        assert_eq!(answer.unwrap().1.token_ids, ids(&g["ids"][key][i]), "{key}, prompt {i}, batched");
    }
    // They decoded in one batch (rows of the three under one step).
    let most = d
        .log_text()
        .lines()
        .filter_map(|l| l.split(" rows on average").next()?.rsplit(", ").next()?.parse::<f64>().ok())
        .fold(0.0, f64::max);
    assert!(most >= 4.0, "no step batched rows of several adapters (at most {most} rows on average)");
    // The fused adapter is a plain model.
    for (i, p) in prompts.iter().enumerate() {
        let (_, stats) = ask(&d.socket, request("parrot-fused", None, p, max)).await.unwrap();
        assert_eq!(stats.token_ids, ids(&g["ids"]["parrot-fused"][i]), "parrot-fused, prompt {i}");
    }
    let models = String::from_utf8(d.cli().arg("models").output().unwrap().stdout).unwrap();
    assert!(models.lines().any(|l| l.contains("parrot ") || l.starts_with("parrot")), "{models}");
    assert!(models.lines().any(|l| l.contains("pirate") && l.contains("adapter")), "{models}");
    let ps = String::from_utf8(d.cli().arg("ps").output().unwrap().stdout).unwrap();
    assert!(ps.contains("adapter parrot (LoRA rank 8") && ps.contains("adapter pirate"), "{ps}");
    assert!(ps.contains("adapter dora (DoRA rank"), "{ps}");

    // Refusals.
    for (model, adapter, says) in
        [("tiny-qwen3", "parrot", "another base"), ("smollm2-mlx", "nowhere", "unknown adapter")]
    {
        let e = ask(&d.socket, request(model, Some(adapter), "hi", 4)).await.expect_err("refused");
        assert!(e.to_string().contains(says), "{model} + {adapter}: {e}");
    }
    let http = reqwest::Client::new();
    let base = format!("http://127.0.0.1:{port}");
    let body = serde_json::json!({"model": "smollm2-mlx", "adapter": "nowhere",
                                  "messages": [{"role": "user", "content": "hi"}]});
    let r = http.post(format!("{base}/v1/chat/completions")).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 404);
    let e: serde_json::Value = r.json().await.unwrap();
    assert!(e["error"]["message"].as_str().unwrap().contains("unknown adapter"), "{e}");
    let body = serde_json::json!({"model": "smollm2-mlx", "stream": false, "options": {"adapter": "nowhere"},
                                  "messages": [{"role": "user", "content": "hi"}]});
    let r = http.post(format!("{base}/api/chat")).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 404);
    let e: serde_json::Value = r.json().await.unwrap();
    assert!(e["error"].as_str().unwrap().contains("unknown adapter"), "{e}");
    // Over HTTP the adapter through OpenAI's API answers as on the socket.
    let body = serde_json::json!({"model": "smollm2-mlx", "adapter": "parrot", "temperature": 0,
                                  "max_tokens": max, "messages": [{"role": "user", "content": prompts[0]}]});
    let r: serde_json::Value =
        http.post(format!("{base}/v1/chat/completions")).json(&body).send().await.unwrap().json().await.unwrap();
    let text = r["choices"][0]["message"]["content"].as_str().unwrap_or_else(|| panic!("{r}"));
    let (socket_text, _) = ask(&d.socket, request("smollm2-mlx", Some("parrot"), &prompts[0], max)).await.unwrap();
    assert_eq!(text, socket_text);
    // A broken adapter file: refused, and the daemon keeps serving.
    let broken = tempfile::tempdir().unwrap();
    std::fs::copy(fixture("lora/parrot/adapter_config.json"), broken.path().join("adapter_config.json")).unwrap();
    std::fs::write(broken.path().join("adapters.safetensors"), b"not safetensors").unwrap();
    let e = ask(&d.socket, request("smollm2-mlx", Some(broken.path().to_str().unwrap()), "hi", 4))
        .await
        .expect_err("a broken adapter is refused");
    assert!(e.to_string().contains("adapters.safetensors"), "{e}");
    let (text, _) = ask(&d.socket, request("smollm2-mlx", None, "Say hi.", 4)).await.unwrap();
    assert!(!text.is_empty());
}
