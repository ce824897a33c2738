//! One generation as a state machine the engine advances a step at a time:
//! a prefill chunk, or one decode step. `generate::run` prepares it (prompt,
//! media, embeddings, cache) and drives it to its end; a scheduler can
//! interleave the steps of many.
//!
//! The prompt is processed the way mlx-lm's `generate_step` does it (all but
//! the last token in chunks, then the last token alone), so the computation,
//! and therefore the greedy token ids, are the reference's.

use super::error::EngineError;
use super::generate::Finished;
use super::media::MediaStats;
use super::prefix::{PrefixCache, PrefixId};
use super::sampling::Sampler;
use super::stop::{Filtered, StopFilter};
use crate::model::decode_step::DecodeMode;
use crate::model::kv_cache::KvCache;
use crate::model::Model;
use mlx_rs::transforms::{async_eval, eval};
use mlx_rs::Array;
use mlxbc_shared::{GenerationStats, Response, StopReason};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;
use tokio::sync::mpsc::UnboundedSender;

fn inference<E: std::fmt::Display>(e: E) -> EngineError {
    EngineError::Inference(format!("{e:#}"))
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
fn positions(embeds: &Array, from: usize, to: usize) -> Result<Array, EngineError> {
    let idx: Vec<i32> = (from as i32..to as i32).collect();
    embeds.take_axis(Array::from_slice(&idx, &[idx.len() as i32]), 1).map_err(inference)
}

/// Everything a sequence starts from.
pub struct Setup<'a> {
    pub model: &'a Model,
    pub name: &'a str,
    pub ids: Vec<u32>,
    pub embeds: Array,
    pub cache: KvCache,
    pub blocks: Option<Vec<i32>>,
    /// The first prompt position still to prefill (after a reused prefix).
    pub start: usize,
    /// A prefix to prefill first and keep: its end and identity.
    pub keep_prefix: Option<(usize, PrefixId)>,
    /// Prompt positions whose KV came from the prefix cache.
    pub reused: usize,
    pub sampler: Sampler,
    pub stops: StopFilter,
    pub ignore_eos: bool,
    /// Tokens to generate at most (the request's and the context's bound),
    /// and what was asked (to tell `ContextFull` from `MaxTokens`).
    pub limit: usize,
    pub asked: usize,
    pub mode: DecodeMode,
    pub prefill_chunk: usize,
    pub events: &'a UnboundedSender<Response>,
    pub cancel: &'a AtomicBool,
    pub received: Instant,
    pub t_prefill: Instant,
    pub load_ms: f64,
    pub media_stats: MediaStats,
}

/// What a step came to.
pub enum Step {
    Running,
    Finished(Finished),
}

enum Phase {
    /// Prompt positions from `at` are still to prefill.
    Prefill { at: usize },
    /// `token` (the value of `next`) is to be handled.
    Decode { token: u32 },
}

/// tokenizers' streaming decode state (`step_decode_stream`), owned, so a
/// sequence need not borrow the tokenizer between steps.
#[derive(Default)]
struct StreamState {
    ids: Vec<u32>,
    prefix: String,
    prefix_index: usize,
}

/// A generation between steps.
pub struct Sequence<'a> {
    s: Setup<'a>,
    phase: Phase,
    /// The last sampled token, on the device.
    next: Option<Array>,
    /// The step computing the token after `next`, when already queued.
    queued: Option<Array>,
    generated: Vec<u32>,
    stream: StreamState,
    t_first: Option<Instant>,
    decode_steps: usize,
    /// Host time per token: building and queueing a step, and waiting for a
    /// token to come back; which one dominates says what bounds decode.
    /// Queueing is building the graph (MLX operations called) plus
    /// dispatching it (MLX's per-operation work in evaluation).
    queue_s: f64,
    build_s: f64,
    wait_s: f64,
}

impl<'a> Sequence<'a> {
    /// A sequence about to prefill.
    pub fn new(setup: Setup<'a>) -> Self {
        let at = match &setup.keep_prefix {
            Some(_) => 0,
            None => setup.start,
        };
        Self {
            s: setup,
            phase: Phase::Prefill { at },
            next: None,
            queued: None,
            generated: Vec::new(),
            stream: StreamState::default(),
            t_first: None,
            decode_steps: 0,
            queue_s: 0.0,
            build_s: 0.0,
            wait_s: 0.0,
        }
    }

    fn gone(&self) -> bool {
        self.s.cancel.load(Ordering::Relaxed) || self.s.events.is_closed()
    }

    /// One unit of work: a prefill chunk, or one decode step.
    pub fn step(&mut self, prefixes: &mut PrefixCache) -> Result<Step, EngineError> {
        match self.phase {
            Phase::Prefill { at } => self.prefill_chunk(at, prefixes),
            Phase::Decode { token } => self.decode(token),
        }
    }

    fn prefill_chunk(&mut self, at: usize, prefixes: &mut PrefixCache) -> Result<Step, EngineError> {
        let n = self.s.ids.len();
        // The kept prefix is prefilled alone and waited for, then stored.
        let (to, keeping) = match &self.s.keep_prefix {
            Some((p, _)) if at < *p => (*p, true),
            _ => (n - 1, false),
        };
        if at < to {
            let end = chunk_end(self.s.blocks.as_deref(), at, to, self.s.prefill_chunk);
            let lm = &self.s.model.lm;
            lm.forward(&positions(&self.s.embeds, at, end)?, &mut self.s.cache, self.s.blocks.as_deref())
                .map_err(inference)?;
            // The prompt's final chunk is queued, not waited for: the host
            // builds the last position's step while the device computes it.
            if end < to || keeping {
                eval(self.s.cache.arrays()).map_err(inference)?;
            } else {
                async_eval(self.s.cache.arrays()).map_err(inference)?;
            }
            if self.gone() {
                return Ok(Step::Finished(Finished::Abandoned));
            }
            if keeping && end == to {
                if let Some((_, id)) = self.s.keep_prefix.take() {
                    prefixes.put(id, &self.s.cache);
                }
                self.phase = Phase::Prefill { at: self.s.start.max(to) };
            } else {
                self.phase = Phase::Prefill { at: end };
            }
            return Ok(Step::Running);
        }
        if keeping {
            // An empty kept prefix (cannot happen: it ends after an image).
            self.s.keep_prefix = None;
            return Ok(Step::Running);
        }
        // The last prompt position alone, then the first token.
        let last = positions(&self.s.embeds, n - 1, n)?;
        let lm = &self.s.model.lm;
        let h = lm.forward(&last, &mut self.s.cache, None).map_err(inference)?;
        let next = self.s.sampler.pick(&lm.logits(&h).map_err(inference)?).map_err(inference)?;
        async_eval([&next]).map_err(inference)?;
        let token = read(&next)?;
        self.next = Some(next);
        self.t_first = Some(Instant::now());
        self.phase = Phase::Decode { token };
        Ok(Step::Running)
    }

    /// Handles `token`, then computes the next one (queueing the step after
    /// it first, so the device never waits for the host: mlx-lm's
    /// generate_step pipelining).
    fn decode(&mut self, token: u32) -> Result<Step, EngineError> {
        let model = self.s.model;
        if !self.s.ignore_eos && model.eos_ids.contains(&token) {
            return self.finish(StopReason::Eos);
        }
        self.generated.push(token);
        let tokenizer = &model.prompter.tokenizer;
        let st = &mut self.stream;
        let piece =
            tokenizers::step_decode_stream(tokenizer, token, true, &mut st.ids, &mut st.prefix, &mut st.prefix_index)
                .map_err(inference)?;
        if let Some(piece) = piece {
            let (text, stop) = match self.s.stops.push(&piece) {
                Filtered::Emit(t) => (t, false),
                Filtered::Stop(t) => (t, true),
            };
            if !text.is_empty() && self.s.events.send(Response::Token { text }).is_err() {
                return Ok(Step::Finished(Finished::Abandoned));
            }
            if stop {
                return self.finish(StopReason::StopString);
            }
        }
        if self.generated.len() >= self.s.limit {
            let reason = if self.s.limit < self.s.asked { StopReason::ContextFull } else { StopReason::MaxTokens };
            return self.finish(reason);
        }
        if self.gone() {
            return Ok(Step::Finished(Finished::Abandoned));
        }
        let current = match self.queued.take() {
            Some(q) => q,
            None => {
                let next = self.next.take().ok_or_else(|| EngineError::Internal("no token to decode from".into()))?;
                self.queue_step(&next)?
            }
        };
        if self.generated.len() + 1 < self.s.limit {
            self.queued = Some(self.queue_step(&current)?);
        }
        let t = Instant::now();
        let token = read(&current)?;
        self.wait_s += t.elapsed().as_secs_f64();
        self.next = Some(current);
        self.decode_steps += 1;
        self.phase = Phase::Decode { token };
        Ok(Step::Running)
    }

    /// One decode step: ids (on the device) → the next id, queued for
    /// evaluation but not waited for.
    fn queue_step(&mut self, ids: &Array) -> Result<Array, EngineError> {
        let t = Instant::now();
        let logits = self.s.model.decode_logits(ids, &mut self.s.cache, self.s.mode).map_err(inference)?;
        let next = self.s.sampler.pick(&logits).map_err(inference)?;
        self.build_s += t.elapsed().as_secs_f64();
        async_eval([&next]).map_err(inference)?;
        self.queue_s += t.elapsed().as_secs_f64();
        Ok(next)
    }

    fn finish(&mut self, stop_reason: StopReason) -> Result<Step, EngineError> {
        let tail = self.s.stops.finish();
        if stop_reason != StopReason::StopString
            && !tail.is_empty()
            && self.s.events.send(Response::Token { text: tail }).is_err()
        {
            return Ok(Step::Finished(Finished::Abandoned));
        }
        let t_first = self.t_first.unwrap_or_else(Instant::now);
        let decode_s = t_first.elapsed().as_secs_f64();
        let steps = self.decode_steps;
        if steps > 0 {
            let per = |s: f64| s * 1e6 / steps as f64;
            tracing::info!(
                "decode ({:?}): {steps} steps, {:.0} µs/token: queueing {:.0} (building {:.0}), waiting {:.0}, the rest {:.0}",
                self.s.mode,
                per(decode_s),
                per(self.queue_s),
                per(self.build_s),
                per(self.wait_s),
                per(decode_s - self.queue_s - self.wait_s)
            );
        }
        let prefill_s = t_first.duration_since(self.s.t_prefill).as_secs_f64();
        let m = &self.s.media_stats;
        Ok(Step::Finished(Finished::Done(GenerationStats {
            model: self.s.name.to_string(),
            prompt_tokens: self.s.ids.len() as u32,
            generated_tokens: self.generated.len() as u32,
            time_to_first_token_ms: t_first.duration_since(self.s.received).as_secs_f64() * 1000.0,
            load_ms: self.s.load_ms,
            prefill_tokens_per_s: (self.s.ids.len() - self.s.reused) as f64 / prefill_s.max(1e-9),
            decode_tokens_per_s: if steps > 0 { steps as f64 / decode_s.max(1e-9) } else { 0.0 },
            stop_reason,
            token_ids: std::mem::take(&mut self.generated),
            encoder_hits: m.hits,
            encoder_misses: m.misses,
            encode_ms: m.encode_ms,
            lookup_ms: m.lookup_ms,
            preprocess_ms: m.preprocess_ms,
            prefix_tokens_reused: self.s.reused as u32,
            prefill_ms: prefill_s * 1000.0,
            warnings: vec![],
        })))
    }
}

fn read(ids: &Array) -> Result<u32, EngineError> {
    ids.try_item_cast::<u32>().map_err(inference)
}
