//! Anthropic's Messages API on the gateway, for Claude Code and the
//! `anthropic` SDKs: `POST /v1/messages` (system, text and base64 image
//! blocks, `tools` / `tool_use` / `tool_result`, `tool_choice`,
//! `stop_sequences`, `output_config.format` (a JSON schema the answer is
//! constrained to), streaming events in Anthropic's order) and
//! `POST /v1/messages/count_tokens`. Sampling: the current API has no
//! `temperature` (its models choose), so these default to 1 as Anthropic's
//! did; `temperature`, `top_p` and `top_k` in the body are still honoured. Errors are Anthropic's
//! `{"type": "error", "error": {"type", "message"}}`.
//!
//! Thinking blocks a client sends back are dropped (these models do not
//! think in Anthropic's form); server tools (web search, code execution)
//! and URL images are refused with a sentence, never silently ignored.

use super::{begin, collect, count_prompt_tokens, event_stream, named_event, Begun};
use crate::state::AppState;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine as _;
use mlxbc_shared::{
    ChatMessage, ErrorKind, GenerateRequest, GenerationStats, MediaRef, Response as Wire, Role, SamplingParams,
    StopReason, Tool, ToolCall, ToolChoice,
};
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::Arc;

/// `POST /v1/messages` (and `count_tokens`, which has no `max_tokens`).
#[derive(Debug, Deserialize)]
pub struct MessagesRequest {
    #[serde(default)]
    model: Option<String>,
    max_tokens: Option<u32>,
    messages: Vec<Message>,
    system: Option<System>,
    #[serde(default)]
    stop_sequences: Vec<String>,
    #[serde(default)]
    stream: bool,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<u32>,
    #[serde(default)]
    tools: Vec<ToolDef>,
    tool_choice: Option<ToolChoiceDef>,
    output_config: Option<OutputConfig>,
}

#[derive(Debug, Deserialize)]
struct OutputConfig {
    format: Option<OutputFormat>,
}

#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum OutputFormat {
    JsonSchema { schema: Value },
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum System {
    Text(String),
    Blocks(Vec<TextBlock>),
}

#[derive(Debug, Deserialize)]
struct TextBlock {
    text: String,
}

#[derive(Debug, Deserialize)]
struct Message {
    role: String,
    content: Content,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Blocks(Vec<Block>),
}

#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Block {
    Text {
        text: String,
    },
    Image {
        source: ImageSource,
    },
    ToolUse {
        id: String,
        name: String,
        input: Value,
    },
    ToolResult {
        tool_use_id: String,
        content: Option<Content>,
        #[serde(default)]
        is_error: bool,
    },
    /// Extended thinking sent back by a client: dropped.
    Thinking {},
    RedactedThinking {},
    #[serde(other)]
    Unsupported,
}

#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum ImageSource {
    Base64 {
        data: String,
    },
    Url {},
    #[serde(other)]
    Other,
}

#[derive(Debug, Deserialize)]
struct ToolDef {
    name: String,
    #[serde(default)]
    description: String,
    /// Absent on Anthropic's server tools (web search, ...), which are refused.
    input_schema: Option<Value>,
}

#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum ToolChoiceDef {
    Auto {},
    Any {},
    None {},
    Tool { name: String },
}

/// Anthropic's error body for one of ours.
fn error(kind: ErrorKind, message: String) -> Response {
    let (status, name) = match kind {
        ErrorKind::UnknownModel => (StatusCode::NOT_FOUND, "not_found_error"),
        ErrorKind::BadRequest | ErrorKind::BadMedia | ErrorKind::ContextOverflow | ErrorKind::BadFrame => {
            (StatusCode::BAD_REQUEST, "invalid_request_error")
        }
        // 529: what Anthropic answers when overloaded (its SDK retries it).
        ErrorKind::Busy | ErrorKind::OutOfMemory | ErrorKind::ShuttingDown | ErrorKind::RankStopped => {
            (StatusCode::from_u16(529).expect("a status"), "overloaded_error")
        }
        _ => (StatusCode::INTERNAL_SERVER_ERROR, "api_error"),
    };
    (status, Json(json!({"type": "error", "error": {"type": name, "message": message}}))).into_response()
}

fn bad(message: impl Into<String>) -> (ErrorKind, String) {
    (ErrorKind::BadRequest, message.into())
}

fn image(source: ImageSource) -> Result<MediaRef, (ErrorKind, String)> {
    match source {
        ImageSource::Base64 { data } => base64::engine::general_purpose::STANDARD
            .decode(data.trim())
            .map(MediaRef::from_bytes)
            .map_err(|e| bad(format!("an image's base64 data is not valid: {e}"))),
        ImageSource::Url {} => {
            Err(bad("image sources must be base64 (\"type\": \"base64\"); mlxbcd does not fetch URLs"))
        }
        ImageSource::Other => Err(bad("image sources must be base64 (\"type\": \"base64\")")),
    }
}

/// A tool result's text (its images go with it).
fn result_content(content: Option<Content>, msg: &mut ChatMessage) -> Result<(), (ErrorKind, String)> {
    match content {
        None => {}
        Some(Content::Text(t)) => msg.content.push_str(&t),
        Some(Content::Blocks(blocks)) => {
            for b in blocks {
                match b {
                    Block::Text { text } => push_text(&mut msg.content, &text),
                    Block::Image { source } => msg.media.push(image(source)?),
                    _ => return Err(bad("a tool_result's content holds text and image blocks only")),
                }
            }
        }
    }
    Ok(())
}

fn push_text(into: &mut String, text: &str) {
    if !into.is_empty() {
        into.push('\n');
    }
    into.push_str(text);
}

impl MessagesRequest {
    /// Our request for it. A user turn's `tool_result` blocks become
    /// `tool` messages (in order, before the turn's own text); an assistant
    /// turn's `tool_use` blocks become its tool calls.
    pub fn into_generate(self) -> Result<(GenerateRequest, bool), (ErrorKind, String)> {
        let mut messages = Vec::with_capacity(self.messages.len() + 1);
        match self.system {
            None => {}
            Some(System::Text(t)) if t.is_empty() => {}
            Some(System::Text(t)) => messages.push(ChatMessage::system(t)),
            Some(System::Blocks(b)) if b.is_empty() => {}
            Some(System::Blocks(b)) => {
                messages.push(ChatMessage::system(b.into_iter().map(|b| b.text).collect::<Vec<_>>().join("\n")))
            }
        }
        for m in self.messages {
            let role = match m.role.as_str() {
                "user" => Role::User,
                "assistant" => Role::Assistant,
                other => return Err(bad(format!("message role {other:?}: \"user\" or \"assistant\""))),
            };
            let blocks = match m.content {
                Content::Text(t) => vec![Block::Text { text: t }],
                Content::Blocks(b) => b,
            };
            let mut msg = ChatMessage { role, ..ChatMessage::user("") };
            for b in blocks {
                match b {
                    Block::Text { text } => push_text(&mut msg.content, &text),
                    Block::Image { source } => msg.media.push(image(source)?),
                    Block::ToolUse { id, name, input } if role == Role::Assistant => {
                        msg.tool_calls.push(ToolCall { id, name, arguments: input.to_string() })
                    }
                    Block::ToolResult { tool_use_id, content, is_error } if role == Role::User => {
                        let mut result = ChatMessage { role: Role::Tool, ..ChatMessage::user("") };
                        result.tool_call_id = Some(tool_use_id);
                        if is_error {
                            result.content.push_str("Error: ");
                        }
                        result_content(content, &mut result)?;
                        messages.push(result);
                    }
                    Block::ToolUse { .. } => return Err(bad("tool_use blocks belong to assistant turns")),
                    Block::ToolResult { .. } => return Err(bad("tool_result blocks belong to user turns")),
                    Block::Thinking {} | Block::RedactedThinking {} => {}
                    Block::Unsupported => {
                        return Err(bad(
                            "a content block of an unsupported type (text, image, tool_use and tool_result are served)",
                        ))
                    }
                }
            }
            // A user turn of only tool results adds no user message.
            let only_results = role == Role::User && msg.content.is_empty() && msg.media.is_empty();
            if !only_results || messages.last().is_none_or(|l| l.role != Role::Tool) {
                messages.push(msg);
            }
        }
        if !messages.iter().any(|m| m.role != Role::System) {
            return Err(bad("messages must not be empty"));
        }
        let tools = self
            .tools
            .into_iter()
            .map(|t| match t.input_schema {
                Some(schema) => Ok(Tool { name: t.name, description: t.description, parameters: schema.to_string() }),
                None => Err(bad(format!("tool {:?} has no input_schema: server tools are not served", t.name))),
            })
            .collect::<Result<Vec<_>, _>>()?;
        let tool_choice = match self.tool_choice {
            None | Some(ToolChoiceDef::Auto {}) => ToolChoice::Auto,
            Some(ToolChoiceDef::Any {}) => ToolChoice::Required,
            Some(ToolChoiceDef::None {}) => ToolChoice::None,
            Some(ToolChoiceDef::Tool { name }) => ToolChoice::Function(name),
        };
        let request = GenerateRequest {
            model: self.model.filter(|m| !m.is_empty()),
            messages,
            sampling: SamplingParams {
                // Anthropic's defaults: temperature 1, no top-k / top-p cut.
                temperature: self.temperature.unwrap_or(1.0),
                top_k: self.top_k.unwrap_or(0),
                top_p: self.top_p.unwrap_or(1.0),
                seed: None,
            },
            max_tokens: self.max_tokens.unwrap_or(4096),
            stop: self.stop_sequences,
            tools,
            tool_choice,
            constraint: self
                .output_config
                .and_then(|o| o.format)
                .map(|OutputFormat::JsonSchema { schema }| mlxbc_shared::Constraint::JsonSchema(schema.to_string())),
            ..GenerateRequest::ask("")
        };
        Ok((request, self.stream))
    }
}

/// Anthropic's `stop_reason` and `stop_sequence`.
fn stop(stats: &GenerationStats) -> (&'static str, Option<String>) {
    if !stats.tool_calls.is_empty() {
        return ("tool_use", None);
    }
    match stats.stop_reason {
        StopReason::Eos => ("end_turn", None),
        StopReason::StopString => ("stop_sequence", stats.stop_string.clone()),
        StopReason::MaxTokens | StopReason::ContextFull => ("max_tokens", None),
    }
}

fn tool_use(call: &ToolCall) -> Value {
    let input: Value = serde_json::from_str(&call.arguments).unwrap_or_else(|_| json!({}));
    json!({"type": "tool_use", "id": call.id, "name": call.name, "input": input})
}

fn message_id() -> String {
    format!("msg_{:024x}", rand::random::<u128>() >> 32)
}

/// The body of `POST /v1/messages`: a whole `message`, or its event stream.
pub async fn messages(State(state): State<Arc<AppState>>, body: axum::body::Bytes) -> Response {
    let parsed: MessagesRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return error(ErrorKind::BadRequest, format!("request body: {e}")),
    };
    if parsed.max_tokens.is_none() {
        return error(ErrorKind::BadRequest, "max_tokens: field required".into());
    }
    let (request, stream) = match parsed.into_generate() {
        Ok(r) => r,
        Err((kind, message)) => return error(kind, message),
    };
    let begun = match begin(&state, request).await {
        Ok(b) => b,
        Err((kind, message)) => return error(kind, message),
    };
    let (id, model, input_tokens) = (message_id(), begun.model.clone(), begun.prompt_tokens);
    if stream {
        return stream_events(begun, id);
    }
    match collect(begun).await {
        Ok((text, stats)) => {
            let mut content = Vec::new();
            if !text.is_empty() || stats.tool_calls.is_empty() {
                content.push(json!({"type": "text", "text": text}));
            }
            content.extend(stats.tool_calls.iter().map(tool_use));
            let (stop_reason, stop_sequence) = stop(&stats);
            Json(json!({"id": id, "type": "message", "role": "assistant", "model": model, "content": content,
                        "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                        "usage": {"input_tokens": input_tokens, "output_tokens": stats.generated_tokens}}))
            .into_response()
        }
        Err((kind, message)) => error(kind, message),
    }
}

/// The events of a streamed message, in Anthropic's order: `message_start`,
/// then per content block `content_block_start`, its deltas and
/// `content_block_stop` (the text block opens with the first text; each
/// tool call is a `tool_use` block with its input as one JSON delta), then
/// `message_delta` (stop reason, output tokens) and `message_stop`.
fn stream_events(begun: Begun, id: String) -> Response {
    let start = json!({"type": "message_start", "message": {
        "id": id, "type": "message", "role": "assistant", "model": begun.model, "content": [],
        "stop_reason": null, "stop_sequence": null,
        "usage": {"input_tokens": begun.prompt_tokens, "output_tokens": 0}}});
    let mut text_open = false;
    let first = vec![named_event(start), named_event(json!({"type": "ping"}))];
    event_stream(begun, first, move |event| match event {
        Wire::Token { text } => {
            let mut out = Vec::new();
            if !text_open {
                text_open = true;
                out.push(named_event(json!({"type": "content_block_start", "index": 0,
                                            "content_block": {"type": "text", "text": ""}})));
            }
            out.push(named_event(json!({"type": "content_block_delta", "index": 0,
                                        "delta": {"type": "text_delta", "text": text}})));
            (out, false)
        }
        Wire::Done { stats } => {
            let mut out = Vec::new();
            let mut index = 0;
            if text_open || stats.tool_calls.is_empty() {
                if !text_open {
                    out.push(named_event(json!({"type": "content_block_start", "index": 0,
                                                "content_block": {"type": "text", "text": ""}})));
                }
                out.push(named_event(json!({"type": "content_block_stop", "index": 0})));
                index = 1;
            }
            for call in &stats.tool_calls {
                let mut block = tool_use(call);
                let input = std::mem::replace(&mut block["input"], json!({}));
                out.push(named_event(json!({"type": "content_block_start", "index": index, "content_block": block})));
                out.push(named_event(json!({"type": "content_block_delta", "index": index,
                                            "delta": {"type": "input_json_delta", "partial_json": input.to_string()}})));
                out.push(named_event(json!({"type": "content_block_stop", "index": index})));
                index += 1;
            }
            let (stop_reason, stop_sequence) = stop(&stats);
            out.push(named_event(json!({"type": "message_delta",
                                        "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                        "usage": {"output_tokens": stats.generated_tokens}})));
            out.push(named_event(json!({"type": "message_stop"})));
            (out, true)
        }
        Wire::Error { kind, message } => {
            let name =
                if matches!(kind, ErrorKind::OutOfMemory | ErrorKind::Busy) { "overloaded_error" } else { "api_error" };
            (vec![named_event(json!({"type": "error", "error": {"type": name, "message": message}}))], true)
        }
        _ => (vec![], false),
    })
}

/// `POST /v1/messages/count_tokens`: the prompt's tokens as this model
/// reads it (template, tools and images included), nothing generated.
pub async fn count_tokens(State(state): State<Arc<AppState>>, body: axum::body::Bytes) -> Response {
    let parsed: MessagesRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return error(ErrorKind::BadRequest, format!("request body: {e}")),
    };
    let request = match parsed.into_generate() {
        Ok((r, _)) => r,
        Err((kind, message)) => return error(kind, message),
    };
    match count_prompt_tokens(&state, request).await {
        Ok((_, n)) => Json(json!({"input_tokens": n})).into_response(),
        Err((kind, message)) => error(kind, message),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn convert(body: Value) -> Result<GenerateRequest, (ErrorKind, String)> {
        serde_json::from_value::<MessagesRequest>(body).unwrap().into_generate().map(|(r, _)| r)
    }

    #[test]
    fn tool_turns_become_calls_and_tool_messages() {
        let r = convert(json!({"model": "m", "max_tokens": 9, "system": [{"type": "text", "text": "be brief"}],
            "messages": [
                {"role": "user", "content": "weather in Paris?"},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "x"},
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                    "content": [{"type": "text", "text": "18C"}]}]}],
            "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "any"}, "stop_sequences": ["END"]}))
        .unwrap();
        let roles: Vec<Role> = r.messages.iter().map(|m| m.role).collect();
        assert_eq!(roles, [Role::System, Role::User, Role::Assistant, Role::Tool]);
        assert_eq!(r.messages[2].content, "Let me look.");
        assert_eq!(r.messages[2].tool_calls[0].arguments, r#"{"city":"Paris"}"#);
        assert_eq!((r.messages[3].tool_call_id.as_deref(), r.messages[3].content.as_str()), (Some("toolu_1"), "18C"));
        assert_eq!((r.tool_choice, r.stop, r.max_tokens), (ToolChoice::Required, vec!["END".to_string()], 9));
    }

    #[test]
    fn url_images_server_tools_and_unknown_blocks_are_refused() {
        let url = json!({"max_tokens": 1, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://example.com/x.png"}}]}]});
        assert!(convert(url).unwrap_err().1.contains("does not fetch URLs"));
        let server = json!({"max_tokens": 1, "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "web_search_20250305", "name": "web_search"}]});
        assert!(convert(server).unwrap_err().1.contains("server tools"));
        let doc = json!({"max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "document"}]}]});
        assert!(convert(doc).unwrap_err().1.contains("unsupported type"));
        let role = json!({"max_tokens": 1, "messages": [{"role": "system", "content": "x"}]});
        assert!(convert(role).is_err());
    }
}
