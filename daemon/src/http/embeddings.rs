//! Embeddings over HTTP: OpenAI's `POST /v1/embeddings` (a string or a list
//! of them, or token ids of the model's tokenizer; `encoding_format` float or base64, which the `openai` SDK asks
//! for by default; `dimensions`; an input longer than the model takes is
//! an error, as OpenAI answers it) and ollama's `POST /api/embed` (`input`,
//! `truncate`, default true) and older `POST /api/embeddings` (`prompt`,
//! one vector). Every text goes through the engine's store first
//! (`engine::embed`): a re-index of unchanged chunks computes nothing.

use super::{error_response, ollama};
use crate::state::AppState;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine as _;
use mlxbc_shared::{EmbedRequest, Embeddings, ErrorKind, KeepAlive, Response as Wire};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::sync::Arc;

/// The longest an embedding request may wait for the engine.
const EMBED_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30 * 60);

/// Runs `request` on the engine.
async fn embed(state: &AppState, request: EmbedRequest) -> Result<Embeddings, (ErrorKind, String)> {
    if !crate::catalog::registry::is_plain_name(&request.model) {
        return Err((ErrorKind::BadRequest, format!("model {:?}: a name, not a path", request.model)));
    }
    let (reply, answer) = tokio::sync::oneshot::channel();
    let job = crate::engine::Job::Embed { request, received: std::time::Instant::now(), reply };
    state.engine.submit(job).map_err(|e| match e.into_response() {
        Wire::Error { kind, message } => (kind, message),
        _ => (ErrorKind::Internal, "the engine refused the request".into()),
    })?;
    match tokio::time::timeout(EMBED_TIMEOUT, answer).await {
        Ok(Ok(Wire::Embedded(e))) => Ok(e),
        Ok(Ok(Wire::Error { kind, message })) => Err((kind, message)),
        Ok(_) => Err((ErrorKind::Internal, "the engine dropped the request".into())),
        Err(_) => Err((ErrorKind::Internal, "embedding took longer than 30 minutes".into())),
    }
}

/// One text or several.
#[derive(Deserialize)]
#[serde(untagged)]
enum Input {
    One(String),
    Many(Vec<String>),
    /// Token ids of the model's tokenizer: one input, or a list of them.
    Ids(Vec<u32>),
    IdLists(Vec<Vec<u32>>),
}

impl Input {
    /// The texts, and the token-id inputs (one of the two is empty).
    fn split(self) -> (Vec<String>, Vec<Vec<u32>>) {
        match self {
            Input::One(t) => (vec![t], Vec::new()),
            Input::Many(t) => (t, Vec::new()),
            Input::Ids(ids) => (Vec::new(), vec![ids]),
            Input::IdLists(ids) => (Vec::new(), ids),
        }
    }
}

#[derive(Deserialize)]
struct OpenAiBody {
    model: String,
    input: Input,
    #[serde(default)]
    encoding_format: Option<String>,
    #[serde(default)]
    dimensions: Option<u32>,
    #[serde(default)]
    #[expect(dead_code, reason = "OpenAI's end-user id: accepted, not used")]
    user: Option<String>,
    /// An extension (Cohere's and Voyage's name): `query` or `document`,
    /// or any prompt the model's directory names.
    #[serde(default)]
    input_type: Option<String>,
}

/// `POST /v1/embeddings`.
pub async fn openai(State(state): State<Arc<AppState>>, body: axum::body::Bytes) -> Response {
    let b: OpenAiBody = match serde_json::from_slice(&body) {
        Ok(b) => b,
        Err(e) => return error_response(ErrorKind::BadRequest, format!("request body: {e}")),
    };
    let base64 = match b.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return error_response(ErrorKind::BadRequest, format!("encoding_format {other:?}: float or base64"))
        }
    };
    let (inputs, token_inputs) = b.input.split();
    let request = EmbedRequest {
        model: b.model,
        inputs,
        token_inputs,
        truncate: false,
        dimensions: b.dimensions,
        keep_alive: None,
        prompt: b.input_type,
    };
    let e = match embed(&state, request).await {
        Ok(e) => e,
        Err((kind, message)) => return error_response(kind, message),
    };
    let data: Vec<OpenAiEmbedding> = e
        .vectors
        .iter()
        .enumerate()
        .map(|(index, v)| {
            let embedding = if base64 {
                let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                Vector::Base64(base64::engine::general_purpose::STANDARD.encode(bytes))
            } else {
                Vector::Floats(v)
            };
            OpenAiEmbedding { object: "embedding", index, embedding }
        })
        .collect();
    Json(OpenAiEmbeddings {
        object: "list",
        data,
        model: &e.model,
        usage: Usage { prompt_tokens: e.prompt_tokens, total_tokens: e.prompt_tokens },
    })
    .into_response()
}

// The answers are serialized from these types, not through `json!`: a
// `serde_json::Value` holds an f32 as an f64, written with 17 digits
// (0.10000000149011612 for 0.1), twice the text a client parses for the
// same vector as f32's shortest form.

/// A vector as floats, or as base64 of its little-endian f32 bytes.
#[derive(Serialize)]
#[serde(untagged)]
enum Vector<'a> {
    Floats(&'a [f32]),
    Base64(String),
}

#[derive(Serialize)]
struct OpenAiEmbedding<'a> {
    object: &'static str,
    index: usize,
    embedding: Vector<'a>,
}

#[derive(Serialize)]
struct Usage {
    prompt_tokens: u64,
    total_tokens: u64,
}

/// `POST /v1/embeddings`' answer.
#[derive(Serialize)]
struct OpenAiEmbeddings<'a> {
    object: &'static str,
    data: Vec<OpenAiEmbedding<'a>>,
    model: &'a str,
    usage: Usage,
}

/// `POST /api/embed`'s answer.
#[derive(Serialize)]
struct OllamaEmbeddings<'a> {
    model: &'a str,
    embeddings: &'a [Vec<f32>],
    total_duration: u64,
    load_duration: u64,
    prompt_eval_count: u64,
}

/// `POST /api/embeddings`' answer (one vector).
#[derive(Serialize)]
struct OllamaLegacyEmbedding<'a> {
    embedding: &'a [f32],
}

#[derive(Deserialize)]
struct OllamaBody {
    model: String,
    #[serde(default)]
    input: Option<Input>,
    /// `/api/embeddings`' one text.
    #[serde(default)]
    prompt: Option<String>,
    #[serde(default)]
    truncate: Option<bool>,
    #[serde(default)]
    dimensions: Option<u32>,
    #[serde(default)]
    keep_alive: Option<Value>,
    /// As for `/v1/embeddings`: the model's prompt to put before each input.
    #[serde(default)]
    input_type: Option<String>,
}

fn ollama_request(b: OllamaBody, legacy: bool) -> Result<EmbedRequest, String> {
    let (inputs, token_inputs) = match (legacy, b.input, b.prompt) {
        (true, _, Some(p)) => (vec![p], Vec::new()),
        (true, _, None) => return Err("prompt is required".into()),
        (false, Some(i), _) => i.split(),
        (false, None, _) => return Err("input is required".into()),
    };
    let keep_alive: Option<KeepAlive> = ollama::keep_alive(b.keep_alive)?;
    Ok(EmbedRequest {
        model: b.model,
        inputs,
        token_inputs,
        truncate: b.truncate.unwrap_or(true),
        dimensions: b.dimensions,
        keep_alive,
        prompt: b.input_type,
    })
}

/// `POST /api/embed`.
pub async fn ollama_embed(State(state): State<Arc<AppState>>, body: axum::body::Bytes) -> Response {
    ollama_answer(&state, &body, false).await
}

/// `POST /api/embeddings` (ollama's older endpoint: one `prompt`, one `embedding`).
pub async fn ollama_embeddings(State(state): State<Arc<AppState>>, body: axum::body::Bytes) -> Response {
    ollama_answer(&state, &body, true).await
}

async fn ollama_answer(state: &AppState, body: &[u8], legacy: bool) -> Response {
    let started = std::time::Instant::now();
    let request = match serde_json::from_slice(body)
        .map_err(|e| format!("request body: {e}"))
        .and_then(|b| ollama_request(b, legacy))
    {
        Ok(r) => r,
        Err(e) => return ollama::error(ErrorKind::BadRequest, e),
    };
    let e = match embed(state, request).await {
        Ok(e) => e,
        Err((kind, message)) => return ollama::error(kind, message),
    };
    if legacy {
        return Json(OllamaLegacyEmbedding { embedding: e.vectors.first().map_or(&[], Vec::as_slice) }).into_response();
    }
    Json(OllamaEmbeddings {
        model: &e.model,
        embeddings: &e.vectors,
        total_duration: started.elapsed().as_nanos() as u64,
        load_duration: (e.load_ms * 1e6) as u64,
        prompt_eval_count: e.prompt_tokens,
    })
    .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Vectors are written as f32's shortest form (what a client parses),
    /// not as the 17 digits of an f64 that `json!` would write.
    #[test]
    fn vectors_are_written_in_f32_shortest_form() {
        let vectors = vec![vec![0.1f32, -0.033_417_6]];
        let ollama = OllamaEmbeddings {
            model: "m",
            embeddings: &vectors,
            total_duration: 0,
            load_duration: 0,
            prompt_eval_count: 2,
        };
        let text = serde_json::to_string(&ollama).unwrap();
        assert!(text.contains(r#""embeddings":[[0.1,-0.0334176]]"#), "{text}");
        let openai = OpenAiEmbedding { object: "embedding", index: 0, embedding: Vector::Floats(&vectors[0]) };
        assert_eq!(
            serde_json::to_string(&openai).unwrap(),
            r#"{"object":"embedding","index":0,"embedding":[0.1,-0.0334176]}"#
        );
        let legacy = serde_json::to_string(&OllamaLegacyEmbedding { embedding: &vectors[0] }).unwrap();
        assert_eq!(legacy, r#"{"embedding":[0.1,-0.0334176]}"#);
    }
}
