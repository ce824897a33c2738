//! ollama's native API on the same gateway, for the editors that speak it
//! (VS Code Copilot's Ollama provider, Zed, Cline, Continue) and the
//! `ollama` Python client: `/api/version`, `/api/tags`, `/api/ps`,
//! `/api/show` (with capabilities: completion, tools, vision), `/api/chat`
//! and `/api/generate` (NDJSON streams, base64 images, `format`, `tools`,
//! `options`, `keep_alive`). Errors are ollama's `{"error": "..."}`.
//! `/api/generate` takes `raw` prompts and `suffix` (fill-in-the-middle);
//! `/api/pull` is in [`super::ollama_pull`].

use super::{begin, openai, Begun};
use crate::state::AppState;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine as _;
use futures::StreamExt;
use mlxbc_shared::{
    ChatMessage, Constraint, ErrorKind, GenerateRequest, GenerationStats, KeepAlive, MediaRef, Response as Wire, Role,
    SamplingParams, StopReason, Tool, ToolCall, ToolChoice,
};
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::Arc;

/// The ollama version this API follows (clients check it is recent enough).
const OLLAMA_VERSION: &str = "0.12.6";

pub(super) fn error(kind: ErrorKind, message: String) -> Response {
    let status = match kind {
        ErrorKind::UnknownModel => StatusCode::NOT_FOUND,
        ErrorKind::BadRequest | ErrorKind::BadMedia | ErrorKind::ContextOverflow | ErrorKind::BadFrame => {
            StatusCode::BAD_REQUEST
        }
        ErrorKind::OutOfMemory | ErrorKind::ShuttingDown | ErrorKind::Busy | ErrorKind::RankStopped => {
            StatusCode::SERVICE_UNAVAILABLE
        }
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    (status, Json(json!({"error": message}))).into_response()
}

fn now_rfc3339() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    let (year, month, day) = crate::model::chat_template::civil_date(days);
    format!("{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

pub async fn version() -> Json<Value> {
    Json(json!({"version": OLLAMA_VERSION}))
}

fn details(format: &str) -> Value {
    json!({"format": format, "family": "", "families": null, "parameter_size": "", "quantization_level": ""})
}

pub async fn tags(State(state): State<Arc<AppState>>) -> Json<Value> {
    let models: Vec<Value> = state
        .registry
        .list()
        .into_iter()
        .map(|m| {
            json!({"name": m.name, "model": m.name, "modified_at": now_rfc3339(), "size": m.size_bytes,
                   "digest": "", "details": details(&m.format)})
        })
        .collect();
    Json(json!({"models": models}))
}

pub async fn ps(State(state): State<Arc<AppState>>) -> Json<Value> {
    let models: Vec<Value> = state
        .registry
        .list()
        .into_iter()
        .filter(|m| m.loaded)
        .map(|m| {
            json!({"name": m.name, "model": m.name, "size": m.size_bytes, "size_vram": m.size_bytes, "digest": "",
                   "details": details(&m.format), "expires_at": "0001-01-01T00:00:00Z"})
        })
        .collect();
    Json(json!({"models": models}))
}

#[derive(Deserialize)]
struct ShowRequest {
    model: Option<String>,
    name: Option<String>,
}

/// A model's facts and capabilities (it is loaded to read them: its chat
/// template says whether it takes tools, its tower whether it sees).
pub async fn show(State(state): State<Arc<AppState>>, body: axum::body::Bytes) -> Response {
    let req: ShowRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return error(ErrorKind::BadRequest, format!("request body: {e}")),
    };
    let Some(name) = req.model.or(req.name).filter(|n| !n.is_empty()) else {
        return error(ErrorKind::BadRequest, "model is required".into());
    };
    if !crate::catalog::registry::is_plain_name(&name) {
        return error(ErrorKind::UnknownModel, format!("model {name:?} not found"));
    }
    let Some(info) = state.registry.list().into_iter().find(|m| m.name == name || m.aliases.contains(&name)) else {
        return error(ErrorKind::UnknownModel, format!("model {name:?} not found"));
    };
    if info.capability == "embedding" || info.capability == "rerank" {
        // An embedder (or reranker) has no chat route to load: its files
        // say what it is.
        return Json(json!({
            "modelfile": "", "parameters": "", "template": "", "license": "",
            "details": details(&info.format),
            "model_info": {"general.architecture": ""},
            "capabilities": [info.capability],
            "modified_at": now_rfc3339(),
        }))
        .into_response();
    }
    let model = Some(name.clone());
    let request = GenerateRequest { model: model.clone(), ..GenerateRequest::ask("") };
    crate::requests::prepare::load(&state.engine, &request).await;
    let Some(route) = state.engine.route(&model) else {
        return error(ErrorKind::Internal, format!("model {name:?} could not be loaded (see the daemon's log)"));
    };
    let mut capabilities = vec!["completion"];
    if crate::model::raw_prompt::has_fim(&route.prompter.tokenizer) {
        capabilities.push("insert");
    }
    if route.prompter.template.tool_format.is_some() {
        capabilities.push("tools");
    }
    if route.media.is_some() {
        capabilities.push("vision");
    }
    Json(json!({
        "modelfile": "", "parameters": "", "template": "", "license": "",
        "details": details(&info.format),
        "model_info": {"general.architecture": "", "general.context_length": route.context,
                       "mlxbc.context_length": route.context},
        "capabilities": capabilities,
        "modified_at": now_rfc3339(),
    }))
    .into_response()
}

#[derive(Deserialize, Default)]
struct Options {
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<u32>,
    seed: Option<i64>,
    num_predict: Option<i64>,
    stop: Option<Vec<String>>,
    /// An extension: the LoRA adapter to answer under (its name).
    adapter: Option<String>,
    /// Extensions (mlx-lm's names): the KV cache kept quantized.
    kv_bits: Option<u8>,
    kv_group_size: Option<u16>,
    quantized_kv_start: Option<u32>,
    kv_rotate: Option<bool>,
    kv_key_bits: Option<u8>,
}

#[derive(Deserialize)]
struct OMessage {
    role: String,
    #[serde(default)]
    content: String,
    #[serde(default)]
    images: Vec<String>,
    #[serde(default)]
    tool_calls: Vec<OCall>,
}

#[derive(Deserialize)]
struct OCall {
    function: OFunction,
}

#[derive(Deserialize)]
struct OFunction {
    name: String,
    arguments: Value,
}

pub(super) fn yes() -> bool {
    true
}

#[derive(Deserialize)]
struct ChatBody {
    model: String,
    #[serde(default)]
    messages: Vec<OMessage>,
    #[serde(default = "yes")]
    stream: bool,
    format: Option<Value>,
    options: Option<Options>,
    #[serde(default)]
    tools: Vec<openai::ToolDef>,
    keep_alive: Option<Value>,
}

#[derive(Deserialize)]
struct GenerateBody {
    model: String,
    #[serde(default)]
    prompt: String,
    system: Option<String>,
    #[serde(default)]
    images: Vec<String>,
    #[serde(default = "yes")]
    stream: bool,
    format: Option<Value>,
    options: Option<Options>,
    keep_alive: Option<Value>,
    #[serde(default)]
    raw: bool,
    suffix: Option<String>,
}

fn image(b64: &str) -> Result<MediaRef, String> {
    base64::engine::general_purpose::STANDARD
        .decode(b64.trim())
        .map(MediaRef::from_bytes)
        .map_err(|e| format!("an image is not valid base64: {e}"))
}

fn constraint(format: Option<Value>) -> Result<Option<Constraint>, String> {
    Ok(match format {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if s.is_empty() => None,
        Some(Value::String(s)) if s == "json" => Some(Constraint::JsonObject),
        Some(v @ Value::Object(_)) => Some(Constraint::JsonSchema(v.to_string())),
        Some(other) => return Err(format!("format must be \"json\" or a JSON schema, not {other}")),
    })
}

pub(super) fn keep_alive(v: Option<Value>) -> Result<Option<KeepAlive>, String> {
    Ok(match v {
        None | Some(Value::Null) => None,
        Some(Value::Number(n)) => match n.as_f64() {
            Some(s) if s < 0.0 => Some(KeepAlive::Forever),
            Some(s) => Some(KeepAlive::Seconds(s as u64)),
            None => None,
        },
        Some(Value::String(s)) if s.starts_with('-') => Some(KeepAlive::Forever),
        Some(Value::String(s)) => Some(KeepAlive::parse(&s)?),
        Some(other) => return Err(format!("keep_alive: a duration (\"5m\") or seconds, not {other}")),
    })
}

/// Our request with ollama's option defaults (temperature 0.8, top_k 40,
/// top_p 0.9; num_predict -1: until the context is full).
fn request(
    model: String,
    messages: Vec<ChatMessage>,
    options: Option<Options>,
    format: Option<Value>,
    keep: Option<Value>,
) -> Result<GenerateRequest, String> {
    let o = options.unwrap_or_default();
    Ok(GenerateRequest {
        model: Some(model).filter(|m| !m.is_empty()),
        messages,
        sampling: SamplingParams {
            temperature: o.temperature.unwrap_or(0.8),
            top_k: o.top_k.unwrap_or(40),
            top_p: o.top_p.unwrap_or(0.9),
            seed: o.seed.map(|s| s as u64),
        },
        max_tokens: match o.num_predict {
            Some(n) if n >= 0 => n.min(u32::MAX as i64) as u32,
            _ => u32::MAX,
        },
        stop: o.stop.unwrap_or_default(),
        keep_alive: keep_alive(keep)?,
        ignore_eos: false,
        session: None,
        constraint: constraint(format)?,
        tools: Vec::new(),
        tool_choice: ToolChoice::Auto,
        raw: None,
        logprobs: None,
        speculate: Default::default(),
        draft: None,
        draft_max: None,
        adapter: o.adapter,
        kv: mlxbc_shared::KvCacheSpec {
            bits: o.kv_bits,
            group_size: o.kv_group_size,
            start: o.quantized_kv_start,
            rotate: o.kv_rotate,
            key_bits: o.kv_key_bits,
        },
    })
}

fn chat_request(b: ChatBody) -> Result<GenerateRequest, String> {
    let mut messages = Vec::with_capacity(b.messages.len());
    for m in b.messages {
        let role = match m.role.as_str() {
            "system" => Role::System,
            "user" => Role::User,
            "assistant" => Role::Assistant,
            "tool" => Role::Tool,
            other => return Err(format!("unsupported message role {other:?}")),
        };
        let mut msg = ChatMessage { role, content: m.content, ..ChatMessage::user("") };
        msg.media = m.images.iter().map(|i| image(i)).collect::<Result<_, _>>()?;
        msg.tool_calls = m
            .tool_calls
            .into_iter()
            .enumerate()
            .map(|(i, c)| ToolCall {
                id: format!("call_{i}"),
                name: c.function.name,
                arguments: c.function.arguments.to_string(),
            })
            .collect();
        messages.push(msg);
    }
    if messages.is_empty() {
        return Err("messages must not be empty".into());
    }
    let tools = b
        .tools
        .into_iter()
        .map(|t| {
            let parameters = t.function.parameters.unwrap_or_else(|| json!({"type": "object", "properties": {}}));
            Tool { name: t.function.name, description: t.function.description, parameters: parameters.to_string() }
        })
        .collect();
    let mut r = request(b.model, messages, b.options, b.format, b.keep_alive)?;
    r.tools = tools;
    Ok(r)
}

fn done_reason(r: StopReason) -> &'static str {
    match r {
        StopReason::MaxTokens | StopReason::ContextFull => "length",
        StopReason::Eos | StopReason::StopString => "stop",
    }
}

/// The counts and durations (nanoseconds) of the last line.
fn timings(s: &GenerationStats, total: std::time::Duration) -> Value {
    let ns = |ms: f64| (ms * 1e6) as u64;
    let eval_ms =
        if s.decode_tokens_per_s > 0.0 { s.generated_tokens as f64 / s.decode_tokens_per_s * 1e3 } else { 0.0 };
    json!({"total_duration": total.as_nanos() as u64, "load_duration": ns(s.load_ms),
           "prompt_eval_count": s.prompt_tokens, "prompt_eval_duration": ns(s.prefill_ms),
           "eval_count": s.generated_tokens, "eval_duration": ns(eval_ms)})
}

fn calls(stats: &GenerationStats) -> Value {
    Value::Array(
        stats
            .tool_calls
            .iter()
            .map(|c| {
                let arguments: Value = serde_json::from_str(&c.arguments).unwrap_or(Value::String(c.arguments.clone()));
                json!({"function": {"name": c.name, "arguments": arguments}})
            })
            .collect(),
    )
}

/// How a line carries text: `/api/chat`'s message or `/api/generate`'s response.
#[derive(Clone, Copy)]
enum Shape {
    Chat,
    Generate,
}

fn line(shape: Shape, model: &str, text: &str, done: Option<(&GenerationStats, std::time::Duration)>) -> Value {
    let mut v = match shape {
        Shape::Chat => json!({"model": model, "created_at": now_rfc3339(),
                              "message": {"role": "assistant", "content": text}, "done": false}),
        Shape::Generate => json!({"model": model, "created_at": now_rfc3339(), "response": text, "done": false}),
    };
    if let Some((stats, total)) = done {
        v["done"] = json!(true);
        v["done_reason"] = json!(done_reason(stats.stop_reason));
        if let (Shape::Chat, false) = (shape, stats.tool_calls.is_empty()) {
            v["message"]["tool_calls"] = calls(stats);
        }
        if let Value::Object(t) = timings(stats, total) {
            v.as_object_mut().expect("an object").extend(t);
        }
    }
    v
}

/// Answers a started generation as one object or an NDJSON stream.
async fn answer(begun: Begun, shape: Shape, stream: bool, started: std::time::Instant) -> Response {
    if !stream {
        let model = begun.model.clone();
        return match super::collect(begun).await {
            Ok((text, stats)) => Json(line(shape, &model, &text, Some((&stats, started.elapsed())))).into_response(),
            Err((kind, message)) => error(kind, message),
        };
    }
    let Begun { rx, guard, model, .. } = begun;
    let lines = futures::stream::unfold((rx, Some(guard), false), move |(mut rx, guard, done)| {
        let model = model.clone();
        async move {
            if done {
                return None;
            }
            let (v, done) = match rx.recv().await {
                Some(Wire::Token { text }) => (line(shape, &model, &text, None), false),
                Some(Wire::Done { stats }) => (line(shape, &model, "", Some((&stats, started.elapsed()))), true),
                Some(Wire::Error { message, .. }) => (json!({"error": message}), true),
                Some(_) => return Some((None, (rx, guard, false))),
                None => return None,
            };
            Some((Some(format!("{v}\n")), (rx, guard, done)))
        }
    })
    .filter_map(|l| async move { l.map(Ok::<_, std::convert::Infallible>) });
    ([(axum::http::header::CONTENT_TYPE, "application/x-ndjson")], axum::body::Body::from_stream(lines)).into_response()
}

/// A request with nothing to answer loads the model (as ollama does).
async fn preload(state: &AppState, model: String, shape: Shape) -> Response {
    let request = GenerateRequest { model: Some(model.clone()).filter(|m| !m.is_empty()), ..GenerateRequest::ask("") };
    if let Err(e) = crate::requests::validate::generate(&request, state.limits) {
        return error(ErrorKind::BadRequest, e.0);
    }
    crate::requests::prepare::load(&state.engine, &request).await;
    if state.engine.route(&request.model).is_none() {
        return error(ErrorKind::UnknownModel, format!("model {model:?} not found or not loadable"));
    }
    let mut v = match shape {
        Shape::Chat => json!({"message": {"role": "assistant", "content": ""}}),
        Shape::Generate => json!({"response": ""}),
    };
    v["model"] = json!(model);
    v["created_at"] = json!(now_rfc3339());
    v["done"] = json!(true);
    v["done_reason"] = json!("load");
    Json(v).into_response()
}

pub async fn chat(State(state): State<Arc<AppState>>, body: axum::body::Bytes) -> Response {
    let started = std::time::Instant::now();
    let parsed: ChatBody = match serde_json::from_slice(&body) {
        Ok(b) => b,
        Err(e) => return error(ErrorKind::BadRequest, format!("request body: {e}")),
    };
    let stream = parsed.stream;
    if parsed.messages.is_empty() {
        return preload(&state, parsed.model, Shape::Chat).await;
    }
    let request = match chat_request(parsed) {
        Ok(r) => r,
        Err(e) => return error(ErrorKind::BadRequest, e),
    };
    match begin(&state, request).await {
        Ok(b) => answer(b, Shape::Chat, stream, started).await,
        Err((kind, message)) => error(kind, message),
    }
}

pub async fn generate(State(state): State<Arc<AppState>>, body: axum::body::Bytes) -> Response {
    let started = std::time::Instant::now();
    let b: GenerateBody = match serde_json::from_slice(&body) {
        Ok(b) => b,
        Err(e) => return error(ErrorKind::BadRequest, format!("request body: {e}")),
    };
    if b.prompt.is_empty() && b.images.is_empty() {
        return preload(&state, b.model, Shape::Generate).await;
    }
    let mut messages = Vec::new();
    if let Some(s) = b.system.filter(|s| !s.is_empty()) {
        messages.push(ChatMessage::system(s));
    }
    let mut user = ChatMessage::user(b.prompt);
    user.media = match b.images.iter().map(|i| image(i)).collect() {
        Ok(i) => i,
        Err(e) => return error(ErrorKind::BadRequest, e),
    };
    messages.push(user);
    let suffix = b.suffix.filter(|s| !s.is_empty());
    let raw = (b.raw || suffix.is_some())
        .then(|| mlxbc_shared::RawPrompt { prefix: messages.pop().map(|m| m.content).unwrap_or_default(), suffix });
    if raw.is_some() && (!messages.is_empty() || !b.images.is_empty()) {
        return error(
            ErrorKind::BadRequest,
            "a raw or fill-in-the-middle prompt takes no system prompt or images".into(),
        );
    }
    let mut request =
        match request(b.model, if raw.is_some() { Vec::new() } else { messages }, b.options, b.format, b.keep_alive) {
            Ok(r) => r,
            Err(e) => return error(ErrorKind::BadRequest, e),
        };
    request.raw = raw;
    match begin(&state, request).await {
        Ok(b2) => answer(b2, Shape::Generate, b.stream, started).await,
        Err((kind, message)) => error(kind, message),
    }
}
