//! OpenAI's Responses API, the subset Codex and the `openai` SDK's
//! `responses.create` use: `POST /v1/responses` with `instructions`, `input`
//! (a string or items: messages with `input_text` / `output_text` /
//! `input_image` parts, `function_call` and `function_call_output`),
//! function `tools` and `tool_choice`, `text.format` (json_object,
//! json_schema), `max_output_tokens`; the answer whole or as its event
//! stream (`response.created` … `response.completed`).
//!
//! Nothing is stored: `previous_response_id` is refused with a sentence
//! (send the whole input, as Codex does with `store: false`); reasoning
//! items a client sends back are dropped.

use super::openai::{self, BadRequest};
use super::{begin, collect, event_stream, named_event, now_secs, Begun};
use crate::state::AppState;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use mlxbc_shared::{
    ChatMessage, Constraint, ErrorKind, GenerateRequest, GenerationStats, MediaRef, Response as Wire, Role,
    SamplingParams, StopReason, Tool, ToolCall, ToolChoice,
};
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::Arc;

/// `POST /v1/responses` (the fields we honour; others are ignored).
#[derive(Debug, Deserialize)]
pub struct ResponsesRequest {
    #[serde(default)]
    model: Option<String>,
    input: Value,
    instructions: Option<String>,
    #[serde(default)]
    stream: bool,
    temperature: Option<f32>,
    top_p: Option<f32>,
    max_output_tokens: Option<u32>,
    #[serde(default)]
    tools: Vec<ToolDef>,
    tool_choice: Option<Value>,
    text: Option<TextConfig>,
    previous_response_id: Option<String>,
}

#[derive(Debug, Deserialize)]
struct ToolDef {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    name: String,
    #[serde(default)]
    description: String,
    parameters: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct TextConfig {
    format: Option<TextFormat>,
}

/// `text.format`: as chat completions' `response_format`, with the schema
/// beside the type rather than under `json_schema`.
#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum TextFormat {
    Text,
    JsonObject,
    JsonSchema { schema: Option<Value> },
}

fn bad(message: impl Into<String>) -> BadRequest {
    BadRequest(message.into())
}

/// A message item's text and images (`input_text`, `output_text`,
/// `input_image` with a `data:` URL).
fn message_content(content: &Value, msg: &mut ChatMessage) -> Result<(), BadRequest> {
    let parts = match content {
        Value::String(s) => {
            return {
                msg.content.push_str(s);
                Ok(())
            }
        }
        Value::Array(parts) => parts,
        _ => return Err(bad("a message's content is a string or a list of parts")),
    };
    for p in parts {
        match p["type"].as_str().unwrap_or("") {
            "input_text" | "output_text" | "text" => {
                if !msg.content.is_empty() {
                    msg.content.push('\n');
                }
                msg.content.push_str(p["text"].as_str().unwrap_or(""));
            }
            "input_image" => {
                let url = p["image_url"]
                    .as_str()
                    .ok_or_else(|| bad("input_image needs an image_url (a data: URL); file ids are not served"))?;
                msg.media.push(MediaRef::from_bytes(openai::data_url_bytes(url)?));
            }
            "refusal" => {}
            other => return Err(bad(format!("content parts of type {other:?} are not served"))),
        }
    }
    Ok(())
}

/// The conversation `input` (and `instructions`) describe.
fn messages(instructions: Option<String>, input: Value) -> Result<Vec<ChatMessage>, BadRequest> {
    let mut messages = Vec::new();
    if let Some(i) = instructions.filter(|i| !i.is_empty()) {
        messages.push(ChatMessage::system(i));
    }
    let items = match input {
        Value::String(s) => return Ok([messages, vec![ChatMessage::user(s)]].concat()),
        Value::Array(items) => items,
        _ => return Err(bad("input is a string or a list of items")),
    };
    for item in items {
        // A message item may leave out its type (the SDK's "easy" form).
        match item["type"].as_str().unwrap_or("message") {
            "message" => {
                let role = match item["role"].as_str().unwrap_or("") {
                    "system" | "developer" => Role::System,
                    "user" => Role::User,
                    "assistant" => Role::Assistant,
                    other => return Err(bad(format!("message role {other:?} is not served"))),
                };
                let mut msg = ChatMessage { role, ..ChatMessage::user("") };
                message_content(&item["content"], &mut msg)?;
                messages.push(msg);
            }
            "function_call" => {
                let call = ToolCall {
                    id: item["call_id"].as_str().unwrap_or_default().to_string(),
                    name: item["name"].as_str().unwrap_or_default().to_string(),
                    arguments: item["arguments"].as_str().unwrap_or("{}").to_string(),
                };
                // Calls follow the assistant's text of the same turn.
                match messages.last_mut() {
                    Some(last) if last.role == Role::Assistant => last.tool_calls.push(call),
                    _ => messages.push(ChatMessage {
                        role: Role::Assistant,
                        tool_calls: vec![call],
                        ..ChatMessage::user("")
                    }),
                }
            }
            "function_call_output" => {
                let output = match &item["output"] {
                    Value::String(s) => s.clone(),
                    Value::Array(parts) => {
                        parts.iter().filter_map(|p| p["text"].as_str()).collect::<Vec<_>>().join("\n")
                    }
                    other => other.to_string(),
                };
                let mut result = ChatMessage { role: Role::Tool, content: output, ..ChatMessage::user("") };
                result.tool_call_id = item["call_id"].as_str().map(str::to_string);
                messages.push(result);
            }
            "reasoning" => {}
            other => return Err(bad(format!("input items of type {other:?} are not served"))),
        }
    }
    if !messages.iter().any(|m| m.role != Role::System) {
        return Err(bad("input must not be empty"));
    }
    Ok(messages)
}

impl ResponsesRequest {
    /// Our request for it.
    pub fn into_generate(self) -> Result<(GenerateRequest, bool), BadRequest> {
        if self.previous_response_id.is_some() {
            return Err(bad(
                "previous_response_id is not served: mlxbcd stores no responses; send the whole input (store: false)",
            ));
        }
        let tools = self
            .tools
            .into_iter()
            .map(|t| {
                if t.kind != "function" {
                    return Err(bad(format!("tools of type {:?} are not served (only \"function\")", t.kind)));
                }
                let parameters = t.parameters.unwrap_or_else(|| json!({"type": "object", "properties": {}}));
                Ok(Tool { name: t.name, description: t.description, parameters: parameters.to_string() })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let tool_choice = match self.tool_choice {
            None => ToolChoice::Auto,
            Some(Value::String(m)) => match m.as_str() {
                "auto" => ToolChoice::Auto,
                "none" => ToolChoice::None,
                "required" => ToolChoice::Required,
                other => return Err(bad(format!("tool_choice {other:?}: auto, none, required or a function"))),
            },
            Some(v) if v["type"] == "function" && v["name"].is_string() => {
                ToolChoice::Function(v["name"].as_str().unwrap_or_default().to_string())
            }
            Some(other) => return Err(bad(format!("tool_choice {other} is not served"))),
        };
        let constraint = match self.text.and_then(|t| t.format) {
            None | Some(TextFormat::Text) => None,
            Some(TextFormat::JsonObject) => Some(Constraint::JsonObject),
            Some(TextFormat::JsonSchema { schema: Some(schema) }) => Some(Constraint::JsonSchema(schema.to_string())),
            Some(TextFormat::JsonSchema { schema: None }) => Some(Constraint::JsonObject),
        };
        let request = GenerateRequest {
            model: self.model.filter(|m| !m.is_empty()),
            messages: messages(self.instructions, self.input)?,
            sampling: SamplingParams {
                temperature: self.temperature.unwrap_or(1.0),
                top_k: 0,
                top_p: self.top_p.unwrap_or(1.0),
                seed: None,
            },
            max_tokens: self.max_output_tokens.unwrap_or(4096),
            tools,
            tool_choice,
            constraint,
            ..GenerateRequest::ask("")
        };
        Ok((request, self.stream))
    }
}

/// The ids one response's items go by.
struct Ids {
    response: String,
    message: String,
    created: u64,
    model: String,
}

fn message_item(ids: &Ids, text: &str, status: &str) -> Value {
    json!({"type": "message", "id": ids.message, "status": status, "role": "assistant",
           "content": [{"type": "output_text", "text": text, "annotations": []}]})
}

fn call_item(call: &ToolCall, status: &str) -> Value {
    json!({"type": "function_call", "id": format!("fc_{}", call.id), "call_id": call.id, "name": call.name,
           "arguments": call.arguments, "status": status})
}

/// The `response` object: `output` as given, status from the stats (none yet: in progress).
fn response(ids: &Ids, output: Vec<Value>, stats: Option<&GenerationStats>) -> Value {
    let mut v = json!({"id": ids.response, "object": "response", "created_at": ids.created, "model": ids.model,
                       "status": "in_progress", "output": output, "parallel_tool_calls": true,
                       "tool_choice": "auto", "tools": [], "error": null, "incomplete_details": null});
    if let Some(stats) = stats {
        let cut = matches!(stats.stop_reason, StopReason::MaxTokens | StopReason::ContextFull);
        v["status"] = json!(if cut && stats.tool_calls.is_empty() { "incomplete" } else { "completed" });
        if cut && stats.tool_calls.is_empty() {
            v["incomplete_details"] = json!({"reason": "max_output_tokens"});
        }
        let (input, output) = (stats.prompt_tokens, stats.generated_tokens);
        v["usage"] = json!({"input_tokens": input, "output_tokens": output, "total_tokens": input + output,
                            "input_tokens_details": {"cached_tokens": stats.prefix_tokens_reused},
                            "output_tokens_details": {"reasoning_tokens": 0}});
    }
    v
}

/// The output items of a finished answer: its text (when any), then its calls.
fn output(ids: &Ids, text: &str, stats: &GenerationStats) -> Vec<Value> {
    let mut out = Vec::new();
    if !text.is_empty() || stats.tool_calls.is_empty() {
        out.push(message_item(ids, text, "completed"));
    }
    out.extend(stats.tool_calls.iter().map(|c| call_item(c, "completed")));
    out
}

/// `POST /v1/responses`.
pub async fn responses(State(state): State<Arc<AppState>>, body: axum::body::Bytes) -> Response {
    let parsed: ResponsesRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return super::error_response(ErrorKind::BadRequest, format!("request body: {e}")),
    };
    let (request, stream) = match parsed.into_generate() {
        Ok(r) => r,
        Err(e) => return super::error_response(ErrorKind::BadRequest, e.0),
    };
    let begun = match begin(&state, request).await {
        Ok(b) => b,
        Err((kind, message)) => return super::error_response(kind, message),
    };
    let ids = Ids {
        response: format!("resp_{:x}", rand::random::<u64>()),
        message: format!("msg_{:x}", rand::random::<u64>()),
        created: now_secs(),
        model: begun.model.clone(),
    };
    if stream {
        return stream_events(begun, ids);
    }
    match collect(begun).await {
        Ok((text, stats)) => Json(response(&ids, output(&ids, &text, &stats), Some(&stats))).into_response(),
        Err((kind, message)) => super::error_response(kind, message),
    }
}

/// A streamed response's events, each with its `sequence_number`:
/// `response.created`, `response.in_progress`; the message item (added,
/// its `output_text` part added, text deltas, done) once text comes; each
/// call as a `function_call` item with its arguments as one delta; then
/// `response.completed` (or `response.incomplete`) with the whole response.
fn stream_events(begun: Begun, ids: Ids) -> Response {
    let mut seq = 0u64;
    let mut event = move |mut v: Value| {
        v["sequence_number"] = json!(seq);
        seq += 1;
        named_event(v)
    };
    let first = vec![
        event(json!({"type": "response.created", "response": response(&ids, vec![], None)})),
        event(json!({"type": "response.in_progress", "response": response(&ids, vec![], None)})),
    ];
    let mut text: Option<String> = None;
    event_stream(begun, first, move |wire| match wire {
        Wire::Token { text: piece } => {
            let mut out = Vec::new();
            if text.is_none() {
                text = Some(String::new());
                let mut item = message_item(&ids, "", "in_progress");
                item["content"] = json!([]);
                out.push(event(json!({"type": "response.output_item.added", "output_index": 0, "item": item})));
                out.push(event(json!({"type": "response.content_part.added", "item_id": ids.message,
                    "output_index": 0, "content_index": 0,
                    "part": {"type": "output_text", "text": "", "annotations": []}})));
            }
            if let Some(t) = &mut text {
                t.push_str(&piece);
            }
            out.push(event(json!({"type": "response.output_text.delta", "item_id": ids.message, "output_index": 0,
                                  "content_index": 0, "delta": piece, "logprobs": []})));
            (out, false)
        }
        Wire::Done { stats } => {
            let mut out = Vec::new();
            let mut index = 0;
            if let Some(t) = &text {
                out.push(event(json!({"type": "response.output_text.done", "item_id": ids.message, "output_index": 0,
                                      "content_index": 0, "text": t, "logprobs": []})));
                out.push(event(json!({"type": "response.content_part.done", "item_id": ids.message,
                    "output_index": 0, "content_index": 0,
                    "part": {"type": "output_text", "text": t, "annotations": []}})));
                out.push(event(json!({"type": "response.output_item.done", "output_index": 0,
                                      "item": message_item(&ids, t, "completed")})));
                index = 1;
            }
            for call in &stats.tool_calls {
                let mut item = call_item(call, "in_progress");
                item["arguments"] = json!("");
                let item_id = item["id"].clone();
                out.push(event(json!({"type": "response.output_item.added", "output_index": index, "item": item})));
                out.push(event(json!({"type": "response.function_call_arguments.delta", "item_id": item_id,
                                      "output_index": index, "delta": call.arguments})));
                out.push(event(json!({"type": "response.function_call_arguments.done", "item_id": item_id,
                                      "output_index": index, "arguments": call.arguments})));
                out.push(event(json!({"type": "response.output_item.done", "output_index": index,
                                      "item": call_item(call, "completed")})));
                index += 1;
            }
            let whole = response(&ids, output(&ids, text.as_deref().unwrap_or(""), &stats), Some(&stats));
            let kind = if whole["status"] == "incomplete" { "response.incomplete" } else { "response.completed" };
            out.push(event(json!({"type": kind, "response": whole})));
            (out, true)
        }
        Wire::Error { message, .. } => {
            let mut failed = response(&ids, vec![], None);
            failed["status"] = json!("failed");
            failed["error"] = json!({"code": "server_error", "message": message});
            (vec![event(json!({"type": "response.failed", "response": failed}))], true)
        }
        _ => (vec![], false),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn convert(body: Value) -> Result<GenerateRequest, BadRequest> {
        serde_json::from_value::<ResponsesRequest>(body).unwrap().into_generate().map(|(r, _)| r)
    }

    #[test]
    fn codex_style_input_becomes_a_conversation() {
        let r = convert(json!({"model": "m", "instructions": "You are a coding agent.", "stream": true,
            "input": [
                {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "be terse"}]},
                {"role": "user", "content": "list files"},
                {"type": "reasoning", "summary": []},
                {"type": "function_call", "call_id": "call_1", "name": "shell", "arguments": "{\"cmd\":[\"ls\"]}"},
                {"type": "function_call_output", "call_id": "call_1", "output": "a.rs\nb.rs"}],
            "tools": [{"type": "function", "name": "shell", "parameters": {"type": "object"}}],
            "tool_choice": "auto", "max_output_tokens": 50,
            "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}}))
        .unwrap();
        let roles: Vec<Role> = r.messages.iter().map(|m| m.role).collect();
        assert_eq!(roles, [Role::System, Role::System, Role::User, Role::Assistant, Role::Tool]);
        assert_eq!(r.messages[3].tool_calls[0].name, "shell");
        assert_eq!(
            (r.messages[4].tool_call_id.as_deref(), r.messages[4].content.as_str()),
            (Some("call_1"), "a.rs\nb.rs")
        );
        assert_eq!((r.tools.len(), r.max_tokens), (1, 50));
        assert!(matches!(r.constraint, Some(Constraint::JsonSchema(_))));
    }

    #[test]
    fn stored_state_other_tools_and_urls_are_refused() {
        let prev = json!({"input": "hi", "previous_response_id": "resp_1"});
        assert!(convert(prev).unwrap_err().0.contains("stores no responses"));
        let web = json!({"input": "hi", "tools": [{"type": "web_search"}]});
        assert!(convert(web).unwrap_err().0.contains("only \"function\""));
        let url = json!({"input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": "https://example.com/a.png"}]}]});
        assert!(convert(url).unwrap_err().0.contains("does not fetch URLs"));
    }
}
