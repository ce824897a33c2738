//! Residency: at most N models, a memory budget with least-recently-used
//! eviction of unpinned models, a clear error when a model cannot fit, and
//! shedding in tiers under (real, measured) memory pressure.

use crate::helper::*;
use mlxbc_client::{ErrorKind, KeepAlive};
use std::time::Duration;

/// A daemon over the tiny text models (and the tiny VLM) with `config` as its config.toml.
fn daemon_with_config(config: &str) -> Daemon {
    let opts = DaemonOptions {
        models: vec![
            ("tiny-qwen2", fixture("mlx/tiny-qwen2")),
            ("tiny-qwen3", fixture("mlx/tiny-qwen3")),
            ("tiny-gemma3-vlm", fixture("mlx/tiny-gemma3-vlm")),
        ],
        args: vec![],
    };
    let mut d = Daemon::prepare(&opts);
    std::fs::write(d.home.path().join("config.toml"), config).unwrap();
    d.spawn(&[]);
    d
}

async fn loaded(d: &Daemon) -> Vec<String> {
    d.client().await.status().await.unwrap().loaded.into_iter().map(|m| m.name).collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn loading_beyond_max_loaded_models_unloads_the_least_recently_used() {
    // low_memory_mib = 0: only the count limit may unload here, not the machine's memory.
    let d = daemon_with_config("max_loaded_models = 2\nlow_memory_mib = 0\n");
    let mut c = d.client().await;
    for m in ["tiny-qwen2", "tiny-qwen3"] {
        c.load(m, None).await.unwrap();
    }
    // Use qwen2 again, so qwen3 is now the least recently used.
    ask(&d.socket, greedy(Some("tiny-qwen2"), "hi", 2)).await.unwrap();
    c.load("tiny-gemma3-vlm", None).await.unwrap();
    assert_eq!(loaded(&d).await, ["tiny-gemma3-vlm", "tiny-qwen2"], "{}", d.log_text());
    assert!(d.log_text().contains("unloading the least recently used model to make room"));
}

#[tokio::test(flavor = "multi_thread")]
async fn the_memory_budget_evicts_unpinned_models_and_refuses_what_cannot_fit() {
    // In f32 tiny-qwen2 takes ~24 MiB (untied head) and tiny-qwen3 ~12 MiB:
    // either fits in 35 MiB, both do not.
    let d = daemon_with_config("memory_budget_mib = 35\nlow_memory_mib = 0\n");
    let mut c = d.client().await;
    c.load("tiny-qwen2", None).await.unwrap();
    c.load("tiny-qwen3", None).await.unwrap();
    assert_eq!(loaded(&d).await, ["tiny-qwen3"], "the unpinned model made room");

    c.load("tiny-qwen3", Some(KeepAlive::Forever)).await.unwrap();
    let err = ask(&d.socket, greedy(Some("tiny-qwen2"), "hi", 2)).await.unwrap_err();
    match err {
        mlxbc_client::ClientError::Daemon { kind: ErrorKind::OutOfMemory, message } => {
            assert!(message.contains("pinned") && message.contains("tiny-qwen3"), "{message}")
        }
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    assert_eq!(loaded(&d).await, ["tiny-qwen3"], "the pinned model stayed, nothing half-loaded");

    // A model larger than the whole budget is refused before loading.
    let vlm = ask(&d.socket, greedy(Some("tiny-gemma3-vlm"), "hi", 2)).await.unwrap_err();
    assert!(vlm.to_string().contains("more than the memory budget of 35 MiB"), "{vlm}");
}

#[tokio::test(flavor = "multi_thread")]
async fn under_memory_pressure_it_sheds_encoder_ram_then_prompt_blocks_then_unpinned_models() {
    // A threshold far above this machine's memory: the daemon reads the
    // real MemAvailable and finds it below, i.e. it is under pressure throughout.
    let d = daemon_with_config("low_memory_mib = 100000000\n");
    let img = crate::vision::png(64, 64, 5);
    let mut req = greedy(Some("tiny-gemma3-vlm"), "What is this?", 2);
    req.messages[0].media = vec![mlxbc_client::MediaRef::from_bytes(img)];
    ask(&d.socket, req).await.unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let status = loop {
        let s = d.client().await.status().await.unwrap();
        if s.memory_sheds.len() >= 3 || std::time::Instant::now() > deadline {
            break s;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let tiers: Vec<&str> = status.memory_sheds.iter().map(|e| e.tier.as_str()).collect();
    assert_eq!(tiers, ["encoder RAM tier", "prompt cache RAM tier", "model"], "{:?}", status.memory_sheds);
    assert_eq!(status.memory_sheds[2].what, "tiny-gemma3-vlm");
    assert!(status.loaded.is_empty());
    assert!(d.log_text().contains("memory pressure: shed"));

    // A pinned model stays through it; ps reports both.
    d.client().await.load("tiny-qwen2", Some(KeepAlive::Forever)).await.unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(loaded(&d).await, ["tiny-qwen2"]);
    let ps = d.cli().arg("ps").output().unwrap();
    let ps = String::from_utf8_lossy(&ps.stdout);
    assert!(ps.contains("tiny-qwen2") && ps.contains("yes"), "{ps}");
    assert!(ps.contains("under memory pressure") && ps.contains("encoder RAM tier"), "{ps}");
}
