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

    /// True when its picks depend on its seed alone (a seed was given):
    /// such a row's answer is reproducible, which drafting (whose random
    /// draws depend on what was drafted) would give up.
    pub fn is_seeded(&self) -> bool {
        self.key.is_some() && self.params.seed.is_some()
    }

    /// The generator's next key for one draw.
    fn draw_key(&mut self) -> Result<Option<Array>> {
        let Some(key) = self.key.take() else { return Ok(None) };
        let (next, now) = random::split(&key, 2)?;
        self.key = Some(next);
        Ok(Some(now))
    }

    /// Picks the next token from one row's `logits` (`[1, vocab]` or
    /// `[vocab]`) as a `[1, 1]` id array.
    pub fn pick(&mut self, logits: &Array) -> Result<Array> {
        let Some(now) = self.draw_key()? else {
            return Ok(argmax_axis(logits, -1, None)?.reshape(&[1, 1])?);
        };
        let scaled = self.shaped(&logits.reshape(&[1, -1])?)?;
        Ok(random::categorical(&scaled, -1, None, Some(&now))?.reshape(&[1, 1])?.as_dtype(mlx_rs::Dtype::Uint32)?)
    }

    /// `logits` `[n, vocab]` as this sampler draws from them: divided by
    /// the temperature, and outside top-k and top-p set to -inf.
    fn shaped(&self, logits: &Array) -> Result<Array> {
        let p = &self.params;
        let mut scaled = logits.as_dtype(mlx_rs::Dtype::Float32)?.divide(Array::from_f32(p.temperature))?;
        let vocab = scaled.shape()[scaled.ndim() - 1];
        let floor = Array::from_f32(f32::NEG_INFINITY);
        if p.top_k > 0 && (p.top_k as i32) < vocab {
            // The k-th largest logit is the smallest one kept.
            let at = Array::from_slice(&[vocab - p.top_k as i32], &[1]);
            let kth = ops::sort_axis(&scaled, -1)?.take_axis(&at, -1)?;
            scaled = ops::select(&scaled.ge(&kth)?, &scaled, &floor)?;
        }
        if p.top_p < 1.0 {
            // Keep the most likely tokens whose probabilities sum to top_p:
            // in ascending order, drop those whose running sum stays within
            // 1 - top_p; the first one past it is the smallest one kept.
            let probs = ops::softmax_axis(&scaled, -1, None)?;
            let ascending = ops::sort_axis(&probs, -1)?;
            let running = ops::cumsum(&ascending, -1, None, None)?;
            let dropped =
                running.le(Array::from_f32(1.0 - p.top_p))?.sum_axis(-1, true)?.as_dtype(mlx_rs::Dtype::Int32)?;
            let at = ops::minimum(&dropped, Array::from_int(vocab - 1))?;
            let smallest_kept = ascending.take_along_axis(&at, -1)?;
            scaled = ops::select(&probs.ge(&smallest_kept)?, &scaled, &floor)?;
        }
        Ok(scaled)
    }

    /// Speculative sampling over drafts that are certain guesses (prompt
    /// lookup's draft distribution is a point mass): `logits` `[k + 1,
    /// vocab]` are the target's after each verified position, `drafts` the
    /// k drafted tokens. Draft i is accepted with probability p_i(draft i)
    /// (min(1, p/q) with q = 1), while the ones before it were; at the
    /// first rejection the token is drawn from p with the rejected draft
    /// removed (the normalized residual max(0, p − q)); after k accepted,
    /// from p after the last. The tokens so produced are distributed as
    /// drawing from p one step at a time (Leviathan et al., 2023).
    /// Returns how many drafts were accepted and the token after them.
    pub fn accept_drafts(&mut self, logits: &Array, drafts: &[u32]) -> Result<(usize, u32)> {
        use mlx_rs::ops::indexing::IndexOp;
        let k = drafts.len() as i32;
        anyhow::ensure!(logits.shape()[0] == k + 1, "logits of {} positions for {k} drafts", logits.shape()[0]);
        let (Some(accept_key), Some(draw_key)) = (self.draw_key()?, self.draw_key()?) else {
            anyhow::bail!("a greedy row's drafts are checked against its argmax, not sampled");
        };
        let scaled = self.shaped(logits)?;
        let ids = Array::from_slice(drafts, &[k, 1]).as_dtype(mlx_rs::Dtype::Int32)?;
        let probs = ops::softmax_axis(scaled.index(..k), -1, None)?;
        let p_drafts = probs.take_along_axis(&ids, -1)?.reshape(&[-1])?;
        let u = random::uniform::<_, f32>(0.0, 1.0, &[k], Some(&accept_key))?;
        mlx_rs::transforms::eval([&p_drafts, &u])?;
        let (p_drafts, u) = (p_drafts.as_slice::<f32>(), u.as_slice::<f32>());
        let accepted = (0..k as usize).take_while(|&i| u[i] < p_drafts[i]).count();
        let at = accepted as i32;
        let mut row = scaled.index(at..at + 1);
        if accepted < drafts.len() {
            let vocab = row.shape()[1];
            let rejected = ops::arange::<_, i32>(0, vocab, None)?.eq(Array::from_int(drafts[accepted] as i32))?;
            row = ops::select(&rejected, Array::from_f32(f32::NEG_INFINITY), &row)?;
        }
        let next = random::categorical(&row, -1, None, Some(&draw_key))?;
        Ok((accepted, next.as_dtype(mlx_rs::Dtype::Uint32)?.item_cast::<u32>()))
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

    /// Counts of each of `cells` outcomes against their expected
    /// probabilities: Pearson's chi-square statistic.
    fn chi_square(counts: &[u32], probs: &[f64]) -> f64 {
        let n: u32 = counts.iter().sum();
        counts.iter().zip(probs).map(|(&c, &p)| (c as f64 - n as f64 * p).powi(2) / (n as f64 * p)).sum()
    }

    /// Speculative sampling leaves the distribution of what is generated
    /// unchanged: over 4,000 seeds, with a two-token draft (likely first
    /// tokens and unlikely ones), the first token drawn through
    /// `accept_drafts` is distributed as p₀, and the second, where the
    /// first draft was accepted, as p₁: Pearson's chi-square over the six
    /// tokens below 20.5 each (5 degrees of freedom, the 0.001 level).
    #[test]
    fn speculative_sampling_keeps_the_distribution() {
        // Six tokens. The second position's logits are the target's after
        // the first draft (a verify pass feeds it); after a rejection the
        // next step computes them anew, so only the accepted case has a
        // second token here.
        let l0 = [1.2f32, 0.3, -0.5, 0.8, 0.0, -1.0];
        let l1 = [0.1f32, 0.9, 0.4, -0.2, 1.1, -0.7];
        let logits = Array::from_slice(&[l0, l1, l1].concat(), &[3, 6]);
        let softmax = |l: &[f32], t: f64| {
            let e: Vec<f64> = l.iter().map(|&x| (x as f64 / t).exp()).collect();
            let z: f64 = e.iter().sum();
            e.into_iter().map(|x| x / z).collect::<Vec<_>>()
        };
        let t = 0.9;
        let (p0, p1) = (softmax(&l0, t), softmax(&l1, t));
        let params = |seed| SamplingParams { temperature: t as f32, top_k: 0, top_p: 1.0, seed: Some(seed) };
        for drafts in [[0u32, 4], [5, 2]] {
            let mut first = [0u32; 6];
            let mut second = [0u32; 6];
            let n = 4000;
            for seed in 0..n {
                let mut s = Sampler::new(params(seed)).unwrap();
                let (accepted, next) = s.accept_drafts(&logits, &drafts).unwrap();
                let tokens: Vec<u32> = drafts[..accepted].iter().copied().chain([next]).collect();
                first[tokens[0] as usize] += 1;
                if tokens[0] == drafts[0] {
                    second[tokens[1] as usize] += 1;
                }
            }
            let x1 = chi_square(&first, &p0);
            assert!(
                x1 < 20.5,
                "drafts {drafts:?}: the first token's distribution, chi-square {x1:.1} (df 5, 0.001: 20.5): {first:?}"
            );
            let x2 = chi_square(&second, &p1);
            assert!(x2 < 20.5, "drafts {drafts:?}: the second token's, chi-square {x2:.1}: {second:?}");
            // The test has power: drawing the first token as the draft
            // always (no rejection rule) fails it.
            let mut forced = [0u32; 6];
            forced[drafts[0] as usize] = first.iter().sum();
            assert!(chi_square(&forced, &p0) > 1000.0);
        }
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
