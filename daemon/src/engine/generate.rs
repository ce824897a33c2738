//! One chat completion: template → tokens → chunked prefill → decode loop,
//! streaming text as it becomes whole characters.
//!
//! The prompt is processed the way mlx-lm's `generate_step` does it (all but
//! the last token in chunks, then the last token alone), so the computation,
//! and therefore the greedy token ids, are the reference's.

use super::sampling::Sampler;
use super::stop::{Filtered, StopFilter};
use crate::model::tokenizer::StreamDecoder;
use crate::model::transformer::KvCache;
use crate::model::TextModel;
use mlx_rs::transforms::{async_eval, eval};
use mlx_rs::Array;
use mlxbc_shared::{ErrorKind, GenerateRequest, GenerationStats, Response, StopReason};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;
use tokio::sync::mpsc::UnboundedSender;

/// Facts about the request that the engine knows and the model does not.
pub struct GenerationContext<'a> {
    pub model_name: &'a str,
    pub load_ms: f64,
    pub prefill_chunk: usize,
    pub received: Instant,
}

type Failure = (ErrorKind, String);

fn inference<E: std::fmt::Display>(e: E) -> Failure {
    (ErrorKind::Inference, format!("{e:#}"))
}

/// Runs the generation. `Ok(None)` means the client went away and the work
/// was abandoned; nothing more should be sent.
pub fn run(
    model: &TextModel,
    ctx: &GenerationContext,
    request: &GenerateRequest,
    events: &UnboundedSender<Response>,
    cancel: &AtomicBool,
) -> Result<Option<GenerationStats>, Failure> {
    if request.messages.is_empty() {
        return Err((ErrorKind::BadRequest, "the request has no messages".into()));
    }
    let prompt = model.template.render(&request.messages).map_err(|e| (ErrorKind::BadRequest, format!("{e:#}")))?;
    let ids = model.encode(&prompt).map_err(inference)?;
    let context = model.transformer.config.context_length as usize;
    if ids.is_empty() {
        return Err((ErrorKind::BadRequest, "the prompt is empty".into()));
    }
    if ids.len() >= context {
        return Err((
            ErrorKind::ContextOverflow,
            format!(
                "the prompt is {} tokens but model {} has a context of {context} tokens; shorten it",
                ids.len(),
                ctx.model_name
            ),
        ));
    }
    let gone = || cancel.load(Ordering::Relaxed) || events.is_closed();
    if events.send(Response::Started { model: ctx.model_name.to_string(), prompt_tokens: ids.len() as u32 }).is_err() {
        return Ok(None);
    }

    let t_prefill = Instant::now();
    let mut cache = KvCache::new(model.transformer.config.num_layers as usize);
    let (body, last) = ids.split_at(ids.len() - 1);
    for chunk in body.chunks(ctx.prefill_chunk) {
        model.transformer.hidden(chunk, &mut cache).map_err(inference)?;
        eval(cache.arrays()).map_err(inference)?;
        if gone() {
            return Ok(None);
        }
    }
    let mut sampler = Sampler::new(request.sampling.clone());
    // One decode step: ids (on the device) -> the next id, queued for
    // evaluation but not waited for. Building step n+1 while step n computes
    // keeps the host out of the way, as mlx-lm's generate_step does.
    let mut step = |ids: &Array, cache: &mut KvCache| -> Result<Array, Failure> {
        let h = model.transformer.hidden_of(ids, cache).map_err(inference)?;
        let logits = model.transformer.logits_last(&h).map_err(inference)?;
        let next = sampler.pick(&logits).map_err(inference)?;
        async_eval([&next]).map_err(inference)?;
        Ok(next)
    };
    let mut next = step(&Array::from_slice(last, &[1, 1]), &mut cache)?;
    let read = |ids: &Array| -> Result<u32, Failure> { Ok(ids.try_item_cast::<u32>().map_err(inference)?) };
    let mut token = read(&next)?;
    let t_first = Instant::now();
    let prefill_s = t_first.duration_since(t_prefill).as_secs_f64();

    let room = context - ids.len();
    let limit = (request.max_tokens as usize).min(room);
    let mut generated: Vec<u32> = Vec::new();
    let mut decoder = StreamDecoder::new();
    let mut stops = StopFilter::new(&request.stop);
    let mut decode_steps = 0usize;
    let stop_reason = loop {
        // Queue the step after `token` before handling it.
        let queued = if generated.len() + 1 < limit { Some(step(&next, &mut cache)?) } else { None };
        if !request.ignore_eos && model.eos_ids.contains(&token) {
            break StopReason::Eos;
        }
        generated.push(token);
        if let Some(piece) = decoder.push(&model.tokenizer, token).map_err(inference)? {
            let (text, stop) = match stops.push(&piece) {
                Filtered::Emit(t) => (t, false),
                Filtered::Stop(t) => (t, true),
            };
            if !text.is_empty() && events.send(Response::Token { text }).is_err() {
                return Ok(None);
            }
            if stop {
                break StopReason::StopString;
            }
        }
        if generated.len() >= limit {
            break if limit < request.max_tokens as usize { StopReason::ContextFull } else { StopReason::MaxTokens };
        }
        if gone() {
            return Ok(None);
        }
        next = queued.expect("queued while below the limit");
        token = read(&next)?;
        decode_steps += 1;
    };
    let tail = stops.finish();
    if stop_reason != StopReason::StopString && !tail.is_empty() && events.send(Response::Token { text: tail }).is_err() {
        return Ok(None);
    }
    let decode_s = t_first.elapsed().as_secs_f64();
    Ok(Some(GenerationStats {
        model: ctx.model_name.to_string(),
        prompt_tokens: ids.len() as u32,
        generated_tokens: generated.len() as u32,
        time_to_first_token_ms: t_first.duration_since(ctx.received).as_secs_f64() * 1000.0,
        load_ms: ctx.load_ms,
        prefill_tokens_per_s: ids.len() as f64 / prefill_s.max(1e-9),
        decode_tokens_per_s: if decode_steps > 0 { decode_steps as f64 / decode_s.max(1e-9) } else { 0.0 },
        stop_reason,
        token_ids: generated,
    }))
}
