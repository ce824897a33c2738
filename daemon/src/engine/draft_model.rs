//! A draft model's side of speculative decoding, per sequence: a small
//! model with its target's tokenizer proposes the next tokens of the
//! sequence greedily; the target verifies them in its batch
//! (`batch::DecodeBatch::verify_rows`) exactly as it verifies prompt-lookup
//! drafts. The draft model's cache of the sequence's history is its decode
//! batch's ([`super::draft_batch::DraftBatch`]): every row drafting with
//! one draft model is drafted in the same passes.

use crate::model::Model;
use std::rc::Rc;

/// How much a new measurement moves the cost estimate.
const COST_WEIGHT: f64 = 0.25;

/// One sequence's draft model and what its drafts cost.
pub struct DraftRun {
    model: Rc<Model>,
    /// Seconds per drafted token (catch-up included; a batched proposal's
    /// time shared by its rows), smoothed: what a draft costs the step
    /// that verifies it (`draft_costs`); starts from the draft model's
    /// estimate over earlier sequences.
    secs_per_token: Option<f64>,
}

impl DraftRun {
    /// A run of `model` for a new sequence.
    pub fn new(model: Rc<Model>) -> Self {
        let secs_per_token = model.draft_secs.get();
        Self { model, secs_per_token }
    }

    /// The draft model.
    pub fn model(&self) -> &Rc<Model> {
        &self.model
    }

    /// Seconds a drafted token costs, once measured.
    pub fn secs_per_token(&self) -> Option<f64> {
        self.secs_per_token
    }

    /// A proposal cost this sequence `per` seconds a drafted token.
    pub fn measured(&mut self, per: f64) {
        let slot = self.secs_per_token.get_or_insert(per);
        *slot += COST_WEIGHT * (per - *slot);
        // The model's own estimate, for the sequences after this one.
        let shared = self.model.draft_secs.get().map_or(per, |s| s + COST_WEIGHT * (per - s));
        self.model.draft_secs.set(Some(shared));
    }
}
