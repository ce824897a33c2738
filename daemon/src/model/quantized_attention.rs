//! Attention over quantized keys and values, op for op as mlx-lm's
//! `quantized_scaled_dot_product_attention`: the scores are a quantized
//! matrix product of the (scaled) queries with the packed keys, the output
//! one of the softmax with the packed values, so the keys and values are
//! never expanded to full precision. Grouped-query heads share their
//! key/value head through a broadcast axis.
//!
//! Except on a GPU: MLX 0.32.2's CUDA `quantized_matmul` has no kernel for
//! these batched, broadcast operands at prefill shapes ("No implementation
//! for problem shape: 2048x4096x64x14", bits 8, on an H100), so there the
//! keys and values are expanded one layer at a time and attended by MLX's
//! fused attention; what stays resident is still the packed cache.

use crate::model::kv_cache::KvQuantization;
use anyhow::Result;
use mlx_rs::ops::{expand_dims, quantized_matmul};
use mlx_rs::Array;

/// Which keys each query sees.
pub enum Mask<'a> {
    /// All of them (one query per row, unpadded).
    None,
    /// Query i of L sees keys up to its own position (the last L keys are
    /// the queries').
    Causal,
    /// Per row, as the cache's padding mask says (`[B, 1, L, keys]`, bool).
    Rows(&'a Array),
}

/// Attention output `[B, heads, L, head_dim]` of queries `[B, heads, L,
/// head_dim]` over the quantized `keys` and `values` (MLX's `quantize`
/// output, `[B, kv_heads, keys, ...]` each).
pub fn attend(
    queries: &Array,
    keys: &[Array; 3],
    values: &[Array; 3],
    q: KvQuantization,
    scale: f32,
    mask: Mask,
) -> Result<Array> {
    if expands_on_this_device() {
        return expanded(queries, keys, values, q, scale, mask);
    }
    attend_quantized(queries, keys, values, q, scale, mask)
}

/// [`attend`]'s result through the quantized products (mlx-lm's way).
fn attend_quantized(
    queries: &Array,
    keys: &[Array; 3],
    values: &[Array; 3],
    q: KvQuantization,
    scale: f32,
    mask: Mask,
) -> Result<Array> {
    let s = queries.shape();
    let (b, heads, l, d) = (s[0], s[1], s[2], s[3]);
    let kv_heads = keys[0].shape()[1];
    let repeats = heads / kv_heads;
    // The scale in the queries' own dtype (a Python float's weak type in
    // mlx-lm: an f32 array here would promote bf16 queries).
    let queries = rotated(queries, q)?;
    let mut queries = queries.multiply(Array::from_f32(scale).as_dtype(queries.dtype())?)?;
    let (mut keys, mut values) = (keys.clone(), values.clone());
    if repeats > 1 {
        queries = queries.reshape(&[b, kv_heads, repeats, l, d])?;
        for part in keys.iter_mut().chain(values.iter_mut()) {
            *part = expand_dims(&*part, -3)?;
        }
    }
    let [kw, ks, kb] = &keys;
    let mut scores = quantized_matmul(&queries, kw, ks, kb, true, q.group_size, q.key_bits)?;
    let allowed = match mask {
        Mask::None => None,
        Mask::Causal => {
            let total = scores.shape()[scores.ndim() - 1];
            let rows = mlx_rs::ops::arange::<_, i32>(total - l, total, 1)?.reshape(&[l, 1])?;
            let columns = mlx_rs::ops::arange::<_, i32>(0, total, 1)?.reshape(&[1, total])?;
            Some(rows.ge(&columns)?)
        }
        Mask::Rows(m) if repeats > 1 && m.ndim() > 3 => Some(expand_dims(m, -3)?),
        Mask::Rows(m) => Some(m.clone()),
    };
    if let Some(allowed) = allowed {
        let lowest = Array::from_f32(dtype_min(scores.dtype())).as_dtype(scores.dtype())?;
        scores = mlx_rs::ops::select(&allowed, &scores, &lowest)?;
    }
    let scores = mlx_rs::ops::softmax_axis(&scores, -1, true)?;
    let [vw, vs, vb] = &values;
    let out = quantized_matmul(&scores, vw, vs, vb, false, q.group_size, q.bits)?;
    let out = if repeats > 1 { out.reshape(&[b, heads, l, d])? } else { out };
    // The values were rotated: H is its own inverse.
    Ok(rotated(&out, q)?)
}

/// True when the default device is a GPU (see the module's note), decided once.
fn expands_on_this_device() -> bool {
    static ON_GPU: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON_GPU.get_or_init(|| matches!(mlx_rs::Device::default().get_type(), Ok(mlx_rs::DeviceType::Gpu)))
}

/// [`attend`]'s result through expanded keys and values and MLX's fused
/// attention (grouped-query heads and the causal offset are its own).
fn expanded(
    queries: &Array,
    keys: &[Array; 3],
    values: &[Array; 3],
    q: KvQuantization,
    scale: f32,
    mask: Mask,
) -> Result<Array> {
    use mlx_rs::fast::{scaled_dot_product_attention, ScaledDotProductAttentionMask};
    let [kw, ks, kb] = keys;
    let [vw, vs, vb] = values;
    let k = mlx_rs::ops::dequantize(kw, ks, kb, q.group_size, q.key_bits)?.as_dtype(queries.dtype())?;
    let v = mlx_rs::ops::dequantize(vw, vs, vb, q.group_size, q.bits)?.as_dtype(queries.dtype())?;
    let mask = match mask {
        Mask::None => None,
        Mask::Causal => Some(ScaledDotProductAttentionMask::Causal),
        Mask::Rows(m) => Some(ScaledDotProductAttentionMask::Array(m)),
    };
    let out = scaled_dot_product_attention(rotated(queries, q)?, &k, &v, scale, mask, None)?;
    // The values were rotated: H is its own inverse.
    Ok(rotated(&out, q)?)
}

/// `x` (`[..., head_dim]`) times the normalized Hadamard matrix of its
/// width when `q` rotates (Sylvester's: symmetric, orthogonal, its own
/// inverse); `x` itself otherwise, or when the width is not a power of two.
pub fn rotated(x: &Array, q: KvQuantization) -> Result<Array, mlx_rs::error::Exception> {
    let d = x.shape()[x.ndim() - 1];
    if !q.rotate || d < 2 || d & (d - 1) != 0 {
        return Ok(x.clone());
    }
    x.matmul(hadamard(d).as_dtype(x.dtype())?)
}

/// The `d`×`d` normalized Hadamard matrix (`d` a power of two), f32.
fn hadamard(d: i32) -> Array {
    thread_local! {
        static MADE: std::cell::RefCell<Vec<(i32, Array)>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    MADE.with(|made| {
        if let Some((_, h)) = made.borrow().iter().find(|(n, _)| *n == d) {
            return h.clone();
        }
        let n = d as usize;
        let norm = 1.0 / (d as f32).sqrt();
        // Entry (i, j) is (-1)^popcount(i & j).
        let values: Vec<f32> =
            (0..n * n).map(|k| if ((k / n) & (k % n)).count_ones().is_multiple_of(2) { norm } else { -norm }).collect();
        let h = Array::from_slice(&values, &[d, d]);
        made.borrow_mut().push((d, h.clone()));
        h
    })
}

/// `mx.finfo(dtype).min` for the float types attention runs in.
fn dtype_min(dtype: mlx_rs::Dtype) -> f32 {
    match dtype {
        mlx_rs::Dtype::Float16 => -65504.0,
        // -3.3895e38: f32::MIN would round to -inf in bfloat16.
        mlx_rs::Dtype::Bfloat16 => f32::from_bits(0xFF7F_0000),
        _ => f32::MIN,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Hadamard matrix is its own inverse, and rotating queries and
    /// keys alike leaves their products as they were.
    #[test]
    fn rotating_twice_is_identity_and_keeps_query_key_products() {
        let q = KvQuantization { bits: 8, key_bits: 8, group_size: 64, start: 0, rotate: true };
        let v: Vec<f32> =
            (0..4 * 64).map(|i| (i as f32 * 0.731).sin() * if i % 64 == 5 { 40.0 } else { 1.0 }).collect();
        let x = Array::from_slice(&v, &[4, 64]);
        let back = rotated(&rotated(&x, q).unwrap(), q).unwrap();
        let err = back.subtract(&x).unwrap().abs().unwrap().max(None).unwrap().try_item_cast::<f32>().unwrap();
        assert!(err < 1e-4, "{err}");
        let products = |a: &Array| a.matmul(a.t()).unwrap();
        let (r, plain) = (products(&rotated(&x, q).unwrap()), products(&x));
        let err = r.subtract(&plain).unwrap().abs().unwrap().max(None).unwrap().try_item_cast::<f32>().unwrap();
        assert!(err < 1e-2, "{err}");
        // The outlier channel (40x) is spread: no rotated value is near it.
        let top = rotated(&x, q).unwrap().abs().unwrap().max(None).unwrap().try_item_cast::<f32>().unwrap();
        assert!(top < 10.0, "{top}");
        // A width that is not a power of two is left as it is.
        let odd = Array::from_slice(&[1.0f32; 80], &[1, 80]);
        assert_eq!(rotated(&odd, q).unwrap().shape(), &[1, 80]);
    }

    /// The GPU's route (expanded keys and values, fused attention) gives
    /// what the quantized products give, for each kind of mask, with
    /// grouped-query heads and rotation.
    #[test]
    fn expanded_route_matches_the_quantized_products() {
        let wave = |n: usize, k: f32| -> Vec<f32> { (0..n).map(|i| (i as f32 * k).sin()).collect() };
        let (heads, kv_heads, l, keys, d) = (4, 2, 3, 7, 64);
        let queries = Array::from_slice(&wave(heads * l * d, 0.37), &[1, heads as i32, l as i32, d as i32]);
        for (key_bits, bits, rotate) in [(8, 8, false), (4, 4, true), (8, 4, true)] {
            let q = KvQuantization { bits, key_bits, group_size: 64, start: 0, rotate };
            let pack = |k: f32, bits: i32| -> [Array; 3] {
                let x = Array::from_slice(&wave(kv_heads * keys * d, k), &[1, kv_heads as i32, keys as i32, d as i32]);
                let (w, s, b) = mlx_rs::ops::quantize(rotated(&x, q).unwrap(), q.group_size, bits).unwrap();
                [w, s, b]
            };
            let (k, v) = (pack(0.53, key_bits), pack(0.71, bits));
            let rows: Vec<bool> = (0..l * keys).map(|i| (i % keys) != 1 && (i % keys) <= 4 + i / keys).collect();
            let rows = Array::from_slice(&rows, &[1, 1, l as i32, keys as i32]);
            for (name, mask) in [("none", 0), ("causal", 1), ("rows", 2)] {
                let m = || match mask {
                    0 => Mask::None,
                    1 => Mask::Causal,
                    _ => Mask::Rows(&rows),
                };
                let a = attend_quantized(&queries, &k, &v, q, 0.125, m()).unwrap();
                let b = expanded(&queries, &k, &v, q, 0.125, m()).unwrap();
                let gap = a.subtract(&b).unwrap().abs().unwrap().max(None).unwrap().try_item_cast::<f32>().unwrap();
                assert!(gap < 1e-4, "{bits} bits, mask {name}: routes differ by {gap}");
            }
        }
    }
}
