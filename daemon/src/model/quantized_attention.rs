//! Attention over quantized keys and values, op for op as mlx-lm's
//! `quantized_scaled_dot_product_attention`: the scores are a quantized
//! matrix product of the (scaled) queries with the packed keys, the output
//! one of the softmax with the packed values, so the keys and values are
//! never expanded to full precision. Grouped-query heads share their
//! key/value head through a broadcast axis.

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
    let mut scores = quantized_matmul(&queries, kw, ks, kb, true, q.group_size, q.bits)?;
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
        let q = KvQuantization { bits: 8, group_size: 64, start: 0, rotate: true };
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
}
