//! Everything about a generation that needs no MLX happens here, on tokio's
//! blocking pool, before its job is queued: a session's history is read;
//! the prompt is rendered and tokenized (text prompts for a resident
//! model); media is hashed, looked up in the feature store, decoded,
//! EXIF-rotated, resized and patchified. A request whose images the store
//! lacks and whose bytes were not sent is answered `NeedMedia` here,
//! without entering the engine's queue. The engine then only computes.
//! (A 60 MB prompt used to be tokenized on the engine thread, 28.7 s during
//! which nobody got a token; a 1024x1024 PNG's decoding and resizing cost
//! the engine about 17 ms per image.)
//!
//! Prompts with images are still tokenized by the engine: their
//! placeholders expand by the features' sizes, known once encoded.

use crate::engine::generate::{fits_by_bytes, fits_by_tokens};
use crate::engine::EngineHandle;
use crate::engine::{Job, PreparedPrompt, PromptRoute, SessionTurn};
use crate::error::EngineError;
use crate::media::{self, PreparedMedia, Resolved};
use crate::prompt_cache;
use crate::sessions::SessionStore;
use mlxbc_shared::{GenerateRequest, MediaRef, Response};
use std::sync::Arc;
use tokio::sync::oneshot;

/// A request made ready for the engine.
pub struct Ready {
    pub request: GenerateRequest,
    pub prepared: Option<PreparedPrompt>,
    pub media: Option<PreparedMedia>,
    pub turn: Option<SessionTurn>,
    /// Time a load this preparation asked for took (ms), for the stats.
    pub load_ms: f64,
}

/// What preparing a request came to.
pub enum Preparation {
    Ready(Box<Ready>),
    /// The store lacks these images and their bytes were not sent.
    NeedMedia(Vec<[u8; 32]>),
}

/// Media preparation running at once, at most: half the cores (at least
/// one), so decoding a burst of new images never takes every core from the
/// engine's running generations; the rest wait their turn here, not in the
/// engine's queue.
fn media_permits() -> &'static tokio::sync::Semaphore {
    static PERMITS: std::sync::OnceLock<tokio::sync::Semaphore> = std::sync::OnceLock::new();
    PERMITS.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        tokio::sync::Semaphore::new((cores / 2).max(1))
    })
}

/// Runs media preparation on the blocking pool under [`media_permits`].
async fn prepare_media_bounded<T: Send + 'static>(work: impl FnOnce() -> T + Send + 'static) -> Result<T, EngineError> {
    let _permit = media_permits().acquire().await.map_err(|e| EngineError::Internal(e.to_string()))?;
    tokio::task::spawn_blocking(work).await.map_err(joined)
}

fn joined(e: tokio::task::JoinError) -> EngineError {
    EngineError::Internal(format!("preparing the request: {e}"))
}

/// Prepares `request` as far as can be done off the engine thread.
pub async fn prepare(
    engine: &EngineHandle,
    sessions: &Arc<SessionStore>,
    mut request: GenerateRequest,
) -> Result<Preparation, EngineError> {
    let turn = begin_session(sessions, &mut request).await?;
    let has_media = request.messages.iter().any(|m| !m.media.is_empty());
    let mut load_ms = 0.0;
    let mut route = engine.route(&request.model);
    if has_media && route.is_none() {
        // Preparing media needs the model's preprocessing: load it first
        // (a failure is the engine's to report, with the generation).
        load_ms = load(engine, &request).await;
        route = engine.route(&request.model);
    }
    let ready = |request, prepared, media, turn| {
        Preparation::Ready(Box::new(Ready { request, prepared, media, turn, load_ms }))
    };
    let Some(route) = route else { return Ok(ready(request, None, None, turn)) };
    if has_media {
        let Some(media_route) = route.media.clone() else {
            // A text-only model: the engine refuses images with its own message.
            return Ok(ready(request, None, None, turn));
        };
        let store = engine.store.clone();
        let (request, outcome) = prepare_media_bounded(move || {
            let refs: Vec<&MediaRef> = request.messages.iter().flat_map(|m| &m.media).collect();
            let outcome = media::prepare(&media_route, store.as_ref(), &refs);
            (request, outcome)
        })
        .await?;
        return match outcome? {
            Resolved::Missing(missing) => Ok(Preparation::NeedMedia(missing)),
            Resolved::Ready(media) => Ok(ready(request, None, Some(media), turn)),
        };
    }
    let prepared = tokenize(engine, &route, &request).await?;
    Ok(ready(request, prepared, None, turn))
}

/// A named session: its history goes before this turn's messages.
async fn begin_session(
    sessions: &Arc<SessionStore>,
    request: &mut GenerateRequest,
) -> Result<Option<SessionTurn>, EngineError> {
    let Some(name) = request.session.clone() else { return Ok(None) };
    let sessions = Arc::clone(sessions);
    let begun = tokio::task::spawn_blocking(move || sessions.begin(&name).map(|t| (name, t))).await.map_err(joined)?;
    let (name, mut started) = begun?;
    let messages = std::mem::take(&mut request.messages);
    request.messages = std::mem::take(&mut started.history);
    request.messages.extend(messages.iter().cloned());
    Ok(Some(SessionTurn { name, messages, started }))
}

/// Loads the model `request` names; how long that took (ms).
pub async fn load(engine: &EngineHandle, request: &GenerateRequest) -> f64 {
    let (reply, answer) = oneshot::channel();
    let job = Job::Load {
        model: request.model.clone(),
        keep_alive: request.keep_alive,
        for_request: true,
        sharded: false,
        reply,
    };
    if engine.submit(job).is_err() {
        return 0.0;
    }
    match answer.await {
        Ok(Response::Loaded { load_ms, .. }) => load_ms as f64,
        _ => 0.0,
    }
}

/// The prompt's ids, when the text can be tokenized here, with the prompt
/// cache's blocks of them that are on disk (read here, not on the engine).
async fn tokenize(
    engine: &EngineHandle,
    route: &PromptRoute,
    request: &GenerateRequest,
) -> Result<Option<PreparedPrompt>, EngineError> {
    let raw_bytes = request.raw.as_ref().map_or(0, |r| r.prefix.len() + r.suffix.as_ref().map_or(0, String::len));
    fits_by_bytes(
        &route.model,
        route.context,
        request.messages.iter().map(|m| m.content.len()).sum::<usize>() + raw_bytes,
    )?;
    let (prompter, request_copy) = (route.prompter.clone(), request.clone());
    let placeholder = route.placeholder.clone();
    let (kv_root, context, recurrent) = (route.kv_root, route.context, route.recurrent);
    let (disk, in_ram) = (engine.prompt_disk.clone(), engine.prompt_shared.clone());
    type Made = Option<(Vec<u32>, prompt_cache::StoredBlocks)>;
    let made = tokio::task::spawn_blocking(move || -> anyhow::Result<Made> {
        let text = match &request_copy.raw {
            Some(raw) => crate::model::raw_prompt::text(&prompter.tokenizer, raw).map_err(anyhow::Error::msg)?,
            None => {
                let tools = crate::decoding::tools::for_prompt(&prompter.template, &request_copy)
                    .map_err(anyhow::Error::msg)?;
                prompter.template.render_with_tools(&request_copy.messages, tools)?
            }
        };
        if placeholder.is_some_and(|p| text.contains(p.as_str())) {
            // Placeholders typed without images: left to the engine, which refuses them.
            return Ok(None);
        }
        let ids = prompter.encode(&text)?;
        let stored = match (kv_root, &disk) {
            (Some(root), Some(disk)) if ids.len() < context => {
                let keys = prompt_cache::PromptKeys::of(&root, &ids, &[]).for_recurrent(recurrent);
                prompt_cache::read_stored(&keys, &in_ram, disk)
            }
            _ => Default::default(),
        };
        Ok(Some((ids, stored)))
    })
    .await
    .map_err(joined)?
    .map_err(|e| EngineError::BadRequest(format!("{e:#}")))?;
    let Some((ids, stored)) = made else { return Ok(None) };
    fits_by_tokens(&route.model, route.context, ids.len())?;
    Ok(Some(PreparedPrompt { model: route.model.clone(), prompter: route.prompter.clone(), ids, stored }))
}

/// A prefetch's media, prepared as a generation's is; `Err(response)` is
/// the answer when it must not reach the engine (`NeedMedia`).
pub async fn prefetch(
    engine: &EngineHandle,
    model: &Option<String>,
    media: Vec<MediaRef>,
) -> Result<(Vec<MediaRef>, Option<PreparedMedia>), Response> {
    let request = GenerateRequest { model: model.clone(), ..GenerateRequest::ask("") };
    let media_route = match engine.route(model) {
        Some(r) => r.media,
        None => {
            load(engine, &request).await;
            engine.route(model).and_then(|r| r.media)
        }
    };
    let Some(media_route) = media_route else { return Ok((media, None)) };
    let store = engine.store.clone();
    let prepared = prepare_media_bounded(move || {
        let outcome = media::prepare(&media_route, store.as_ref(), &media.iter().collect::<Vec<_>>());
        (media, outcome)
    })
    .await;
    match prepared {
        Err(e) => Err(e.into_response()),
        Ok((_, Ok(Resolved::Missing(missing)))) => Err(Response::NeedMedia { missing }),
        Ok((_, Err(e))) => Err(e.into_response()),
        Ok((media, Ok(Resolved::Ready(p)))) => Ok((media, Some(p))),
    }
}
