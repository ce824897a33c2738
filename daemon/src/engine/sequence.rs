//! One generation as a state machine the scheduler advances a step at a
//! time. While prefilling, a step is one prompt chunk of this sequence
//! alone; once the first token is out, the sequence hands its KV cache to
//! its model's [`super::batch::DecodeBatch`], which computes the next token
//! of every row in one forward pass and gives each sequence its token
//! ([`Sequence::accept`]): stop checks, streaming and statistics stay here.
//!
//! The prompt is processed the way mlx-lm's `generate_step` does it (all but
//! the last token in chunks, then the last token alone), so the computation,
//! and therefore the greedy token ids, are the reference's.

use super::draft_costs::Drafting;
use super::draft_model::DraftRun;
use super::generate::Finished;
use crate::decoding::constraint::{Allowed, Constrained};
use crate::decoding::lookup::Drafter;
use crate::decoding::sampling::Sampler;
use crate::decoding::stop::{Filtered, StopFilter};
use crate::decoding::tools::ToolCallFilter;
use crate::error::EngineError;
use crate::media::MediaStats;
use crate::model::decode_step::DecodeMode;
use crate::model::kv_cache::{KvCache, KvQuantization};
use crate::model::options::Speculate;
use crate::model::positions::{Deepstack, MediaPositions, MropePositions};
use crate::model::Model;
use crate::prompt_cache::{PromptCache, PromptKeys};
use mlx_rs::transforms::{async_eval, eval};
use mlx_rs::Array;
use mlxbc_shared::{GenerationStats, Response, StopReason};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc::UnboundedSender;

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
    embeds.take_axis(Array::from_slice(&idx, &[idx.len() as i32]), 1).map_err(EngineError::inference)
}

/// Everything a sequence starts from.
pub struct Setup {
    pub model: Rc<Model>,
    pub name: String,
    pub ids: Vec<u32>,
    pub embeds: Array,
    pub cache: KvCache,
    /// Its keys and values kept quantized (also set on `cache`): it decodes
    /// in a batch of sequences quantized alike.
    pub kv: Option<KvQuantization>,
    pub blocks: Option<Vec<i32>>,
    /// Multimodal rope positions of the prompt (models whose rope follows
    /// an image's grid), from the tower's `rope_positions`.
    pub mrope: Option<MropePositions>,
    /// Qwen3-VL's deepstack: what the first layers add at the prompt's
    /// visual positions, from the tower's `deepstack`.
    pub deepstack: Option<Deepstack>,
    /// The first prompt position still to prefill (after a reused prefix).
    pub start: usize,
    /// The prompt's cache keys (None: the model's KV has no identity), for
    /// storing its blocks once prefilled.
    pub keys: Option<PromptKeys>,
    /// Prompt positions whose KV came from the prompt cache, and of those
    /// the ones read from disk.
    pub reused: usize,
    pub from_disk: usize,
    /// What those disk blocks cost (bytes, seconds to read and convert).
    pub disk_cost: Option<(u64, f64)>,
    pub sampler: Sampler,
    /// The constraint the answer must match (structured output), if any.
    pub constraint: Option<Constrained>,
    /// Takes tool calls out of the answer's text (a request with tools).
    pub tool_filter: Option<ToolCallFilter>,
    /// Records the tokens' log-probabilities (a request that asked).
    pub logprobs: Option<crate::decoding::logprobs::LogprobTracker>,
    pub stops: StopFilter,
    pub ignore_eos: bool,
    /// Whether it drafts tokens from its history and verifies them in one
    /// pass (where it decodes greedily): where they pay, or always.
    pub speculate: Speculate,
    /// The draft model its drafts come from, where speculation uses one
    /// (else prompt lookup).
    pub draft: Option<Rc<Model>>,
    /// The most tokens it drafts a step (its request's `draft_max`, else
    /// `lookup::MAX_DRAFT`).
    pub draft_max: usize,
    /// Tokens to generate at most (the request's and the context's bound),
    /// and what was asked (to tell `ContextFull` from `MaxTokens`).
    pub limit: usize,
    pub asked: usize,
    pub mode: DecodeMode,
    pub prefill_chunk: usize,
    pub events: UnboundedSender<Response>,
    pub cancel: Arc<AtomicBool>,
    pub received: Instant,
    pub load_ms: f64,
    pub media_stats: MediaStats,
}

/// What a prefill step came to.
#[expect(
    clippy::large_enum_variant,
    reason = "one value per request or load, moved a few times and matched at once; boxing the large variant buys nothing"
)]
pub enum Prefilled {
    /// `tokens` more prompt positions were processed; more remain.
    Chunk { tokens: usize },
    /// The first token was computed and streamed: the sequence is ready to
    /// join a decode batch ([`Sequence::take_for_batch`]).
    Ready,
    /// It ended on its first token (or its client left).
    Finished(Finished),
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
pub struct Sequence {
    setup: Setup,
    /// Prompt positions from here are still to prefill; `None` once done.
    prefill_at: Option<usize>,
    /// The first token (on the device) and the cache, from the end of the
    /// prefill until a batch takes them.
    handoff: Option<(KvCache, Array)>,
    generated: Vec<u32>,
    stream: StreamState,
    t_prefill: Option<Instant>,
    t_first: Option<Instant>,
    /// When the last token arrived: the decode rate counts the steps up to
    /// it, not the step queued after it (pipelined) that is thrown away.
    t_last: Option<Instant>,
    /// The stop string that ended it, once one did.
    stop_string: Option<String>,
    /// Its drafting (how far, how often, how well), when speculation is on.
    drafter: Option<Drafter>,
    /// Its draft model and that model's cache of its history, where its
    /// drafts come from one (else from prompt lookup).
    draft_run: Option<DraftRun>,
}

/// Where a row's drafts for a verify pass come from ([`Sequence::draft`]).
pub enum Drafts {
    /// Drafted already (prompt lookup); empty: none.
    Ready(Vec<u32>),
    /// Its draft model is to propose up to this many.
    Model(usize),
}

impl Sequence {
    /// A sequence about to prefill.
    pub fn new(setup: Setup) -> Self {
        let at = setup.start;
        let draft_run = match setup.speculate {
            Speculate::Auto | Speculate::Draft => setup.draft.clone().map(DraftRun::new),
            Speculate::Off | Speculate::Ngram => None,
        };
        // Acceptance differs by where drafts come from: a draft model's
        // evidence is kept on the draft model.
        let prior = draft_run.as_ref().map_or_else(|| setup.model.draft_prior(), |r| r.model().draft_prior());
        let drafter = match setup.speculate {
            Speculate::Off => None,
            Speculate::Auto => Some(Drafter::new(false, prior)),
            Speculate::Ngram | Speculate::Draft => Some(Drafter::new(true, prior)),
        }
        .map(|d| d.limited(setup.draft_max));
        Self {
            setup,
            prefill_at: Some(at),
            handoff: None,
            generated: Vec::new(),
            stream: StreamState::default(),
            t_prefill: None,
            t_first: None,
            t_last: None,
            stop_string: None,
            drafter,
            draft_run,
        }
    }

    /// The model it runs on.
    pub fn model(&self) -> &Rc<Model> {
        &self.setup.model
    }

    /// The model's canonical name.
    pub fn model_name(&self) -> &str {
        &self.setup.name
    }

    /// Prompt tokens.
    pub fn prompt_tokens(&self) -> usize {
        self.setup.ids.len()
    }

    /// Tokens generated so far.
    pub fn generated_tokens(&self) -> usize {
        self.generated.len()
    }

    /// Still prefilling.
    pub fn is_prefilling(&self) -> bool {
        self.prefill_at.is_some()
    }

    /// Positions its KV cache may come to hold: the prompt and every token
    /// it may generate (what admission reserves).
    pub fn max_positions(&self) -> usize {
        self.setup.ids.len() + self.setup.limit
    }

    /// How its keys and values are kept quantized, if they are.
    pub fn kv_quantization(&self) -> Option<KvQuantization> {
        self.setup.kv
    }

    /// KV bytes one of its positions takes (quantized or not).
    pub fn kv_bytes_per_position(&self) -> u64 {
        self.setup.model.kv_bytes_per_position_as(self.setup.kv)
    }

    /// How decode steps are built for it.
    pub fn decode_mode(&self) -> DecodeMode {
        self.setup.mode
    }

    /// Where its events go.
    pub fn events(&self) -> &UnboundedSender<Response> {
        &self.setup.events
    }

    /// When the daemon received it.
    pub fn received(&self) -> Instant {
        self.setup.received
    }

    /// True when the next token depends on a host-side mask (a
    /// constraint): its step cannot be queued before this one's token is read.
    pub fn is_constrained(&self) -> bool {
        self.setup.constraint.is_some()
    }

    /// True when its next token is the argmax of its logits.
    pub fn picks_argmax(&self) -> bool {
        self.setup.constraint.is_none() && self.setup.logprobs.is_none() && self.setup.sampler.is_greedy()
    }

    /// True when its next steps may verify drafts: speculation is on, no
    /// constraint shapes a sampled row's picks, no multimodal rope
    /// places its positions, and it is greedy or sampled; a seeded sampled
    /// row drafts only where its request asked (`ngram`): its answer is
    /// then distributed as without drafts but no longer the same draw.
    pub fn speculates(&self) -> bool {
        let Some(d) = &self.drafter else { return false };
        // A constraint's masks apply per verified position (greedy rows);
        // log-probabilities come from the verify pass's logits.
        let unshaped = self.setup.constraint.is_none() || self.setup.sampler.is_greedy();
        let reproducible = self.setup.sampler.is_greedy() || !self.setup.sampler.is_seeded() || d.forced;
        unshaped && reproducible && self.setup.mrope.is_none()
    }

    /// True when this step should try to draft ([`Self::speculates`], and
    /// not resting after a miss: see [`Drafter`]).
    pub fn wants_draft(&mut self) -> bool {
        self.speculates() && self.drafter.as_mut().is_some_and(Drafter::try_now)
    }

    /// What the cost model needs of a sequence that wants to draft: the
    /// most it would draft and how often its drafts are accepted; and
    /// whether it drafts whatever that costs (its request asked).
    pub fn draft_outlook(&self) -> Option<(Drafting, bool)> {
        let d = self.drafter.as_ref()?;
        let draft_secs = self.draft_run.as_ref().and_then(DraftRun::secs_per_token).unwrap_or(0.0);
        let explore = d.explores(self.generated.len());
        // A draft model's drafts cost its steps: its own `k` bounds them.
        let k = if self.draft_run.is_some() { d.k() } else { d.most() };
        Some((Drafting { k, rate: d.rate(), draft_secs, explore }, d.forced))
    }

    /// Tokens drafted to follow its prompt and answer so far (at most
    /// `most`, and the tokens it may still generate) from its history, or
    /// how many its draft model is to propose (its decode batch drafts
    /// every row of a draft model together, then hands them to
    /// [`Self::proposed`]); none: take a plain step.
    pub fn draft(&mut self, most: usize) -> Drafts {
        let Some(d) = &mut self.drafter else { return Drafts::Ready(Vec::new()) };
        let room = self.setup.limit.saturating_sub(self.generated.len()).min(most);
        if room == 0 {
            return Drafts::Ready(Vec::new());
        }
        if self.draft_run.is_some() {
            return Drafts::Model(d.k().min(room));
        }
        let history = [&self.setup.ids[..], &self.generated[..]].concat();
        let drafts = d.draft(&history, room);
        Drafts::Ready(drafts)
    }

    /// Its prompt and answer so far.
    pub fn history(&self) -> Vec<u32> {
        [&self.setup.ids[..], &self.generated[..]].concat()
    }

    /// Its draft model, where its drafts come from one.
    pub fn draft_run(&self) -> Option<&DraftRun> {
        self.draft_run.as_ref()
    }

    /// What its draft model proposed for [`Drafts::Model`] (`secs` a
    /// drafted token, the proposal's time shared by its rows): the drafts
    /// to verify.
    pub fn proposed(&mut self, drafts: Vec<u32>, secs: f64) -> Vec<u32> {
        if let Some(run) = &mut self.draft_run {
            run.measured(secs);
        }
        match &mut self.drafter {
            Some(d) => d.proposed(drafts),
            None => Vec::new(),
        }
    }

    /// A verify pass checked `drafted` tokens and the model agreed with the
    /// first `accepted`; or (`drafted` 0) its drafts were not verified.
    /// (Its draft model's cache hears it from its batch.)
    pub fn verified(&mut self, drafted: usize, accepted: usize) {
        if let (Some(d), true) = (&mut self.drafter, drafted > 0) {
            d.verified(drafted, accepted);
        }
    }

    /// Its next token `[1, 1]` from its row's logits: masked by its
    /// constraint, then picked by its sampler.
    pub fn pick(&mut self, logits: &Array) -> Result<Array, EngineError> {
        if let Some(t) = &mut self.setup.logprobs {
            t.queue(logits).map_err(EngineError::inference)?;
        }
        let masked;
        // (A row that just ended still gets a pick from its batch: unmasked.)
        let logits = match &mut self.setup.constraint {
            Some(c) if !c.is_done() => {
                masked = c.mask(logits).map_err(EngineError::inference)?;
                &masked
            }
            _ => logits,
        };
        let token = self.setup.sampler.pick(logits).map_err(EngineError::inference)?;
        if let Some(t) = &mut self.setup.logprobs {
            t.picked(&token).map_err(EngineError::inference)?;
        }
        Ok(token)
    }

    /// True when its picks are the argmax of its (masked) logits.
    pub fn is_greedy(&self) -> bool {
        self.setup.sampler.is_greedy()
    }

    /// A verify pass's logits `[n, vocab]` for the first `n` of its
    /// positions, whose picks it accepted: their log-probabilities are
    /// queued, to be recorded as the tokens are accepted (when asked).
    pub fn queue_logprobs(&mut self, logits: &Array) -> Result<(), EngineError> {
        use mlx_rs::ops::indexing::IndexOp;
        let Some(t) = &mut self.setup.logprobs else { return Ok(()) };
        for i in 0..logits.shape()[0] {
            t.queue(&logits.index(i..i + 1)).map_err(EngineError::inference)?;
        }
        Ok(())
    }

    /// For a constrained row's verify pass: what its grammar allows after
    /// each of `drafts` in turn, up to the first it forbids (`None`:
    /// unconstrained, or the grammar is complete).
    pub fn allowed_along(&mut self, drafts: &[u32]) -> Result<Option<Vec<Allowed>>, EngineError> {
        match &mut self.setup.constraint {
            Some(c) if !c.is_done() => c.allowed_along(drafts).map(Some).map_err(EngineError::inference),
            _ => Ok(None),
        }
    }

    /// A sampled row's verify pass: how many of `drafts` are accepted and
    /// the token after them, by the speculative sampling rule
    /// (`Sampler::accept_drafts`; `logits` `[drafts + 1, vocab]`).
    pub fn accept_drafts(&mut self, logits: &Array, drafts: &[u32]) -> Result<(usize, u32), EngineError> {
        self.setup.sampler.accept_drafts(logits, drafts).map_err(EngineError::inference)
    }

    /// The log-probability arrays its last pick queued (none when not asked).
    pub fn logprob_arrays(&self) -> Vec<&Array> {
        self.setup.logprobs.as_ref().map(|t| t.newest()).unwrap_or_default()
    }

    /// The client cancelled or went away.
    pub fn gone(&self) -> bool {
        self.setup.cancel.load(Ordering::Relaxed) || self.setup.events.is_closed()
    }

    /// The cache and the first token (already streamed), for a batch.
    pub fn take_for_batch(&mut self) -> Option<(KvCache, Array)> {
        self.handoff.take()
    }

    /// True when its prompt can be prefilled in one batch with others':
    /// not begun, nothing reused, no image blocks that must see each
    /// other, no multimodal rope.
    pub fn can_prefill_together(&self) -> bool {
        self.prefill_at == Some(0)
            && !self.setup.model.lm.recurrent()
            && self.setup.blocks.is_none()
            && self.setup.mrope.is_none()
            && self.setup.reused == 0
            && self.setup.cache.offset == 0
            && self.setup.kv.is_none()
            && self.setup.cache.adapters.is_empty()
    }

    /// Its prompt has multimodal rope positions: it decodes in a batch of its own.
    pub fn has_mrope(&self) -> bool {
        self.setup.mrope.is_some()
    }

    /// Its own inputs to a forward pass (image blocks only while prefilling
    /// its prompt's chunks).
    pub fn media_positions(&self, with_blocks: bool) -> MediaPositions<'_> {
        let s = &self.setup;
        MediaPositions {
            image_blocks: s.blocks.as_deref().filter(|_| with_blocks),
            mrope: s.mrope.as_ref(),
            deepstack: s.deepstack.as_ref(),
        }
    }

    /// The prompt's embeddings `[1, L, hidden]`, for a batched prefill.
    pub fn prompt_embeds(&self) -> &Array {
        &self.setup.embeds
    }

    /// A batched prefill has begun with this sequence in it.
    pub fn prefill_started(&mut self) {
        self.t_prefill.get_or_insert_with(Instant::now);
    }

    /// The first token, from a batched prefill whose cache holds this
    /// sequence as row `row` (its blocks are stored from there): streamed
    /// like any token; `Some` when the sequence ended on it.
    pub fn prefilled_together(
        &mut self,
        token: u32,
        batch: &KvCache,
        row: usize,
        prompts: &mut PromptCache,
    ) -> Option<Result<Finished, EngineError>> {
        self.t_first = Some(Instant::now());
        self.prefill_at = None;
        self.setup.embeds = Array::from_int(0);
        self.setup.cache = KvCache::new(0);
        let ended = self.accept(token);
        // After the first token is streamed: this row's blocks are kept.
        if let Some(keys) = self.setup.keys.take() {
            self.note_prefill_costs(&keys, prompts);
            prompts.store(&keys, batch, row);
        }
        ended
    }

    /// One prompt chunk (or the last position and the first token).
    pub fn prefill(&mut self, prompts: &mut PromptCache) -> Result<Prefilled, EngineError> {
        let Some(at) = self.prefill_at else {
            return Err(EngineError::Internal("prefill after the prompt was done".into()));
        };
        self.t_prefill.get_or_insert_with(Instant::now);
        let n = self.setup.ids.len();
        let to = n - 1;
        if at < to {
            let end = self.chunk_end_from(at);
            let checkpoint = self.state_checkpoint().filter(|&p| p == end);
            let s = &mut self.setup;
            let lm = &s.model.lm;
            let media = MediaPositions {
                image_blocks: s.blocks.as_deref(),
                mrope: s.mrope.as_ref(),
                deepstack: s.deepstack.as_ref(),
            };
            lm.forward(&positions(&s.embeds, at, end)?, &mut s.cache, &media).map_err(EngineError::inference)?;
            if checkpoint.is_some() {
                self.setup.cache.checkpoint_states();
            }
            // The prompt's final chunk is queued, not waited for: the host
            // builds the last position's step while the device computes it.
            if end < to {
                eval(self.setup.cache.arrays()).map_err(EngineError::inference)?;
            } else {
                async_eval(self.setup.cache.arrays()).map_err(EngineError::inference)?;
            }
            if self.gone() {
                return Ok(Prefilled::Finished(Finished::Abandoned));
            }
            self.prefill_at = Some(end);
            return Ok(Prefilled::Chunk { tokens: end - at });
        }
        // The last prompt position alone, then the first token.
        let last = positions(&self.setup.embeds, n - 1, n)?;
        let s = &mut self.setup;
        let lm = &s.model.lm;
        let media = MediaPositions { image_blocks: None, mrope: s.mrope.as_ref(), deepstack: s.deepstack.as_ref() };
        let h = lm.forward(&last, &mut s.cache, &media).map_err(EngineError::inference)?;
        let logits = lm.logits(&h).map_err(EngineError::inference)?;
        let next = self.pick(&logits)?;
        async_eval([&next]).map_err(EngineError::inference)?;
        let token = next.try_item_cast::<u32>().map_err(EngineError::inference)?;
        self.t_first = Some(Instant::now());
        self.prefill_at = None;
        // The prompt's embeddings are not needed any more.
        self.setup.embeds = Array::from_int(0);
        let ended = self.accept(token);
        // The first token is out (streamed by `accept`): now the prompt's
        // new blocks are kept (RAM now, disk behind), computed by the chunks above.
        if let Some(keys) = self.setup.keys.take() {
            self.note_prefill_costs(&keys, prompts);
            prompts.store(&keys, &self.setup.cache, 0);
        }
        self.setup.cache.checkpoint = None;
        if let Some(end) = ended {
            return end.map(Prefilled::Finished);
        }
        let cache = std::mem::replace(&mut self.setup.cache, KvCache::new(0));
        self.handoff = Some((cache, next));
        Ok(Prefilled::Ready)
    }

    /// For a recurrent model whose prompt is cached, the position where the
    /// prefix the prompt cache may store ends (its last full block, or the
    /// end of its last image when that is further): its state is saved there.
    /// Where the prefill chunk that starts at `at` ends: `prefill_chunk`
    /// tokens on, not cutting an image's block, and stopping where a
    /// recurrent model's state is saved (where the prefix the prompt cache
    /// may store ends).
    fn chunk_end_from(&self, at: usize) -> usize {
        let to = self.setup.ids.len() - 1;
        let end = chunk_end(self.setup.blocks.as_deref(), at, to, self.setup.prefill_chunk);
        match self.state_checkpoint() {
            Some(p) if at < p && p <= end => p,
            _ => end,
        }
    }

    /// The prompt tokens each prefill call still to come takes, in order
    /// (the last is the final position alone, which yields the first
    /// token); empty when the prompt is done. The scheduler plans with it.
    pub fn prefill_calls(&self) -> Vec<usize> {
        let Some(mut at) = self.prefill_at else { return vec![] };
        let to = self.setup.ids.len() - 1;
        let mut calls = Vec::new();
        while at < to {
            let end = self.chunk_end_from(at);
            calls.push(end - at);
            at = end;
        }
        calls.push(1);
        calls
    }

    fn state_checkpoint(&self) -> Option<usize> {
        if !self.setup.model.lm.recurrent() {
            return None;
        }
        self.setup.keys.as_ref().and_then(|k| k.longest_storable())
    }

    /// Takes the next generated token: stops on end-of-sequence, a stop
    /// string or the token limit, else streams its text. `Some` when the
    /// sequence is over.
    pub fn accept(&mut self, token: u32) -> Option<Result<Finished, EngineError>> {
        self.t_last = Some(Instant::now());
        if !self.setup.ignore_eos && self.setup.model.eos_ids.contains(&token) {
            return Some(self.finish(StopReason::Eos));
        }
        if let Some(c) = &mut self.setup.constraint {
            if let Err(e) = c.consume(token) {
                return Some(Err(EngineError::Inference(format!("{e:#}"))));
            }
        }
        let tokenizer = &self.setup.model.prompter.tokenizer;
        if let Some(t) = &mut self.setup.logprobs {
            if let Err(e) = t.accept(token, tokenizer) {
                return Some(Err(EngineError::inference(e)));
            }
        }
        self.generated.push(token);
        let st = &mut self.stream;
        let piece = match tokenizers::step_decode_stream(
            tokenizer,
            token,
            true,
            &mut st.ids,
            &mut st.prefix,
            &mut st.prefix_index,
        ) {
            Ok(piece) => piece,
            Err(e) => return Some(Err(EngineError::Inference(e.to_string()))),
        };
        // A tool-call marker is a special token the decoder does not print:
        // its text goes to the tool filter as if it had.
        let marker = self.setup.tool_filter.as_ref().and_then(|f| f.marker(token));
        let piece = match (piece, marker) {
            (Some(p), Some(m)) => Some(p + m),
            (None, Some(m)) => Some(m.to_string()),
            (p, None) => p,
        };
        if let Some(piece) = piece {
            let (mut text, stop) = match self.setup.stops.push(&piece) {
                Filtered::Emit(t) => (t, None),
                Filtered::Stop(t, matched) => (t, Some(matched)),
            };
            if let Some(f) = &mut self.setup.tool_filter {
                text = f.push(&text);
            }
            if !text.is_empty() && self.setup.events.send(Response::Token { text }).is_err() {
                return Some(Ok(Finished::Abandoned));
            }
            if let Some(matched) = stop {
                self.stop_string = Some(matched);
                return Some(self.finish(StopReason::StopString));
            }
        }
        // A complete constrained answer ends here (its grammar admits no more).
        if self.setup.constraint.as_ref().is_some_and(|c| c.is_done()) {
            return Some(self.finish(StopReason::Eos));
        }
        if self.generated.len() >= self.setup.limit {
            let reason =
                if self.setup.limit < self.setup.asked { StopReason::ContextFull } else { StopReason::MaxTokens };
            return Some(self.finish(reason));
        }
        if self.gone() {
            return Some(Ok(Finished::Abandoned));
        }
        None
    }

    /// Tells the prompt cache what this prompt's prefill took (it weighs
    /// disk reads against prefills with it).
    fn note_prefill_costs(&self, keys: &PromptKeys, prompts: &mut PromptCache) {
        let (Some(first), Some(start)) = (self.t_first, self.t_prefill) else { return };
        let computed = self.setup.ids.len() - self.setup.reused;
        prompts.note_prefilled(keys, computed, first.duration_since(start).as_secs_f64(), self.setup.disk_cost);
    }

    fn finish(&mut self, stop_reason: StopReason) -> Result<Finished, EngineError> {
        let mut tail = if stop_reason != StopReason::StopString { self.setup.stops.finish() } else { String::new() };
        let (mut tool_calls, mut warnings) = (Vec::new(), Vec::new());
        if let Some(f) = &mut self.setup.tool_filter {
            tail = f.push(&tail);
            tail.push_str(&f.finish());
            tool_calls = std::mem::take(&mut f.calls);
            warnings = std::mem::take(&mut f.warnings);
        }
        if !tail.is_empty() && self.setup.events.send(Response::Token { text: tail }).is_err() {
            return Ok(Finished::Abandoned);
        }
        let t_first = self.t_first.unwrap_or_else(Instant::now);
        let t_prefill = self.t_prefill.unwrap_or(t_first);
        let decode_s = self.t_last.map_or(0.0, |t| t.saturating_duration_since(t_first).as_secs_f64());
        // The first token came from the prefill; the others from decode steps.
        let steps = (self.generated.len() + usize::from(stop_reason == StopReason::Eos)).saturating_sub(1);
        let prefill_s = t_first.duration_since(t_prefill).as_secs_f64();
        let mut stats =
            stats_without_decode(&self.setup.name, self.setup.ids.len(), self.setup.load_ms, &self.setup.media_stats);
        stats.generated_tokens = self.generated.len() as u32;
        stats.time_to_first_token_ms = t_first.duration_since(self.setup.received).as_secs_f64() * 1000.0;
        stats.prefill_tokens_per_s = (self.setup.ids.len() - self.setup.reused) as f64 / prefill_s.max(1e-9);
        // One token (or none) takes no decode step: no rate to report (the
        // CLI says so rather than printing 0.0 tok/s).
        stats.decode_tokens_per_s = if steps > 0 && decode_s > 0.0 { steps as f64 / decode_s } else { 0.0 };
        stats.stop_reason = stop_reason;
        stats.token_ids = std::mem::take(&mut self.generated);
        stats.prefix_tokens_reused = self.setup.reused as u32;
        stats.prompt_tokens_from_disk = self.setup.from_disk as u32;
        stats.prefill_tokens_computed = (self.setup.ids.len() - self.setup.reused) as u32;
        stats.prefill_ms = prefill_s * 1000.0;
        stats.tool_calls = tool_calls;
        stats.stop_string = self.stop_string.take();
        stats.logprobs = self.setup.logprobs.take().map(|t| t.entries).unwrap_or_default();
        if let Some(d) = &self.drafter {
            (stats.draft_tokens, stats.accepted_draft_tokens) = (d.drafted, d.accepted);
            let (drafted, accepted) = self.setup.model.drafts.get();
            self.setup.model.drafts.set((drafted + u64::from(d.drafted), accepted + u64::from(d.accepted)));
            match &self.draft_run {
                Some(run) => run.model().record_drafts(d.accepted, d.rejections),
                None => self.setup.model.record_drafts(d.accepted, d.rejections),
            }
        }
        stats.warnings.extend(warnings);
        Ok(Finished::Done(stats))
    }
}

/// Statistics of a generation that computed nothing yet: the prompt and
/// what loading and media took.
pub fn stats_without_decode(model: &str, prompt_tokens: usize, load_ms: f64, m: &MediaStats) -> GenerationStats {
    GenerationStats {
        model: model.to_string(),
        prompt_tokens: prompt_tokens as u32,
        generated_tokens: 0,
        time_to_first_token_ms: 0.0,
        load_ms,
        prefill_tokens_per_s: 0.0,
        decode_tokens_per_s: 0.0,
        stop_reason: StopReason::MaxTokens,
        token_ids: vec![],
        encoder_hits: m.hits,
        encoder_misses: m.misses,
        encode_ms: m.encode_ms,
        lookup_ms: m.lookup_ms,
        preprocess_ms: m.preprocess_ms,
        prefix_tokens_reused: 0,
        prompt_tokens_from_disk: 0,
        prefill_tokens_computed: 0,
        prefill_ms: 0.0,
        warnings: vec![],
        tool_calls: vec![],
        stop_string: None,
        logprobs: vec![],
        draft_tokens: 0,
        accepted_draft_tokens: 0,
    }
}
