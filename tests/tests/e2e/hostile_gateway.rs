//! The HTTP gateway against a web page and other local users: Host and
//! Origin checks (DNS rebinding, cross-site pages), JSON bodies only, the
//! bearer token, model names limited to the listed ones; and 32 concurrent
//! streams all served.

use crate::helper::*;
use serde_json::{json, Value};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn gateway_with(config: &str) -> (Daemon, String, u16) {
    let port = free_port();
    let opts = DaemonOptions { args: vec!["--http".into(), format!("127.0.0.1:{port}")], ..Default::default() };
    let mut d = Daemon::prepare(&opts);
    std::fs::write(d.home.path().join("config.toml"), config).unwrap();
    d.spawn(&opts.args);
    (d, format!("http://127.0.0.1:{port}"), port)
}

fn body(max_tokens: u32) -> Value {
    json!({"model": SMOLLM2, "temperature": 0, "max_tokens": max_tokens,
           "messages": [{"role": "user", "content": "What is the capital of France?"}]})
}

#[tokio::test(flavor = "multi_thread")]
async fn host_origin_content_type_and_token_are_enforced() {
    let (_d, base, port) =
        gateway_with("http_token = \"s3cret\"\nhttp_allowed_origins = [\"http://localhost:5173\"]\n");
    let http = reqwest::Client::new();
    let url = format!("{base}/v1/chat/completions");
    let post = |host: Option<String>| {
        let mut r = http.post(&url).bearer_auth("s3cret").json(&body(3));
        if let Some(h) = host {
            r = r.header("Host", h);
        }
        r
    };
    // DNS rebinding: the page's own name arrives in Host.
    let r = post(Some(format!("attacker.example:{port}"))).send().await.unwrap();
    assert_eq!(r.status(), 403);
    assert!(r.text().await.unwrap().contains("Host"));
    // A cross-site page.
    let r = post(None).header("Origin", "https://attacker.example").send().await.unwrap();
    assert_eq!(r.status(), 403);
    // A "simple" request a page can send without a preflight.
    let r = http.post(&url).bearer_auth("s3cret").header("Content-Type", "text/plain").body(body(3).to_string());
    assert_eq!(r.send().await.unwrap().status(), 415);
    // A form upload (also "simple"): only the audio paths take one, and a
    // cross-site page's is refused by its Origin.
    let form = "--x\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nwhisper-1\r\n--x--\r\n";
    let multipart = |path: &str| {
        http.post(format!("{base}{path}"))
            .bearer_auth("s3cret")
            .header("Content-Type", "multipart/form-data; boundary=x")
            .body(form)
    };
    assert_eq!(multipart("/v1/chat/completions").send().await.unwrap().status(), 415);
    let r = multipart("/v1/audio/transcriptions").header("Origin", "https://attacker.example").send().await.unwrap();
    assert_eq!(r.status(), 403);
    let r = multipart("/v1/audio/transcriptions").send().await.unwrap();
    assert_eq!(r.status(), 400, "the owner's form, without a file");
    assert!(r.text().await.unwrap().contains("file is required"));
    let r = http.post(format!("{base}/v1/audio/transcriptions")).bearer_auth("s3cret").json(&body(3));
    assert_eq!(r.send().await.unwrap().status(), 415);
    // Another local user without the token.
    let r = http.post(&url).json(&body(3)).send().await.unwrap();
    assert_eq!(r.status(), 401);
    let r = http.get(format!("{base}/v1/models")).bearer_auth("wrong").send().await.unwrap();
    assert_eq!(r.status(), 401);
    // Paths are not model names over HTTP: no probing which files exist.
    for model in ["/etc/passwd", "/nonexistent/x.gguf", "../models/x.gguf"] {
        let mut b = body(3);
        b["model"] = json!(model);
        let r = http.post(&url).bearer_auth("s3cret").json(&b).send().await.unwrap();
        assert_eq!(r.status(), 404, "{model}");
    }
    // Bad sampling over HTTP is a 400 too.
    let mut b = body(3);
    b["top_p"] = json!(-1);
    assert_eq!(http.post(&url).bearer_auth("s3cret").json(&b).send().await.unwrap().status(), 400);
    // The allowed origin: preflight and request, with CORS headers.
    let pre = http
        .request(reqwest::Method::OPTIONS, &url)
        .header("Origin", "http://localhost:5173")
        .header("Access-Control-Request-Method", "POST")
        .send()
        .await
        .unwrap();
    assert_eq!(pre.status(), 204);
    assert_eq!(pre.headers()["access-control-allow-origin"], "http://localhost:5173");
    let r = post(None).header("Origin", "http://localhost:5173").send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["access-control-allow-origin"], "http://localhost:5173");
    // The owner with the token, as the openai SDK sends it.
    let r = post(Some(format!("localhost:{port}"))).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert!(!v["choices"][0]["message"]["content"].as_str().unwrap().is_empty());
}

/// 32 concurrent streaming requests through the gateway: all complete, and
/// all give the greedy answer the socket gives.
#[tokio::test(flavor = "multi_thread")]
async fn thirty_two_concurrent_http_streams_complete_and_agree() {
    let (d, base, _) = gateway_with("");
    let (want, _) = ask(&d.socket, greedy(None, "What is the capital of France?", 8)).await.unwrap();
    let http = reqwest::Client::new();
    let mut tasks = Vec::new();
    for _ in 0..32 {
        let (http, url) = (http.clone(), format!("{base}/v1/chat/completions"));
        tasks.push(tokio::spawn(async move {
            let mut b = body(8);
            b["stream"] = json!(true);
            let text = http.post(url).json(&b).send().await.unwrap().text().await.unwrap();
            let mut out = String::new();
            for data in text.lines().filter_map(|l| l.strip_prefix("data: ")).filter(|d| *d != "[DONE]") {
                let v: Value = serde_json::from_str(data).unwrap();
                if let Some(c) = v["choices"][0]["delta"]["content"].as_str() {
                    out.push_str(c);
                }
            }
            assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
            out
        }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), want);
    }
}

/// Every route the gateway serves (OpenAI and ollama alike) passes the same
/// guard: a foreign Host or Origin is refused, the token is required, and
/// loopback with it is served; bad bodies get each API's error shape.
#[tokio::test(flavor = "multi_thread")]
async fn every_route_is_guarded_and_bad_bodies_get_their_apis_error_shape() {
    let (_d, base, port) = gateway_with("http_token = \"s3cret\"\n");
    let http = reqwest::Client::new();
    let chat = json!({"model": SMOLLM2, "messages": [{"role": "user", "content": "hi"}], "stream": false,
                      "options": {"num_predict": 2, "temperature": 0}});
    let messages = json!({"model": SMOLLM2, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]});
    let routes: Vec<(reqwest::Method, &str, Option<Value>)> = vec![
        (reqwest::Method::GET, "/v1/models", None),
        (reqwest::Method::POST, "/v1/chat/completions", Some(body(2))),
        (reqwest::Method::POST, "/v1/completions", Some(json!({"model": SMOLLM2, "prompt": "hi", "max_tokens": 2}))),
        (
            reqwest::Method::POST,
            "/v1/responses",
            Some(json!({"model": SMOLLM2, "input": "hi", "max_output_tokens": 2})),
        ),
        (reqwest::Method::POST, "/v1/messages", Some(messages.clone())),
        (reqwest::Method::POST, "/v1/messages/count_tokens", Some(messages.clone())),
        (reqwest::Method::GET, "/api/version", None),
        (reqwest::Method::GET, "/api/tags", None),
        (reqwest::Method::GET, "/api/ps", None),
        (reqwest::Method::POST, "/api/show", Some(json!({"model": SMOLLM2}))),
        (reqwest::Method::POST, "/api/chat", Some(chat.clone())),
        (
            reqwest::Method::POST,
            "/api/generate",
            Some(json!({"model": SMOLLM2, "prompt": "hi", "stream": false,
                                                             "options": {"num_predict": 2}})),
        ),
    ];
    for (method, path, b) in &routes {
        let req = |token: bool, host: Option<String>, origin: Option<&str>| {
            let mut r = http.request(method.clone(), format!("{base}{path}"));
            if token {
                r = r.bearer_auth("s3cret");
            }
            if let Some(h) = host {
                r = r.header("Host", h);
            }
            if let Some(o) = origin {
                r = r.header("Origin", o);
            }
            if let Some(b) = b {
                r = r.json(b);
            }
            r
        };
        let status = |r: reqwest::RequestBuilder| async move { r.send().await.unwrap().status().as_u16() };
        assert_eq!(status(req(true, Some(format!("attacker.example:{port}")), None)).await, 403, "{path} Host");
        assert_eq!(status(req(true, None, Some("https://attacker.example"))).await, 403, "{path} Origin");
        assert_eq!(status(req(false, None, None)).await, 401, "{path} token");
        assert_eq!(status(req(true, Some(format!("127.0.0.1:{port}")), None)).await, 200, "{path} served");
    }
    // Bad bodies: OpenAI's {"error": {"message"}} and ollama's {"error": "..."}.
    let post = |path: &str, raw: String| {
        http.post(format!("{base}{path}")).bearer_auth("s3cret").header("Content-Type", "application/json").body(raw)
    };
    for path in ["/api/chat", "/api/generate", "/api/show"] {
        for raw in ["{not json".to_string(), json!({"model": 7}).to_string()] {
            let r = post(path, raw.clone()).send().await.unwrap();
            assert_eq!(r.status(), 400, "{path} {raw}");
            let v: Value = r.json().await.unwrap();
            assert!(v["error"].is_string(), "{path}: {v}");
        }
    }
    // Anthropic's {"type": "error", "error": {"type", "message"}}; its SDK's x-api-key carries the token.
    for raw in ["{not json".to_string(), json!({"model": SMOLLM2, "messages": []}).to_string()] {
        let r = post("/v1/messages", raw.clone()).send().await.unwrap();
        assert_eq!(r.status(), 400, "{raw}");
        let v: Value = r.json().await.unwrap();
        assert_eq!((v["type"].as_str(), v["error"]["type"].as_str()), (Some("error"), Some("invalid_request_error")));
    }
    let by_key = http.post(format!("{base}/v1/messages")).header("x-api-key", "s3cret").json(&messages);
    assert_eq!(by_key.send().await.unwrap().status(), 200);
    let mut unknown = chat.clone();
    unknown["model"] = json!("no-such-model");
    let r = post("/api/chat", unknown.to_string()).send().await.unwrap();
    assert_eq!(r.status(), 404);
    let mut bad_schema = chat.clone();
    bad_schema["format"] = json!({"type": "no-such-type"});
    let r = post("/api/chat", bad_schema.to_string()).send().await.unwrap();
    assert_eq!(r.status(), 400);
    assert!(r.json::<Value>().await.unwrap()["error"].as_str().unwrap().contains("constraint"));
    let mut wrong = body(2);
    wrong["response_format"] =
        json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}});
    let r = post("/v1/chat/completions", wrong.to_string()).send().await.unwrap();
    assert_eq!(r.status(), 400);
    assert!(r.json::<Value>().await.unwrap()["error"]["message"].is_string());
    let mut tools = body(2);
    tools["tools"] = json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]);
    tools["tool_choice"] = json!({"type": "function", "function": {"name": "not-f"}});
    assert_eq!(post("/v1/chat/completions", tools.to_string()).send().await.unwrap().status(), 400);
}
