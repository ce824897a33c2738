//! Log-probabilities of the generated tokens (OpenAI's `logprobs` and
//! `top_logprobs`): the model's own distribution, log-softmax of the raw
//! logits (before temperature, top-k/p and any constraint's mask), as
//! mlx-lm's `generate_step` reports them.
//!
//! A decode step picks row tokens one step ahead of reading them (the
//! batch is pipelined), so each pick queues its arrays, lazily, and the
//! token's acceptance a step later reads them: one small read per token,
//! only for requests that asked.

use mlx_rs::ops::argpartition_axis;
use mlx_rs::ops::indexing::{take_along_axis, IndexOp};
use mlx_rs::{Array, Dtype};
use mlxbc_shared::{TokenLogprob, TokenText};
use std::collections::VecDeque;

/// A sequence's log-probabilities: queued at each pick, recorded at each
/// accepted token.
pub struct LogprobTracker {
    top: i32,
    pending: VecDeque<Pending>,
    pub entries: Vec<TokenLogprob>,
}

/// One pick's arrays, not yet evaluated.
struct Pending {
    /// `[1, vocab]` log-probabilities.
    logprobs: Array,
    /// `[1, 1]` the picked token's, once the pick is known (lazily).
    chosen: Option<Array>,
    /// `[1, top]` the likeliest ids and their log-probabilities (unordered).
    top_ids: Option<(Array, Array)>,
}

impl LogprobTracker {
    /// Reports each token and `top` alternatives (0–20).
    pub fn new(top: u8) -> Self {
        Self { top: i32::from(top), pending: VecDeque::new(), entries: Vec::new() }
    }

    /// Queues the log-probabilities of one row's logits `[1, vocab]`
    /// (where that row's next token is picked from them).
    pub fn queue(&mut self, logits: &Array) -> mlx_rs::error::Result<()> {
        let x = logits.as_dtype(Dtype::Float32)?;
        let logprobs = x.subtract(x.logsumexp_axis(-1, true)?)?;
        let top_ids = if self.top > 0 {
            let vocab = logprobs.shape()[1];
            let k = self.top.min(vocab);
            // The k largest: partition the negated row at k - 1, keep its front.
            let order = argpartition_axis(logprobs.negative()?, k - 1, -1)?;
            let ids = order.index((.., ..k));
            let values = take_along_axis(&logprobs, &ids, -1)?;
            Some((ids, values))
        } else {
            None
        };
        self.pending.push_back(Pending { logprobs, chosen: None, top_ids });
        Ok(())
    }

    /// The newest pick's token `[1, 1]` (lazy): its log-probability is
    /// computed with the step, so reading it later waits on nothing.
    pub fn picked(&mut self, token: &Array) -> mlx_rs::error::Result<()> {
        if let Some(p) = self.pending.back_mut() {
            p.chosen = Some(take_along_axis(&p.logprobs, token.reshape(&[1, 1])?, -1)?);
        }
        Ok(())
    }

    /// The newest pick's arrays, for the step to evaluate with its tokens
    /// (read a step later without waiting on the step queued after them).
    pub fn newest(&self) -> Vec<&Array> {
        let Some(p) = self.pending.back() else { return Vec::new() };
        let mut out: Vec<&Array> = p.chosen.iter().collect();
        if let Some((ids, values)) = &p.top_ids {
            out.extend([ids, values]);
        }
        out
    }

    /// `token` was accepted from the oldest queued pick: records it.
    pub fn accept(&mut self, token: u32, tokenizer: &tokenizers::Tokenizer) -> mlx_rs::error::Result<()> {
        let Some(p) = self.pending.pop_front() else { return Ok(()) };
        let chosen = match p.chosen {
            Some(c) => c,
            None => p.logprobs.index((.., token as i32)),
        };
        let mut arrays = vec![&chosen];
        if let Some((ids, values)) = &p.top_ids {
            arrays.extend([ids, values]);
        }
        mlx_rs::transforms::eval(arrays)?;
        let text = |id: u32| TokenText { id, text: tokenizer.decode(&[id], false).unwrap_or_default() };
        let mut top: Vec<(TokenText, f32)> = match &p.top_ids {
            // argpartition's indices are uint32 already (no conversion, no second read).
            Some((ids, values)) => {
                ids.as_slice::<u32>().iter().zip(values.as_slice::<f32>()).map(|(&i, &v)| (text(i), v)).collect()
            }
            None => Vec::new(),
        };
        top.sort_by(|a, b| b.1.total_cmp(&a.1));
        self.entries.push(TokenLogprob { token: text(token), logprob: chosen.as_slice::<f32>()[0], top });
        Ok(())
    }
}
