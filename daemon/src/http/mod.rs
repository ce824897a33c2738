//! The optional HTTP gateway for editors and agents
//! (`mlxbcd --http 127.0.0.1:PORT`; off by default, loopback only), on the
//! same engine as the socket: OpenAI's chat and text completions,
//! `/v1/models` and `/v1/responses` ([`openai`], [`responses`]), ollama's
//! native API ([`ollama`]), Anthropic's Messages API ([`anthropic`]),
//! OpenAI's speech-to-text ([`audio`]), both APIs' embeddings
//! ([`embeddings`]) and the Jina/Cohere reranking API ([`rerank`]);
//! streams are server-sent events (NDJSON for ollama), images `data:`
//! URLs or base64.
//! Every request passes [`guard`] first; a model must be a plain name
//! (`registry::is_plain_name`), never a path (the socket, which only its
//! owner can reach, still takes paths).

mod anthropic;
mod audio;
mod embeddings;
mod guard;
mod listener;
mod ollama;
mod ollama_pull;
mod openai;
mod rerank;
mod responses;

use crate::state::AppState;
use anyhow::{bail, Context, Result};
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::StreamExt;
use mlxbc_shared::{ErrorKind, Response as Wire};
use openai::ChatCompletionRequest;
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Binds the gateway's address; only loopback addresses are accepted.
pub async fn bind(addr: SocketAddr) -> Result<tokio::net::TcpListener> {
    if !addr.ip().is_loopback() {
        bail!("--http must be a loopback address (127.0.0.1 or ::1), not {addr}: a token (http_token) guards requests, not the traffic, which is unencrypted");
    }
    tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding the HTTP gateway to {addr}"))
}

/// Serves HTTP on `listener` until `stop` turns true; a connection with no
/// request in flight is closed after `idle_timeout`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    idle_timeout: std::time::Duration,
    stop: tokio::sync::watch::Receiver<bool>,
) -> Result<()> {
    let limits = listener::HttpLimits { idle_timeout, max_body_bytes: mlxbc_shared::MAX_FRAME_BYTES };
    let addr = listener.local_addr()?;
    let guard = Arc::new(guard::Guard::new(addr, state.http_token.clone(), state.http_allowed_origins.clone()));
    let app = Router::new()
        .route("/", get(page))
        .route("/v1/models", get(models))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/responses", post(responses::responses))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route("/api/version", get(ollama::version))
        .route("/api/tags", get(ollama::tags))
        .route("/api/ps", get(ollama::ps))
        .route("/api/show", post(ollama::show))
        .route("/api/chat", post(ollama::chat))
        .route("/api/generate", post(ollama::generate))
        .route("/api/pull", post(ollama_pull::pull))
        .route("/metrics", get(metrics))
        .route("/v1/embeddings", post(embeddings::openai))
        .route("/api/embed", post(embeddings::ollama_embed))
        .route("/api/embeddings", post(embeddings::ollama_embeddings))
        .route("/v1/rerank", post(rerank::rerank))
        .route("/rerank", post(rerank::rerank))
        .route("/v1/reranking", post(rerank::rerank))
        .route("/reranking", post(rerank::rerank))
        .route("/v1/audio/transcriptions", post(audio::transcriptions))
        .route("/v1/audio/translations", post(audio::translations))
        .route_layer(axum::middleware::from_fn_with_state(state.clone(), count_requests))
        // Bodies carry base64 images: the socket's frame cap, no more,
        // read whole under a deadline before a handler runs; and before
        // that, the guard.
        .layer(axum::extract::DefaultBodyLimit::max(limits.max_body_bytes))
        .layer(axum::middleware::from_fn_with_state(limits, listener::read_body))
        .layer(axum::middleware::from_fn_with_state(guard, guard::check))
        .with_state(state.clone());
    tracing::info!(%addr, token = state.http_token.is_some(), "OpenAI-compatible HTTP gateway listening");
    listener::accept_loop(listener, app, state.http_connections.clone(), limits, stop).await;
    Ok(())
}

/// How `begin` says images sent by hash are not in the store: the message
/// starts with this, then their hashes (comma-separated hex).
const NEED_MEDIA: &str = "need_media:";

/// An OpenAI-style error body with a fitting status; images the store
/// lacks (sent by hash) are a 409 naming them in `missing`.
fn error_response(kind: ErrorKind, message: String) -> Response {
    if let Some(hashes) = message.strip_prefix(NEED_MEDIA) {
        let missing: Vec<&str> = hashes.split(',').collect();
        let body = json!({"error": {"message": "send these images' bytes (data: URLs): the store lacks them",
                                    "type": "invalid_request_error", "code": "need_media", "missing": missing}});
        return (StatusCode::CONFLICT, Json(body)).into_response();
    }
    let (status, kind_name) = match kind {
        ErrorKind::UnknownModel => (StatusCode::NOT_FOUND, "model_not_found"),
        ErrorKind::BadRequest | ErrorKind::BadMedia | ErrorKind::ContextOverflow | ErrorKind::BadFrame => {
            (StatusCode::BAD_REQUEST, "invalid_request_error")
        }
        ErrorKind::OutOfMemory | ErrorKind::ShuttingDown | ErrorKind::RankStopped => {
            (StatusCode::SERVICE_UNAVAILABLE, "server_error")
        }
        _ => (StatusCode::INTERNAL_SERVER_ERROR, "server_error"),
    };
    (status, Json(json!({"error": {"message": message, "type": kind_name, "code": format!("{kind:?}")}})))
        .into_response()
}

/// `GET /metrics`: counters and the daemon's state in Prometheus' text
/// format (`crate::metrics`; docs/http-api.md lists the series).
async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let status = state.status();
    let prompts = state.engine.prompt_report();
    let (store, path) = (state.engine.store.clone(), state.engine.store_path.clone());
    // The store's stats take its lock: off the async threads.
    let report = tokio::task::spawn_blocking(move || store.map(|s| crate::media::report(&s.lock(), &path, prompts)))
        .await
        .ok()
        .flatten();
    let body = crate::metrics::render(&state.engine.metrics, &status, report.as_ref());
    ([(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], body).into_response()
}

/// Counts each request by its route and the status it was answered with.
async fn count_requests(
    State(state): State<Arc<AppState>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let route = request.extensions().get::<axum::extract::MatchedPath>().map_or("", |p| p.as_str()).to_string();
    let response = next.run(request).await;
    state.engine.metrics.http(&route, response.status().as_u16());
    response
}

/// The chat page (`GET /`): one file written in this repo, no build step,
/// nothing fetched from elsewhere (the policy below forbids it).
const PAGE: &str = include_str!("page/index.html");

async fn page() -> Response {
    use axum::http::header;
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'none'; script-src 'unsafe-inline' blob:; style-src 'unsafe-inline'; \
                 img-src blob: data:; connect-src 'self'; media-src blob:; base-uri 'none'; form-action 'none'",
            ),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::REFERRER_POLICY, "no-referrer"),
        ],
        PAGE,
    )
        .into_response()
}

/// `GET /v1/models`: every model the daemon can serve, with what it does
/// (`capability`: chat, vision, speech, embedding, rerank); a resident one also says its
/// context length (others would have to be loaded to know it).
async fn models(State(state): State<Arc<AppState>>) -> Json<serde_json::Value> {
    let data: Vec<_> = state
        .registry
        .list()
        .into_iter()
        .map(|m| {
            let mut v = json!({"id": m.name, "object": "model", "created": 0, "owned_by": "mlxbc",
                               "loaded": m.loaded, "capability": m.capability});
            if let Some(route) = m.loaded.then(|| state.engine.route(&Some(m.name.clone()))).flatten() {
                v["context_length"] = json!(route.context);
            }
            v
        })
        .collect();
    Json(json!({"object": "list", "data": data}))
}

/// Sets the generation's cancel flag when the HTTP response is dropped
/// (the editor closed the connection mid-stream).
struct CancelOnDrop(Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// A generation the gateway started: its events after `Started`, the guard
/// that cancels it when dropped, the model's name and the prompt's length.
struct Begun {
    rx: tokio::sync::mpsc::UnboundedReceiver<Wire>,
    guard: CancelOnDrop,
    model: String,
    prompt_tokens: u32,
}

/// Checks and starts `request` for an HTTP client (whatever its API); the
/// error is the kind and message for that API's error shape.
async fn begin(state: &AppState, request: mlxbc_shared::GenerateRequest) -> Result<Begun, (ErrorKind, String)> {
    crate::requests::validate::generate(&request, state.limits).map_err(|e| (ErrorKind::BadRequest, e.0))?;
    if let Some(name) = &request.model {
        if !crate::catalog::registry::is_plain_name(name) {
            return Err((
                ErrorKind::UnknownModel,
                format!("model {name:?} is a path; over HTTP name a model that the model list shows (paths are accepted on the socket only)"),
            ));
        }
    }
    if let Some(name) = request.adapter.as_deref().filter(|a| !crate::catalog::registry::is_plain_name(a)) {
        return Err((
            ErrorKind::UnknownModel,
            format!("adapter {name:?} is a path; over HTTP name an adapter that the model list shows"),
        ));
    }
    let (mut rx, cancel) = state.start_generation(request).await.map_err(|e| (e.kind(), e.to_string()))?;
    let guard = CancelOnDrop(cancel);
    // The first event decides the status: an error before any output is an HTTP error.
    match rx.recv().await {
        Some(Wire::Started { model, prompt_tokens }) => Ok(Begun { rx, guard, model, prompt_tokens }),
        Some(Wire::Error { kind, message }) => Err((kind, message)),
        Some(Wire::NeedMedia { missing }) => {
            let hex: Vec<String> = missing.iter().map(|h| mlxbc_cache::hex(h)).collect();
            Err((ErrorKind::BadMedia, format!("{NEED_MEDIA}{}", hex.join(","))))
        }
        other => Err((ErrorKind::Internal, format!("unexpected first event {other:?}"))),
    }
}

/// The prompt's length in tokens as the model would see it (images and
/// tools included): the request is set up with nothing to generate, so it
/// is rendered, checked and counted, and nothing is computed.
async fn count_prompt_tokens(
    state: &AppState,
    mut request: mlxbc_shared::GenerateRequest,
) -> Result<(String, u32), (ErrorKind, String)> {
    request.max_tokens = 0;
    let begun = begin(state, request).await?;
    Ok((begun.model, begun.prompt_tokens))
}

/// Streams a generation as server-sent events: `first`, then what `on`
/// makes of each engine event; `on` says when its events were the last.
fn event_stream<F>(begun: Begun, first: Vec<Event>, on: F) -> Response
where
    F: FnMut(Wire) -> (Vec<Event>, bool) + Send + 'static,
{
    let Begun { rx, guard, .. } = begun;
    let events = futures::stream::unfold((rx, guard, on, false), |(mut rx, guard, mut on, finished)| async move {
        if finished {
            return None;
        }
        let (out, last) = on(rx.recv().await?);
        Some((out, (rx, guard, on, last)))
    })
    .flat_map(futures::stream::iter);
    Sse::new(futures::stream::iter(first).chain(events).map(Ok::<_, std::convert::Infallible>)).into_response()
}

/// An SSE event with only data (OpenAI's chat and text completions).
fn data_event(v: &Value) -> Event {
    Event::default().data(v.to_string())
}

/// An SSE event with a name and data (the Anthropic and Responses streams).
fn named_event(v: Value) -> Event {
    let name = v["type"].as_str().unwrap_or("message").to_string();
    Event::default().event(name).data(v.to_string())
}

/// Streams a generation as OpenAI's server-sent events: `first` (if any),
/// then `token`'s data for each piece of text, then `done`'s and `[DONE]`.
fn sse(
    begun: Begun,
    first: Option<Value>,
    token: impl Fn(&str) -> Value + Send + Sync + 'static,
    done: impl Fn(&mlxbc_shared::GenerationStats) -> Vec<Value> + Send + Sync + 'static,
) -> Response {
    event_stream(begun, first.iter().map(data_event).collect(), move |event| match event {
        Wire::Token { text } => (vec![data_event(&token(&text))], false),
        Wire::Done { stats } => {
            let mut out: Vec<Event> = done(&stats).iter().map(data_event).collect();
            out.push(Event::default().data("[DONE]"));
            (out, true)
        }
        Wire::Error { message, .. } => {
            (vec![data_event(&json!({"error": {"message": message, "type": "server_error"}}))], true)
        }
        _ => (vec![], false),
    })
}

/// A whole generation's text and statistics, or the error's kind and message.
async fn collect(begun: Begun) -> Result<(String, mlxbc_shared::GenerationStats), (ErrorKind, String)> {
    let Begun { mut rx, guard, .. } = begun;
    let mut text = String::new();
    loop {
        match rx.recv().await {
            Some(Wire::Token { text: t }) => text.push_str(&t),
            Some(Wire::Done { stats }) => {
                drop(guard);
                return Ok((text, stats));
            }
            Some(Wire::Error { kind, message }) => return Err((kind, message)),
            Some(_) => {}
            None => return Err((ErrorKind::Internal, "the engine dropped the request".into())),
        }
    }
}

fn now_secs() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// `POST /v1/completions`: a prompt (with `suffix`: fill-in-the-middle).
async fn completions(State(state): State<Arc<AppState>>, body: axum::body::Bytes) -> Response {
    let parsed: openai::CompletionRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return error_response(ErrorKind::BadRequest, format!("request body: {e}")),
    };
    let stream = parsed.stream;
    let request = match parsed.into_generate() {
        Ok(r) => r,
        Err(e) => return error_response(ErrorKind::BadRequest, e.0),
    };
    let begun = match begin(&state, request).await {
        Ok(b) => b,
        Err((kind, message)) => return error_response(kind, message),
    };
    let (id, created, model) = (format!("cmpl-{:x}", rand::random::<u64>()), now_secs(), begun.model.clone());
    if stream {
        let (id2, model2) = (id.clone(), model.clone());
        return sse(
            begun,
            None,
            move |text| openai::text_completion(&id, created, &model, text, None, None),
            move |stats| {
                let finish = openai::finish_reason(stats.stop_reason);
                let mut last = openai::text_completion(&id2, created, &model2, "", Some(finish), None);
                if !stats.logprobs.is_empty() {
                    last["choices"][0]["logprobs"] = openai::completion_logprobs(&stats.logprobs);
                }
                vec![last]
            },
        );
    }
    match collect(begun).await {
        Ok((text, stats)) => {
            let finish = openai::finish_reason(stats.stop_reason);
            let mut v = openai::text_completion(&id, created, &model, &text, Some(finish), Some(&stats));
            if !stats.logprobs.is_empty() {
                v["choices"][0]["logprobs"] = openai::completion_logprobs(&stats.logprobs);
            }
            Json(v).into_response()
        }
        Err((kind, message)) => error_response(kind, message),
    }
}

async fn chat_completions(State(state): State<Arc<AppState>>, body: axum::body::Bytes) -> Response {
    let parsed: ChatCompletionRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return error_response(ErrorKind::BadRequest, format!("request body: {e}")),
    };
    let stream = parsed.stream;
    let include_usage = parsed.stream_options.as_ref().is_some_and(|o| o.include_usage);
    let request = match parsed.into_generate() {
        Ok(r) => r,
        Err(e) => return error_response(ErrorKind::BadRequest, e.0),
    };
    let begun = match begin(&state, request).await {
        Ok(b) => b,
        Err((kind, message)) => return error_response(kind, message),
    };
    let (id, created, model) = (format!("chatcmpl-{:x}", rand::random::<u64>()), now_secs(), begun.model.clone());
    if stream {
        let first = openai::chunk(&id, created, &model, json!({"role": "assistant", "content": ""}), None);
        let (id2, model2) = (id.clone(), model.clone());
        return sse(
            begun,
            Some(first),
            move |text| openai::chunk(&id, created, &model, json!({"content": text}), None),
            move |stats| {
                let (id, model) = (&id2, &model2);
                let mut out = Vec::new();
                let mut finish = openai::finish_reason(stats.stop_reason);
                if !stats.tool_calls.is_empty() {
                    // The calls, whole, as one delta (parsed once closed).
                    let calls = json!({"tool_calls": openai::tool_calls(&stats.tool_calls, true)});
                    out.push(openai::chunk(id, created, model, calls, None));
                    finish = "tool_calls";
                }
                let mut last = openai::chunk(id, created, model, json!({}), Some(finish));
                last["mlxbc"] = openai::cache_stats(stats);
                if !stats.logprobs.is_empty() {
                    // All the answer's tokens, on its last chunk (they are read as it ends).
                    last["choices"][0]["logprobs"] = openai::chat_logprobs(&stats.logprobs);
                }
                out.push(last);
                if include_usage {
                    out.push(openai::usage_chunk(id, created, model, stats));
                }
                out
            },
        );
    }
    match collect(begun).await {
        Ok((text, stats)) => Json(openai::completion(&id, created, &model, &text, &stats)).into_response(),
        Err((kind, message)) => error_response(kind, message),
    }
}
