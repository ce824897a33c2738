//! One chat completion's setup: template → tokens (unless prepared off the
//! engine thread), media features, embeddings, the prompt cache. What comes
//! out is a [`super::sequence::Sequence`] for the scheduler, which runs its
//! chunked prefill and batches its decode steps with the others'.

use super::sequence::{stats_without_decode, Sequence, Setup};
use crate::decoding::sampling::Sampler;
use crate::decoding::stop::StopFilter;
use crate::error::EngineError;
use crate::media::{self, Encoded, MediaStats, PreparedMedia, Resolved, SharedStore};
use crate::model::decode_step::DecodeMode;
use crate::model::family::MediaAttention;
use crate::model::kv_cache::{KvCache, KvQuantization};
use crate::model::options::Speculate;
use crate::model::Model;
use crate::prompt_cache::{self, PromptCache, PromptKeys};
use mlx_rs::Array;
use mlxbc_shared::{GenerateRequest, GenerationStats, Response};
use mlxbc_shared::{MediaKind, MediaRef};
use std::rc::Rc;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
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
    pub prompts: &'a mut PromptCache,
    /// The settings' ceiling on `max_tokens`, if any (the context always bounds it).
    pub max_tokens_limit: Option<u32>,
    /// The prompt's ids, if they were made before the job reached the engine.
    pub prepared: Option<super::PreparedPrompt>,
    /// The media, if it was prepared before the job reached the engine.
    pub media: Option<PreparedMedia>,
    /// The draft model loaded beside the model for this request, if any.
    pub draft: Option<Rc<Model>>,
    /// The model's KV cache setting (config.toml), which the request's
    /// own fields override.
    pub kv_default: mlxbc_shared::KvCacheSpec,
    /// The LoRA adapter the request answers under, loaded on the model.
    pub adapter: Option<Rc<crate::model::lora::LoraAdapter>>,
}

/// The bits MLX's `quantize` packs a KV cache's keys or values to.
const KV_BITS: [u8; 6] = [2, 3, 4, 5, 6, 8];

/// The quantization a request's KV cache is kept in (its fields, else the
/// model's), or why it cannot be: bits MLX does not quantize to, a group
/// that does not divide the model's head size, a family whose attention
/// reads only full precision.
pub fn kv_quantization(
    model: &Model,
    name: &str,
    asked: mlxbc_shared::KvCacheSpec,
    default: mlxbc_shared::KvCacheSpec,
) -> Result<Option<KvQuantization>, EngineError> {
    let bits = asked.bits.or(default.bits);
    let Some(bits) = bits.filter(|&b| b != 0 && b != 16) else { return Ok(None) };
    if !KV_BITS.contains(&bits) {
        return Err(EngineError::BadRequest(format!(
            "kv_bits {bits}: the KV cache quantizes to 8, 6, 5, 4, 3 or 2 bits (16: full precision)"
        )));
    }
    let group_size = asked.group_size.or(default.group_size).unwrap_or(64);
    if ![32, 64, 128].contains(&group_size) {
        return Err(EngineError::BadRequest(format!("kv_group_size {group_size}: 32, 64 or 128")));
    }
    if model.lm.recurrent() {
        return Err(EngineError::BadRequest(format!(
            "{name} keeps a recurrent state in its Gated DeltaNet layers, which stays in full precision, and its \
             attention layers do not read a quantized KV cache yet; leave kv_bits out"
        )));
    }
    if !model.lm.reads_quantized_kv() {
        return Err(EngineError::BadRequest(format!(
            "{name} ({}) does not read a quantized KV cache yet; leave kv_bits out",
            model.lm.architecture()
        )));
    }
    if let Some(&(_, dims)) = model.kv_shapes.iter().find(|&&(_, d)| d % i32::from(group_size) != 0) {
        return Err(EngineError::BadRequest(format!(
            "kv_group_size {group_size} does not divide {name}'s head size of {dims}; use 32"
        )));
    }
    let start = asked.start.or(default.start).unwrap_or(0).min(i32::MAX as u32) as i32;
    // Rotated by default: measured on Qwen2.5-Coder-0.5B's keys (outlier
    // channels) 8 bits cost +8.7% perplexity as mlx-lm quantizes, +0.5%
    // rotated (docs/measurements/cpu-2026-12-05-kv-lora.md).
    let rotate = asked.rotate.or(default.rotate).unwrap_or(true);
    let key_bits = match asked.key_bits.or(default.key_bits).filter(|&b| b != 0 && b != 16) {
        None => bits,
        Some(k) if KV_BITS.contains(&k) => k,
        Some(k) => {
            return Err(EngineError::BadRequest(format!(
                "kv_key_bits {k}: the KV cache quantizes keys to 8, 6, 5, 4, 3 or 2 bits"
            )))
        }
    };
    Ok(Some(KvQuantization {
        bits: i32::from(bits),
        key_bits: i32::from(key_bits),
        group_size: i32::from(group_size),
        start,
        rotate,
    }))
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

type Failure = EngineError;

/// How a generation ended, when it did not fail.
#[expect(
    clippy::large_enum_variant,
    reason = "one value per request or load, moved a few times and matched at once; boxing the large variant buys nothing"
)]
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
) -> Result<Option<(Vec<u32>, Encoded)>, Failure> {
    let template = &model.prompter.template;
    let mut prompt = match &request.raw {
        Some(raw) => crate::model::raw_prompt::text(&model.prompter.tokenizer, raw).map_err(EngineError::BadRequest)?,
        None => {
            let tools = crate::decoding::tools::for_prompt(template, request).map_err(EngineError::BadRequest)?;
            template
                .render_with_tools(&request.messages, tools)
                .map_err(|e| EngineError::BadRequest(format!("{e:#}")))?
        }
    };
    if let Some(v) = &model.media_tower {
        let placeholders = prompt.matches(v.placeholder.as_str()).count();
        let video_placeholders = v.video.as_ref().map_or(0, |p| prompt.matches(p.text.as_str()).count());
        let audio_placeholders = v.audio.as_ref().map_or(0, |p| prompt.matches(p.text.as_str()).count());
        let videos = media.iter().filter(|m| m.kind == MediaKind::Video).count();
        let clips = media.iter().filter(|m| m.kind == MediaKind::Audio).count();
        if videos > 0 && v.video.is_none() {
            return Err(EngineError::BadMedia(format!(
                "model {} takes images but not video; use a video-language model (Qwen3-VL, Gemma 4)",
                ctx.model_name
            )));
        }
        if clips > 0 && v.audio.is_none() {
            return Err(EngineError::BadMedia(format!(
                "model {} has no audio tower and cannot hear audio; use one that does (Gemma 4 E2B/E4B), \
                 or `mlxbc transcribe` with a speech model",
                ctx.model_name
            )));
        }
        if placeholders != media.len() - videos - clips {
            return Err(EngineError::BadMedia(format!(
                "the prompt has {placeholders} image placeholders but {} images were sent",
                media.len() - videos - clips
            )));
        }
        if video_placeholders != videos {
            return Err(EngineError::BadMedia(format!(
                "the prompt has {video_placeholders} video placeholders but {videos} videos were sent"
            )));
        }
        if audio_placeholders != clips {
            return Err(EngineError::BadMedia(format!(
                "the prompt has {audio_placeholders} audio placeholders but {clips} clips were sent"
            )));
        }
    }
    // Placeholders are checked before any media is decoded or stored.
    let encoded = if media.is_empty() {
        Encoded { features: Vec::new(), layout: Vec::new(), spans: Vec::new(), stats: MediaStats::default() }
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
    if let Some(v) = &model.media_tower {
        // Each placeholder becomes as many media tokens as its features have rows.
        let rows: Vec<usize> = encoded
            .features
            .iter()
            .map(|f| f.shape()[..f.shape().len() - 1].iter().product::<i32>() as usize)
            .collect();
        prompt = v.expand_media(&prompt, &encoded.layout, &rows).map_err(EngineError::BadMedia)?;
    }
    Ok(Some((model.encode(&prompt).map_err(EngineError::inference)?, encoded)))
}

/// What setting a request up came to.
#[expect(
    clippy::large_enum_variant,
    reason = "one value per request or load, moved a few times and matched at once; boxing the large variant buys nothing"
)]
pub enum Begun {
    /// A sequence to prefill and decode.
    Sequence(Box<Sequence>),
    /// Nothing to compute (no tokens asked, media asked for, client gone).
    Finished(Finished),
}

/// Sets up the generation of `request` on `model`: its events go to
/// `events` (`Started` is sent here).
pub fn begin(
    model: Rc<Model>,
    ctx: &mut GenerationContext,
    request: &GenerateRequest,
    events: UnboundedSender<Response>,
    cancel: Arc<AtomicBool>,
) -> Result<Begun, Failure> {
    let events = &events;
    if request.messages.is_empty() && request.raw.is_none() {
        return Err(EngineError::BadRequest("the request has no messages".into()));
    }
    let media: Vec<&MediaRef> = request.messages.iter().flat_map(|m| &m.media).collect();
    if !media.is_empty() && model.media_tower.is_none() {
        return Err(EngineError::BadMedia(format!(
            "model {} is text-only and cannot take images, video or audio; use a vision-language model",
            ctx.model_name
        )));
    }
    let context = model.lm.context_length() as usize;
    fits_by_bytes(ctx.model_name, context, request.messages.iter().map(|m| m.content.len()).sum())?;
    // A text prompt may have been rendered and tokenized before the job
    // reached the engine (off this thread); it is used when it was made by
    // this very model's prompter.
    let prepared = ctx.prepared.take().filter(|p| media.is_empty() && p.is_for(ctx.model_name, &model.prompter));
    let (ids, features, span_hashes, media_stats, stored) = match prepared {
        Some(p) => (p.ids, Vec::new(), Vec::new(), MediaStats::default(), Some(p.stored)),
        None => match prompt_here(&model, ctx, request, &media, events)? {
            Some((ids, e)) => (ids, e.features, e.spans, e.stats, None),
            None => return Ok(Begun::Finished(Finished::AskedForMedia)),
        },
    };
    if ids.is_empty() {
        return Err(EngineError::BadRequest("the prompt is empty".into()));
    }
    fits_by_tokens(ctx.model_name, context, ids.len())?;
    if events.send(Response::Started { model: ctx.model_name.to_string(), prompt_tokens: ids.len() as u32 }).is_err() {
        return Ok(Begun::Finished(Finished::Abandoned));
    }
    if request.max_tokens == 0 {
        // Asked for nothing: the prompt was checked, nothing is computed.
        let stats = stats_without_decode(ctx.model_name, ids.len(), ctx.load_ms, &media_stats);
        return Ok(Begun::Finished(Finished::Done(stats)));
    }

    // Features exist only for a vision model (media::resolve refuses the
    // others); a splice that fails blames the media, a plain lookup does not.
    let embeds = match &model.media_tower {
        Some(v) if !features.is_empty() => {
            v.tower.splice(&*model.lm, &ids, &features).map_err(|e| match EngineError::inference(e) {
                stopped @ EngineError::RankStopped(_) => stopped,
                other => EngineError::BadMedia(other.to_string()),
            })
        }
        _ => model.lm.embed(&Array::from_slice(&ids, &[1, ids.len() as i32])).map_err(EngineError::inference),
    }?;
    // The longest cached prefix (RAM, or disk blocks read while the prompt
    // was tokenized), computed only for a model whose KV identity is known.
    let spans = match &model.media_tower {
        Some(v) => prompt_cache::media_spans(&ids, &v.media_tokens(), &span_hashes),
        None => Vec::new(),
    };
    let kv = kv_quantization(&model, ctx.model_name, request.kv, ctx.kv_default)?;
    let adapter = ctx.adapter.take();
    // Under an adapter, prefixes are its own (its fingerprint in the root);
    // a quantized cache's are stored quantized, under a root of their own.
    let root = model.kv_root.map(|root| match &adapter {
        Some(a) => prompt_cache::adapted_root(&root, &a.fingerprint),
        None => root,
    });
    let root = root.map(|root| match &kv {
        Some(q) => prompt_cache::quantized_root(&root, q),
        None => root,
    });
    // A split model's ranks restore prefixes without knowing a request's
    // quantization, so a quantized cache of a split model is not cached.
    let split = model.lm.split_description().is_some();
    let keys = root
        .filter(|_| kv.is_none() || !split)
        .map(|root| PromptKeys::of(&root, &ids, &spans).for_recurrent(model.lm.recurrent()));
    // The blocks read while the prompt was tokenized are the full-precision
    // root's: a quantized cache reads its own here.
    let stored = if kv.is_some() { None } else { stored };
    let reuse = keys.as_ref().and_then(|k| {
        let stored = stored.unwrap_or_else(|| ctx.prompts.read_stored_here(k));
        ctx.prompts.lookup(
            k,
            stored,
            &model.kv_shapes,
            model.kv_block_bytes_per_position,
            &model.state_layout,
            kv.map(|q| (q, model.kv_dtype)),
        )
    });
    // A split model's other ranks restore the same prefix from their own
    // stores, or it is computed.
    let reuse = match (reuse, &keys) {
        (Some(mut r), Some(k)) => match model.lm.adopt_prefix(&mut r.cache, &|| k.to_bytes()) {
            Ok(true) => Some(r),
            Ok(false) => None,
            Err(e) => return Err(EngineError::inference(e)),
        },
        _ => None,
    };
    let (mut cache, reused, from_disk, disk_cost) = match reuse {
        Some(r) => (r.cache, r.ram_tokens + r.disk_tokens, r.disk_tokens, r.disk_cost),
        None => (KvCache::new(model.lm.num_layers()), 0, 0, None),
    };
    cache.quantization = kv;
    cache.adapters = adapter.iter().map(|a| Some(a.clone())).collect();
    let (mrope, deepstack) = match &model.media_tower {
        Some(v) => (
            v.tower.rope_positions(&ids, &features),
            v.tower.deepstack(&ids, &features).map_err(|e| EngineError::BadMedia(format!("{e:#}")))?,
        ),
        None => (None, None),
    };
    // Which image each position belongs to, for a model whose image
    // positions see each other during prefill.
    let blocks = match (&model.media_tower, model.lm.media_attention()) {
        (Some(v), MediaAttention::BidirectionalWithinImage) => Some(v.image_blocks(&ids)),
        _ => None,
    };
    let room = context - ids.len();
    let asked = request.max_tokens.min(ctx.max_tokens_limit.unwrap_or(u32::MAX)) as usize;
    let (speculate, draft) = speculates(&model, request.speculate, ctx.draft.take())?;
    let calls_tools = !crate::decoding::tools::for_prompt(&model.prompter.template, request)
        .map_err(EngineError::BadRequest)?
        .is_empty();
    let setup = Setup {
        model: model.clone(),
        name: ctx.model_name.to_string(),
        ids,
        embeds,
        cache,
        kv,
        blocks,
        mrope,
        deepstack,
        start: reused,
        keys,
        reused,
        from_disk,
        disk_cost,
        sampler: Sampler::new(request.sampling.clone()).map_err(EngineError::inference)?,
        constraint: constraint_of(&model, request)?,
        tool_filter: calls_tools
            .then(|| crate::decoding::tools::ToolCallFilter::new(&model.prompter.tokenizer, &request.tools)),
        logprobs: request.logprobs.map(crate::decoding::logprobs::LogprobTracker::new),
        stops: StopFilter::new(&request.stop),
        ignore_eos: request.ignore_eos,
        speculate,
        draft,
        draft_max: draft_max(request)?,
        limit: asked.min(room),
        asked,
        // A compiled step writes full-precision buffers through the bare base.
        mode: if kv.is_some() || adapter.is_some() { DecodeMode::Eager } else { model.decode_mode(ctx.decode) },
        prefill_chunk: ctx.prefill_chunk,
        events: events.clone(),
        cancel,
        received: ctx.received,
        load_ms: ctx.load_ms,
        media_stats,
    };
    Ok(Begun::Sequence(Box::new(Sequence::new(setup))))
}

/// The most tokens a request's answer drafts a step: its `draft_max`
/// (1 to 8), else the most a draft may propose.
fn draft_max(request: &GenerateRequest) -> Result<usize, EngineError> {
    use crate::decoding::lookup::MAX_DRAFT;
    match request.draft_max.map(usize::from) {
        None => Ok(MAX_DRAFT),
        Some(n @ 1..=MAX_DRAFT) => Ok(n),
        Some(n) => Err(EngineError::BadRequest(format!(
            "draft_max {n}: a step drafts from 1 to {MAX_DRAFT} tokens (leave it out for the daemon's choice, \
             or turn drafting off with speculate off)"
        ))),
    }
}

/// Whether a request's answer drafts and verifies tokens, and with which
/// draft model (`draft`: the request's or the model's configured one, if
/// loaded; else drafts come from prompt lookup): as it asks, else as the
/// daemon is set (`speculate`). A model that cannot verify drafts refuses
/// a request that insists, and never drafts otherwise; `draft` without a
/// draft model is refused with what to do.
fn speculates(
    model: &Model,
    asked: mlxbc_shared::Speculation,
    draft: Option<Rc<Model>>,
) -> Result<(Speculate, Option<Rc<Model>>), EngineError> {
    use mlxbc_shared::Speculation;
    let verifies = model.lm.verifies_drafts();
    let wanted = match asked {
        Speculation::Off => Speculate::Off,
        Speculation::Auto => crate::decoding::lookup::configured(),
        Speculation::Ngram => Speculate::Ngram,
        Speculation::Draft => Speculate::Draft,
    };
    if !verifies {
        return match wanted {
            Speculate::Ngram | Speculate::Draft if asked != Speculation::Auto => Err(EngineError::BadRequest(format!(
                "speculative decoding is not available for {} models yet (llama, Qwen2 and Qwen3 \
                 decoders have it): ask without --speculate, or with --speculate off",
                model.lm.architecture()
            ))),
            _ => Ok((Speculate::Off, None)),
        };
    }
    Ok(match (wanted, draft) {
        (Speculate::Off, _) => (Speculate::Off, None),
        (Speculate::Ngram, _) => (Speculate::Ngram, None),
        (Speculate::Auto, draft) => (Speculate::Auto, draft),
        (Speculate::Draft, Some(draft)) => (Speculate::Draft, Some(draft)),
        // The daemon drafts with draft models where models name one.
        (Speculate::Draft, None) if asked == Speculation::Auto => (Speculate::Auto, None),
        (Speculate::Draft, None) => {
            return Err(EngineError::BadRequest(
                "--speculate draft needs a draft model: name one with --draft NAME (a small model with the \
                 same tokenizer), or in config.toml as [models.\"MODEL\"] draft = \"NAME\""
                    .into(),
            ))
        }
    })
}

/// The constraint a request's answer is generated under: its own
/// (structured output), or the grammar of a required tool call.
fn constraint_of(
    model: &Model,
    request: &GenerateRequest,
) -> Result<Option<crate::decoding::constraint::Constrained>, EngineError> {
    let tokenizer = &model.prompter.tokenizer;
    let format = model.prompter.template.tool_format.unwrap_or(crate::decoding::tools::ToolFormat::Hermes);
    let required = crate::decoding::tools::required_call_grammar(
        format,
        &request.tools,
        &request.tool_choice,
        tokenizer.token_to_id("<tool_call>"),
        tokenizer.token_to_id("</tool_call>"),
    );
    let c = match (&request.constraint, required) {
        (Some(_), Some(_)) => {
            return Err(EngineError::BadRequest(
                "a response format and a required tool call cannot both constrain one answer".into(),
            ))
        }
        (Some(c), None) => c.clone(),
        (None, Some(c)) => c,
        (None, None) => return Ok(None),
    };
    let eos: Vec<u32> = model.eos_ids.iter().copied().collect();
    let compiled = model.constraint_factory().and_then(|f| crate::decoding::constraint::Constrained::new(&f, &c, eos));
    compiled.map(Some).map_err(EngineError::BadRequest)
}
