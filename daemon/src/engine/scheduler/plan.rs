//! The scheduler's decisions, made from plain data: which waiting sequences
//! are admitted, refused or let go, which prompts are prefilled together
//! and how many prefill calls each sequence gets this tick. Nothing here
//! touches MLX, so every rule is unit-tested (`tests` below, after vLLM's
//! `tests/v1/core/test_scheduler.py`); `super` carries a plan out.

use std::collections::{HashMap, VecDeque};

/// A sequence's key in the scheduler.
pub type SeqId = u64;

/// Which resident model a sequence runs on (the model's address: a model
/// reloaded under the same name is another).
pub type ModelId = usize;

const MIB: u64 = 1 << 20;

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

/// What the plan knows of a sequence, read from it at the start of a tick.
#[derive(Debug, Clone, Default)]
pub struct Facts {
    pub model: ModelId,
    /// KV bytes its prompt and its whole answer may take.
    pub kv_need: u64,
    pub prompt_tokens: usize,
    /// Its prompt may be prefilled in one padded batch with others' (not
    /// begun, nothing reused, no image blocks, no multimodal rope).
    pub groupable: bool,
    /// Its client cancelled or went away.
    pub gone: bool,
}

/// Why a sequence is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// Its KV would not fit even with its model alone in the budget.
    NeverFits { need: u64, beside: u64 },
    /// `max_queue` sequences are already waiting.
    QueueFull { waiting: usize },
    /// The oldest waiting sequence does not fit in what the resident models
    /// leave, and nothing running will free any.
    DoesNotFitNow { need: u64, free: u64 },
}

impl Refusal {
    /// The sentence its client reads.
    pub fn message(&self, prompt_tokens: usize, max_new: usize, model: &str) -> String {
        match *self {
            Refusal::NeverFits { need, beside } => format!(
                "this request's KV cache ({prompt_tokens} prompt tokens plus up to {max_new} generated) needs about \
                 {} MiB, more than the memory budget leaves beside model {model} ({} MiB); lower max_tokens or \
                 raise memory_budget_mib in config.toml",
                need.div_ceil(MIB),
                beside / MIB
            ),
            Refusal::QueueFull { waiting } => format!(
                "mlxbcd is busy: {waiting} requests are already waiting (max_queue in config.toml); retry shortly"
            ),
            Refusal::DoesNotFitNow { need, free } => format!(
                "this request's KV cache needs about {} MiB and the memory budget leaves {} MiB beside the \
                 resident models; unload one (`mlxbc unload NAME`) or lower max_tokens",
                need.div_ceil(MIB),
                free / MIB
            ),
        }
    }
}

/// What one tick does, in this order.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct TickPlan {
    /// Waiting or prefilling sequences whose clients left: let go.
    pub abandon: Vec<SeqId>,
    /// The oldest waiting sequence when it can never fit: refused.
    pub refuse: Vec<(SeqId, Refusal)>,
    /// Admitted, oldest first (their KV reserved; they start prefilling).
    pub admit: Vec<SeqId>,
    /// Prompts prefilled together as one padded batch (two or more).
    pub group: Vec<SeqId>,
    /// Then, in order, how many prefill calls each sequence makes.
    pub prefill: Vec<(SeqId, usize)>,
}

/// Where every sequence stands: waiting (arrival order), prefilling
/// (admission order), decoding (by model); and the KV reserved at admission.
#[derive(Debug, Default)]
pub struct Queues {
    waiting: VecDeque<SeqId>,
    prefilling: VecDeque<SeqId>,
    decoding: HashMap<SeqId, ModelId>,
    reserved: HashMap<SeqId, u64>,
    reserved_bytes: u64,
}

impl Queues {
    /// Sequences waiting for admission, oldest first.
    pub fn waiting(&self) -> impl Iterator<Item = SeqId> + '_ {
        self.waiting.iter().copied()
    }

    /// Admitted sequences still prefilling, oldest first.
    pub fn prefilling(&self) -> impl Iterator<Item = SeqId> + '_ {
        self.prefilling.iter().copied()
    }

    pub fn is_waiting(&self, id: SeqId) -> bool {
        self.waiting.contains(&id)
    }

    /// KV bytes reserved by admitted sequences.
    pub fn reserved_bytes(&self) -> u64 {
        self.reserved_bytes
    }

    /// What a sequence reserved (0 while it waits).
    pub fn reserved_by(&self, id: SeqId) -> u64 {
        self.reserved.get(&id).copied().unwrap_or(0)
    }

    /// Whether a new sequence may queue: refused when its KV would not fit
    /// even beside its own model alone (`beside`: what the budget leaves
    /// next to it), or when the queue is full.
    pub fn check_arrival(&self, limits: &SchedulerLimits, kv_need: u64, beside: u64) -> Result<(), Refusal> {
        if kv_need > beside {
            return Err(Refusal::NeverFits { need: kv_need, beside });
        }
        if self.waiting.len() >= limits.max_queue {
            return Err(Refusal::QueueFull { waiting: self.waiting.len() });
        }
        Ok(())
    }

    /// Queues a sequence at the back.
    pub fn arrive(&mut self, id: SeqId) {
        self.waiting.push_back(id);
    }

    /// Admits a waiting sequence, reserving its KV.
    pub fn admit(&mut self, id: SeqId, kv_need: u64) {
        self.waiting.retain(|&w| w != id);
        self.prefilling.push_back(id);
        self.reserved.insert(id, kv_need);
        self.reserved_bytes += kv_need;
    }

    /// A prefilled sequence decodes now, in its model's batch.
    pub fn start_decoding(&mut self, id: SeqId, model: ModelId) {
        self.prefilling.retain(|&p| p != id);
        self.decoding.insert(id, model);
    }

    /// A sequence left (ended, refused, abandoned): its reservation is free.
    pub fn leave(&mut self, id: SeqId) {
        self.waiting.retain(|&w| w != id);
        self.prefilling.retain(|&p| p != id);
        self.decoding.remove(&id);
        self.reserved_bytes -= self.reserved.remove(&id).unwrap_or(0);
    }

    /// Admitted sequences (prefilling or decoding) of a model.
    fn admitted_of(&self, model: ModelId, facts: &HashMap<SeqId, Facts>) -> usize {
        let prefilling = self.prefilling.iter().filter(|id| facts.get(id).is_some_and(|f| f.model == model)).count();
        prefilling + self.decoding.values().filter(|&&m| m == model).count()
    }

    /// The plan for one tick, given every sequence's facts and the memory
    /// the budget leaves beside the resident models (`free_bytes`).
    /// `prefill_calls` gives the tokens each of a sequence's prefill calls
    /// still to come takes (`Sequence::prefill_calls`); it is asked only for
    /// the few sequences this tick's prefill budget reaches, not for every
    /// waiting one.
    ///
    /// Admission is first come, first served: the oldest waiting sequence is
    /// admitted while its KV fits beside what is reserved and its model's
    /// batch has room, and nothing behind it overtakes it. When it does not
    /// fit and nothing is reserved, nothing running will free memory: it is
    /// refused. Prefill: a burst of groupable prompts on the oldest
    /// prefilling sequence's model is prefilled as one padded batch (rows ×
    /// longest prompt within the budget); the rest of the budget goes to
    /// prefill calls, oldest first, each costing its tokens (at least one).
    pub fn plan(
        &self,
        facts: &HashMap<SeqId, Facts>,
        mut prefill_calls: impl FnMut(SeqId) -> Vec<usize>,
        limits: &SchedulerLimits,
        free_bytes: u64,
    ) -> TickPlan {
        let mut plan = TickPlan::default();
        let gone = |id: &SeqId| facts.get(id).is_none_or(|f| f.gone);
        plan.abandon = self.waiting.iter().chain(&self.prefilling).copied().filter(gone).collect();

        let mut reserved = self.reserved_bytes;
        let mut admitted: HashMap<ModelId, usize> = HashMap::new();
        let mut prefilling: Vec<SeqId> = self.prefilling.iter().copied().filter(|id| !gone(id)).collect();
        for id in self.waiting.iter().copied().filter(|id| !gone(id)) {
            let f = &facts[&id];
            let of_model = admitted.entry(f.model).or_insert_with(|| self.admitted_of(f.model, facts));
            let fits = reserved + f.kv_need <= free_bytes;
            if fits && *of_model < limits.max_batch {
                reserved += f.kv_need;
                *of_model += 1;
                plan.admit.push(id);
                prefilling.push(id);
                continue;
            }
            if !fits && reserved == 0 {
                plan.refuse.push((id, Refusal::DoesNotFitNow { need: f.kv_need, free: free_bytes }));
                continue;
            }
            break;
        }

        let mut budget = limits.prefill_budget;
        plan.group = prefill_group(&prefilling, facts, limits, budget);
        if !plan.group.is_empty() {
            let longest = plan.group.iter().map(|id| facts[id].prompt_tokens).max().unwrap_or(0);
            budget = budget.saturating_sub(longest * plan.group.len());
        }
        for id in prefilling.into_iter().filter(|id| !plan.group.contains(id)) {
            if budget == 0 {
                break;
            }
            let all_calls = prefill_calls(id);
            let mut calls = 0;
            for &tokens in &all_calls {
                if budget == 0 {
                    break;
                }
                budget = budget.saturating_sub(tokens.max(1));
                calls += 1;
            }
            if calls > 0 {
                plan.prefill.push((id, calls));
            }
            // A sequence still prefilling after its calls holds the rest of
            // the budget's order: those behind it wait for the next tick.
            if calls < all_calls.len() {
                break;
            }
        }
        plan
    }
}

/// The oldest prefilling sequences on the first one's model that can be
/// prefilled together, while the padded batch (rows × longest prompt)
/// stays within `budget` tokens and `max_batch` rows; empty unless at
/// least two, and unless the oldest is groupable.
fn prefill_group(
    prefilling: &[SeqId],
    facts: &HashMap<SeqId, Facts>,
    limits: &SchedulerLimits,
    budget: usize,
) -> Vec<SeqId> {
    let Some(head) = prefilling.first().map(|id| &facts[id]) else { return vec![] };
    if !head.groupable {
        return vec![];
    }
    let (mut group, mut longest) = (Vec::new(), 0);
    for &id in prefilling {
        let f = &facts[&id];
        if f.model != head.model || !f.groupable {
            continue;
        }
        let n = f.prompt_tokens.max(longest);
        if !group.is_empty() && (n * (group.len() + 1) > budget || group.len() >= limits.max_batch) {
            break;
        }
        longest = n;
        group.push(id);
    }
    if group.len() >= 2 {
        group
    } else {
        vec![]
    }
}

#[cfg(test)]
mod tests;
