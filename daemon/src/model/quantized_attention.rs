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
    Ok(if repeats > 1 { out.reshape(&[b, heads, l, d])? } else { out })
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
