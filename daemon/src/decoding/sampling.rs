//! Choosing the next token from logits, on the device: greedy (argmax), or
//! temperature / top-k / top-p with a seeded MLX generator. Either way the
//! pick is a lazy `[1, 1]` array, so the decode loop can queue the next step
//! before reading this token back; nothing waits for the logits on the host.

use anyhow::Result;
use mlx_rs::{ops, ops::indexing::argmax_axis, random, Array};
use mlxbc_shared::SamplingParams;

/// Temperatures below this are greedy decoding: dividing logits by 1e-45
/// gives infinities, and softmax over them NaNs (garbage text was seen at
/// `-t 1e-45`); at 1e-4 sampling is already argmax for any real logits.
pub const MIN_TEMPERATURE: f32 = 1e-4;

/// A sampler for one generation.
pub struct Sampler {
    params: SamplingParams,
    /// The generator's state; split once per sampled token.
    key: Option<Array>,
}

impl Sampler {
    /// Seeds from `params.seed`, or from entropy when there is none; below
    /// [`MIN_TEMPERATURE`] it is greedy.
    pub fn new(params: SamplingParams) -> Result<Self> {
        let key = if params.temperature < MIN_TEMPERATURE || params.top_k == 1 {
            None
        } else {
            Some(random::key(params.seed.unwrap_or_else(rand::random))?)
        };
        Ok(Self { params, key })
    }

    /// True when picks are the argmax (no generator): a batch of such rows
    /// picks with one argmax over all of them.
    pub fn is_greedy(&self) -> bool {
        self.key.is_none()
    }

    /// Picks the next token from one row's `logits` (`[1, vocab]` or
    /// `[vocab]`) as a `[1, 1]` id array.
    pub fn pick(&mut self, logits: &Array) -> Result<Array> {
        let Some(key) = self.key.take() else {
            return Ok(argmax_axis(logits, -1, None)?.reshape(&[1, 1])?);
        };
        let (next, now) = random::split(&key, 2)?;
        self.key = Some(next);
        let p = &self.params;
        let mut scaled = logits.as_dtype(mlx_rs::Dtype::Float32)?.divide(Array::from_f32(p.temperature))?;
        let vocab = scaled.shape()[scaled.ndim() - 1];
        let floor = Array::from_f32(f32::NEG_INFINITY);
        if p.top_k > 0 && (p.top_k as i32) < vocab {
            // The k-th largest logit is the smallest one kept.
            let kth = ops::sort_axis(&scaled, -1)?.take_axis(Array::from_int(vocab - p.top_k as i32), -1)?;
            scaled = ops::select(&scaled.ge(&kth)?, &scaled, &floor)?;
        }
        if p.top_p < 1.0 {
            // Keep the most likely tokens whose probabilities sum to top_p:
            // in ascending order, drop those whose running sum stays within
            // 1 - top_p; the first one past it is the smallest one kept.
            let probs = ops::softmax_axis(&scaled, -1, None)?;
            let ascending = ops::sort_axis(&probs, -1)?;
            let running = ops::cumsum(&ascending, -1, None, None)?;
            let dropped = running.le(Array::from_f32(1.0 - p.top_p))?.sum(None)?.as_dtype(mlx_rs::Dtype::Int32)?;
            let smallest_kept = ascending.take_axis(&ops::minimum(&dropped, Array::from_int(vocab - 1))?, -1)?;
            scaled = ops::select(&probs.ge(&smallest_kept)?, &scaled, &floor)?;
        }
        Ok(random::categorical(&scaled, -1, None, Some(&now))?.reshape(&[1, 1])?.as_dtype(mlx_rs::Dtype::Uint32)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits() -> Array {
        let v: Vec<f32> = (0..100).map(|i| ((i * 37) % 101) as f32 * 0.03).collect();
        Array::from_slice(&v, &[100])
    }

    fn draws(p: &SamplingParams, n: usize) -> Vec<u32> {
        let mut s = Sampler::new(p.clone()).unwrap();
        (0..n).map(|_| s.pick(&logits()).unwrap().item_cast::<u32>()).collect()
    }

    fn ranked() -> Vec<u32> {
        let l = logits();
        let v = l.as_slice::<f32>();
        let mut order: Vec<u32> = (0..100).collect();
        order.sort_by(|&a, &b| v[b as usize].total_cmp(&v[a as usize]));
        order
    }

    #[test]
    fn seeded_sampling_repeats_and_varies() {
        let p = SamplingParams { temperature: 0.8, top_k: 0, top_p: 1.0, seed: Some(7) };
        let a = draws(&p, 40);
        assert_eq!(a, draws(&p, 40), "same seed, same tokens");
        assert!(a.iter().collect::<std::collections::BTreeSet<_>>().len() > 5, "draws vary: {a:?}");
        assert_ne!(a, draws(&SamplingParams { seed: Some(8), ..p }, 40), "another seed, other tokens");
    }

    #[test]
    fn top_k_and_top_p_restrict_the_candidates() {
        let order = ranked();
        let greedy = draws(&SamplingParams { temperature: 1.0, top_k: 1, top_p: 1.0, seed: Some(1) }, 3);
        assert_eq!(greedy, vec![order[0]; 3], "top_k 1 is greedy");
        let top3 = draws(&SamplingParams { temperature: 5.0, top_k: 3, top_p: 1.0, seed: Some(2) }, 60);
        assert!(top3.iter().all(|t| order[..3].contains(t)), "{top3:?} outside {:?}", &order[..3]);
        assert!(top3.iter().collect::<std::collections::BTreeSet<_>>().len() == 3, "all three drawn: {top3:?}");
        // A tiny top_p keeps only the most likely token.
        let nucleus = draws(&SamplingParams { temperature: 1.0, top_k: 0, top_p: 0.01, seed: Some(3) }, 20);
        assert_eq!(nucleus, vec![order[0]; 20]);
    }
}
