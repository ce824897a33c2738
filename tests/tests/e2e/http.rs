//! The OpenAI-compatible HTTP gateway, with a real HTTP client (reqwest):
//! non-streaming and SSE-streaming chat completions that match the socket's
//! answer, images as data: URLs, /v1/models, errors as OpenAI error bodies,
//! and loopback only.

use crate::helper::*;
use base64::Engine as _;
use futures::StreamExt;
use serde_json::{json, Value};

/// A free loopback port.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn gateway(models: Vec<(&'static str, std::path::PathBuf)>) -> (Daemon, String) {
    let port = free_port();
    let d = Daemon::start_with(DaemonOptions { models, args: vec!["--http".into(), format!("127.0.0.1:{port}")] });
    (d, format!("http://127.0.0.1:{port}"))
}

#[tokio::test(flavor = "multi_thread")]
async fn chat_completions_plain_and_streamed_match_the_socket() {
    let (d, base) = gateway(DaemonOptions::default().models);
    let http = reqwest::Client::new();
    let question = "What is the capital of France?";
    let (want, _) = ask(&d.socket, greedy(None, question, 5)).await.unwrap();

    let body = json!({"model": SMOLLM2, "temperature": 0, "max_tokens": 5,
                      "messages": [{"role": "user", "content": question}]});
    let r = http.post(format!("{base}/v1/chat/completions")).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["content"], want.as_str());
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 5);

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let r = http.post(format!("{base}/v1/chat/completions")).json(&streamed).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "text/event-stream");
    let mut raw = String::new();
    let mut bytes = r.bytes_stream();
    while let Some(chunk) = bytes.next().await {
        raw.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
    }
    let datas: Vec<&str> = raw.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    assert_eq!(datas.last(), Some(&"[DONE]"), "{raw}");
    let chunks: Vec<Value> = datas[..datas.len() - 1].iter().map(|d| serde_json::from_str(d).unwrap()).collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(text, want);
    assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "length");

    let models: Value = http.get(format!("{base}/v1/models")).send().await.unwrap().json().await.unwrap();
    assert!(models["data"].as_array().unwrap().iter().any(|m| m["id"] == SMOLLM2), "{models}");
}

#[tokio::test(flavor = "multi_thread")]
async fn images_as_data_urls_and_errors_as_openai_bodies() {
    let (d, base) = gateway(vec![
        ("tiny-gemma3-vlm", fixture("mlx/tiny-gemma3-vlm")),
        (SMOLLM2, fixture(&format!("models/{SMOLLM2}"))),
    ]);
    let http = reqwest::Client::new();
    let png = crate::vision::png(64, 64, 9);
    let url = format!("data:image/png;base64,{}", base64::engine::general_purpose::STANDARD.encode(&png));
    let body = json!({"model": "tiny-gemma3-vlm", "temperature": 0, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is this?"}]}]});
    let r = http.post(format!("{base}/v1/chat/completions")).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    // The same image over the socket: a hit in the feature store, the same answer.
    let mut req = greedy(Some("tiny-gemma3-vlm"), "What is this?", 4);
    req.messages[0].media = vec![mlxbc_client::MediaRef::from_bytes(png)];
    let (text, stats) = ask(&d.socket, req).await.unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], text.as_str());
    assert_eq!(stats.encoder_hits, 1, "encoded once, through HTTP");

    let unknown = http
        .post(format!("{base}/v1/chat/completions"))
        .json(&json!({"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(unknown.status(), 404);
    let e: Value = unknown.json().await.unwrap();
    assert!(e["error"]["message"].as_str().unwrap().contains("no-such-model"), "{e}");

    let remote = json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]});
    let r = http.post(format!("{base}/v1/chat/completions")).json(&remote).send().await.unwrap();
    assert_eq!(r.status(), 400);
    let url = format!("{base}/v1/chat/completions");
    let r = http.post(&url).header("Content-Type", "application/json").body("{not json").send().await.unwrap();
    assert_eq!(r.status(), 400);
    // Without the JSON content type (what a web page can send with no preflight): 415.
    assert_eq!(http.post(&url).body("{not json").send().await.unwrap().status(), 415);
    // The daemon keeps serving.
    let (again, _) = ask(&d.socket, greedy(None, "What is the capital of France?", 4)).await.unwrap();
    assert!(!again.is_empty());
}

#[test]
fn a_non_loopback_http_address_is_refused_at_start() {
    let mut d = Daemon::prepare(&DaemonOptions::default());
    let out = std::process::Command::new(binary("mlxbcd"))
        .args(["--http", "0.0.0.0:11435"])
        .env("MLXBC_HOME", d.home.path())
        .env_remove("MLXBC_SOCKET")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("must be a loopback address"), "{stderr}");
    d.child = None;
}

/// Runs a client-SDK script of tests/clients/ with the pinned clients venv
/// (scripts/test-fixtures makes it); its assertions are the test's.
pub fn run_client_script(script: &str, args: &[&str]) {
    let python = fixture("clients/bin/python");
    let out = std::process::Command::new(python)
        .arg(workspace().join("tests/clients").join(script))
        .args(args)
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{script} failed:\n{stdout}\n{stderr}");
    assert!(stdout.trim_end().ends_with("OK"), "{script} did not finish:\n{stdout}\n{stderr}");
    eprintln!("{stdout}");
}

/// The `openai` SDK: json_schema answers (20 at once) all validate,
/// json_object answers parse, streamed usage, a bad schema is a 400.
#[test]
fn openai_sdk_structured_output_always_parses_and_validates() {
    let (_d, base) = gateway(DaemonOptions::default().models);
    run_client_script("openai_structured.py", &[&base, SMOLLM2]);
}

/// The `openai` SDK: a tool round trip on Qwen2.5-Coder-0.5B (required,
/// streamed, named, then the tool's result), and a model without tools.
#[test]
fn openai_sdk_tool_round_trip_on_qwen25_coder() {
    let qwen = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";
    let mut models = DaemonOptions::default().models;
    models.push((qwen, fixture(&format!("models/{qwen}"))));
    let (_d, base) = gateway(models);
    run_client_script("openai_tools.py", &[&base, qwen]);
}

/// The `ollama` Python client: list, show (capabilities), chat plain and
/// streamed, generate, `format=` a schema, tools on Qwen2.5-Coder, an image.
#[test]
fn ollama_client_lists_shows_chats_generates_with_tools_formats_and_images() {
    run_against_text_tools_and_vision("ollama_client.py");
}

/// Runs `script` against a gateway serving SmolLM2 (text), Qwen2.5-Coder
/// (tools) and the tiny Gemma 3 (vision), with their names and a PNG.
fn run_against_text_tools_and_vision(script: &str) {
    let qwen = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";
    let vlm = "tiny-gemma3-vlm";
    let mut models = DaemonOptions::default().models;
    models.push((qwen, fixture(&format!("models/{qwen}"))));
    models.push((vlm, fixture("mlx/tiny-gemma3-vlm")));
    let (_d, base) = gateway(models);
    let png = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(png.path(), crate::vision::png(64, 48, 5)).unwrap();
    run_client_script(script, &[&base, SMOLLM2, qwen, vlm, png.path().to_str().unwrap()]);
}

/// The `anthropic` SDK: messages plain and streamed equal to chat
/// completions, stop sequences, count_tokens, structured output, a tool
/// round trip on Qwen2.5-Coder, an image on a vision model, refusals.
#[test]
fn anthropic_sdk_messages_tools_images_and_count_tokens() {
    run_against_text_tools_and_vision("anthropic_messages.py");
}

/// The `openai` SDK's Responses API (Codex's): text equal to chat
/// completions, events in order, json_schema, a function-call round trip.
#[test]
fn openai_sdk_responses_text_events_schema_and_function_calls() {
    let qwen = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";
    let mut models = DaemonOptions::default().models;
    models.push((qwen, fixture(&format!("models/{qwen}"))));
    let (_d, base) = gateway(models);
    run_client_script("openai_responses.py", &[&base, SMOLLM2, qwen]);
}

/// The `openai` SDK's completions: fill-in-the-middle on Qwen2.5-Coder
/// fills the gap; plain and streamed agree; logprobs; n > 1 refused.
#[test]
fn openai_sdk_completions_fill_in_the_middle_on_qwen25_coder() {
    let qwen = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";
    let mut models = DaemonOptions::default().models;
    models.push((qwen, fixture(&format!("models/{qwen}"))));
    let (_d, base) = gateway(models);
    run_client_script("openai_completions.py", &[&base, qwen, SMOLLM2]);
}

/// The `openai` SDK's `audio.transcriptions.create` with Whisper tiny.en:
/// every response format, `whisper-1`, and its errors (tests/clients/openai_audio.py).
#[test]
fn openai_sdk_transcribes_with_whisper() {
    let models =
        vec![(SMOLLM2, fixture(&format!("models/{SMOLLM2}"))), ("whisper-tiny.en", fixture("models/whisper-tiny.en"))];
    let (_d, base) = gateway(models);
    let wav = fixture("whisper/clips/s2.wav");
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("whisper/reference/s2.json")).unwrap()).unwrap();
    let want = reference["text"].as_str().unwrap().trim();
    run_client_script("openai_audio.py", &[&base, wav.to_str().unwrap(), want, SMOLLM2]);
}

/// The web page (`GET /`) in Debian's chromium (tests/clients/web_page.py):
/// hold-to-talk puts the transcript in the box, a streamed answer, an
/// image answered with an encoder miss then a hit. Screenshots in
/// target/test-artifacts/web/.
#[test]
fn the_web_page_in_chromium_talks_answers_and_sees() {
    let models = vec![
        (SMOLLM2, fixture(&format!("models/{SMOLLM2}"))),
        ("whisper-tiny.en", fixture("models/whisper-tiny.en")),
        ("tiny-gemma3-vlm", fixture("mlx/tiny-gemma3-vlm")),
    ];
    let (_d, base) = gateway(models);
    let out = workspace().join("target/test-artifacts/web");
    let (wav, png) = (fixture("whisper/clips/s2.wav"), workspace().join("tests/fixtures/reference/vlm-pipeline.png"));
    let args = [&base, wav.to_str().unwrap(), png.to_str().unwrap(), out.to_str().unwrap(), SMOLLM2, "tiny-gemma3-vlm"];
    run_client_script("web_page.py", &args);
}
