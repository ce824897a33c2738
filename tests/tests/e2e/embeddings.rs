//! Sentence embeddings through a real daemon (all-MiniLM-L6-v2, real
//! weights): the client library's `embed` and `mlxbc embed`; every text
//! embedded once, ever (a second request, and one after a restart, are
//! answered from the store with the same vectors); the `openai` SDK and the
//! `ollama` client through the gateway (tests/clients/embeddings.py); bad
//! requests refused with a sentence while the daemon keeps serving.

use crate::helper::{fixture, Daemon, DaemonOptions, SMOLLM2};
use mlxbc_client::EmbedRequest;

const MINILM: &str = "all-MiniLM-L6-v2";

fn options(args: Vec<String>) -> DaemonOptions {
    DaemonOptions {
        models: vec![(SMOLLM2, fixture(&format!("models/{SMOLLM2}"))), (MINILM, fixture("models/all-MiniLM-L6-v2"))],
        args,
    }
}

fn request(inputs: &[&str]) -> EmbedRequest {
    EmbedRequest {
        model: MINILM.into(),
        inputs: inputs.iter().map(|s| s.to_string()).collect(),
        truncate: true,
        dimensions: None,
        keep_alive: None,
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn texts_are_embedded_once_ever_and_the_daemon_keeps_serving_after_bad_requests() {
    let mut d = Daemon::start_with(options(vec![]));
    let texts: Vec<String> = (0..40).map(|i| format!("Chunk {i}: fn item_{i}() -> u32 {{ {i} * 7 }}")).collect();
    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    let mut c = d.client().await;
    let first = c.embed(request(&refs)).await.unwrap();
    assert_eq!((first.vectors.len(), first.cached), (40, 0));
    assert!(first.vectors.iter().all(|v| v.len() == 384));
    let again = c.embed(request(&refs)).await.unwrap();
    assert_eq!(again.cached, 40, "the second request should come from the store");
    assert_eq!(again.vectors, first.vectors);
    // A request mixing stored and new texts, with a repeat.
    let mixed = c.embed(request(&[refs[3], "something new", refs[3]])).await.unwrap();
    assert_eq!(mixed.cached, 2);
    assert_eq!((&mixed.vectors[0], &mixed.vectors[2]), (&first.vectors[3], &first.vectors[3]));
    drop(c);

    // Refusals, each a sentence; the daemon answers afterwards.
    let mut c = d.client().await;
    for (r, says) in [
        (request(&[]), "nothing to embed"),
        (EmbedRequest { model: SMOLLM2.into(), ..request(&["x"]) }, "not an embedding model"),
        (EmbedRequest { truncate: false, ..request(&[&"word ".repeat(600)]) }, "tokens"),
        (EmbedRequest { dimensions: Some(9999), ..request(&["x"]) }, "dimensions"),
    ] {
        let e = c.embed(r).await.expect_err("refused");
        assert!(e.to_string().contains(says), "{e}");
    }
    let (text, _) = crate::helper::ask(&d.socket, crate::helper::greedy(Some(SMOLLM2), "Say hi.", 4)).await.unwrap();
    assert!(!text.is_empty());
    drop(c);

    // After a restart, from the disk tier.
    d.terminate();
    d.spawn(&[]);
    let mut c = d.client().await;
    let after = c.embed(request(&refs)).await.unwrap();
    assert_eq!(after.cached, 40, "after a restart the vectors should come from disk");
    assert_eq!(after.vectors, first.vectors);
    drop(c);

    // The CLI: one JSON array per text, and `mlxbc models` says what it does.
    let out = d.cli().args(["embed", "-m", MINILM, "A man is eating food.", "-v"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let line = String::from_utf8(out.stdout).unwrap();
    let v: Vec<f32> = serde_json::from_str(line.trim()).unwrap();
    assert_eq!(v.len(), 384);
    let models = String::from_utf8(d.cli().arg("models").output().unwrap().stdout).unwrap();
    assert!(models.lines().any(|l| l.contains(MINILM) && l.contains("embedding")), "{models}");
}

/// The `openai` SDK and the `ollama` client.
#[test]
fn openai_sdk_and_ollama_client_embed() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let _d = Daemon::start_with(options(vec!["--http".into(), format!("127.0.0.1:{port}")]));
    crate::http::run_client_script("embeddings.py", &[&format!("http://127.0.0.1:{port}"), MINILM, SMOLLM2]);
}

/// `GET /metrics` parses with prometheus_client's parser and its counters
/// move as requests are served (tests/clients/metrics.py).
#[test]
fn metrics_parse_and_move_as_requests_are_served() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let _d = Daemon::start_with(options(vec!["--http".into(), format!("127.0.0.1:{port}")]));
    crate::http::run_client_script("metrics.py", &[&format!("http://127.0.0.1:{port}"), SMOLLM2, MINILM]);
}
