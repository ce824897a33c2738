//! One chat completion: template → tokens → chunked prefill → decode loop,
//! streaming text as it becomes whole characters.
//!
//! The prompt is processed the way mlx-lm's `generate_step` does it (all but
//! the last token in chunks, then the last token alone), so the computation,
//! and therefore the greedy token ids, are the reference's.

use super::error::EngineError;
use super::media::{self, MediaStats, PreparedMedia, Resolved, SharedStore};
use super::prefix::PrefixCache;
use super::sampling::Sampler;
use super::stop::{Filtered, StopFilter};
use crate::model::decode_step::DecodeMode;
use crate::model::family::MediaAttention;
use crate::model::kv_cache::KvCache;
use crate::model::Model;
use mlx_rs::transforms::{async_eval, eval};
use mlx_rs::Array;
use mlxbc_shared::MediaRef;
use mlxbc_shared::{GenerateRequest, GenerationStats, Response, StopReason};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;
use tokio::sync::mpsc::UnboundedSender;

/// Facts about the request that the engine knows and the model does not,
/// and the engine's caches the generation may use.
pub struct GenerationContext<'a> {
    pub model_name: &'a str,
    pub load_ms: f64,
    pub prefill_chunk: usize,
    /// How decode steps are built on this device (options and measurements).
    pub decode: DecodeMode,
    pub received: Instant,
    pub store: Option<&'a SharedStore>,
    pub prefixes: &'a mut PrefixCache,
    /// The settings' ceiling on `max_tokens`, if any (the context always bounds it).
    pub max_tokens_limit: Option<u32>,
    /// The prompt's ids, if they were made before the job reached the engine.
    pub prepared: Option<super::PreparedPrompt>,
    /// The media, if it was prepared before the job reached the engine.
    pub media: Option<PreparedMedia>,
}

/// No tokenizer here averages more than this many bytes of text per token,
/// so a prompt with more bytes than this times the context cannot fit, and
/// is refused before the tokenizer spends time on it.
pub const MAX_BYTES_PER_TOKEN: usize = 32;

/// Refuses, before anything is tokenized, a prompt of more text than
/// `model`'s context could hold at [`MAX_BYTES_PER_TOKEN`].
pub fn fits_by_bytes(model: &str, context: usize, bytes: usize) -> Result<(), EngineError> {
    if bytes > context.saturating_mul(MAX_BYTES_PER_TOKEN) {
        return Err(EngineError::ContextOverflow(format!(
            "the prompt is {bytes} bytes, more than model {model} can hold in its context of {context} tokens; shorten it"
        )));
    }
    Ok(())
}

/// Refuses a tokenized prompt that leaves no room in `model`'s context.
pub fn fits_by_tokens(model: &str, context: usize, tokens: usize) -> Result<(), EngineError> {
    if tokens >= context {
        return Err(EngineError::ContextOverflow(format!(
            "the prompt is {tokens} tokens but model {model} has a context of {context} tokens; shorten it"
        )));
    }
    Ok(())
}

/// Where a prefill chunk starting at `from` may end: at most `to`, and
/// never inside an image whose positions must see each other (`blocks`,
/// present only for such models, names each position's image or -1).
fn chunk_end(blocks: Option<&[i32]>, from: usize, to: usize, chunk: usize) -> usize {
    let mut end = (from + chunk).min(to);
    if let Some(b) = blocks {
        while end < to && end > 0 && b[end] >= 0 && b[end] == b[end - 1] {
            end += 1;
        }
    }
    end
}

/// Positions `from..to` of `[1, L, hidden]` embeddings.
fn positions(embeds: &Array, from: usize, to: usize) -> Result<Array, Failure> {
    let idx: Vec<i32> = (from as i32..to as i32).collect();
    embeds.take_axis(Array::from_slice(&idx, &[idx.len() as i32]), 1).map_err(inference)
}

type Failure = EngineError;

fn inference<E: std::fmt::Display>(e: E) -> Failure {
    EngineError::Inference(format!("{e:#}"))
}

/// How a generation ended, when it did not fail.
pub enum Finished {
    /// Answered; `Done` is to be sent with these statistics.
    Done(GenerationStats),
    /// The client went away; nothing more is sent.
    Abandoned,
    /// `NeedMedia` was sent: the client will resend with the bytes.
    AskedForMedia,
}

/// The prompt's ids, made here on the engine thread: the template rendered,
/// placeholders checked against the media, the media's features taken from
/// what was prepared (or looked up and prepared here when nothing was) and
/// encoded, placeholders expanded, the text tokenized. `None`: `NeedMedia`
/// was sent.
fn prompt_here(
    model: &Model,
    ctx: &mut GenerationContext,
    request: &GenerateRequest,
    media: &[&MediaRef],
    events: &UnboundedSender<Response>,
) -> Result<Option<(Vec<u32>, Vec<Array>, MediaStats)>, Failure> {
    let mut prompt =
        model.prompter.template.render(&request.messages).map_err(|e| EngineError::BadRequest(format!("{e:#}")))?;
    if let Some(v) = &model.vision {
        let placeholders = prompt.matches(v.placeholder.as_str()).count();
        if placeholders != media.len() {
            return Err(EngineError::BadMedia(format!(
                "the prompt has {placeholders} image placeholders but {} images were sent",
                media.len()
            )));
        }
    }
    // Placeholders are checked before any media is decoded or stored.
    let (features, media_stats) = if media.is_empty() {
        (Vec::new(), MediaStats::default())
    } else {
        let resolved = match ctx.media.take() {
            Some(prepared) => media::finish(model, ctx.model_name, ctx.store, prepared, media)?,
            None => media::resolve(model, ctx.model_name, ctx.store, media)?,
        };
        match resolved {
            Resolved::Ready(made) => made,
            Resolved::Missing(missing) => {
                let _ = events.send(Response::NeedMedia { missing });
                return Ok(None);
            }
        }
    };
    if let Some(v) = &model.vision {
        // Each placeholder becomes as many image tokens as its image has feature rows.
        let rows: Vec<usize> =
            features.iter().map(|f| f.shape()[..f.shape().len() - 1].iter().product::<i32>() as usize).collect();
        prompt = v
            .expand(&prompt, &rows)
            .ok_or_else(|| EngineError::BadMedia("the prompt's image placeholders do not match its images".into()))?;
    }
    Ok(Some((model.encode(&prompt).map_err(inference)?, features, media_stats)))
}

/// Runs the generation, streaming events into `events`.
pub fn run(
    model: &Model,
    ctx: &mut GenerationContext,
    request: &GenerateRequest,
    events: &UnboundedSender<Response>,
    cancel: &AtomicBool,
) -> Result<Finished, Failure> {
    if request.messages.is_empty() {
        return Err(EngineError::BadRequest("the request has no messages".into()));
    }
    let media: Vec<&MediaRef> = request.messages.iter().flat_map(|m| &m.images).collect();
    if !media.is_empty() && model.vision.is_none() {
        return Err(EngineError::BadMedia(format!(
            "model {} is text-only and cannot take images; use a vision-language model",
            ctx.model_name
        )));
    }
    let context = model.lm.context_length() as usize;
    fits_by_bytes(ctx.model_name, context, request.messages.iter().map(|m| m.content.len()).sum())?;
    // A text prompt may have been rendered and tokenized before the job
    // reached the engine (off this thread); it is used when it was made by
    // this very model's prompter.
    let prepared = ctx.prepared.take().filter(|p| media.is_empty() && p.is_for(ctx.model_name, &model.prompter));
    let (ids, features, media_stats) = match prepared {
        Some(p) => (p.ids, Vec::new(), MediaStats::default()),
        None => match prompt_here(model, ctx, request, &media, events)? {
            Some(made) => made,
            None => return Ok(Finished::AskedForMedia),
        },
    };
    if ids.is_empty() {
        return Err(EngineError::BadRequest("the prompt is empty".into()));
    }
    fits_by_tokens(ctx.model_name, context, ids.len())?;
    let gone = || cancel.load(Ordering::Relaxed) || events.is_closed();
    if events.send(Response::Started { model: ctx.model_name.to_string(), prompt_tokens: ids.len() as u32 }).is_err() {
        return Ok(Finished::Abandoned);
    }
    if request.max_tokens == 0 {
        // Asked for nothing: the prompt was checked, nothing is computed.
        return Ok(Finished::Done(GenerationStats {
            model: ctx.model_name.to_string(),
            prompt_tokens: ids.len() as u32,
            generated_tokens: 0,
            time_to_first_token_ms: 0.0,
            load_ms: ctx.load_ms,
            prefill_tokens_per_s: 0.0,
            decode_tokens_per_s: 0.0,
            stop_reason: StopReason::MaxTokens,
            token_ids: vec![],
            encoder_hits: media_stats.hits,
            encoder_misses: media_stats.misses,
            encode_ms: media_stats.encode_ms,
            lookup_ms: media_stats.lookup_ms,
            preprocess_ms: media_stats.preprocess_ms,
            prefix_tokens_reused: 0,
            prefill_ms: 0.0,
            warnings: vec![],
        }));
    }

    let t_prefill = Instant::now();
    // Features exist only for a vision model (media::resolve refuses the others).
    let embeds = match &model.vision {
        Some(v) if !features.is_empty() => v.tower.splice(&*model.lm, &ids, &features),
        _ => model.lm.embed(&Array::from_slice(&ids, &[1, ids.len() as i32])),
    }
    .map_err(|e| EngineError::BadMedia(format!("{e:#}")))?;
    let n = ids.len();
    // The prefix that ends after the last image has an identity; its KV state
    // is kept so the next question about the same images skips it.
    let prefix = model
        .vision
        .as_ref()
        .and_then(|v| ids.iter().rposition(|&t| t == v.image_token_id))
        .map(|p| p + 1)
        .filter(|&p| p < n);
    let identity = prefix.map(|p| PrefixCache::identity(ctx.model_name, &ids[..p], &media));
    let mut reused = 0;
    let mut cache = match identity.as_ref().and_then(|id| ctx.prefixes.get(id)) {
        Some(c) => {
            reused = prefix.unwrap();
            c
        }
        None => KvCache::new(model.lm.num_layers()),
    };
    if let Some(v) = &model.vision {
        cache.mrope = v.tower.rope_positions(&ids, &features);
    }
    // Which image each position belongs to, for a model whose image
    // positions see each other during prefill.
    let blocks = match (&model.vision, model.lm.media_attention()) {
        (Some(v), MediaAttention::BidirectionalWithinImage) => Some(v.image_blocks(&ids)),
        _ => None,
    };
    // `sync_last`: wait for the last chunk too. The prompt's final chunk is
    // queued, not waited for: the host builds the last position's step while
    // the device computes the chunk.
    let prefill = |from: usize, to: usize, cache: &mut KvCache, sync_last: bool| -> Result<bool, Failure> {
        let mut at = from;
        while at < to {
            let end = chunk_end(blocks.as_deref(), at, to, ctx.prefill_chunk);
            model.lm.forward(&positions(&embeds, at, end)?, cache, blocks.as_deref()).map_err(inference)?;
            if end < to || sync_last {
                eval(cache.arrays()).map_err(inference)?;
            } else {
                async_eval(cache.arrays()).map_err(inference)?;
            }
            if gone() {
                return Ok(false);
            }
            at = end;
        }
        Ok(true)
    };
    if let (Some(p), Some(id), 0) = (prefix, identity, reused) {
        if !prefill(0, p, &mut cache, true)? {
            return Ok(Finished::Abandoned);
        }
        ctx.prefixes.put(id, &cache);
    }
    if !prefill(prefix.unwrap_or(0).max(reused), n - 1, &mut cache, false)? {
        return Ok(Finished::Abandoned);
    }
    let last_embed = positions(&embeds, n - 1, n)?;
    let mut sampler = Sampler::new(request.sampling.clone()).map_err(inference)?;
    let h = model.lm.forward(&last_embed, &mut cache, None).map_err(inference)?;
    let mut next = sampler.pick(&model.lm.logits(&h).map_err(inference)?).map_err(inference)?;
    async_eval([&next]).map_err(inference)?;
    let mode = model.decode_mode(ctx.decode);
    // Host time per token: building and queueing a step, and waiting for a
    // token to come back; which one dominates says what bounds decode.
    // Queueing is building the graph (MLX operations called) plus dispatching
    // it (MLX's per-operation work in evaluation).
    let (mut queue_s, mut build_s, mut wait_s) = (0.0f64, 0.0f64, 0.0f64);
    // One decode step: ids (on the device) -> the next id, queued for
    // evaluation but not waited for.
    let mut step = |ids: &Array, cache: &mut KvCache| -> Result<Array, Failure> {
        let t = Instant::now();
        let logits = model.decode_logits(ids, cache, mode).map_err(inference)?;
        let next = sampler.pick(&logits).map_err(inference)?;
        build_s += t.elapsed().as_secs_f64();
        async_eval([&next]).map_err(inference)?;
        queue_s += t.elapsed().as_secs_f64();
        Ok(next)
    };
    let read = |ids: &Array| -> Result<u32, Failure> { Ok(ids.try_item_cast::<u32>().map_err(inference)?) };
    let mut token = read(&next)?;
    let t_first = Instant::now();
    let prefill_s = t_first.duration_since(t_prefill).as_secs_f64();

    let room = context - ids.len();
    let asked = request.max_tokens.min(ctx.max_tokens_limit.unwrap_or(u32::MAX)) as usize;
    let limit = asked.min(room);
    let mut generated: Vec<u32> = Vec::new();
    // tokenizers' own stream: it holds back bytes that are not yet a whole
    // UTF-8 character (daemon/tests/stream_decoder.rs checks it on every
    // family's tokenizer).
    let mut decoder = model.prompter.tokenizer.decode_stream(true);
    let mut stops = StopFilter::new(&request.stop);
    let mut decode_steps = 0usize;
    // The step computing the token after `next`, when already queued.
    let mut queued: Option<Array> = None;
    let stop_reason = loop {
        // `token` (the value of `next`) is handled first, so the first token
        // reaches the client before any decode step is built.
        if !request.ignore_eos && model.eos_ids.contains(&token) {
            break StopReason::Eos;
        }
        generated.push(token);
        if let Some(piece) = decoder.step(token).map_err(inference)? {
            let (text, stop) = match stops.push(&piece) {
                Filtered::Emit(t) => (t, false),
                Filtered::Stop(t) => (t, true),
            };
            if !text.is_empty() && events.send(Response::Token { text }).is_err() {
                return Ok(Finished::Abandoned);
            }
            if stop {
                break StopReason::StopString;
            }
        }
        if generated.len() >= limit {
            break if limit < asked { StopReason::ContextFull } else { StopReason::MaxTokens };
        }
        if gone() {
            return Ok(Finished::Abandoned);
        }
        let current = match queued.take() {
            Some(q) => q,
            None => step(&next, &mut cache)?,
        };
        // Queue the step after `current` before waiting for it: the host
        // builds step n+1 while the device computes step n, as mlx-lm's
        // generate_step does, so the device never waits for the host.
        if generated.len() + 1 < limit {
            queued = Some(step(&current, &mut cache)?);
        }
        let t = Instant::now();
        token = read(&current)?;
        wait_s += t.elapsed().as_secs_f64();
        next = current;
        decode_steps += 1;
    };
    let tail = stops.finish();
    if stop_reason != StopReason::StopString && !tail.is_empty() && events.send(Response::Token { text: tail }).is_err()
    {
        return Ok(Finished::Abandoned);
    }
    let decode_s = t_first.elapsed().as_secs_f64();
    drop(step);
    if decode_steps > 0 {
        let per = |s: f64| s * 1e6 / decode_steps as f64;
        tracing::info!(
            "decode ({mode:?}): {decode_steps} steps, {:.0} µs/token: queueing {:.0} (building {:.0}), waiting {:.0}, the rest {:.0}",
            per(decode_s),
            per(queue_s),
            per(build_s),
            per(wait_s),
            per(decode_s - queue_s - wait_s)
        );
    }
    Ok(Finished::Done(GenerationStats {
        model: ctx.model_name.to_string(),
        prompt_tokens: ids.len() as u32,
        generated_tokens: generated.len() as u32,
        time_to_first_token_ms: t_first.duration_since(ctx.received).as_secs_f64() * 1000.0,
        load_ms: ctx.load_ms,
        prefill_tokens_per_s: (ids.len() - reused) as f64 / prefill_s.max(1e-9),
        decode_tokens_per_s: if decode_steps > 0 { decode_steps as f64 / decode_s.max(1e-9) } else { 0.0 },
        stop_reason,
        token_ids: generated,
        encoder_hits: media_stats.hits,
        encoder_misses: media_stats.misses,
        encode_ms: media_stats.encode_ms,
        lookup_ms: media_stats.lookup_ms,
        preprocess_ms: media_stats.preprocess_ms,
        prefix_tokens_reused: reused as u32,
        prefill_ms: t_first.duration_since(t_prefill).as_secs_f64() * 1000.0,
        warnings: vec![],
    }))
}
