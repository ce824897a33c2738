//! The OpenAI chat-completions wire format: request bodies in, response
//! bodies and stream chunks out, and the conversion to our own request.

use base64::Engine as _;
use mlxbc_shared::{
    ChatMessage, Constraint, GenerateRequest, MediaRef, Role, SamplingParams, StopReason, Tool, ToolCall, ToolChoice,
};
use serde::Deserialize;
use serde_json::{json, Value};

/// `POST /v1/chat/completions` body (the fields we honour; others are ignored).
#[derive(Debug, Deserialize)]
pub struct ChatCompletionRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub messages: Vec<Message>,
    #[serde(default)]
    pub stream: bool,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub max_tokens: Option<u32>,
    pub max_completion_tokens: Option<u32>,
    pub stop: Option<Stop>,
    pub seed: Option<u64>,
    /// `json_object` or `json_schema`: the answer is constrained to it.
    pub response_format: Option<ResponseFormat>,
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub tools: Vec<ToolDef>,
    pub tool_choice: Option<ToolChoiceDef>,
    /// Refused above 1 (one answer per request; send n requests).
    pub n: Option<u32>,
    /// Each token's log-probability, with `top_logprobs` alternatives.
    #[serde(default)]
    pub logprobs: bool,
    pub top_logprobs: Option<u8>,
    /// An extension: the LoRA adapter to answer under (its name).
    pub adapter: Option<String>,
    /// Extensions (mlx-lm's names): the KV cache kept quantized.
    pub kv_bits: Option<u8>,
    pub kv_group_size: Option<u16>,
    pub quantized_kv_start: Option<u32>,
    pub kv_rotate: Option<bool>,
    pub kv_key_bits: Option<u8>,
}

/// `POST /v1/completions` body: a prompt, and with `suffix` the gap
/// between them (fill-in-the-middle, as Continue's autocomplete asks).
#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub prompt: Value,
    pub suffix: Option<String>,
    #[serde(default)]
    pub stream: bool,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub max_tokens: Option<u32>,
    pub stop: Option<Stop>,
    pub seed: Option<u64>,
    pub n: Option<u32>,
    #[serde(default)]
    pub echo: bool,
    pub logprobs: Option<u32>,
}

impl CompletionRequest {
    /// Our request for it.
    pub fn into_generate(self) -> Result<GenerateRequest, BadRequest> {
        refuse_unserved(self.n)?;
        let logprobs = self.logprobs.map(top_logprobs).transpose()?;
        if self.echo {
            return Err(BadRequest("echo is not served".into()));
        }
        let prompt = match self.prompt {
            Value::String(p) => p,
            Value::Array(a) if a.len() == 1 && a[0].is_string() => a[0].as_str().unwrap_or_default().to_string(),
            _ => return Err(BadRequest("prompt must be one string".into())),
        };
        Ok(GenerateRequest {
            model: self.model.filter(|m| !m.is_empty()),
            messages: Vec::new(),
            sampling: SamplingParams {
                temperature: self.temperature.unwrap_or(1.0),
                top_k: 0,
                top_p: self.top_p.unwrap_or(1.0),
                seed: self.seed,
            },
            // OpenAI's default for completions.
            max_tokens: self.max_tokens.unwrap_or(16),
            stop: stops(self.stop),
            raw: Some(mlxbc_shared::RawPrompt { prefix: prompt, suffix: self.suffix }),
            logprobs,
            ..GenerateRequest::ask("")
        })
    }
}

fn stops(stop: Option<Stop>) -> Vec<String> {
    match stop {
        None => vec![],
        Some(Stop::One(s)) => vec![s],
        Some(Stop::Many(v)) => v,
    }
}

/// What the gateway does not serve is refused with a sentence.
fn refuse_unserved(n: Option<u32>) -> Result<(), BadRequest> {
    if n.is_some_and(|n| n > 1) {
        return Err(BadRequest("n > 1 is not served: send n requests (they are batched)".into()));
    }
    Ok(())
}

/// How many alternatives a request asks for (OpenAI caps them at 20).
fn top_logprobs(k: u32) -> Result<u8, BadRequest> {
    u8::try_from(k).ok().filter(|&k| k <= mlxbc_shared::MAX_TOP_LOGPROBS).ok_or_else(|| {
        BadRequest(format!("logprobs: at most {} alternatives, not {k}", mlxbc_shared::MAX_TOP_LOGPROBS))
    })
}

fn token_json(t: &mlxbc_shared::TokenText, logprob: f32) -> Value {
    json!({"token": t.text, "logprob": logprob, "bytes": t.text.as_bytes()})
}

/// A chat choice's `logprobs`: `{"content": [{token, logprob, bytes, top_logprobs}]}`.
pub fn chat_logprobs(entries: &[mlxbc_shared::TokenLogprob]) -> Value {
    let content: Vec<Value> = entries
        .iter()
        .map(|e| {
            let mut v = token_json(&e.token, e.logprob);
            v["top_logprobs"] = e.top.iter().map(|(t, lp)| token_json(t, *lp)).collect();
            v
        })
        .collect();
    json!({"content": content, "refusal": null})
}

/// A text completion choice's `logprobs` (the legacy shape: parallel lists).
pub fn completion_logprobs(entries: &[mlxbc_shared::TokenLogprob]) -> Value {
    let mut offset = 0;
    let mut offsets = Vec::with_capacity(entries.len());
    for e in entries {
        offsets.push(offset);
        offset += e.token.text.len();
    }
    let tops: Vec<Value> = entries
        .iter()
        .map(|e| Value::Object(e.top.iter().map(|(t, lp)| (t.text.clone(), json!(lp))).collect()))
        .collect();
    json!({"tokens": entries.iter().map(|e| e.token.text.clone()).collect::<Vec<_>>(),
           "token_logprobs": entries.iter().map(|e| e.logprob).collect::<Vec<_>>(),
           "top_logprobs": tops, "text_offset": offsets})
}

/// One `text_completion` (or a stream chunk of one).
pub fn text_completion(
    id: &str,
    created: u64,
    model: &str,
    text: &str,
    finish: Option<&str>,
    stats: Option<&mlxbc_shared::GenerationStats>,
) -> Value {
    let mut v = json!({"id": id, "object": "text_completion", "created": created, "model": model,
                       "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": finish}]});
    if let Some(stats) = stats {
        v["usage"] = usage(stats);
    }
    v
}

#[derive(Debug, Deserialize)]
pub struct ToolDef {
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionDef,
}

#[derive(Debug, Deserialize)]
pub struct FunctionDef {
    pub name: String,
    #[serde(default)]
    pub description: String,
    pub parameters: Option<Value>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum ToolChoiceDef {
    Mode(String),
    Named { function: NamedFunction },
}

#[derive(Debug, Deserialize)]
pub struct NamedFunction {
    pub name: String,
}

#[derive(Debug, Deserialize)]
pub struct CallDef {
    pub id: String,
    pub function: CallFunction,
}

#[derive(Debug, Deserialize)]
pub struct CallFunction {
    pub name: String,
    /// A JSON object as text (OpenAI's form).
    pub arguments: String,
}

#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ResponseFormat {
    Text,
    JsonObject,
    JsonSchema { json_schema: JsonSchemaFormat },
}

#[derive(Debug, Deserialize)]
pub struct JsonSchemaFormat {
    #[allow(dead_code)]
    pub name: Option<String>,
    pub schema: Option<Value>,
}

#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

#[derive(Debug, Deserialize)]
pub struct Message {
    pub role: String,
    #[serde(default)]
    pub content: Option<Content>,
    #[serde(default)]
    pub tool_calls: Vec<CallDef>,
    pub tool_call_id: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Part {
    Text {
        text: String,
    },
    ImageUrl {
        image_url: ImageUrl,
    },
    /// vLLM's and SGLang's video part (`{"type": "video_url", "video_url": {"url": ...}}`).
    VideoUrl {
        video_url: ImageUrl,
    },
    /// OpenAI's audio part (`{"type": "input_audio", "input_audio": {"data": BASE64, "format": "wav"}}`),
    /// for a model that hears.
    InputAudio {
        input_audio: InputAudio,
    },
}

/// Its `format` (`wav`, `mp3`, ...) is not read: the bytes say what they are.
#[derive(Debug, Deserialize)]
pub struct InputAudio {
    /// The clip's bytes, base64.
    pub data: String,
}

#[derive(Debug, Deserialize)]
pub struct ImageUrl {
    pub url: String,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

/// Why a request body cannot be served (HTTP 400).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct BadRequest(pub String);

/// The image bytes of a `data:` URL. Other URLs are refused: the daemon
/// never fetches from the network on a client's behalf.
pub fn data_url_bytes(url: &str) -> Result<Vec<u8>, BadRequest> {
    let rest = url.strip_prefix("data:").ok_or_else(|| {
        BadRequest(
            "image_url and video_url must be data: URLs (data:image/png;base64,...); mlxbcd does not fetch URLs".into(),
        )
    })?;
    let (meta, payload) = rest.split_once(',').ok_or_else(|| BadRequest("malformed data: URL (no comma)".into()))?;
    if !meta.ends_with(";base64") {
        return Err(BadRequest("data: URL images must be base64-encoded".into()));
    }
    base64::engine::general_purpose::STANDARD
        .decode(payload.trim())
        .map_err(|e| BadRequest(format!("data: URL is not valid base64: {e}")))
}

/// An image by URL: a `data:` URL, or `mlxbc:sha256:HEX`, an image by its
/// hash alone (the web page sends those first; a 409 names the ones the
/// store lacks, which it then sends as data).
pub fn image_ref(url: &str) -> Result<MediaRef, BadRequest> {
    let Some(hex) = url.strip_prefix("mlxbc:sha256:") else { return Ok(MediaRef::from_bytes(data_url_bytes(url)?)) };
    let bytes: Vec<u8> = (0..hex.len())
        .step_by(2)
        .filter_map(|i| hex.get(i..i + 2).and_then(|b| u8::from_str_radix(b, 16).ok()))
        .collect();
    let sha256: [u8; 32] =
        bytes.try_into().map_err(|_| BadRequest(format!("{url:?}: mlxbc:sha256: takes 64 hex digits")))?;
    Ok(MediaRef::hash_only(sha256))
}

/// What the feature store and the prompt cache did for one answer (the
/// `mlxbc` field of a response's last chunk: the web page shows it).
pub fn cache_stats(stats: &mlxbc_shared::GenerationStats) -> Value {
    json!({"encoder_hits": stats.encoder_hits, "encoder_misses": stats.encoder_misses,
           "encode_ms": stats.encode_ms, "prompt_tokens": stats.prompt_tokens,
           "prefix_tokens_reused": stats.prefix_tokens_reused, "prompt_tokens_from_disk": stats.prompt_tokens_from_disk,
           "time_to_first_token_ms": stats.time_to_first_token_ms, "decode_tokens_per_s": stats.decode_tokens_per_s})
}

impl ChatCompletionRequest {
    /// Our request for it.
    pub fn into_generate(self) -> Result<GenerateRequest, BadRequest> {
        refuse_unserved(self.n)?;
        let logprobs = match (self.logprobs, self.top_logprobs) {
            (false, Some(_)) => return Err(BadRequest("top_logprobs needs logprobs: true".into())),
            (false, None) => None,
            (true, k) => Some(top_logprobs(u32::from(k.unwrap_or(0)))?),
        };
        let mut messages = Vec::with_capacity(self.messages.len());
        for m in self.messages {
            let role = match m.role.as_str() {
                "system" | "developer" => Role::System,
                "user" => Role::User,
                "assistant" => Role::Assistant,
                "tool" => Role::Tool,
                other => return Err(BadRequest(format!("unsupported message role {other:?}"))),
            };
            let mut msg = ChatMessage { role, ..ChatMessage::user("") };
            msg.tool_call_id = m.tool_call_id;
            msg.tool_calls = m
                .tool_calls
                .into_iter()
                .map(|c| ToolCall { id: c.id, name: c.function.name, arguments: c.function.arguments })
                .collect();
            match m.content {
                None => {}
                Some(Content::Text(t)) => msg.content = t,
                Some(Content::Parts(parts)) => {
                    for p in parts {
                        match p {
                            Part::Text { text } => {
                                if !msg.content.is_empty() {
                                    msg.content.push('\n');
                                }
                                msg.content.push_str(&text);
                            }
                            Part::ImageUrl { image_url } => msg.media.push(image_ref(&image_url.url)?),
                            Part::VideoUrl { video_url } => {
                                let media = image_ref(&video_url.url)?;
                                msg.media.push(MediaRef { kind: mlxbc_shared::MediaKind::Video, ..media })
                            }
                            Part::InputAudio { input_audio } => {
                                let bytes =
                                    base64::engine::general_purpose::STANDARD.decode(input_audio.data.trim()).map_err(
                                        |e| BadRequest(format!("input_audio data is not valid base64: {e}")),
                                    )?;
                                msg.media.push(MediaRef::audio(bytes))
                            }
                        }
                    }
                }
            }
            messages.push(msg);
        }
        if messages.is_empty() {
            return Err(BadRequest("messages must not be empty".into()));
        }
        let stop = stops(self.stop);
        Ok(GenerateRequest {
            model: self.model.filter(|m| !m.is_empty()),
            messages,
            sampling: SamplingParams {
                // OpenAI's default temperature is 1; say 0 for greedy.
                temperature: self.temperature.unwrap_or(1.0),
                top_k: 0,
                top_p: self.top_p.unwrap_or(1.0),
                seed: self.seed,
            },
            max_tokens: self.max_completion_tokens.or(self.max_tokens).unwrap_or(2048),
            stop,
            keep_alive: None,
            ignore_eos: false,
            session: None,
            tools: self
                .tools
                .into_iter()
                .map(|t| {
                    if t.kind != "function" {
                        return Err(BadRequest(format!(
                            "tools of type {:?} are not supported (only \"function\")",
                            t.kind
                        )));
                    }
                    let parameters =
                        t.function.parameters.unwrap_or_else(|| json!({"type": "object", "properties": {}}));
                    Ok(Tool {
                        name: t.function.name,
                        description: t.function.description,
                        parameters: parameters.to_string(),
                    })
                })
                .collect::<Result<_, _>>()?,
            tool_choice: match self.tool_choice {
                None => ToolChoice::Auto,
                Some(ToolChoiceDef::Mode(m)) => match m.as_str() {
                    "auto" => ToolChoice::Auto,
                    "none" => ToolChoice::None,
                    "required" => ToolChoice::Required,
                    other => {
                        return Err(BadRequest(format!("tool_choice {other:?}: auto, none, required or a function")))
                    }
                },
                Some(ToolChoiceDef::Named { function }) => ToolChoice::Function(function.name),
            },
            raw: None,
            logprobs,
            constraint: match self.response_format {
                None | Some(ResponseFormat::Text) => None,
                Some(ResponseFormat::JsonObject) => Some(Constraint::JsonObject),
                // A schema-less json_schema is any JSON object.
                Some(ResponseFormat::JsonSchema { json_schema }) => Some(match json_schema.schema {
                    Some(schema) => Constraint::JsonSchema(schema.to_string()),
                    None => Constraint::JsonObject,
                }),
            },
            speculate: Default::default(),
            draft: None,
            draft_max: None,
            adapter: self.adapter.clone(),
            kv: mlxbc_shared::KvCacheSpec {
                bits: self.kv_bits,
                group_size: self.kv_group_size,
                start: self.quantized_kv_start,
                rotate: self.kv_rotate,
                key_bits: self.kv_key_bits,
            },
        })
    }
}

/// OpenAI's `finish_reason` for ours.
pub fn finish_reason(r: StopReason) -> &'static str {
    match r {
        StopReason::MaxTokens | StopReason::ContextFull => "length",
        StopReason::Eos | StopReason::StopString => "stop",
    }
}

/// One `chat.completion.chunk`.
pub fn chunk(id: &str, created: u64, model: &str, delta: Value, finish: Option<&str>) -> Value {
    json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
           "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
}

/// The last chunk of a stream that asked `stream_options.include_usage`.
pub fn usage_chunk(id: &str, created: u64, model: &str, stats: &mlxbc_shared::GenerationStats) -> Value {
    json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [],
           "usage": usage(stats)})
}

/// A generation's `usage`: tokens, and speculation's drafts in OpenAI's
/// fields for predicted tokens (`completion_tokens_details`).
fn usage(stats: &mlxbc_shared::GenerationStats) -> Value {
    let (prompt, generated) = (stats.prompt_tokens, stats.generated_tokens);
    let mut v = json!({"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated});
    if stats.draft_tokens > 0 {
        v["completion_tokens_details"] = json!({
            "accepted_prediction_tokens": stats.accepted_draft_tokens,
            "rejected_prediction_tokens": stats.draft_tokens - stats.accepted_draft_tokens,
        });
    }
    v
}

/// Calls as OpenAI writes them (`index` for stream deltas).
pub fn tool_calls(calls: &[ToolCall], with_index: bool) -> Value {
    Value::Array(
        calls
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let mut v =
                    json!({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}});
                if with_index {
                    v["index"] = json!(i);
                }
                v
            })
            .collect(),
    )
}

/// A whole `chat.completion`.
pub fn completion(id: &str, created: u64, model: &str, text: &str, stats: &mlxbc_shared::GenerationStats) -> Value {
    let mut message = json!({"role": "assistant", "content": text});
    let mut finish = finish_reason(stats.stop_reason);
    if !stats.tool_calls.is_empty() {
        message["tool_calls"] = tool_calls(&stats.tool_calls, false);
        if text.trim().is_empty() {
            message["content"] = Value::Null;
        }
        finish = "tool_calls";
    }
    let logprobs = (!stats.logprobs.is_empty()).then(|| chat_logprobs(&stats.logprobs));
    json!({"id": id, "object": "chat.completion", "created": created, "model": model,
           "choices": [{"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}],
           "usage": usage(stats)})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drafts_are_reported_as_predicted_tokens_in_the_usage() {
        let mut stats = crate::engine::sequence::stats_without_decode("m", 5, 0.0, &Default::default());
        stats.generated_tokens = 30;
        let plain = completion("id", 0, "m", "text", &stats);
        assert!(plain["usage"].get("completion_tokens_details").is_none(), "{plain}");
        (stats.draft_tokens, stats.accepted_draft_tokens) = (24, 19);
        let v = completion("id", 0, "m", "text", &stats);
        assert_eq!(
            v["usage"]["completion_tokens_details"],
            json!({"accepted_prediction_tokens": 19, "rejected_prediction_tokens": 5})
        );
        assert_eq!(v["usage"]["completion_tokens"], 30);
        // A stream's usage chunk says the same.
        assert_eq!(usage_chunk("id", 0, "m", &stats)["usage"], v["usage"]);
    }

    #[test]
    fn parts_images_and_stop_convert() {
        let png = base64::engine::general_purpose::STANDARD.encode(b"\x89PNG....");
        let body = json!({"model": "m", "stop": "END", "max_tokens": 7, "temperature": 0,
            "messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "what?"},
                             {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{png}")}}]}]});
        let req: ChatCompletionRequest = serde_json::from_value(body).unwrap();
        let g = req.into_generate().unwrap();
        assert_eq!(g.messages.len(), 2);
        assert_eq!(g.messages[1].media[0].bytes.as_deref(), Some(&b"\x89PNG...."[..]));
        assert_eq!((g.stop, g.max_tokens, g.sampling.temperature), (vec!["END".to_string()], 7, 0.0));
        let by_hash = image_ref(&format!("mlxbc:sha256:{}", "ab".repeat(32))).unwrap();
        assert_eq!((by_hash.sha256, by_hash.bytes), ([0xab; 32], None));
        assert!(image_ref("mlxbc:sha256:abc").is_err());
    }

    #[test]
    fn a_video_url_part_is_a_video() {
        let clip = base64::engine::general_purpose::STANDARD.encode(b"....ftypisom");
        let body = json!({"model": "m", "messages": [{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": format!("data:video/mp4;base64,{clip}")}},
            {"type": "text", "text": "what happens?"}]}]});
        let req: ChatCompletionRequest = serde_json::from_value(body).unwrap();
        let g = req.into_generate().unwrap();
        assert_eq!(g.messages[0].media[0].kind, mlxbc_shared::MediaKind::Video);
        assert_eq!(g.messages[0].media[0].bytes.as_deref(), Some(&b"....ftypisom"[..]));
    }

    #[test]
    fn remote_urls_and_bad_roles_are_refused() {
        let remote = json!({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/x.png"}}]}]});
        let err = serde_json::from_value::<ChatCompletionRequest>(remote).unwrap().into_generate().unwrap_err();
        assert!(err.0.contains("does not fetch URLs"), "{err}");
        let role = json!({"messages": [{"role": "wizard", "content": "x"}]});
        assert!(serde_json::from_value::<ChatCompletionRequest>(role).unwrap().into_generate().is_err());
    }
}
