//! A draft model's side of speculative decoding: a small model with its
//! target's tokenizer proposes the next tokens of one sequence, greedily,
//! from its own KV cache of that sequence's history; the target verifies
//! them in its batch (`batch::DecodeBatch::verify_rows`) exactly as it
//! verifies prompt-lookup drafts.
//!
//! The draft cache follows the sequence lazily: it holds a prefix of the
//! sequence's history, and each draft first feeds whatever the sequence
//! added since (the prompt, the first time; tokens decoded by plain steps
//! while drafting rested; the target's token after the last verify pass).
//! After a verify pass it forgets the drafts the target rejected.

use crate::model::decode_step::DecodeMode;
use crate::model::kv_cache::KvCache;
use crate::model::positions::MediaPositions;
use crate::model::Model;
use anyhow::Result;
use mlx_rs::ops::indexing::argmax_axis;
use mlx_rs::Array;
use std::rc::Rc;
use std::time::Instant;

/// History fed to the draft model per pass when it catches up (a prompt).
const CATCH_UP_CHUNK: usize = 512;

/// How much a new measurement moves the cost estimate.
const COST_WEIGHT: f64 = 0.25;

/// One sequence's draft model and its cache.
pub struct DraftRun {
    model: Rc<Model>,
    mode: DecodeMode,
    cache: KvCache,
    /// Tokens of the sequence's history in the cache (a prefix of it).
    fed: usize,
    /// History length when the last draft was made, and the drafts fed
    /// into the cache beyond it (all but the last one proposed).
    drafted_at: usize,
    drafts_fed: usize,
    /// Token ids at or above this are not the tokenizer's (padding rows of
    /// an embedding): a draft stops before one, since the target's own
    /// embedding may not have such a row.
    vocab: u32,
    /// Seconds per drafted token (catch-up included), smoothed: what a
    /// draft costs the step that verifies it (`draft_costs`); starts from
    /// the draft model's estimate over earlier sequences.
    secs_per_token: Option<f64>,
    /// Seconds the last draft took.
    pub last_secs: f64,
}

impl DraftRun {
    /// A run of `model` for a new sequence; single-row steps built as `mode`.
    pub fn new(model: Rc<Model>, mode: DecodeMode) -> Self {
        let cache = KvCache::new(model.lm.num_layers());
        let vocab = model.prompter.tokenizer.get_vocab_size(true) as u32;
        let mode = model.decode_mode(mode);
        let secs_per_token = model.draft_secs.get();
        Self { model, mode, cache, fed: 0, drafted_at: 0, drafts_fed: 0, vocab, secs_per_token, last_secs: 0.0 }
    }

    /// The draft model (for its acceptance evidence).
    pub fn model(&self) -> &Rc<Model> {
        &self.model
    }

    /// Seconds a drafted token costs, once measured.
    pub fn secs_per_token(&self) -> Option<f64> {
        self.secs_per_token
    }

    /// The draft model's greedy continuation of `history`: `k` tokens
    /// (fewer where it picks an id outside the tokenizer).
    pub fn propose(&mut self, history: &[u32], k: usize) -> Result<Vec<u32>> {
        if k == 0 || history.is_empty() {
            return Ok(Vec::new());
        }
        let t = Instant::now();
        let lm = &self.model.lm;
        // Feed what the history added since, all but its last token in
        // chunks; the last one through the decode step.
        let new = &history[self.fed.min(history.len() - 1)..];
        for chunk in new[..new.len() - 1].chunks(CATCH_UP_CHUNK) {
            let ids = Array::from_slice(chunk, &[1, chunk.len() as i32]);
            lm.forward(&lm.embed(&ids)?, &mut self.cache, &MediaPositions::default())?;
            mlx_rs::transforms::eval(self.cache.arrays())?;
        }
        // The k steps are one lazy graph, each feeding the previous argmax:
        // the host reads nothing until all k are queued.
        let mut token = Array::from_slice(&history[history.len() - 1..], &[1, 1]);
        let mut picks = Vec::with_capacity(k);
        for _ in 0..k {
            let logits = self.model.decode_logits(&token, &mut self.cache, &MediaPositions::default(), self.mode)?;
            token = argmax_axis(&logits, -1, None)?.reshape(&[1, 1])?;
            picks.push(token.clone());
        }
        // k steps fed the history's last token and the first k - 1 picks
        // (the last pick is not in the cache: nothing followed it yet).
        let all = mlx_rs::ops::concatenate(&picks, 1)?;
        all.eval()?;
        let mut drafts: Vec<u32> = all.as_slice::<u32>().to_vec();
        if let Some(cut) = drafts.iter().position(|&d| d >= self.vocab) {
            drafts.truncate(cut);
        }
        self.fed = history.len();
        self.drafted_at = history.len();
        self.drafts_fed = k - 1;
        self.last_secs = t.elapsed().as_secs_f64();
        let per = self.last_secs / k as f64;
        let slot = self.secs_per_token.get_or_insert(per);
        *slot += COST_WEIGHT * (per - *slot);
        // The model's own estimate, for the sequences after this one.
        let shared = self.model.draft_secs.get().map_or(per, |s| s + COST_WEIGHT * (per - s));
        self.model.draft_secs.set(Some(shared));
        Ok(drafts)
    }

    /// The target accepted the first `accepted` drafts of the last
    /// proposal: the cache forgets the drafts after them, so it holds a
    /// prefix of the sequence's history again (0 also when the proposal
    /// was not verified at all).
    pub fn verified(&mut self, accepted: usize) -> Result<()> {
        let keep = accepted.min(self.drafts_fed);
        let forget = (self.drafts_fed - keep) as i32;
        if forget > 0 && !self.cache.trim_rows(&[forget])? {
            anyhow::bail!("the draft model's cache could not forget rejected drafts");
        }
        self.fed = self.drafted_at + keep;
        self.drafts_fed = 0;
        Ok(())
    }
}
