//! Element-wise functions for MLX's CPU backend built from multiplies and
//! adds. MLX computes `erf` and `exp` on the CPU one element at a time
//! (26 and 12 ns an element on this project's x86 machine, measured by
//! `scripts/bench.d/mlx_cpu_ops.py`), while its multiplies and adds run at
//! memory speed (0.3 ns): a BERT layer spent three quarters of its time in
//! GELU's `erf` and attention's softmax. The same functions as polynomials
//! are 3-4x faster there and agree to float precision (erf within 6e-7,
//! softmax within 1e-6 relative). On a GPU MLX's own kernels are used.

use mlx_rs::error::Exception;
use mlx_rs::Array;

/// True unless `MLXBC_CPU_MATH=mlx` asks for MLX's own `erf` and `exp`
/// (for measuring one against the other).
pub fn enabled() -> bool {
    std::env::var("MLXBC_CPU_MATH").map_or(true, |v| v != "mlx")
}

/// True unless `MLXBC_CPU_MATH` is `polynomial` (these polynomials as MLX
/// operations) or `mlx`: softmax, GELU and add+norm computed by
/// `cpu_native` over MLX's buffers, vectorized and on every core. Read
/// once (it is asked every layer).
pub fn native() -> bool {
    static NATIVE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *NATIVE.get_or_init(|| std::env::var("MLXBC_CPU_MATH").map_or(true, |v| v != "mlx" && v != "polynomial"))
}

/// Makes glibc keep freed buffers of up to 32 MiB (its largest mmap
/// threshold) on the heap for reuse, and up to 256 MiB of them before
/// returning memory to the system. MLX's CPU backend allocates every op's
/// output with `malloc`: above the threshold each is a fresh mapping whose
/// pages fault in on first touch, which costs more than the op (a multiply
/// over 94 MB: 2.5 ns an element against 0.26 ns over 12 MB). Once per
/// process; only where MLX runs on the CPU.
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            // SAFETY: mallopt only sets allocator parameters.
            unsafe {
                libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
                libc::mallopt(libc::M_TRIM_THRESHOLD, 256 << 20);
            }
        });
    }
}

/// Eigen's `generic_fast_erf_float`: erf(x) = x·P(x²)/Q(x²) on [-4, 4]
/// (|erf(x)| rounds to 1 in f32 beyond), within 6e-7 of `erf`.
pub(crate) const ERF_P: [f32; 7] =
    [-2.726_142_3e-10, 2.770_681_4e-8, -2.101_024e-6, -5.692_506_4e-5, -7.349_906_3e-4, -2.954_6e-3, -1.609_603_4e-2];
pub(crate) const ERF_Q: [f32; 5] = [-1.456_607_2e-5, -2.133_740_6e-4, -1.682_827e-3, -7.373_329_2e-3, -1.426_474e-2];

/// 2^f on [0, 1): Taylor terms of e^(f·ln 2), within 2e-7 relative.
const EXP2: [f32; 8] = [
    1.0,
    std::f32::consts::LN_2,
    0.240_226_5,
    5.550_411e-2,
    9.618_129e-3,
    1.333_355_8e-3,
    1.540_353e-4,
    1.525_273_4e-5,
];

/// `EXP2` highest degree first, as Horner's rule takes it.
pub(crate) const EXP2_HIGH_FIRST: [f32; 8] = [EXP2[7], EXP2[6], EXP2[5], EXP2[4], EXP2[3], EXP2[2], EXP2[1], EXP2[0]];

fn horner(x: &Array, coefficients: &[f32]) -> Result<Array, Exception> {
    let mut p = Array::from_f32(coefficients[0]);
    for &c in &coefficients[1..] {
        p = p.multiply(x)?.add(Array::from_f32(c))?;
    }
    Ok(p)
}

/// erf(x), f32.
pub fn erf(x: &Array) -> Result<Array, Exception> {
    let x = mlx_rs::ops::clip(x, (-4.0f32, 4.0f32))?;
    let x2 = x.square()?;
    horner(&x2, &ERF_P)?.multiply(&x)?.divide(horner(&x2, &ERF_Q)?)
}

/// GELU with the exact erf (BERT's `gelu`): x·(1 + erf(x/√2))/2, f32;
/// by `cpu_native` unless `MLXBC_CPU_MATH=polynomial`.
pub fn gelu(x: &Array) -> Result<Array, Exception> {
    if native() {
        super::cpu_native::gelu(x)
    } else {
        gelu_polynomial(x)
    }
}

/// [`gelu`] as MLX operations.
pub fn gelu_polynomial(x: &Array) -> Result<Array, Exception> {
    let e = erf(&x.multiply(Array::from_f32(std::f32::consts::FRAC_1_SQRT_2))?)?;
    x.multiply(e.add(Array::from_f32(1.0))?)?.multiply(Array::from_f32(0.5))
}

/// e^x for x ≤ 0 (as softmax feeds it; below -87 it is taken as -87,
/// e^-87 ≈ 1.6e-38): 2^k · 2^f with k whole, 2^k made from its exponent
/// bits.
fn exp_nonpositive(x: &Array) -> Result<Array, Exception> {
    let y = mlx_rs::ops::maximum(x, Array::from_f32(-87.0))?.multiply(Array::from_f32(std::f32::consts::LOG2_E))?;
    let k = y.floor()?;
    let two_f = horner(&y.subtract(&k)?, &EXP2_HIGH_FIRST)?;
    // (k + 127) << 23 is the f32 whose value is 2^k.
    let bits = k.as_dtype(mlx_rs::Dtype::Int32)?.add(Array::from_int(127))?.multiply(Array::from_int(1 << 23))?;
    two_f.multiply(bits.view::<f32>()?)
}

/// Softmax over the last axis of `scores + bias` (attention's scores
/// `[B, heads, queries, keys]`, a bias `[B or 1, 1, queries or 1, keys]`),
/// f32; by `cpu_native` unless `MLXBC_CPU_MATH=polynomial`.
pub fn softmax_biased(scores: &Array, bias: &Array) -> Result<Array, Exception> {
    if native() {
        super::cpu_native::softmax_biased(scores, bias)
    } else {
        softmax_last(&scores.add(bias)?)
    }
}

/// `norm(a + b)` (a post-norm encoder's residual and its norm), f32; by
/// `cpu_native` unless `MLXBC_CPU_MATH` is `polynomial` or `mlx` (MLX's CPU
/// layer norm is several operations, each a pass on one thread).
pub fn add_layer_norm(a: &Array, b: &Array, norm: &super::layers::LayerNorm) -> anyhow::Result<Array> {
    if native() {
        let (weight, bias, eps) = norm.parts();
        Ok(super::cpu_native::add_layer_norm(a, b, weight, bias, eps)?)
    } else {
        norm.forward(&a.add(b)?)
    }
}

/// Softmax over the last axis, f32, as MLX operations.
pub fn softmax_last(x: &Array) -> Result<Array, Exception> {
    let e = exp_nonpositive(&x.subtract(x.max_axis(-1, true)?)?)?;
    e.divide(e.sum_axis(-1, true)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: i32, scale: f32) -> Array {
        let v: Vec<f32> = (0..n).map(|i| ((i as f32 * 0.618_034).fract() - 0.5) * 2.0 * scale).collect();
        Array::from_slice(&v, &[n])
    }

    fn max_abs(a: &Array, b: &Array) -> f32 {
        a.subtract(b).unwrap().abs().unwrap().max(None).unwrap().try_item_cast::<f32>().unwrap()
    }

    #[test]
    fn erf_and_gelu_agree_with_mlx_to_float_precision() {
        let x = values(10_000, 6.0);
        assert!(max_abs(&erf(&x).unwrap(), &mlx_rs::ops::erf(&x).unwrap()) < 1e-6);
        assert!(max_abs(&gelu_polynomial(&x).unwrap(), &mlx_rs::nn::gelu(&x).unwrap()) < 5e-6);
    }

    #[test]
    fn softmax_agrees_with_mlx_relative_to_each_value() {
        let x = values(12_000, 30.0).reshape(&[40, 300]).unwrap();
        let want = mlx_rs::ops::softmax_axis(&x, -1, None).unwrap();
        let got = softmax_last(&x).unwrap();
        let relative = got.subtract(&want).unwrap().abs().unwrap().divide(&want).unwrap();
        assert!(relative.max(None).unwrap().try_item_cast::<f32>().unwrap() < 2e-6);
        // A masked position (-1e9) weighs nothing.
        let masked = Array::from_slice(&[0.0f32, -1e9, 1.0], &[1, 3]);
        let s = softmax_last(&masked).unwrap();
        s.eval().unwrap();
        assert!(s.as_slice::<f32>()[1] < 1e-30);
    }
}
