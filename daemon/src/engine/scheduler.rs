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

use super::batch::{prefill_together, DecodeBatch, SeqId};
use super::generate::Finished;
use super::sequence::{Prefilled, Sequence};
use super::SessionTurn;
use crate::error::EngineError;
use crate::prompt_cache::PromptCache;
use mlxbc_shared::{KeepAlive, SequenceInfo};
use std::collections::{HashMap, VecDeque};
use std::rc::Rc;

const MIB: u64 = 1 << 20;

/// A sequence and what answering it needs once it ends.
pub struct Active {
    pub seq: Sequence,
    /// The request's stop strings (to cut the answer saved to a session).
    pub stop: Vec<String>,
    pub turn: Option<SessionTurn>,
    pub keep_alive: Option<KeepAlive>,
    /// KV bytes reserved at admission (0 until admitted).
    reserved: u64,
}

impl Active {
    pub fn new(seq: Sequence, stop: Vec<String>, turn: Option<SessionTurn>, keep_alive: Option<KeepAlive>) -> Self {
        Self { seq, stop, turn, keep_alive, reserved: 0 }
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
}

/// Limits the scheduler keeps.
#[derive(Debug, Clone, Copy)]
pub struct SchedulerLimits {
    /// Sequences of one model admitted at once (prefilling or decoding).
    pub max_batch: usize,
    /// Sequences waiting for admission before new ones are refused.
    pub max_queue: usize,
    /// Prompt tokens prefilled per tick, across sequences.
    pub prefill_budget: usize,
}

/// Every sequence in flight.
pub struct Scheduler {
    limits: SchedulerLimits,
    next_id: SeqId,
    active: HashMap<SeqId, Active>,
    /// Not admitted yet, in arrival order.
    waiting: VecDeque<SeqId>,
    /// Admitted and prefilling, oldest first.
    prefilling: VecDeque<SeqId>,
    batches: HashMap<BatchKey, DecodeBatch>,
    reserved_bytes: u64,
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
            waiting: VecDeque::new(),
            prefilling: VecDeque::new(),
            batches: HashMap::new(),
            reserved_bytes: 0,
            changed: false,
        }
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
        self.waiting.len()
    }

    /// KV bytes reserved by admitted sequences.
    pub fn reserved_bytes(&self) -> u64 {
        self.reserved_bytes
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
        let waiting: std::collections::HashSet<SeqId> = self.waiting.iter().copied().collect();
        let mut out: Vec<(SeqId, SequenceInfo)> = self
            .active
            .iter()
            .map(|(&id, a)| {
                let state = if waiting.contains(&id) {
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
                    reserved_kv_bytes: a.reserved,
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
    pub fn add(&mut self, active: Active, never_fits_beside: u64) -> Result<(), (Active, EngineError)> {
        let need = kv_need(&active.seq);
        if need > never_fits_beside {
            let e = EngineError::OutOfMemory(format!(
                "this request's KV cache ({} prompt tokens plus up to {} generated) needs about {} MiB, \
                 more than the memory budget leaves beside model {} ({} MiB); lower max_tokens or raise \
                 memory_budget_mib in config.toml",
                active.seq.prompt_tokens(),
                active.seq.max_positions() - active.seq.prompt_tokens(),
                need.div_ceil(MIB),
                active.seq.model_name(),
                never_fits_beside / MIB
            ));
            return Err((active, e));
        }
        if self.waiting.len() >= self.limits.max_queue {
            let e = EngineError::Busy(format!(
                "mlxbcd is busy: {} requests are already waiting (max_queue in config.toml); retry shortly",
                self.waiting.len()
            ));
            return Err((active, e));
        }
        let id = self.next_id;
        self.next_id += 1;
        self.active.insert(id, active);
        self.waiting.push_back(id);
        self.changed = true;
        Ok(())
    }

    /// Admits waiting sequences in arrival order while their KV fits in
    /// `free_bytes` (the budget less the resident models) beside what is
    /// reserved, and their model's batch has room. When nothing is running
    /// and the oldest still does not fit, it never will: it is refused.
    fn admit(&mut self, free_bytes: u64, ended: &mut Vec<Ended>) {
        while let Some(&id) = self.waiting.front() {
            let Some(a) = self.active.get(&id) else {
                self.waiting.pop_front();
                continue;
            };
            let need = kv_need(&a.seq);
            let model = Rc::as_ptr(a.seq.model()) as usize;
            // Admitted: prefilling, or a row of one of the model's batches.
            let of_model =
                |id: &SeqId| self.active.get(id).is_some_and(|o| Rc::as_ptr(o.seq.model()) as usize == model);
            let admitted_of_model = self.prefilling.iter().filter(|i| of_model(i)).count()
                + self.batches.iter().filter(|(k, _)| k.model == model).map(|(_, b)| b.len()).sum::<usize>();
            let fits = self.reserved_bytes + need <= free_bytes;
            if fits && admitted_of_model < self.limits.max_batch {
                self.waiting.pop_front();
                self.reserved_bytes += need;
                if let Some(a) = self.active.get_mut(&id) {
                    a.reserved = need;
                }
                self.prefilling.push_back(id);
                self.changed = true;
                continue;
            }
            if !fits && self.reserved_bytes == 0 {
                self.waiting.pop_front();
                let a = self.take(id).expect("a waiting sequence");
                let e = EngineError::OutOfMemory(format!(
                    "this request's KV cache needs about {} MiB and the memory budget leaves {} MiB beside the \
                     resident models; unload one (`mlxbc unload NAME`) or lower max_tokens",
                    need.div_ceil(MIB),
                    free_bytes / MIB
                ));
                ended.push((a, Err(e)));
                continue;
            }
            break;
        }
    }

    /// Removes a sequence, releasing its reservation.
    fn take(&mut self, id: SeqId) -> Option<Active> {
        let a = self.active.remove(&id)?;
        self.changed = true;
        self.reserved_bytes -= a.reserved;
        self.waiting.retain(|&w| w != id);
        self.prefilling.retain(|&p| p != id);
        Some(a)
    }

    /// Refuses every sequence not admitted yet (shutting down).
    pub fn refuse_waiting(&mut self) -> Vec<Ended> {
        let ids: Vec<SeqId> = self.waiting.drain(..).collect();
        let err = || EngineError::ShuttingDown("mlxbcd is shutting down".into());
        ids.into_iter().filter_map(|id| self.take(id)).map(|a| (a, Err(err()))).collect()
    }

    /// One round: admission, a budget of prefill chunks, then one decode
    /// step of every batch. Returns the sequences that ended.
    pub fn tick(&mut self, prompts: &mut PromptCache, free_bytes: u64) -> Vec<Ended> {
        let mut ended = Vec::new();
        // A client that left while its request waited is let go at once.
        let gone: Vec<SeqId> = self
            .waiting
            .iter()
            .chain(&self.prefilling)
            .copied()
            .filter(|id| self.active.get(id).is_some_and(|a| a.seq.gone()))
            .collect();
        for id in gone {
            if let Some(a) = self.take(id) {
                ended.push((a, Ok(Finished::Abandoned)));
            }
        }
        self.admit(free_bytes, &mut ended);
        self.prefill(prompts, &mut ended);
        self.decode(&mut ended);
        ended
    }

    fn prefill(&mut self, prompts: &mut PromptCache, ended: &mut Vec<Ended>) {
        let mut budget = self.limits.prefill_budget;
        // A burst of new prompts on one model is prefilled as one batch.
        if let Some((group, cost)) = self.prefill_group(budget) {
            budget = budget.saturating_sub(cost);
            self.prefill_group_now(&group, prompts, ended);
        }
        while budget > 0 {
            let Some(&id) = self.prefilling.front() else { return };
            let Some(a) = self.active.get_mut(&id) else {
                self.prefilling.pop_front();
                continue;
            };
            let step = guarded(|| a.seq.prefill(prompts));
            match step {
                Ok(Prefilled::Chunk { tokens }) => budget = budget.saturating_sub(tokens.max(1)),
                Ok(Prefilled::Ready) => {
                    budget = budget.saturating_sub(1);
                    self.prefilling.pop_front();
                    let (model, mode) = (a.seq.model().clone(), a.seq.decode_mode());
                    let Some((cache, first)) = a.seq.take_for_batch() else { continue };
                    let key =
                        BatchKey { model: Rc::as_ptr(&model) as usize, alone: cache.mrope.is_some().then_some(id) };
                    self.changed = true;
                    let batch = self.batches.entry(key).or_insert_with(|| DecodeBatch::new(model, mode));
                    if let Err(e) = batch.join(&[id], cache, first) {
                        let a = self.take(id).expect("a prefilled sequence");
                        ended.push((a, Err(e)));
                    }
                }
                Ok(Prefilled::Finished(f)) => {
                    let a = self.take(id).expect("a prefilling sequence");
                    ended.push((a, Ok(f)));
                }
                Err(e) => {
                    let a = self.take(id).expect("a prefilling sequence");
                    ended.push((a, Err(e)));
                }
            }
        }
    }

    /// The oldest prefilling sequences on the first one's model that can be
    /// prefilled together, while the padded batch (rows × longest prompt)
    /// stays within `budget` tokens; `None` unless at least two.
    fn prefill_group(&self, budget: usize) -> Option<(Vec<SeqId>, usize)> {
        let head = self.active.get(self.prefilling.front()?)?;
        if !head.seq.can_prefill_together() {
            return None;
        }
        let model = Rc::as_ptr(head.seq.model());
        let (mut group, mut longest) = (Vec::new(), 0);
        for &id in &self.prefilling {
            let Some(a) = self.active.get(&id) else { continue };
            if Rc::as_ptr(a.seq.model()) != model || !a.seq.can_prefill_together() {
                continue;
            }
            let n = a.seq.prompt_tokens().max(longest);
            if !group.is_empty() && (n * (group.len() + 1) > budget || group.len() >= self.limits.max_batch) {
                break;
            }
            longest = n;
            group.push(id);
        }
        let cost = longest * group.len();
        (group.len() >= 2).then_some((group, cost))
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
        self.prefilling.retain(|p| !group.contains(p));
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
            let key = BatchKey { model: Rc::as_ptr(&model) as usize, alone: None };
            let batch = self.batches.entry(key).or_insert_with(|| DecodeBatch::new(model.clone(), mode));
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
                            ended.push((a, Err(EngineError::Inference(e.to_string()))));
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
                        ended.push((a, Err(EngineError::Inference(e.to_string()))));
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

/// KV bytes a sequence may come to hold.
fn kv_need(seq: &Sequence) -> u64 {
    seq.max_positions() as u64 * seq.model().kv_bytes_per_position
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
