//! Text prompts are rendered and tokenized here, on tokio's blocking pool,
//! before their job is queued, whenever the model they name is already
//! resident: the engine thread then only computes. (A 60 MB prompt used to
//! be tokenized on the engine thread, 28.7 s during which nobody got a token.)
//! Prompts with images (their placeholders expand by the features' sizes),
//! session turns (the engine owns the history) and models not yet loaded
//! are still tokenized by the engine.

use crate::engine::generate::{fits_by_bytes, fits_by_tokens};
use crate::engine::{EngineError, EngineHandle, PreparedPrompt};
use mlxbc_shared::GenerateRequest;

/// The prompt's ids if they could be made off the engine thread.
pub async fn prepare(engine: &EngineHandle, request: &GenerateRequest) -> Result<Option<PreparedPrompt>, EngineError> {
    let Some(route) = engine.prompt_route(request) else { return Ok(None) };
    fits_by_bytes(&route.model, route.context, request.messages.iter().map(|m| m.content.len()).sum())?;
    let (prompter, messages) = (route.prompter.clone(), request.messages.clone());
    let placeholder = route.placeholder.clone();
    let made = tokio::task::spawn_blocking(move || -> anyhow::Result<Option<Vec<u32>>> {
        let text = prompter.template.render(&messages)?;
        if placeholder.is_some_and(|p| text.contains(p.as_str())) {
            return Ok(None);
        }
        prompter.encode(&text).map(Some)
    })
    .await
    .map_err(|e| EngineError::Internal(format!("tokenizing the prompt: {e}")))?
    .map_err(|e| EngineError::BadRequest(format!("{e:#}")))?;
    let Some(ids) = made else { return Ok(None) };
    fits_by_tokens(&route.model, route.context, ids.len())?;
    Ok(Some(PreparedPrompt { model: route.model, prompter: route.prompter, ids }))
}
