//! The scheduler over sequences: every request in flight is a
//! [`Sequence`]; the engine calls [`Scheduler::tick`] between its jobs, and
//! each tick runs a budget of prefill chunks (oldest admitted first) and then
//! one batched decode step per model ([`DecodeBatch`]). So a new request
//! starts within one step of arriving, a long prompt stalls the streams
//! running beside it by at most a chunk, and loads, unloads and prefetches
//! run between steps, never behind a whole generation.
//!
//! Admission: a sequence reserves the KV its prompt and its whole answer
//! may take; it waits (in arrival order) while that does not fit beside the
//! resident models and the reservations of those running, or while its
//! model's batch is full.
//!
//! The decisions are made in [`plan`] from plain data (each sequence's
//! model, KV need, prompt length and prefill calls); this file carries a
//! plan out on the sequences and their batches.

mod plan;

pub use plan::SchedulerLimits;
pub use plan::SeqId;
use plan::{Facts, Queues, Refusal, TickPlan};

use super::batch::{prefill_together, DecodeBatch};
use super::draft_costs::PassCosts;
use super::generate::Finished;
use super::sequence::{Prefilled, Sequence};
use super::SessionTurn;
use crate::error::EngineError;
use crate::model::kv_cache::KvQuantization;
use crate::model::Model;
use crate::prompt_cache::PromptCache;
use mlxbc_shared::{KeepAlive, SequenceInfo};
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::{Rc, Weak};

/// A sequence and what answering it needs once it ends.
pub struct Active {
    pub seq: Sequence,
    /// The request's stop strings (to cut the answer saved to a session).
    pub stop: Vec<String>,
    pub turn: Option<SessionTurn>,
    pub keep_alive: Option<KeepAlive>,
}

impl Active {
    pub fn new(seq: Sequence, stop: Vec<String>, turn: Option<SessionTurn>, keep_alive: Option<KeepAlive>) -> Self {
        Self { seq, stop, turn, keep_alive }
    }
}

/// A sequence that ended, and how.
pub type Ended = (Active, Result<Finished, EngineError>);

/// Which batch a sequence decodes in: its model's (by identity, so a model
/// reloaded under the same name starts a new batch), or its own when its
/// positions cannot be batched (multimodal rope).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct BatchKey {
    model: usize,
    alone: Option<SeqId>,
    /// Rows of one batch keep their keys and values alike (their LoRA
    /// adapters may differ: `KvCache::adapters`).
    kv: Option<KvQuantization>,
}

/// Every sequence in flight.
pub struct Scheduler {
    limits: SchedulerLimits,
    next_id: SeqId,
    active: HashMap<SeqId, Active>,
    /// Waiting, prefilling, decoding; the KV reserved.
    queues: Queues,
    batches: HashMap<BatchKey, DecodeBatch>,
    /// Each model's measured pass costs (speculation's cost model), kept
    /// across its batches while the model is loaded.
    costs: Vec<(Weak<Model>, Rc<RefCell<PassCosts>>)>,
    /// A sequence arrived, was admitted, joined a batch or ended since
    /// [`Self::take_changed`] was last called (status should be republished).
    changed: bool,
}

impl Scheduler {
    pub fn new(limits: SchedulerLimits) -> Self {
        Self {
            limits,
            next_id: 1,
            active: HashMap::new(),
            queues: Queues::default(),
            batches: HashMap::new(),
            costs: Vec::new(),
            changed: false,
        }
    }

    /// `model`'s pass costs (new for a model not seen; unloaded models' go).
    fn costs_of(&mut self, model: &Rc<Model>) -> Rc<RefCell<PassCosts>> {
        self.costs.retain(|(m, _)| m.strong_count() > 0);
        if let Some((_, c)) = self.costs.iter().find(|(m, _)| std::ptr::eq(m.as_ptr(), Rc::as_ptr(model))) {
            return c.clone();
        }
        let c = Rc::new(RefCell::new(PassCosts::default()));
        self.costs.push((Rc::downgrade(model), c.clone()));
        c
    }

    /// True once after sequences came, moved on or went.
    pub fn take_changed(&mut self) -> bool {
        std::mem::take(&mut self.changed)
    }

    /// The limits in force.
    pub fn limits(&self) -> SchedulerLimits {
        self.limits
    }

    /// No sequence in flight.
    pub fn is_empty(&self) -> bool {
        self.active.is_empty()
    }

    /// Sequences waiting for admission.
    pub fn queue_length(&self) -> usize {
        self.queues.waiting().count()
    }

    /// KV bytes reserved by admitted sequences.
    pub fn reserved_bytes(&self) -> u64 {
        self.queues.reserved_bytes()
    }

    /// Names of the models sequences are running on.
    pub fn models_in_use(&self) -> Vec<String> {
        let mut names: Vec<String> = self.active.values().map(|a| a.seq.model_name().to_string()).collect();
        names.sort();
        names.dedup();
        names
    }

    /// What `mlxbc ps` shows of each sequence, oldest first.
    pub fn describe(&self) -> Vec<SequenceInfo> {
        let batch_of: HashMap<SeqId, usize> =
            self.batches.values().flat_map(|b| b.sequences().map(move |s| (s, b.len()))).collect();
        let mut out: Vec<(SeqId, SequenceInfo)> = self
            .active
            .iter()
            .map(|(&id, a)| {
                let state = if self.queues.is_waiting(id) {
                    "waiting"
                } else if a.seq.is_prefilling() {
                    "prefill"
                } else {
                    "decode"
                };
                let info = SequenceInfo {
                    id,
                    model: a.seq.model_name().to_string(),
                    state: state.to_string(),
                    prompt_tokens: a.seq.prompt_tokens() as u32,
                    generated_tokens: a.seq.generated_tokens() as u32,
                    batch_size: batch_of.get(&id).copied().unwrap_or(0) as u32,
                    age_ms: a.seq.received().elapsed().as_millis() as u64,
                    reserved_kv_bytes: self.queues.reserved_by(id),
                };
                (id, info)
            })
            .collect();
        out.sort_by_key(|(id, _)| *id);
        out.into_iter().map(|(_, i)| i).collect()
    }

    /// Queues a sequence for admission. `never_fits_beside` is the memory the
    /// budget leaves next to its own model: a sequence whose KV would not
    /// fit even there is refused now, and so is one past the queue limit.
    #[expect(clippy::result_large_err, reason = "the refused sequence comes back to be answered, once per request")]
    pub fn add(&mut self, active: Active, never_fits_beside: u64) -> Result<(), (Active, EngineError)> {
        if let Err(r) = self.queues.check_arrival(&self.limits, kv_need(&active.seq), never_fits_beside) {
            let e = refusal_error(&r, &active.seq);
            return Err((active, e));
        }
        let id = self.next_id;
        self.next_id += 1;
        self.active.insert(id, active);
        self.queues.arrive(id);
        self.changed = true;
        Ok(())
    }

    /// Removes a sequence, releasing its reservation.
    fn take(&mut self, id: SeqId) -> Option<Active> {
        let a = self.active.remove(&id)?;
        self.changed = true;
        self.queues.leave(id);
        Some(a)
    }

    /// Refuses every sequence not admitted yet (shutting down).
    pub fn refuse_waiting(&mut self) -> Vec<Ended> {
        let ids: Vec<SeqId> = self.queues.waiting().collect();
        let err = || EngineError::ShuttingDown("mlxbcd is shutting down".into());
        ids.into_iter().filter_map(|id| self.take(id)).map(|a| (a, Err(err()))).collect()
    }

    /// One round: the plan for this tick (who leaves, who is admitted, what
    /// is prefilled), carried out, then one decode step of every batch.
    /// Returns the sequences that ended.
    pub fn tick(&mut self, prompts: &mut PromptCache, free_bytes: u64) -> Vec<Ended> {
        let active = &self.active;
        let calls = |id| active.get(&id).map(|a| a.seq.prefill_calls()).unwrap_or_default();
        let plan = self.queues.plan(&self.facts(), calls, &self.limits, free_bytes);
        let mut ended = Vec::new();
        self.carry_out(plan, prompts, &mut ended);
        self.decode(&mut ended);
        ended
    }

    /// What the plan needs of the sequences not decoding yet.
    fn facts(&self) -> HashMap<SeqId, Facts> {
        self.queues
            .waiting()
            .chain(self.queues.prefilling())
            .filter_map(|id| {
                let seq = &self.active.get(&id)?.seq;
                let facts = Facts {
                    model: model_id(seq),
                    kv_need: kv_need(seq),
                    prompt_tokens: seq.prompt_tokens(),
                    groupable: seq.can_prefill_together(),
                    gone: seq.gone(),
                };
                Some((id, facts))
            })
            .collect()
    }

    fn carry_out(&mut self, plan: TickPlan, prompts: &mut PromptCache, ended: &mut Vec<Ended>) {
        for id in plan.abandon {
            // A client that left while its request waited is let go at once.
            if let Some(a) = self.take(id) {
                ended.push((a, Ok(Finished::Abandoned)));
            }
        }
        for (id, refusal) in plan.refuse {
            if let Some(a) = self.take(id) {
                let e = refusal_error(&refusal, &a.seq);
                ended.push((a, Err(e)));
            }
        }
        for id in plan.admit {
            let Some(a) = self.active.get(&id) else { continue };
            self.queues.admit(id, kv_need(&a.seq));
            self.changed = true;
        }
        if !plan.group.is_empty() {
            self.prefill_group_now(&plan.group, prompts, ended);
        }
        for (id, calls) in plan.prefill {
            for _ in 0..calls {
                if !self.prefill_once(id, prompts, ended) {
                    break;
                }
            }
        }
    }

    /// One prefill call of a sequence; true while it is still prefilling.
    fn prefill_once(&mut self, id: SeqId, prompts: &mut PromptCache, ended: &mut Vec<Ended>) -> bool {
        let Some(a) = self.active.get_mut(&id) else { return false };
        match guarded(|| a.seq.prefill(prompts)) {
            Ok(Prefilled::Chunk { .. }) => true,
            Ok(Prefilled::Ready) => {
                let (model, mode, alone) = (a.seq.model().clone(), a.seq.decode_mode(), a.seq.has_mrope());
                let kv = a.seq.kv_quantization();
                // A row quantizes when it holds `start` positions of its own,
                // but a batch's rows quantize together: a later start decodes
                // in a batch of its own.
                let alone = alone || kv.is_some_and(|q| q.start > 0);
                let Some((cache, first)) = a.seq.take_for_batch() else { return false };
                let key = BatchKey { model: Rc::as_ptr(&model) as usize, alone: alone.then_some(id), kv };
                self.changed = true;
                self.queues.start_decoding(id, key.model);
                let costs = self.costs_of(&model);
                let batch = self.batches.entry(key).or_insert_with(|| DecodeBatch::new(model, mode, costs));
                if let Err(e) = batch.join(&[id], cache, first) {
                    let a = self.take(id).expect("a prefilled sequence");
                    ended.push((a, Err(e)));
                }
                false
            }
            Ok(Prefilled::Finished(f)) => {
                let a = self.take(id).expect("a prefilling sequence");
                ended.push((a, Ok(f)));
                false
            }
            Err(e) => {
                let a = self.take(id).expect("a prefilling sequence");
                ended.push((a, Err(e)));
                false
            }
        }
    }

    /// Prefills `group` as one batch; those that did not end on their first
    /// token join their model's decode batch together.
    fn prefill_group_now(&mut self, group: &[SeqId], prompts: &mut PromptCache, ended: &mut Vec<Ended>) {
        let Some(head) = self.active.get(&group[0]) else { return };
        let (model, mode) = (head.seq.model().clone(), head.seq.decode_mode());
        let mut by_id: HashMap<SeqId, &mut Sequence> =
            self.active.iter_mut().filter(|(i, _)| group.contains(i)).map(|(&i, a)| (i, &mut a.seq)).collect();
        let mut seqs: Vec<&mut Sequence> = group.iter().filter_map(|i| by_id.remove(i)).collect();
        let chunk = self.limits.prefill_budget;
        tracing::debug!(rows = seqs.len(), "prompts prefilled together");
        let outcome = guarded(|| prefill_together(&model, &mut seqs, chunk, prompts));
        drop(seqs);
        self.changed = true;
        let (mut cache, mut first, ends) = match outcome {
            Ok(made) => made,
            Err(e) => {
                for &id in group {
                    if let Some(a) = self.take(id) {
                        ended.push((a, Err(e.clone())));
                    }
                }
                return;
            }
        };
        let mut keep = Vec::new();
        for (i, (&id, end)) in group.iter().zip(ends).enumerate() {
            match end {
                Some(end) => {
                    if let Some(a) = self.take(id) {
                        ended.push((a, end));
                    }
                }
                None => keep.push(i),
            }
        }
        if keep.is_empty() {
            return;
        }
        let joined: Vec<SeqId> = keep.iter().map(|&i| group[i]).collect();
        let kept = || -> Result<(), EngineError> {
            if keep.len() < group.len() {
                cache.keep_rows(&keep).map_err(EngineError::inference)?;
                let idx: Vec<i32> = keep.iter().map(|&i| i as i32).collect();
                first = first
                    .take_axis(mlx_rs::Array::from_slice(&idx, &[idx.len() as i32]), 0)
                    .map_err(EngineError::inference)?;
            }
            // Quantized prompts are prefilled alone (`can_prefill_together`).
            let key = BatchKey { model: Rc::as_ptr(&model) as usize, alone: None, kv: None };
            for &id in &joined {
                self.queues.start_decoding(id, key.model);
            }
            let costs = self.costs_of(&model);
            let batch = self.batches.entry(key).or_insert_with(|| DecodeBatch::new(model.clone(), mode, costs));
            batch.join(&joined, cache, first)
        };
        if let Err(e) = kept() {
            for &id in &joined {
                if let Some(a) = self.take(id) {
                    ended.push((a, Err(e.clone())));
                }
            }
        }
    }

    fn decode(&mut self, ended: &mut Vec<Ended>) {
        let keys: Vec<BatchKey> = self.batches.keys().copied().collect();
        for key in keys {
            let Some(batch) = self.batches.get_mut(&key) else { continue };
            let ids: Vec<SeqId> = batch.sequences().collect();
            let mut by_id: HashMap<SeqId, &mut Sequence> =
                self.active.iter_mut().filter(|(i, _)| ids.contains(i)).map(|(&i, a)| (i, &mut a.seq)).collect();
            let seqs: Vec<&mut Sequence> = ids.iter().filter_map(|i| by_id.remove(i)).collect();
            let outcome = guarded(|| batch.step(seqs));
            let finished: Vec<SeqId> = match outcome {
                Ok(done) => {
                    let ids: Vec<SeqId> = done.iter().map(|(i, _)| *i).collect();
                    for (id, end) in done {
                        if let Some(a) = self.take(id) {
                            ended.push((a, end));
                        }
                    }
                    ids
                }
                Err(e) => {
                    // A failed step leaves the batch's state unknown: every
                    // row fails with it.
                    tracing::warn!(rows = ids.len(), "a batched decode step failed: {e}");
                    for &id in &ids {
                        if let Some(a) = self.take(id) {
                            ended.push((a, Err(e.clone())));
                        }
                    }
                    self.batches.remove(&key);
                    continue;
                }
            };
            let batch = self.batches.get_mut(&key).expect("the batch just stepped");
            if let Err(e) = batch.remove(&finished) {
                tracing::warn!("leaving a batch failed: {e}");
                let ids: Vec<SeqId> = batch.sequences().collect();
                for id in ids {
                    if let Some(a) = self.take(id) {
                        ended.push((a, Err(e.clone())));
                    }
                }
                self.batches.remove(&key);
                continue;
            }
            if batch.is_empty() {
                self.batches.remove(&key);
            }
        }
    }
}

/// The model a sequence runs on, by address.
fn model_id(seq: &Sequence) -> plan::ModelId {
    Rc::as_ptr(seq.model()) as usize
}

/// The error a refused sequence's client hears.
fn refusal_error(r: &Refusal, seq: &Sequence) -> EngineError {
    let message = r.message(seq.prompt_tokens(), seq.max_positions() - seq.prompt_tokens(), seq.model_name());
    match r {
        Refusal::QueueFull { .. } => EngineError::Busy(message),
        Refusal::NeverFits { .. } | Refusal::DoesNotFitNow { .. } => EngineError::OutOfMemory(message),
    }
}

/// KV bytes a sequence may come to hold.
fn kv_need(seq: &Sequence) -> u64 {
    seq.max_positions() as u64 * seq.kv_bytes_per_position()
}

/// Runs a step; a panic in it (a bug a hostile model file reached) becomes
/// an error of the sequences it touched, not the end of the engine.
fn guarded<T>(f: impl FnOnce() -> Result<T, EngineError>) -> Result<T, EngineError> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(panic) => {
            let what = crate::error::panic_message(&*panic);
            tracing::error!("a step panicked ({what})");
            Err(EngineError::Internal(format!("the engine hit a bug ({what}); the request was dropped")))
        }
    }
}
