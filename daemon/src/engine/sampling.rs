//! Choosing the next token from logits: greedy on the device (one id comes
//! back), or temperature / top-k / top-p with a seeded generator on the host.

use anyhow::Result;
use mlx_rs::{ops::indexing::argmax_axis, Array};
use mlxbc_shared::SamplingParams;
use rand::{rngs::StdRng, Rng, SeedableRng};

/// A sampler for one generation.
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
}

impl Sampler {
    /// Seeds from `params.seed`, or from entropy when there is none.
    pub fn new(params: SamplingParams) -> Self {
        let rng = match params.seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_entropy(),
        };
        Self { params, rng }
    }

    /// True when no randomness is involved.
    pub fn is_greedy(&self) -> bool {
        self.params.temperature <= 0.0 || self.params.top_k == 1
    }

    /// Picks the next token from `logits` (`[vocab]`) as a `[1, 1]` id array.
    /// Greedy picks stay lazy on the device, so the caller can queue the next
    /// step before reading this one back; sampled picks are made on the host.
    pub fn pick(&mut self, logits: &Array) -> Result<Array> {
        if self.is_greedy() {
            return Ok(argmax_axis(logits, -1, None)?.reshape(&[1, 1])?);
        }
        let logits = logits.as_dtype(mlx_rs::Dtype::Float32)?;
        logits.eval()?;
        let id = self.sample_host(logits.as_slice::<f32>());
        Ok(Array::from_slice(&[id], &[1, 1]))
    }

    fn sample_host(&mut self, logits: &[f32]) -> u32 {
        let t = self.params.temperature;
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.sort_unstable_by(|&a, &b| logits[b].total_cmp(&logits[a]));
        if self.params.top_k > 0 {
            order.truncate(self.params.top_k as usize);
        }
        let max = logits[order[0]];
        let mut probs: Vec<f64> = order.iter().map(|&i| (((logits[i] - max) / t) as f64).exp()).collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= total);
        if self.params.top_p < 1.0 {
            let mut acc = 0.0;
            let keep = probs.iter().position(|p| {
                acc += p;
                acc >= self.params.top_p as f64
            });
            let keep = keep.map_or(probs.len(), |i| i + 1);
            probs.truncate(keep);
            order.truncate(keep);
        }
        let total: f64 = probs.iter().sum();
        let mut x = self.rng.gen::<f64>() * total;
        for (p, &i) in probs.iter().zip(&order) {
            x -= p;
            if x <= 0.0 {
                return i as u32;
            }
        }
        *order.last().unwrap() as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeded_sampling_repeats_and_top_k_one_is_greedy() {
        let logits: Vec<f32> = (0..100).map(|i| ((i * 37) % 101) as f32 * 0.03).collect();
        let p = SamplingParams { temperature: 0.8, top_k: 20, top_p: 0.9, seed: Some(7) };
        let a: Vec<u32> = {
            let mut s = Sampler::new(p.clone());
            (0..20).map(|_| s.sample_host(&logits)).collect()
        };
        let b: Vec<u32> = {
            let mut s = Sampler::new(p);
            (0..20).map(|_| s.sample_host(&logits)).collect()
        };
        assert_eq!(a, b);
        let mut s = Sampler::new(SamplingParams { temperature: 1.0, top_k: 1, top_p: 1.0, seed: Some(1) });
        let best = (0..100).max_by(|&x, &y| logits[x].total_cmp(&logits[y])).unwrap() as u32;
        assert_eq!(s.sample_host(&logits), best);
    }
}
