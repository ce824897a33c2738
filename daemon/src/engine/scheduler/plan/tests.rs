//! The scheduler's rules on plain data, no model loaded:
//! `cargo test -p mlxbc-daemon --lib scheduler`.

use super::*;

const LIMITS: SchedulerLimits = SchedulerLimits { max_batch: 4, max_queue: 8, prefill_budget: 512 };

/// A sequence on `model` needing `kv` bytes, its prompt `tokens` long.
fn seq(model: ModelId, kv: u64, tokens: usize) -> Facts {
    Facts { model, kv_need: kv, prompt_tokens: tokens, groupable: false, gone: false }
}

/// A prompt of `tokens` prefilled in chunks of at most 512, then the final position.
fn chunked(tokens: usize) -> Vec<usize> {
    let mut calls = Vec::new();
    let mut left = tokens.saturating_sub(1);
    while left > 0 {
        calls.push(left.min(512));
        left -= left.min(512);
    }
    calls.push(1);
    calls
}

/// The plan, each sequence's prefill calls chunked from its prompt length.
fn plan_of(q: &Queues, facts: &HashMap<SeqId, Facts>, free: u64) -> TickPlan {
    q.plan(facts, |id| chunked(facts[&id].prompt_tokens), &LIMITS, free)
}

fn groupable(model: ModelId, tokens: usize) -> Facts {
    Facts { groupable: true, ..seq(model, 1, tokens) }
}

/// Queues with these sequences waiting, ids 1.. in arrival order.
fn waiting(list: Vec<Facts>) -> (Queues, HashMap<SeqId, Facts>) {
    let mut q = Queues::default();
    let mut facts = HashMap::new();
    for (i, f) in list.into_iter().enumerate() {
        let id = i as SeqId + 1;
        q.arrive(id);
        facts.insert(id, f);
    }
    (q, facts)
}

/// Carries out a plan's admissions, as the executor does.
fn admit_all(q: &mut Queues, plan: &TickPlan, facts: &HashMap<SeqId, Facts>) {
    for &id in &plan.admit {
        q.admit(id, facts[&id].kv_need);
    }
}

#[test]
fn admission_is_first_come_first_served_under_the_kv_budget() {
    let (q, facts) = waiting(vec![seq(1, 40, 8), seq(1, 40, 8), seq(1, 40, 8)]);
    let plan = plan_of(&q, &facts, 100);
    assert_eq!(plan.admit, vec![1, 2], "two fit in 100 bytes; the third waits");
    assert!(plan.refuse.is_empty(), "the third is not refused: memory frees as the others end");
}

#[test]
fn a_request_that_does_not_fit_blocks_those_behind_it() {
    // Something already holds memory; the head needs more than is left.
    let (mut q, mut facts) = waiting(vec![seq(1, 60, 8)]);
    let first = plan_of(&q, &facts, 100);
    admit_all(&mut q, &first, &facts);
    q.arrive(2);
    facts.insert(2, seq(1, 80, 8));
    q.arrive(3);
    facts.insert(3, seq(1, 10, 8));
    let plan = plan_of(&q, &facts, 100);
    assert!(plan.admit.is_empty(), "the small request behind does not overtake the big one: {plan:?}");
    assert!(plan.refuse.is_empty());
}

#[test]
fn the_oldest_is_refused_when_it_can_never_fit_and_the_next_is_admitted() {
    let (q, facts) = waiting(vec![seq(1, 200, 8), seq(1, 50, 8)]);
    let plan = plan_of(&q, &facts, 100);
    assert_eq!(plan.refuse, vec![(1, Refusal::DoesNotFitNow { need: 200, free: 100 })]);
    assert_eq!(plan.admit, vec![2]);
    let message = plan.refuse[0].1.message(8, 100, "m");
    assert!(message.contains("unload one"), "{message}");
}

#[test]
fn a_request_larger_than_the_budget_beside_its_model_is_refused_on_arrival() {
    let q = Queues::default();
    assert_eq!(q.check_arrival(&LIMITS, 300, 200), Err(Refusal::NeverFits { need: 300, beside: 200 }));
    assert_eq!(q.check_arrival(&LIMITS, 200, 200), Ok(()));
    let message = Refusal::NeverFits { need: 300 << 20, beside: 200 << 20 }.message(10, 90, "smollm2");
    assert!(message.contains("300 MiB") && message.contains("smollm2") && message.contains("max_tokens"), "{message}");
}

#[test]
fn a_full_queue_refuses_new_requests_as_busy() {
    let (q, _) = waiting((0..LIMITS.max_queue).map(|_| seq(1, 1, 8)).collect());
    assert_eq!(q.check_arrival(&LIMITS, 1, 100), Err(Refusal::QueueFull { waiting: LIMITS.max_queue }));
    let (q, _) = waiting((0..LIMITS.max_queue - 1).map(|_| seq(1, 1, 8)).collect());
    assert_eq!(q.check_arrival(&LIMITS, 1, 100), Ok(()));
    assert!(Refusal::QueueFull { waiting: 8 }.message(1, 1, "m").contains("max_queue"));
}

#[test]
fn max_batch_bounds_the_admitted_sequences_of_one_model() {
    let (q, facts) = waiting((0..6).map(|_| seq(1, 1, 8)).collect());
    let plan = plan_of(&q, &facts, 1000);
    assert_eq!(plan.admit, vec![1, 2, 3, 4]);
}

#[test]
fn decoding_rows_count_toward_max_batch_and_other_models_do_not() {
    let (mut q, mut facts) = waiting((0..4).map(|_| seq(1, 1, 8)).collect());
    let first = plan_of(&q, &facts, 1000);
    admit_all(&mut q, &first, &facts);
    for id in 1..=4 {
        q.start_decoding(id, 1);
        facts.remove(&id);
    }
    q.arrive(5);
    facts.insert(5, seq(1, 1, 8));
    assert!(plan_of(&q, &facts, 1000).admit.is_empty(), "model 1's batch is full");
    let (mut q2, mut facts2) = (q, facts);
    q2.leave(5);
    facts2.remove(&5);
    q2.arrive(6);
    facts2.insert(6, seq(2, 1, 8));
    assert_eq!(plan_of(&q2, &facts2, 1000).admit, vec![6], "model 2 has its own batch");
}

#[test]
fn a_sequence_that_leaves_frees_its_reservation() {
    let (mut q, facts) = waiting(vec![seq(1, 60, 8), seq(1, 60, 8)]);
    let plan = plan_of(&q, &facts, 100);
    admit_all(&mut q, &plan, &facts);
    assert_eq!((plan.admit, q.reserved_bytes(), q.reserved_by(1), q.reserved_by(2)), (vec![1], 60, 60, 0));
    q.leave(1);
    assert_eq!(q.reserved_bytes(), 0);
    assert_eq!(plan_of(&q, &facts, 100).admit, vec![2]);
}

#[test]
fn cancelled_sequences_leave_before_admission_and_prefill() {
    let (mut q, mut facts) = waiting(vec![seq(1, 10, 100), seq(1, 10, 100)]);
    let first = plan_of(&q, &facts, 15);
    admit_all(&mut q, &first, &facts);
    q.arrive(3);
    facts.insert(3, seq(1, 10, 100));
    facts.get_mut(&1).unwrap().gone = true; // prefilling
    facts.get_mut(&2).unwrap().gone = true; // waiting
    let plan = plan_of(&q, &facts, 15);
    assert_eq!(plan.abandon, vec![2, 1], "waiting first, then prefilling");
    assert!(plan.prefill.iter().all(|(id, _)| *id == 3), "{plan:?}");
    // Its reservation still counts until the executor lets it go.
    assert!(plan.admit.is_empty());
    q.leave(1);
    q.leave(2);
    assert_eq!(plan_of(&q, &facts, 15).admit, vec![3]);
}

#[test]
fn a_burst_of_short_prompts_on_one_model_is_prefilled_as_one_batch() {
    let (q, facts) = waiting(vec![groupable(1, 10), groupable(1, 30), groupable(1, 20)]);
    let plan = plan_of(&q, &facts, 1000);
    assert_eq!(plan.admit, vec![1, 2, 3]);
    assert_eq!(plan.group, vec![1, 2, 3]);
    assert!(plan.prefill.is_empty(), "{plan:?}");
}

#[test]
fn the_padded_group_stays_within_the_prefill_budget() {
    // Rows × longest prompt: two of 200 fit 512, three do not.
    let (q, facts) = waiting(vec![groupable(1, 200), groupable(1, 200), groupable(1, 200)]);
    let plan = plan_of(&q, &facts, 1000);
    assert_eq!(plan.group, vec![1, 2]);
    // The rest of the budget (112 tokens) goes to the third, chunk by chunk.
    assert_eq!(plan.prefill, vec![(3, 1)]);
}

#[test]
fn no_group_unless_the_oldest_is_groupable_and_another_shares_its_model() {
    let (q, facts) = waiting(vec![seq(1, 1, 10), groupable(1, 10), groupable(1, 10)]);
    assert!(plan_of(&q, &facts, 1000).group.is_empty(), "the head reuses a cached prefix");
    let (q, facts) = waiting(vec![groupable(1, 10), groupable(2, 10)]);
    assert!(plan_of(&q, &facts, 1000).group.is_empty(), "one per model is no group");
    let (q, facts) = waiting(vec![groupable(1, 10), groupable(2, 10), groupable(1, 10)]);
    assert_eq!(plan_of(&q, &facts, 1000).group, vec![1, 3], "the head's model only");
}

#[test]
fn a_long_prompt_takes_the_budget_chunk_by_chunk_and_those_behind_wait() {
    let (q, facts) = waiting(vec![seq(1, 1, 1500), seq(1, 1, 10)]);
    let plan = plan_of(&q, &facts, 1000);
    assert_eq!(plan.prefill, vec![(1, 1)], "one 512-token chunk per tick: {plan:?}");
    assert_eq!(chunked(facts[&1].prompt_tokens), vec![512, 512, 475, 1]);
}

#[test]
fn short_prompts_share_the_budget_in_admission_order() {
    let (q, facts) = waiting(vec![seq(1, 1, 101), seq(1, 1, 301), seq(1, 1, 300)]);
    let plan = plan_of(&q, &facts, 1000);
    // 100 + 1, then 300 + 1: 110 left for the third's first chunk.
    assert_eq!(plan.prefill, vec![(1, 2), (2, 2), (3, 1)]);
}

#[test]
fn an_empty_tick_plans_nothing() {
    let q = Queues::default();
    assert_eq!(plan_of(&q, &HashMap::new(), 0), TickPlan::default());
}
