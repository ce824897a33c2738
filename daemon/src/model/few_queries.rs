//! Attention of a few query positions over a longer cache, on CUDA, through
//! MLX's plain operations instead of its fused attention.
//!
//! A speculative verify pass attends `k + 1` positions (2 to 9) over every
//! key so far. MLX 0.32's CUDA attention sends any call of more than one
//! query position to cuDNN, whose execution plan it builds per shape (the
//! key length included) and keeps in a small cache: a verify pass's key
//! length is new at every pass, so every pass built a plan. On an H100 a
//! one-row verify pass of Qwen2.5-Coder-0.5B's 24 layers waited 6-13 ms on
//! the device against ~0.01 ms for a plain step, and prompt lookup gained
//! 1.7x where the CPU gains 3.4x
//! (docs/measurements/h100-2026-12-07b-verify-attention.md). The same
//! product through `matmul`, `softmax` and `matmul` (what MLX itself runs
//! where its fused kernel does not apply) costs microseconds at these
//! sizes and builds nothing.
//!
//! Only on CUDA, and only for calls of 2 to [`MAX_QUERIES`] positions over
//! more keys than queries: a prompt's prefill (as many keys as queries, or
//! long chunks) keeps cuDNN's flash kernel, a one-position step keeps MLX's
//! vector kernel or ours ([`crate::model::batch_attention`]), and the CPU
//! and Metal keep MLX's own dispatch (and so their numerics, which the
//! mlx-lm comparisons pin).

use anyhow::Result;
use mlx_rs::{ops, Array};
use std::sync::atomic::{AtomicU8, Ordering};

/// The most query positions a call may have to take this path: a verify
/// pass is at most 1 + 8 drafted positions wide; a prefill chunk's tail of
/// a few positions is served the same way.
pub const MAX_QUERIES: i32 = 16;

/// How few-query calls attend on CUDA.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum FewQueries {
    /// Plain operations on CUDA (the default).
    #[default]
    Ops,
    /// MLX's fused attention, as before (`MLXBC_FEW_QUERIES=mlx`: the A/B).
    Mlx,
}

/// 0: not configured yet, 1: plain operations, 2: MLX's attention.
static CHOICE: AtomicU8 = AtomicU8::new(0);

/// Sets the choice once at start (from `EngineOptions`); plain operations
/// apply only where MLX runs on CUDA.
pub fn configure(choice: FewQueries) {
    let ops = choice == FewQueries::Ops && crate::model::options::cuda_available();
    CHOICE.store(if ops { 1 } else { 2 }, Ordering::Relaxed);
}

/// Which keys each query may see.
pub enum Visible<'a> {
    /// Query `i` of `l` sees the keys up to `keys - l + i` (the queries are
    /// the last positions).
    Causal,
    /// A boolean mask broadcast to `[rows, 1, l, keys]` (true: visible).
    Mask(&'a Array),
}

/// `softmax(q kᵀ · scale, masked) v` for `q` `[rows, heads, l, d]` and `k`,
/// `v` `[rows, kv_heads, keys, d]`, or `None` where this path does not
/// apply (not CUDA, switched off, one query, more than [`MAX_QUERIES`], or
/// no more keys than queries): the caller takes MLX's attention.
pub fn attend(q: &Array, k: &Array, v: &Array, scale: f32, visible: Visible) -> Result<Option<Array>> {
    let (l, keys) = (q.shape()[2], k.shape()[2]);
    if CHOICE.load(Ordering::Relaxed) != 1 || l < 2 || l > MAX_QUERIES || keys <= l {
        return Ok(None);
    }
    let mask = match visible {
        Visible::Mask(m) => m.clone(),
        Visible::Causal => causal(l, keys)?,
    };
    Ok(Some(by_operations(q, k, v, scale, &mask)?))
}

/// The keys each of the last `l` positions sees, `[1, 1, l, keys]`.
fn causal(l: i32, keys: i32) -> Result<Array> {
    let key = ops::arange::<_, i32>(0, keys, 1)?.reshape(&[1, 1, 1, keys])?;
    let query = ops::arange::<_, i32>(keys - l, keys, 1)?.reshape(&[1, 1, l, 1])?;
    Ok(key.le(&query)?)
}

/// The product as MLX's own fallback computes it: the query scaled, the
/// heads sharing a key/value head stacked as extra query rows (no copy of
/// the keys), masked positions at -inf, a softmax in f32, then the values.
fn by_operations(q: &Array, k: &Array, v: &Array, scale: f32, mask: &Array) -> Result<Array> {
    let (rows, heads, l, d) = (q.shape()[0], q.shape()[1], q.shape()[2], q.shape()[3]);
    let (kv_heads, keys) = (k.shape()[1], k.shape()[2]);
    let group = heads / kv_heads;
    let q = q.multiply(Array::from_f32(scale).as_dtype(q.dtype())?)?;
    let q = q.reshape(&[rows, kv_heads, group * l, d])?;
    let scores = q.matmul(k.swap_axes(-1, -2)?)?.reshape(&[rows, kv_heads, group, l, keys])?;
    let mask = mask.reshape(&[mask.shape()[0], 1, 1, l, keys])?;
    let lowest = Array::from_f32(f32::NEG_INFINITY).as_dtype(scores.dtype())?;
    let scores = ops::select(&mask, &scores, &lowest)?;
    let weights = ops::softmax_axis(&scores, -1, true)?.reshape(&[rows, kv_heads, group * l, keys])?;
    Ok(weights.matmul(v)?.reshape(&[rows, heads, l, d])?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx_rs::fast::{scaled_dot_product_attention, ScaledDotProductAttentionMask};

    fn random(shape: &[i32], seed: u64) -> Array {
        let key = mlx_rs::random::key(seed).unwrap();
        mlx_rs::random::normal::<f32>(shape, None, None, Some(&key)).unwrap()
    }

    fn max_difference(a: &Array, b: &Array) -> f32 {
        a.subtract(b).unwrap().abs().unwrap().max(None).unwrap().item::<f32>()
    }

    /// The operations give MLX's attention, causal and masked, with grouped
    /// heads (7 query heads over 1 key/value head, as Qwen2.5-0.5B's 14/2).
    #[test]
    fn the_operations_equal_mlx_attention() {
        let (rows, heads, kv_heads, l, keys, d) = (2, 14, 2, 5, 37, 64);
        let q = random(&[rows, heads, l, d], 1);
        let k = random(&[rows, kv_heads, keys, d], 2);
        let v = random(&[rows, kv_heads, keys, d], 3);
        let scale = 1.0 / (d as f32).sqrt();
        let mine = by_operations(&q, &k, &v, scale, &causal(l, keys).unwrap()).unwrap();
        let theirs =
            scaled_dot_product_attention(&q, &k, &v, scale, ScaledDotProductAttentionMask::Causal, None).unwrap();
        assert!(max_difference(&mine, &theirs) < 1e-5, "causal: {}", max_difference(&mine, &theirs));
        // Row 0 sees keys from 3 on, row 1 from 0 (a padded batch's mask).
        let key = ops::arange::<_, i32>(0, keys, 1).unwrap().reshape(&[1, 1, 1, keys]).unwrap();
        let starts = Array::from_slice(&[3i32, 0], &[rows, 1, 1, 1]);
        let padded = key.ge(&starts).unwrap().logical_and(&causal(l, keys).unwrap()).unwrap();
        let mine = by_operations(&q, &k, &v, scale, &padded).unwrap();
        let theirs =
            scaled_dot_product_attention(&q, &k, &v, scale, ScaledDotProductAttentionMask::Array(&padded), None)
                .unwrap();
        assert!(max_difference(&mine, &theirs) < 1e-5, "masked: {}", max_difference(&mine, &theirs));
    }

    /// Off CUDA (this test's device) nothing changes: MLX's attention is kept.
    #[test]
    fn off_cuda_the_caller_keeps_mlx_attention() {
        configure(FewQueries::Ops);
        let q = random(&[1, 2, 3, 8], 4);
        let k = random(&[1, 2, 9, 8], 5);
        assert!(attend(&q, &k, &k, 1.0, Visible::Causal).unwrap().is_none());
    }
}
