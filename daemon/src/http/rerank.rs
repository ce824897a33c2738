//! Reranking over HTTP: `POST /v1/rerank` and `/rerank` (also
//! `/v1/reranking`, `/reranking`), the Jina and Cohere shape that
//! llama-server, mlx-vlm and Open WebUI's external reranker speak: `model`,
//! `query`, `documents` (strings, or objects with `text`; TEI's `texts` is
//! taken too), `top_n`, `return_documents`; answered with `results`, most
//! relevant first, each `index` and `relevance_score` (0 to 1), and
//! `usage`. `instruction` (an extension) tells a decoder reranker
//! (Qwen3-Reranker) what relevance means. Every pair's score goes through the engine's store first
//! (`engine::embed`): a query asked again over the same documents computes
//! nothing.

use super::error_response;
use crate::state::AppState;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use mlxbc_shared::{ErrorKind, RerankRequest, Reranking, Response as Wire};
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::Arc;

/// The longest a reranking may wait for the engine.
const RERANK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30 * 60);

/// A document: its text, or an object holding it (Cohere's and Jina's).
#[derive(Deserialize)]
#[serde(untagged)]
enum Document {
    Text(String),
    Object { text: String },
}

impl Document {
    fn into_text(self) -> String {
        match self {
            Document::Text(t) | Document::Object { text: t } => t,
        }
    }
}

#[derive(Deserialize)]
struct Body {
    /// The reranker; left out: the first the daemon has.
    #[serde(default)]
    model: Option<String>,
    query: String,
    #[serde(default, alias = "texts")]
    documents: Option<Vec<Document>>,
    #[serde(default)]
    top_n: Option<u32>,
    #[serde(default)]
    return_documents: bool,
    /// An extension: a decoder reranker's instruction.
    #[serde(default)]
    instruction: Option<String>,
}

/// `POST /v1/rerank` (and its other names).
pub async fn rerank(State(state): State<Arc<AppState>>, body: axum::body::Bytes) -> Response {
    let b: Body = match serde_json::from_slice(&body) {
        Ok(b) => b,
        Err(e) => return error_response(ErrorKind::BadRequest, format!("request body: {e}")),
    };
    let Some(documents) = b.documents else {
        return error_response(ErrorKind::BadRequest, "documents is required: the texts to rerank".into());
    };
    let documents: Vec<String> = documents.into_iter().map(Document::into_text).collect();
    let model = match b.model.filter(|m| !m.is_empty()) {
        Some(m) if crate::catalog::registry::is_plain_name(&m) => m,
        Some(m) => return error_response(ErrorKind::BadRequest, format!("model {m:?}: a name, not a path")),
        None => match state.registry.list().into_iter().find(|m| m.capability == "rerank") {
            Some(m) => m.name,
            None => {
                return error_response(
                    ErrorKind::UnknownModel,
                    "no reranker is installed: name one in `model` (`mlxbc models` lists them as rerank)".into(),
                )
            }
        },
    };
    let request = RerankRequest {
        model,
        query: b.query,
        documents,
        top_n: b.top_n,
        keep_alive: None,
        instruction: b.instruction,
    };
    let texts = b.return_documents.then(|| request.documents.clone());
    let r = match run(&state, request).await {
        Ok(r) => r,
        Err((kind, message)) => return error_response(kind, message),
    };
    let results: Vec<Value> = r
        .results
        .iter()
        .map(|x| {
            let mut v = json!({"index": x.index, "relevance_score": x.score});
            if let Some(texts) = &texts {
                v["document"] = json!({"text": texts[x.index as usize]});
            }
            v
        })
        .collect();
    Json(json!({
        "id": format!("rerank-{:x}", rand::random::<u64>()),
        "object": "list",
        "model": r.model,
        "results": results,
        "usage": {"prompt_tokens": r.prompt_tokens, "total_tokens": r.prompt_tokens},
    }))
    .into_response()
}

/// Runs `request` on the engine.
async fn run(state: &AppState, request: RerankRequest) -> Result<Reranking, (ErrorKind, String)> {
    let (reply, answer) = tokio::sync::oneshot::channel();
    let job = crate::engine::Job::Rerank { request, received: std::time::Instant::now(), reply };
    state.engine.submit(job).map_err(|e| match e.into_response() {
        Wire::Error { kind, message } => (kind, message),
        _ => (ErrorKind::Internal, "the engine refused the request".into()),
    })?;
    match tokio::time::timeout(RERANK_TIMEOUT, answer).await {
        Ok(Ok(Wire::Reranked(r))) => Ok(r),
        Ok(Ok(Wire::Error { kind, message })) => Err((kind, message)),
        Ok(_) => Err((ErrorKind::Internal, "the engine dropped the request".into())),
        Err(_) => Err((ErrorKind::Internal, "reranking took longer than 30 minutes".into())),
    }
}
