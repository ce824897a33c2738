//! Continuous batching: the decode steps of every sequence on one model as
//! one forward pass over a batch KV cache whose rows are aligned at their
//! ends by left padding (mlx-lm's `BatchKVCache`). A sequence joins when its
//! prefill is done and leaves the moment it finishes; the batch never
//! drains to let anyone in.
//!
//! The steps are pipelined as mlx-lm's `generate_step` does for one stream:
//! each step is queued on the device before the previous step's tokens are
//! read back, so the device never waits for the host's stop checks and
//! streaming. `ahead` holds, per row, the token that follows everything in
//! the cache: computed by the step in flight, or (for a row that has just
//! joined) the first token, which its prefill already streamed.

use super::draft_batch::{DraftAsk, DraftBatch};
use super::draft_costs::{self, PassCosts};
use super::sequence::{Drafts, Sequence};
use crate::decoding::lookup;
use crate::error::EngineError;
use crate::model::decode_step::DecodeMode;
use crate::model::kv_cache::KvCache;
use crate::model::positions::MediaPositions;
use crate::model::Model;
use mlx_rs::ops::indexing::argmax_axis;
use mlx_rs::transforms::async_eval;
use mlx_rs::Array;
use std::cell::RefCell;
use std::rc::Rc;

/// A sequence's key in the scheduler.
pub use super::scheduler::SeqId;

/// A row that ended in a step, and how.
pub type RowOutcome = (SeqId, Result<super::generate::Finished, EngineError>);

struct Row {
    seq: SeqId,
    /// Its `ahead` token was already taken (it came from the prefill).
    taken: bool,
}

/// The decode batch of one model (or of one sequence whose positions
/// cannot share a batch: multimodal rope).
pub struct DecodeBatch {
    model: Rc<Model>,
    mode: DecodeMode,
    cache: Option<KvCache>,
    rows: Vec<Row>,
    ahead: Option<Array>,
    profile: Profile,
    /// The model's measured pass costs (shared by its batches over time):
    /// whether a verify pass pays.
    costs: Rc<RefCell<PassCosts>>,
    /// Rows of the last step when it was a plain one: the next plain step
    /// of as many rows waits for one like it, so its time is a step's cost.
    plain_before: Option<usize>,
    /// Per draft model its rows use, their drafting together.
    drafters: Vec<DraftBatch>,
}

/// Where a batch's steps spend host time, logged every [`PROFILE_EVERY`]
/// steps (at `info`): queueing a step (building its graph and dispatching
/// it) against waiting for the tokens; which dominates says what bounds decode.
/// Queueing is split further into building the lazy graph and launching
/// it (`async_eval`: MLX walks the graph and hands each operation to the
/// device), and a verify pass's also into drafting: on an H100 a one-row
/// pass of 9 positions queued ~10 ms against a plain step's ~3, and which
/// of the three it is decides what to cut.
#[derive(Default)]
struct Profile {
    steps: u32,
    /// Steps built with the compiled single-row graph.
    compiled: u32,
    /// Speculation's verify passes among the steps (always eager), and
    /// their own queueing and waiting (also in the totals).
    verified: u32,
    verify_queue_s: f64,
    verify_wait_s: f64,
    /// Of the passes' queueing: drafting, and launching (the rest is building).
    verify_draft_s: f64,
    verify_launch_s: f64,
    /// Of all steps' queueing: launching.
    launch_s: f64,
    /// Draft models' proposals, and the rows they drafted for.
    proposals: u32,
    proposed_rows: usize,
    rows: usize,
    queue_s: f64,
    wait_s: f64,
    since: Option<std::time::Instant>,
}

const PROFILE_EVERY: u32 = 64;

/// One step's queueing, in seconds: drafting (a verify pass's), building
/// its graph, launching it.
#[derive(Clone, Copy, Default)]
struct Queueing {
    draft_s: f64,
    build_s: f64,
    launch_s: f64,
}

impl Queueing {
    /// The split of the span from `started` to `launched`, whose drafting
    /// ended at `drafted` and whose graph was built at `built`.
    fn between(
        started: std::time::Instant,
        drafted: std::time::Instant,
        built: std::time::Instant,
        launched: std::time::Instant,
    ) -> Self {
        Self {
            draft_s: (drafted - started).as_secs_f64(),
            build_s: (built - drafted).as_secs_f64(),
            launch_s: (launched - built).as_secs_f64(),
        }
    }

    fn total(&self) -> f64 {
        self.draft_s + self.build_s + self.launch_s
    }
}

impl Profile {
    /// A step of `rows` built as `mode` (`None`: a verify pass).
    fn record(
        &mut self,
        started: std::time::Instant,
        rows: usize,
        mode: Option<DecodeMode>,
        queue: Queueing,
        wait_s: f64,
    ) {
        self.since.get_or_insert(started);
        self.steps += 1;
        self.compiled += u32::from(mode == Some(DecodeMode::Compiled));
        let queue_s = queue.total();
        if mode.is_none() {
            self.verified += 1;
            self.verify_queue_s += queue_s;
            self.verify_wait_s += wait_s;
            self.verify_draft_s += queue.draft_s;
            self.verify_launch_s += queue.launch_s;
        }
        self.launch_s += queue.launch_s;
        self.rows += rows;
        self.queue_s += queue_s;
        self.wait_s += wait_s;
        if self.steps == PROFILE_EVERY {
            self.flush();
        }
    }

    /// Logs what was recorded and starts over.
    fn flush(&mut self) {
        if let Some(since) = self.since.filter(|_| self.steps > 0) {
            let per = |x: f64| x * 1e3 / f64::from(self.steps);
            // The plain steps' mode; verify passes are counted apart.
            let mode = match self.compiled {
                0 => "Eager",
                c if c == self.steps - self.verified => "Compiled",
                _ => "Compiled alone, Eager batched",
            };
            // A verify pass's own split says what bounds speculation.
            let pass = |v: u32| {
                let per_pass = |x: f64| x * 1e3 / f64::from(v);
                format!(
                    "{v} verifying drafts, a pass queueing {:.2} ms (drafting {:.2}, launching {:.2}) and waiting {:.2}",
                    per_pass(self.verify_queue_s),
                    per_pass(self.verify_draft_s),
                    per_pass(self.verify_launch_s),
                    per_pass(self.verify_wait_s)
                )
            };
            let verified = match (self.verified, self.proposals) {
                (0, _) => String::new(),
                (v, 0) => format!(" ({})", pass(v)),
                (v, p) => format!(
                    " ({}; draft models drafted {:.1} rows a proposal)",
                    pass(v),
                    self.proposed_rows as f64 / f64::from(p)
                ),
            };
            tracing::info!(
                "decode ({mode}): {} steps{verified}, {:.1} rows on average, {:.2} ms/step: queueing {:.2} (launching {:.2}), waiting {:.2}",
                self.steps,
                self.rows as f64 / f64::from(self.steps),
                per(since.elapsed().as_secs_f64()),
                per(self.queue_s),
                per(self.launch_s),
                per(self.wait_s)
            );
        }
        *self = Profile::default();
    }
}

impl DecodeBatch {
    /// An empty batch for `model`; a single row decodes as `mode` says,
    /// several rows eagerly. `costs` are the model's measured pass costs.
    pub fn new(model: Rc<Model>, mode: DecodeMode, costs: Rc<RefCell<PassCosts>>) -> Self {
        Self {
            model,
            mode,
            cache: None,
            rows: Vec::new(),
            ahead: None,
            profile: Profile::default(),
            costs,
            plain_before: None,
            drafters: Vec::new(),
        }
    }

    /// Rows in the batch.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// The sequences in it.
    pub fn sequences(&self) -> impl Iterator<Item = SeqId> + '_ {
        self.rows.iter().map(|r| r.seq)
    }

    /// Adds sequences whose prefill is done: their cache (one row each, in
    /// order) and their first tokens `[rows, 1]`, which were streamed already.
    pub fn join(&mut self, seqs: &[SeqId], cache: KvCache, first: Array) -> Result<(), EngineError> {
        match (self.cache.as_mut(), self.ahead.take()) {
            (Some(mine), Some(ahead)) => {
                mine.join(cache).map_err(EngineError::inference)?;
                self.ahead = Some(mlx_rs::ops::concatenate(&[ahead, first], 0).map_err(EngineError::inference)?);
            }
            _ => {
                self.cache = Some(cache);
                self.ahead = Some(first);
            }
        }
        self.rows.extend(seqs.iter().map(|&seq| Row { seq, taken: true }));
        Ok(())
    }

    /// Drops the rows of `gone` sequences (finished, cancelled, failed).
    pub fn remove(&mut self, gone: &[SeqId]) -> Result<(), EngineError> {
        let keep: Vec<usize> = (0..self.rows.len()).filter(|&i| !gone.contains(&self.rows[i].seq)).collect();
        if keep.len() == self.rows.len() {
            return Ok(());
        }
        for d in &mut self.drafters {
            d.remove(gone).map_err(EngineError::inference)?;
        }
        self.drafters.retain(|d| !d.is_empty());
        if keep.is_empty() {
            self.profile.flush();
            self.rows.clear();
            self.cache = None;
            self.ahead = None;
            return Ok(());
        }
        if let Some(cache) = self.cache.as_mut() {
            cache.keep_rows(&keep).map_err(EngineError::inference)?;
        }
        if let Some(ahead) = self.ahead.take() {
            let idx: Vec<i32> = keep.iter().map(|&i| i as i32).collect();
            let idx = Array::from_slice(&idx, &[idx.len() as i32]);
            self.ahead = Some(ahead.take_axis(&idx, 0).map_err(EngineError::inference)?);
        }
        let mut i = 0;
        self.rows.retain(|_| {
            i += 1;
            keep.contains(&(i - 1))
        });
        Ok(())
    }

    /// One decode step for every row: queues the next tokens, then hands
    /// each sequence the token that was ahead. `seqs` are the rows'
    /// sequences in [`Self::sequences`]' order. Returns the sequences that
    /// ended (with how), for the caller to answer and [`Self::remove`].
    pub fn step(&mut self, mut seqs: Vec<&mut Sequence>) -> Result<Vec<RowOutcome>, EngineError> {
        if seqs.len() != self.rows.len() {
            return Err(EngineError::Internal("a batch row lost its sequence".into()));
        }
        // Rows whose tokens a verify pass handed over and that ended there.
        let mut ended = Vec::new();
        if self.model.lm.verifies_drafts() {
            let (over, stepped) = self.verify_rows(&mut seqs)?;
            if stepped {
                return Ok(over);
            }
            ended = over;
        }
        let (Some(cache), Some(ahead)) = (self.cache.as_mut(), self.ahead.take()) else {
            return Ok(Vec::new());
        };
        let t = std::time::Instant::now();
        // The compiled step is one row's: on the CPU a new batch size would
        // retrace it and compile new kernels (seconds, measured), so rows
        // of a batch decode eagerly.
        let alone = self.rows.len() == 1 && !cache.is_padded();
        let mode = if alone { self.model.decode_mode(self.mode) } else { DecodeMode::Eager };
        let lm = &self.model.lm;
        let logits = if alone {
            // A row alone may carry its prompt's multimodal positions.
            self.model.decode_logits(&ahead, cache, &seqs[0].media_positions(false), self.mode)
        } else {
            let plain = MediaPositions::default();
            lm.embed(&ahead).and_then(|x| lm.forward(&x, cache, &plain)).and_then(|h| lm.logits(&h))
        }
        .map_err(EngineError::inference)?;
        // A constrained row's mask needs the token ahead, read first: such
        // a batch's steps are not pipelined (the others' are).
        let constrained = seqs.iter().any(|s| s.is_constrained());
        if constrained {
            ahead.eval().map_err(EngineError::inference)?;
            ended.extend(self.accept_rows(&ahead, &mut seqs));
        }
        // Each row picks with its own sampler; an all-greedy batch with one argmax.
        let next = pick_rows(&logits, &mut seqs)?;
        // Rows that report logprobs compute them with the step, not when read.
        let mut queued = vec![&next];
        queued.extend(seqs.iter().flat_map(|s| s.logprob_arrays()));
        let built = std::time::Instant::now();
        async_eval(queued).map_err(EngineError::inference)?;
        let queued = Queueing::between(t, t, built, std::time::Instant::now());
        if !constrained {
            ahead.eval().map_err(EngineError::inference)?;
            ended.extend(self.accept_rows(&ahead, &mut seqs));
        }
        let took = t.elapsed().as_secs_f64();
        self.profile.record(t, self.rows.len(), Some(mode), queued, took - queued.total());
        if self.plain_before == Some(self.rows.len()) {
            self.costs.borrow_mut().plain_step(self.rows.len(), took);
        }
        self.plain_before = Some(self.rows.len());
        self.ahead = Some(next);
        Ok(ended)
    }

    /// A step with drafts (a draft model's, or prompt lookup's: speculation) for the rows that
    /// draft: every row's token ahead, then that row's drafted tokens, go
    /// through the model in one pass (`[rows, 1 + most drafts]`; a row with
    /// fewer drafts is filled with its last token, which it never accepts),
    /// which gives the model's own pick after each position. The leading
    /// drafts a row's model agrees with are accepted (each a step saved;
    /// a sampled row accepts by the speculative sampling rule instead),
    /// its cache forgets the rest (rows forget different numbers of
    /// positions: [`KvCache::trim_rows`]), and the model's pick after its
    /// last accepted token is its new token ahead. A constrained row's
    /// picks are masked position by position (its drafts stand up to the
    /// first its grammar forbids); a row that reports log-probabilities has
    /// them from this pass. A row that does not draft (drafts off, resting
    /// after a miss) takes its pick after the first position, as a plain
    /// step would have, and forgets the others. Greedy output is the same
    /// as without drafts.
    ///
    /// Returns the rows that ended, and whether the step was taken: not
    /// when no row drafted anything or the cache cannot be cut back (the
    /// caller then takes a plain step; the tokens ahead were handed over).
    fn verify_rows(&mut self, seqs: &mut [&mut Sequence]) -> Result<(Vec<RowOutcome>, bool), EngineError> {
        let cache_fits = self.cache.as_ref().is_some_and(|c| !c.has_states());
        let wants: Vec<bool> = seqs.iter_mut().map(|s| s.wants_draft()).collect();
        let Some(ahead) = self.ahead.as_ref().filter(|_| cache_fits && wants.contains(&true)) else {
            return Ok((Vec::new(), false));
        };
        // How wide a pass pays (1: not at all), unless a row insists.
        let outlooks: Vec<_> =
            seqs.iter().zip(&wants).filter(|(_, &w)| w).filter_map(|(s, _)| s.draft_outlook()).collect();
        let drafting: Vec<_> = outlooks.iter().map(|(d, _)| *d).collect();
        let width = match outlooks.iter().any(|(_, forced)| *forced) {
            true => 1 + drafting.iter().map(|d| d.k).max().unwrap_or(0),
            false => draft_costs::choose_width(&self.costs.borrow(), self.rows.len(), &drafting),
        };
        if width == 1 {
            return Ok((Vec::new(), false));
        }
        ahead.eval().map_err(EngineError::inference)?;
        // The wait for the token ahead belongs to the step that queued it.
        let started = std::time::Instant::now();
        self.plain_before = None;
        let tokens: Vec<u32> = ahead.as_slice::<u32>().to_vec();
        // The drafts continue each history up to its token ahead: it is
        // handed over first (unless its prefill already did).
        let mut ended = Vec::new();
        for ((row, s), &token) in self.rows.iter_mut().zip(seqs.iter_mut()).zip(&tokens) {
            if !std::mem::replace(&mut row.taken, true) {
                if let Some(end) = s.accept(token) {
                    ended.push((row.seq, end));
                }
            }
        }
        // Which rows drafted (and must hear how it went, even if nothing
        // was proposed or verified: a draft model's cache holds its drafts),
        // and the seconds their draft models took (not the pass's cost).
        let mut drafted = vec![false; seqs.len()];
        let mut drafts = vec![Vec::new(); seqs.len()];
        // Rows whose draft model proposes: (row, how many).
        let mut by_model = Vec::new();
        for (r, (s, row)) in seqs.iter_mut().zip(&self.rows).enumerate() {
            let over = ended.iter().any(|(id, _)| *id == row.seq);
            drafted[r] = wants[r] && !over;
            if drafted[r] {
                match s.draft(width - 1) {
                    Drafts::Ready(d) => drafts[r] = d,
                    Drafts::Model(k) => by_model.push((r, k)),
                }
            }
        }
        let drafting_secs = self.propose(seqs, &by_model, &mut drafts)?;
        // A constrained row's drafts stand up to the first one its grammar
        // forbids; its picks are masked position by position.
        let mut allowed = Vec::with_capacity(drafts.len());
        for (s, d) in seqs.iter_mut().zip(drafts.iter_mut()) {
            let along = if d.is_empty() { None } else { s.allowed_along(d)? };
            if let Some(a) = &along {
                d.truncate(a.len() - 1);
            }
            allowed.push(along);
        }
        let drafted_at = std::time::Instant::now();
        let width = 1 + drafts.iter().map(Vec::len).max().unwrap_or(0);
        let Some(cache) = self.cache.as_mut().filter(|_| width > 1) else {
            for (r, _) in drafted.iter().enumerate().filter(|(_, &d)| d) {
                self.drafts_verified(r, &*seqs[r], 0);
                seqs[r].verified(0, 0);
            }
            return Ok((ended, false));
        };
        let mut ids = Vec::with_capacity(drafts.len() * width);
        for (&token, d) in tokens.iter().zip(&drafts) {
            ids.push(token);
            ids.extend_from_slice(d);
            let fill = d.last().copied().unwrap_or(token);
            ids.extend(std::iter::repeat_n(fill, width - 1 - d.len()));
        }
        let lm = &self.model.lm;
        let input = Array::from_slice(&ids, &[drafts.len() as i32, width as i32]);
        let packed = crate::model::layers::pass_weights_packed();
        let logits = crate::model::layers::with_packed_weights(packed, || {
            lm.embed(&input)
                .and_then(|x| lm.forward(&x, cache, &MediaPositions::default()))
                .and_then(|h| lm.logits_all(&h))
        })
        .map_err(EngineError::inference)?;
        // Rows that draft: the argmax after every position (masked for a
        // constrained row). The others: the argmax after the first, or
        // their own pick there (sampler, constraint, log-probabilities).
        let all = argmax_axis(&logits, -1, None).map_err(EngineError::inference)?;
        let mut first = Vec::with_capacity(drafts.len());
        for (r, (s, d)) in seqs.iter_mut().zip(&drafts).enumerate() {
            use mlx_rs::ops::indexing::IndexOp;
            let own = d.is_empty() && !s.picks_argmax();
            first.push(if own { Some(s.pick(&logits.index((r as i32, 0..1, ..)))?) } else { None });
        }
        let masked = masked_picks(&logits, &drafts, &allowed)?;
        let mut queued = vec![&all];
        queued.extend(first.iter().flatten());
        queued.extend(masked.iter().flatten());
        queued.extend(seqs.iter().flat_map(|s| s.logprob_arrays()));
        // Dispatched, then waited for: the log's split of a pass into its
        // host work (drafting, building, launching) and the device's.
        let built = std::time::Instant::now();
        async_eval(queued.clone()).map_err(EngineError::inference)?;
        let dispatched = Queueing::between(started, drafted_at, built, std::time::Instant::now());
        mlx_rs::transforms::eval(queued).map_err(EngineError::inference)?;
        let all = all.as_slice::<u32>();
        let mut forget = Vec::with_capacity(drafts.len());
        let mut next = Vec::with_capacity(drafts.len());
        let mut runs = Vec::with_capacity(drafts.len());
        for (r, d) in drafts.iter().enumerate() {
            let picks = &all[r * width..(r + 1) * width];
            // A greedy row's picks: its argmax, under its grammar's masks if any.
            let greedy = match &masked[r] {
                Some(m) => Some(m.as_slice::<u32>()),
                None => seqs[r].is_greedy().then_some(picks),
            };
            let (accepted, token) = match greedy {
                _ if d.is_empty() => (0, first[r].as_ref().map_or(picks[0], |f| f.as_slice::<u32>()[0])),
                Some(picks) => {
                    let accepted = lookup::accepted_prefix(d, picks);
                    (accepted, picks[accepted])
                }
                // A sampled row: the speculative sampling rule.
                None => {
                    use mlx_rs::ops::indexing::IndexOp;
                    let row = logits.index((r as i32, ..d.len() as i32 + 1, ..));
                    seqs[r].accept_drafts(&row, d)?
                }
            };
            if !d.is_empty() {
                use mlx_rs::ops::indexing::IndexOp;
                seqs[r].queue_logprobs(&logits.index((r as i32, ..accepted as i32 + 1, ..)))?;
            }
            forget.push((width - 1 - accepted) as i32);
            next.push(token);
            runs.push(&d[..accepted]);
        }
        if !cache.trim_rows(&forget).map_err(EngineError::inference)? {
            return Err(EngineError::Internal("a verified cache could not forget its rejected drafts".into()));
        }
        let took = started.elapsed().as_secs_f64();
        self.profile.record(started, self.rows.len(), None, dispatched, took - dispatched.total());
        self.costs.borrow_mut().verify_pass(self.rows.len() * width, (took - drafting_secs).max(0.0));
        for (r, run) in runs.iter().enumerate().filter(|&(r, _)| drafted[r]) {
            self.drafts_verified(r, &*seqs[r], run.len());
        }
        for ((((row, s), d), run), &drafted) in
            self.rows.iter_mut().zip(seqs.iter_mut()).zip(&drafts).zip(runs).zip(&drafted)
        {
            row.taken = false;
            if !drafted {
                continue;
            }
            s.verified(d.len(), run.len());
            for &t in run {
                if let Some(end) = s.accept(t) {
                    ended.push((row.seq, end));
                    break;
                }
            }
        }
        self.ahead = Some(Array::from_slice(&next, &[next.len() as i32, 1]));
        Ok((ended, true))
    }

    /// The drafts of the rows `asks` (row, how many) that come from draft
    /// models, proposed by each model's [`DraftBatch`] for all its rows at
    /// once, into `drafts`; the seconds the draft models took.
    fn propose(
        &mut self,
        seqs: &mut [&mut Sequence],
        asks: &[(usize, usize)],
        drafts: &mut [Vec<u32>],
    ) -> Result<f64, EngineError> {
        let mut secs = 0.0;
        let mut left: Vec<(usize, usize)> = asks.to_vec();
        while let Some(&(first, _)) = left.first() {
            let Some(run) = seqs[first].draft_run() else { break };
            let seq = self.rows[first].seq;
            let at = match self.drafters.iter().position(|d| d.serves(run, seq)) {
                Some(at) => at,
                None => {
                    self.drafters.push(DraftBatch::for_row(run, seq, self.mode));
                    self.drafters.len() - 1
                }
            };
            let serves = |r: usize| seqs[r].draft_run().is_some_and(|d| self.drafters[at].serves(d, self.rows[r].seq));
            let (mine, others): (Vec<_>, Vec<_>) = left.into_iter().partition(|&(r, _)| serves(r));
            left = others;
            let asked: Vec<DraftAsk> =
                mine.iter().map(|&(r, k)| DraftAsk { seq: self.rows[r].seq, history: seqs[r].history(), k }).collect();
            let (proposals, took) = self.drafters[at].propose(&asked).map_err(EngineError::inference)?;
            secs += took;
            self.profile.proposals += 1;
            self.profile.proposed_rows += asked.len();
            let tokens: usize = asked.iter().map(|a| a.k).max().unwrap_or(0) * asked.len();
            let per = took / tokens.max(1) as f64;
            for ((r, _), p) in mine.into_iter().zip(proposals) {
                drafts[r] = seqs[r].proposed(p, per);
            }
        }
        Ok(secs)
    }

    /// Row `r`'s draft model (if its sequence `s` has one) hears that the
    /// target accepted `accepted` of its drafts.
    fn drafts_verified(&mut self, r: usize, s: &Sequence, accepted: usize) {
        let Some(run) = s.draft_run() else { return };
        let seq = self.rows[r].seq;
        if let Some(d) = self.drafters.iter_mut().find(|d| d.serves(run, seq)) {
            d.verified(seq, accepted);
        }
    }

    /// Hands each row's sequence its token of `ahead` (evaluated), except
    /// rows whose token was taken already; the sequences that ended.
    fn accept_rows(&mut self, ahead: &Array, seqs: &mut [&mut Sequence]) -> Vec<RowOutcome> {
        let tokens: Vec<u32> = ahead.as_slice::<u32>().to_vec();
        let mut ended = Vec::new();
        for ((row, s), &token) in self.rows.iter_mut().zip(seqs.iter_mut()).zip(&tokens) {
            if std::mem::replace(&mut row.taken, false) {
                continue;
            }
            if let Some(end) = s.accept(token) {
                ended.push((row.seq, end));
            }
        }
        ended
    }
}

/// For each constrained drafting row (`allowed` per position, from
/// `Constrained::allowed_along`), the argmax of its logits after each of
/// its positions under that position's mask; `None` for the other rows.
fn masked_picks(
    logits: &Array,
    drafts: &[Vec<u32>],
    allowed: &[Option<Vec<crate::decoding::constraint::Allowed>>],
) -> Result<Vec<Option<Array>>, EngineError> {
    use mlx_rs::ops::indexing::IndexOp;
    let vocab = logits.shape()[2];
    let mut out = Vec::with_capacity(drafts.len());
    for (r, (d, along)) in drafts.iter().zip(allowed).enumerate() {
        let Some(along) = along.as_ref().filter(|_| !d.is_empty()) else {
            out.push(None);
            continue;
        };
        let n = d.len() + 1;
        let keep: Vec<bool> = along[..n].iter().flat_map(|a| a.keep(vocab as usize)).collect();
        let keep = Array::from_slice(&keep, &[n as i32, vocab]);
        let row = logits.index((r as i32, ..n as i32, ..));
        let masked = mlx_rs::ops::select(&keep, &row, Array::from_f32(f32::NEG_INFINITY));
        out.push(Some(masked.and_then(|m| argmax_axis(&m, -1, None)).map_err(EngineError::inference)?));
    }
    Ok(out)
}

/// Each row's next token `[B, 1]` from logits `[B, vocab]`, picked by that
/// row's sampler; a batch of greedy rows with one argmax.
pub fn pick_rows(logits: &Array, seqs: &mut [&mut Sequence]) -> Result<Array, EngineError> {
    if seqs.iter().all(|s| s.picks_argmax()) {
        return argmax_axis(logits, -1, None).and_then(|a| a.reshape(&[-1, 1])).map_err(EngineError::inference);
    }
    let mut picks = Vec::with_capacity(seqs.len());
    for (i, s) in seqs.iter_mut().enumerate() {
        let row = logits.take_axis(Array::from_slice(&[i as i32], &[1]), 0).map_err(EngineError::inference)?;
        picks.push(s.pick(&row)?);
    }
    mlx_rs::ops::concatenate(&picks, 0).map_err(EngineError::inference)
}

/// Prefills several prompts of one model as one left-padded batch (as
/// mlx-lm's `BatchGenerator` does): all but each prompt's last position in
/// chunks of `chunk` columns, then the last column alone, and each row's
/// first token. A burst of new requests then costs one pass over the
/// weights per chunk instead of one per request. Returns the batch's cache,
/// the first tokens `[B, 1]` (streamed by each sequence already) and, per
/// row, how its sequence ended if it ended on its first token.
#[allow(clippy::type_complexity)]
pub fn prefill_together(
    model: &Model,
    seqs: &mut [&mut Sequence],
    chunk: usize,
    prompts: &mut crate::prompt_cache::PromptCache,
) -> Result<(KvCache, Array, Vec<Option<Result<super::generate::Finished, EngineError>>>), EngineError> {
    use mlx_rs::ops::indexing::IndexOp;
    let lm = &model.lm;
    let longest = seqs.iter().map(|s| s.prompt_tokens()).max().unwrap_or(0) as i32;
    let mut rows = Vec::with_capacity(seqs.len());
    let mut pads = Vec::with_capacity(seqs.len());
    for s in seqs.iter_mut() {
        s.prefill_started();
        let e = s.prompt_embeds();
        let pad = longest - e.shape()[1];
        pads.push(pad);
        rows.push(if pad == 0 {
            e.clone()
        } else {
            let zeros = mlx_rs::ops::zeros_dtype(&[1, pad, e.shape()[2]], e.dtype()).map_err(EngineError::inference)?;
            mlx_rs::ops::concatenate(&[zeros, e.clone()], 1).map_err(EngineError::inference)?
        });
    }
    let embeds = mlx_rs::ops::concatenate(&rows, 0).map_err(EngineError::inference)?;
    drop(rows);
    let mut cache = KvCache::batch(lm.num_layers(), pads);
    let mut at = 0;
    while at < longest - 1 {
        let end = (at + chunk as i32).min(longest - 1);
        lm.forward(&embeds.index((.., at..end, ..)), &mut cache, &MediaPositions::default())
            .map_err(EngineError::inference)?;
        if end < longest - 1 {
            mlx_rs::transforms::eval(cache.arrays()).map_err(EngineError::inference)?;
        }
        at = end;
    }
    let h = lm
        .forward(&embeds.index((.., longest - 1..longest, ..)), &mut cache, &MediaPositions::default())
        .map_err(EngineError::inference)?;
    let next = pick_rows(&lm.logits(&h).map_err(EngineError::inference)?, seqs)?;
    next.eval().map_err(EngineError::inference)?;
    let tokens: Vec<u32> = next.as_slice::<u32>().to_vec();
    let ends = seqs
        .iter_mut()
        .zip(tokens)
        .enumerate()
        .map(|(row, (s, t))| s.prefilled_together(t, &cache, row, prompts))
        .collect();
    Ok((cache, next, ends))
}
