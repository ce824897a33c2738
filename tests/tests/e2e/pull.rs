//! `mlxbc pull` against a loopback server that serves the hub's API and file
//! protocol (model info, `resolve` with byte ranges, commit and etag
//! headers), through HF_ENDPOINT: into the shared HF cache, resumable after
//! a failure, then served by name; and models that ollama and LM Studio keep
//! on disk, listed and served without copying.

use crate::helper::*;
use axum::extract::{Path as UrlPath, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

const REPO: &str = "test-org/tiny-qwen2";
const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

/// The files of the fake repo, and what the server saw and should break.
struct Hub {
    dir: PathBuf,
    files: Vec<String>,
    /// Range starts requested for the weights file.
    weight_ranges: Mutex<Vec<u64>>,
    /// Fail the next weights request whose range starts at or after this offset.
    fail_from: Mutex<Option<u64>>,
    /// Hold every weights request open without sending a byte.
    stall: std::sync::atomic::AtomicBool,
}

async fn info(State(hub): State<Arc<Hub>>, UrlPath((org, name, _rev)): UrlPath<(String, String, String)>) -> Response {
    if format!("{org}/{name}") != REPO {
        return (StatusCode::NOT_FOUND, "no such repo").into_response();
    }
    let siblings: Vec<_> = hub.files.iter().map(|f| serde_json::json!({"rfilename": f})).collect();
    axum::Json(serde_json::json!({"sha": COMMIT, "siblings": siblings})).into_response()
}

async fn resolve(
    State(hub): State<Arc<Hub>>,
    UrlPath((_org, _name, _rev, file)): UrlPath<(String, String, String, String)>,
    headers: HeaderMap,
) -> Response {
    let Ok(bytes) = std::fs::read(hub.dir.join(&file)) else { return StatusCode::NOT_FOUND.into_response() };
    let len = bytes.len() as u64;
    let (start, end) = headers
        .get("range")
        .and_then(|r| {
            r.to_str().ok()?.strip_prefix("bytes=")?.split_once('-').map(|(a, b)| (a.to_string(), b.to_string()))
        })
        .map(|(a, b)| (a.parse::<u64>().unwrap(), b.parse::<u64>().unwrap_or(len - 1).min(len - 1)))
        .unwrap_or((0, len - 1));
    if file == "model.safetensors" && !(start == 0 && end == 0) {
        hub.weight_ranges.lock().unwrap().push(start);
        {
            let mut fail = hub.fail_from.lock().unwrap();
            if fail.is_some_and(|from| start >= from) {
                *fail = None;
                return (StatusCode::INTERNAL_SERVER_ERROR, "injected failure").into_response();
            }
        }
        if hub.stall.load(std::sync::atomic::Ordering::Relaxed) {
            tokio::time::sleep(std::time::Duration::from_secs(3600)).await;
        }
    }
    use sha2::Digest;
    let etag: String = sha2::Sha256::digest(&bytes).iter().map(|b| format!("{b:02x}")).collect();
    let mut h = HeaderMap::new();
    h.insert("x-repo-commit", COMMIT.parse().unwrap());
    h.insert("etag", format!("\"{etag}\"").parse().unwrap());
    h.insert("content-range", format!("bytes {start}-{end}/{len}").parse().unwrap());
    h.insert("accept-ranges", "bytes".parse().unwrap());
    (StatusCode::PARTIAL_CONTENT, h, bytes[start as usize..=end as usize].to_vec()).into_response()
}

/// Serves the tiny-qwen2 fixture as REPO on a loopback port.
async fn start_hub() -> (Arc<Hub>, String) {
    let dir = fixture("mlx/tiny-qwen2");
    let mut files: Vec<String> =
        std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    files.sort();
    let hub = Arc::new(Hub {
        dir,
        files,
        weight_ranges: Mutex::default(),
        fail_from: Mutex::default(),
        stall: Default::default(),
    });
    let app = axum::Router::new()
        .route("/api/models/{org}/{name}/revision/{rev}", get(info))
        .route("/{org}/{name}/resolve/{rev}/{*file}", get(resolve))
        .with_state(hub.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (hub, url)
}

#[tokio::test(flavor = "multi_thread")]
async fn pull_resumes_after_a_failure_and_the_daemon_serves_it_from_the_hf_cache() {
    let (hub, endpoint) = start_hub().await;
    let mut d = Daemon::prepare(&DaemonOptions::default());
    let (user_home, hf_home) = (d.home.path().join("user"), d.home.path().join("hf"));
    d.extra_env = vec![
        ("HOME".into(), user_home.clone()),
        ("HF_HOME".into(), hf_home.clone()),
        ("HF_ENDPOINT".into(), endpoint.into()),
    ];
    d.spawn(&[]);
    let pull = || {
        let mut c = d.cli();
        c.args(["pull", REPO]);
        c.output().unwrap()
    };

    // The weights are 25 MB: hf-hub fetches them in 10 MB chunks. Break the second.
    *hub.fail_from.lock().unwrap() = Some(10_000_000);
    let failed = pull();
    assert!(!failed.status.success());
    assert!(String::from_utf8_lossy(&failed.stderr).contains("run the same command again to resume"));
    hub.weight_ranges.lock().unwrap().clear();
    let ok = pull();
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    let ranges = hub.weight_ranges.lock().unwrap().clone();
    assert!(!ranges.is_empty() && !ranges.contains(&0), "resumed after the committed first chunk: {ranges:?}");

    let snapshot = hf_home.join("hub/models--test-org--tiny-qwen2/snapshots").join(COMMIT);
    assert_eq!(
        sha256_file(&snapshot.join("model.safetensors")),
        sha256_file(&fixture("mlx/tiny-qwen2/model.safetensors")),
        "the resumed file is whole"
    );
    assert!(String::from_utf8_lossy(&ok.stdout).contains(&format!("mlxbc ask -m {REPO}")));

    let models = String::from_utf8_lossy(&d.cli().arg("models").output().unwrap().stdout).to_string();
    let line = models.lines().find(|l| l.starts_with(REPO)).unwrap_or_else(|| panic!("{models}"));
    assert!(line.contains("hf-cache") && line.contains("mlx"), "{line}");
    let (text, stats) = ask(&d.socket, greedy(Some(REPO), "hello", 3)).await.unwrap();
    assert_eq!((stats.model.as_str(), stats.generated_tokens), (REPO, 3), "{text}");

    // A second pull finds everything in the cache.
    hub.weight_ranges.lock().unwrap().clear();
    assert!(pull().status.success());
    assert!(hub.weight_ranges.lock().unwrap().len() <= 1, "no second download");
}

/// ollama's `/api/pull` on the gateway: the same fetch as `mlxbc pull`,
/// its progress as NDJSON lines ending in `success`, then the model served
/// under its repo name; a second pull downloads nothing; bad names and
/// unknown repos get ollama's error shape.
#[tokio::test(flavor = "multi_thread")]
async fn ollama_api_pull_streams_progress_then_the_model_answers() {
    let (hub, endpoint) = start_hub().await;
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut d = Daemon::prepare(&DaemonOptions::default());
    d.extra_env = vec![
        ("HOME".into(), d.home.path().join("user")),
        ("HF_HOME".into(), d.home.path().join("hf")),
        ("HF_ENDPOINT".into(), endpoint.into()),
    ];
    d.spawn(&["--http".into(), format!("127.0.0.1:{port}")]);
    let (http, base) = (reqwest::Client::new(), format!("http://127.0.0.1:{port}"));
    let pull = |body: serde_json::Value| http.post(format!("{base}/api/pull")).json(&body).send();

    let r = pull(serde_json::json!({"model": format!("hf.co/{REPO}")})).await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "application/x-ndjson");
    let lines: Vec<serde_json::Value> =
        r.text().await.unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines[0]["status"], "pulling manifest");
    let weights: Vec<&serde_json::Value> = lines.iter().filter(|l| l["digest"] == "model.safetensors").collect();
    assert!(weights.len() > 2, "progress lines for the weights: {lines:?}");
    let last = weights.last().unwrap();
    assert_eq!(last["completed"], last["total"]);
    assert_eq!(lines.last().unwrap(), &serde_json::json!({"status": "success", "model": REPO}));

    let chat = serde_json::json!({"model": REPO, "stream": false, "messages": [{"role": "user", "content": "hello"}],
                                  "options": {"num_predict": 3, "temperature": 0}});
    let v: serde_json::Value =
        http.post(format!("{base}/api/chat")).json(&chat).send().await.unwrap().json().await.unwrap();
    assert_eq!((v["done"].as_bool(), v["eval_count"].as_u64()), (Some(true), Some(3)), "{v}");

    hub.weight_ranges.lock().unwrap().clear();
    let again = pull(serde_json::json!({"model": REPO, "stream": false})).await.unwrap();
    assert_eq!(again.status(), 200);
    assert_eq!(again.json::<serde_json::Value>().await.unwrap()["status"], "success");
    assert!(hub.weight_ranges.lock().unwrap().len() <= 1, "no second download");

    let bad = pull(serde_json::json!({"model": "../../etc"})).await.unwrap();
    assert_eq!(bad.status(), 400);
    assert!(bad.json::<serde_json::Value>().await.unwrap()["error"].as_str().unwrap().contains("Hugging Face repo"));
    let missing = pull(serde_json::json!({"model": "test-org/no-such-model", "stream": false})).await.unwrap();
    assert_eq!(missing.status(), 502);
    let e = missing.json::<serde_json::Value>().await.unwrap();
    assert!(e["error"].as_str().unwrap().contains("test-org/no-such-model"), "{e}");
}

/// A hub that accepts a download and then sends nothing: `/api/pull` ends
/// with an error line naming the stall (after `MLXBC_PULL_STALL_S`), not a
/// task held forever, and the gateway goes on serving.
#[tokio::test(flavor = "multi_thread")]
async fn a_stalled_download_ends_the_pull_with_an_error() {
    let (hub, endpoint) = start_hub().await;
    hub.stall.store(true, std::sync::atomic::Ordering::Relaxed);
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut d = Daemon::prepare(&DaemonOptions::default());
    d.extra_env = vec![
        ("HOME".into(), d.home.path().join("user")),
        ("HF_HOME".into(), d.home.path().join("hf")),
        ("HF_ENDPOINT".into(), endpoint.into()),
        ("MLXBC_PULL_STALL_S".into(), "3".into()),
    ];
    d.spawn(&["--http".into(), format!("127.0.0.1:{port}")]);
    let (http, base) = (reqwest::Client::new(), format!("http://127.0.0.1:{port}"));
    let started = std::time::Instant::now();
    let r = http
        .post(format!("{base}/api/pull"))
        .json(&serde_json::json!({"model": REPO}))
        .timeout(std::time::Duration::from_secs(60))
        .send()
        .await
        .unwrap();
    let body = r.text().await.unwrap();
    let last: serde_json::Value = serde_json::from_str(body.lines().last().unwrap()).unwrap();
    let error = last["error"].as_str().unwrap_or_else(|| panic!("{body}"));
    assert!(error.contains("stalled") && error.contains("model.safetensors"), "{error}");
    assert!(started.elapsed() < std::time::Duration::from_secs(30), "{:?}", started.elapsed());
    let (text, _) = ask(&d.socket, greedy(None, "hello", 2)).await.unwrap();
    assert!(!text.is_empty());
}

fn sha256_file(p: &std::path::Path) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(std::fs::read(p).unwrap()).iter().map(|b| format!("{b:02x}")).collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn ggufs_that_ollama_and_lm_studio_keep_are_listed_and_served_in_place() {
    let mut d = Daemon::prepare(&DaemonOptions { models: vec![], args: vec![] });
    let user = d.home.path().join("user");
    let gguf = fixture(&format!("models/{SMOLLM2}"));
    let ollama = user.join(".ollama/models");
    std::fs::create_dir_all(ollama.join("blobs")).unwrap();
    std::fs::create_dir_all(ollama.join("manifests/registry.ollama.ai/library/smollm2")).unwrap();
    std::os::unix::fs::symlink(&gguf, ollama.join("blobs/sha256-abc123")).unwrap();
    std::fs::write(
        ollama.join("manifests/registry.ollama.ai/library/smollm2/135m"),
        r#"{"schemaVersion":2,"layers":[{"mediaType":"application/vnd.ollama.image.template","digest":"sha256:def"},
            {"mediaType":"application/vnd.ollama.image.model","digest":"sha256:abc123","size":1}]}"#,
    )
    .unwrap();
    let lms = user.join(".lmstudio/models/HuggingFaceTB/SmolLM2-GGUF");
    std::fs::create_dir_all(&lms).unwrap();
    std::os::unix::fs::symlink(&gguf, lms.join(SMOLLM2)).unwrap();
    d.extra_env = vec![("HOME".into(), user.clone()), ("HF_HOME".into(), user.join("no-hf"))];
    d.spawn(&[]);

    let models = String::from_utf8_lossy(&d.cli().arg("models").output().unwrap().stdout).to_string();
    assert!(models.lines().any(|l| l.starts_with("ollama:smollm2:135m") && l.contains("ollama")), "{models}");
    let lm_name = format!("lmstudio:HuggingFaceTB/SmolLM2-GGUF/{SMOLLM2}");
    assert!(models.lines().any(|l| l.starts_with(&lm_name) && l.contains("lmstudio")), "{models}");
    for name in ["ollama:smollm2:135m", lm_name.as_str()] {
        let (text, _) = ask(&d.socket, greedy(Some(name), "What is the capital of France?", 8)).await.unwrap();
        assert!(text.contains("Paris"), "{name}: {text}");
    }
}
