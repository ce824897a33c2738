//! The gated delta rule (Gated DeltaNet's recurrence), as mlx-vlm 0.7.10's
//! `qwen3_5/gated_delta.py` runs it where no Metal kernel exists (CPU,
//! CUDA): a chunked parallel scan for a prefill (`chunked`, chunks of
//! [`CHUNK`] positions) and the per-token recurrence for a decode step
//! (`step`). Op for op as the reference, so greedy ids match.
//!
//! Shapes: q, k `[B, T, Hk, Dk]`, v `[B, T, Hv, Dv]`, g and beta
//! `[B, T, Hv]`, the state `[B, Hv, Dv, Dk]` (float32).

use anyhow::Result;
use mlx_rs::ops::indexing::{Ellipsis, IndexOp};
use mlx_rs::ops::{self, expand_dims};
use mlx_rs::{Array, Dtype};

/// Positions per chunk of the parallel scan (the reference's `C`).
pub const CHUNK: i32 = 64;

/// The decay `g = exp(-exp(A_log) * softplus(a + dt_bias))` and the write
/// strength `beta = sigmoid(b)` (`_compute_g_beta`).
pub fn gates(a_log: &Array, a: &Array, b: &Array, dt_bias: &Array) -> Result<(Array, Array)> {
    let softplus = ops::logaddexp(a.add(dt_bias)?, Array::from_f32(0.0))?;
    let g = ops::exp(ops::negative(ops::exp(a_log.as_dtype(Dtype::Float32)?)?)?.multiply(&softplus)?)?;
    Ok((g, ops::sigmoid(b)?))
}

/// q and k with their heads repeated to the value heads' count.
fn repeat_heads(q: &Array, k: &Array, hv: i32) -> Result<(Array, Array)> {
    let hk = q.shape()[2];
    if hv / hk <= 1 {
        return Ok((q.clone(), k.clone()));
    }
    let r = hv / hk;
    Ok((Array::repeat_axis::<f32>(q.clone(), r, -2)?, Array::repeat_axis::<f32>(k.clone(), r, -2)?))
}

/// One position (`T == 1`) through the recurrence (`_gated_delta_step_ops`):
/// returns y `[B, 1, Hv, Dv]` and the new state.
pub fn step(q: &Array, k: &Array, v: &Array, g: &Array, beta: &Array, state: &Array) -> Result<(Array, Array)> {
    let hv = v.shape()[2];
    let (q, k) = repeat_heads(q, k, hv)?;
    let (q, k, v, g, beta) =
        (q.index((.., 0)), k.index((.., 0)), v.index((.., 0)), g.index((.., 0)), beta.index((.., 0)));
    let decay = expand_dims(expand_dims(&g, -1)?, -1)?;
    let state = state.multiply(&decay)?;
    let k_row = expand_dims(&k, -2)?;
    let kv_mem = state.multiply(&k_row)?.sum_axis(-1, None)?;
    let delta = v.subtract(&kv_mem)?.multiply(expand_dims(&beta, -1)?)?;
    let state = state.add(k_row.multiply(expand_dims(&delta, -1)?)?)?;
    let y = state.multiply(expand_dims(&q, -2)?)?.sum_axis(-1, None)?;
    Ok((expand_dims(&y.as_dtype(q.dtype())?, 1)?, state))
}

/// Inverse of a batch of unit lower-triangular `[.., C, C]` matrices by
/// forward substitution (`_invert_unit_lower`).
fn invert_unit_lower(t: &Array, c: i32) -> Result<Array> {
    let eye = ops::eye::<f32>(c, None, None)?;
    let x = ops::broadcast_to(&eye, t.shape())?.add(ops::zeros_like(t)?)?;
    let mut rows = vec![x.index((Ellipsis, 0..1, ..))];
    for i in 1..c {
        let tij = t.index((Ellipsis, i..i + 1, ..i));
        let xj = ops::concatenate(&rows, -2)?;
        rows.push(x.index((Ellipsis, i..i + 1, ..)).subtract(tij.matmul(&xj)?)?);
    }
    Ok(ops::concatenate(&rows, -2)?)
}

/// A prefill of `T > 1` positions by the chunked parallel scan
/// (`gated_delta_chunked`): returns y `[B, T, Hv, Dv]` and the final state.
pub fn chunked(q: &Array, k: &Array, v: &Array, g: &Array, beta: &Array, state: &Array) -> Result<(Array, Array)> {
    let (b, t, _, dk) = (q.shape()[0], q.shape()[1], q.shape()[2], q.shape()[3]);
    let (hv, dv) = (v.shape()[2], v.shape()[3]);
    let in_dtype = v.dtype();
    let (mut q, mut k) = repeat_heads(q, k, hv)?;
    let (mut v, mut g, mut beta) = (v.clone(), g.clone(), beta.clone());
    let c = CHUNK;
    let pad = (c - t % c) % c;
    if pad > 0 {
        let cat = |x: &Array, fill: Array| -> Result<Array> { Ok(ops::concatenate(&[x, &fill], 1)?) };
        q = cat(&q, ops::zeros_dtype(&[b, pad, hv, dk], q.dtype())?)?;
        k = cat(&k, ops::zeros_dtype(&[b, pad, hv, dk], k.dtype())?)?;
        v = cat(&v, ops::zeros_dtype(&[b, pad, hv, dv], v.dtype())?)?;
        g = cat(&g, ops::ones_dtype(&[b, pad, hv], g.dtype())?)?;
        beta = cat(&beta, ops::zeros_dtype(&[b, pad, hv], beta.dtype())?)?;
    }
    let tp = t + pad;
    let n = tp / c;
    let rc = |x: &Array, d: i32| -> Result<Array> {
        Ok(x.reshape(&[b, n, c, hv, d])?.transpose_axes(&[0, 3, 1, 2, 4])?.as_dtype(Dtype::Float32)?)
    };
    let (q, k, v) = (rc(&q, dk)?, rc(&k, dk)?, rc(&v, dv)?);
    let g = g.reshape(&[b, n, c, hv])?.transpose_axes(&[0, 3, 1, 2])?;
    let beta = beta.reshape(&[b, n, c, hv])?.transpose_axes(&[0, 3, 1, 2])?;

    let lcg = ops::cumsum(ops::log(ops::clip(&g, (1e-6f32, 1.0f32))?)?, -1, None, None)?;
    let cumg = ops::exp(&lcg)?;
    let ones = ops::ones::<f32>(&[c, c])?;
    let lower_incl = ops::tril(&ones, 0)?;
    let strict_lower = ops::tril(&ones, -1)?;
    let pairwise = expand_dims(&lcg, -1)?.subtract(expand_dims(&lcg, -2)?)?;
    let diff = ops::select(lower_incl.gt(Array::from_f32(0.0))?, &pairwise, Array::from_f32(-1e30))?;
    let dr = ops::exp(&diff)?;

    let kt_ = k.swap_axes(-1, -2)?;
    let kk = k.matmul(&kt_)?;
    let beta_col = expand_dims(&beta, -1)?;
    let a = beta_col.multiply(&dr)?.multiply(&kk)?.multiply(&strict_lower)?;
    let tinv = invert_unit_lower(&ops::eye::<f32>(c, None, None)?.add(&a)?, c)?;

    let kbeta = expand_dims(beta.multiply(&cumg)?, -1)?.multiply(&k)?;
    let u0 = tinv.matmul(beta_col.multiply(&v)?)?;
    let kt = tinv.matmul(&kbeta)?;
    let m = dr.multiply(q.matmul(&kt_)?)?.multiply(&lower_incl)?;
    let qeff = expand_dims(&cumg, -1)?.multiply(&q)?.subtract(m.matmul(&kt)?)?;
    let mu0 = m.matmul(&u0)?;
    let cumg_last = cumg.index((Ellipsis, -1));
    let ratio_last = ops::exp(expand_dims(lcg.index((Ellipsis, -1)), -1)?.subtract(&lcg)?)?;

    let mut s = state.as_dtype(Dtype::Float32)?;
    let mut ys = Vec::with_capacity(n as usize);
    for i in 0..n {
        let st = s.swap_axes(-1, -2)?;
        ys.push(mu0.index((.., .., i)).add(qeff.index((.., .., i)).matmul(&st)?)?);
        let uc = u0.index((.., .., i)).subtract(kt.index((.., .., i)).matmul(&st)?)?;
        let uscaled = expand_dims(ratio_last.index((.., .., i)), -1)?.multiply(&uc)?;
        let decay = expand_dims(expand_dims(cumg_last.index((.., .., i)), -1)?, -1)?;
        s = decay.multiply(&s)?.add(uscaled.swap_axes(-1, -2)?.matmul(k.index((.., .., i)))?)?;
    }
    let y = ops::stack(&ys, 2)?.transpose_axes(&[0, 2, 3, 1, 4])?.reshape(&[b, tp, hv, dv])?;
    Ok((y.index((.., ..t)).as_dtype(in_dtype)?, s))
}
