//! A decode step's queries and keys, normed and roped in one CUDA kernel.
//!
//! On a GPU a step of few rows is bound by the host's work per operation
//! (~6 µs of MLX's launching each, docs/measurements/h100-2026-12-05b-batched-host.md),
//! not by the device. Between the fused q/k/v projection and the cache,
//! a layer otherwise runs four: Qwen3's RMS norm of the query heads and of
//! the key heads, then rope on each (two for Llama and Qwen2, which have no
//! such norms). This kernel (through MLX's custom-kernel API, compiled by
//! NVRTC on first use and kept in MLX's kernel cache) reads the heads
//! straight from the fused output and writes both, normed and roped, in one
//! launch: a warp a head, the norm's sum by shuffles.
//!
//! Its arithmetic follows MLX's: the norm rounds `x · rsqrt(mean(x²) + eps)`
//! to the float type before the weight's product; rope's inverse frequency
//! is `exp2(-i / (D/2) · log2(base))` (or `1 / freqs[i]` for Llama 3's
//! scaling), computed on the device as MLX computes it. It checks itself at
//! its first use against MLX's own `rms_norm` and `rope`
//! ([`Kernel::self_check`]); if it disagrees it is not used and the log
//! says why. Off CUDA nothing changes.

use crate::model::cuda_kernel::{CudaKernel, Launch, Template};
use anyhow::{bail, Result};
use mlx_rs::{fast, ops::indexing::IndexOp, Array, Dtype};
use std::cell::OnceCell;

thread_local! {
    /// This thread's kernel, built (and checked) on first use; `None` when
    /// not on CUDA or when it failed its check.
    static KERNEL: OnceCell<Option<Kernel>> = const { OnceCell::new() };
}

/// A model's rope and norm settings, as the kernel reads them.
#[derive(Clone)]
pub struct QkRope {
    /// Query and key/value heads (this rank's), and each head's width.
    heads: i32,
    kv_heads: i32,
    head_dim: i32,
    /// `[eps, log2(base)]` (f32): data, so one compiled kernel serves every model.
    params: Array,
    /// Llama 3's scaled frequencies, or `None` for plain `base`.
    freqs: Option<Array>,
}

impl QkRope {
    /// The settings of a model with `heads` query and `kv_heads` key/value
    /// heads of `head_dim`, rope `base` (or Llama 3's `freqs`), norm `eps`.
    pub fn new(heads: i32, kv_heads: i32, head_dim: i32, base: f32, freqs: Option<&Array>, eps: f32) -> Result<Self> {
        let params = Array::from_slice(&[eps, base.log2()], &[2]);
        let freqs = freqs.map(|f| f.as_dtype(Dtype::Float32)).transpose()?;
        Ok(Self { heads, kv_heads, head_dim, params, freqs })
    }

    /// q `[b, heads, 1, D]` and k `[b, kv_heads, 1, D]` of the fused q/k/v
    /// output `y` `[b, 1, (heads + 2 kv_heads) · D]` of one position per row,
    /// each head RMS-normed by `q_norm` / `k_norm` (both or neither) and
    /// roped at `positions` (`[1]` or `[b]`, int32); `None` where the kernel
    /// does not apply (not CUDA, another shape, or it failed its check).
    pub fn apply(
        &self,
        y: &Array,
        q_norm: Option<&Array>,
        k_norm: Option<&Array>,
        positions: &Array,
    ) -> Result<Option<(Array, Array)>> {
        let d = self.head_dim;
        let shape = y.shape();
        let norm = match (q_norm, k_norm) {
            (Some(q), Some(k)) if q.shape() == [d] && k.shape() == [d] => Some((q, k)),
            (None, None) => None,
            _ => return Ok(None),
        };
        let width = (self.heads + 2 * self.kv_heads) * d;
        if !crate::model::cuda_kernel::step_fusion_on()
            || shape.len() != 3
            || shape[1] != 1
            || shape[2] != width
            || d % 64 != 0
            || d > 256
            || !matches!(y.dtype(), Dtype::Float16 | Dtype::Bfloat16)
            || norm.is_some_and(|(q, k)| q.dtype() != y.dtype() || k.dtype() != y.dtype())
            || positions.dtype() != Dtype::Int32
            || !(positions.size() == 1 || positions.size() as i32 == shape[0])
        {
            return Ok(None);
        }
        KERNEL.with(|cell| match cell.get_or_init(Kernel::build_checked) {
            Some(kernel) => {
                // Read as it is ([b, 1, W]): a reshape would be one more
                // operation in a step bound by their count.
                let both = kernel.apply(self, y, norm, positions)?;
                Ok(Some((both.index((.., ..self.heads)), both.index((.., self.heads..)))))
            }
            None => Ok(None),
        })
    }
}

/// The kernel's body. A warp takes one head of one row: lane `l` holds
/// the pairs (j, j + D/2) for j = l, l + 32, ... (rope's halves), sums their
/// squares for the norm, then rotates them.
const SOURCE: &str = r#"
    // y [B, 1, W] (q heads, then k heads, then v heads, D each); qw, kw [D];
    // freqs [D/2] f32 (read when FREQS); params [eps, log2(base)] f32;
    // positions [1] or [B] int32; out [B, HQ + HKV, 1, D].
    constexpr int P = D / 64;
    const int W = y_shape[2];
    const int HKV = (W / D - HQ) / 2;
    const int heads = HQ + HKV;
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    const int b = warp / heads;
    const int h = warp % heads;
    if (b >= y_shape[0]) return;
    const T* src = y + (size_t)b * W + (size_t)h * D;
    const float pos = static_cast<float>(positions[positions_shape[0] == 1 ? 0 : b]);
    float lo[P], hi[P];
#pragma unroll
    for (int t = 0; t < P; ++t) {
        lo[t] = static_cast<float>(src[lane + 32 * t]);
        hi[t] = static_cast<float>(src[lane + 32 * t + D / 2]);
    }
    if (NORM) {
        float ss = 0.f;
#pragma unroll
        for (int t = 0; t < P; ++t) ss += lo[t] * lo[t] + hi[t] * hi[t];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        const float r = rsqrtf(ss / D + params[0]);
        const T* wn = h < HQ ? qw : kw;
#pragma unroll
        for (int t = 0; t < P; ++t) {
            const int j = lane + 32 * t;
            lo[t] = static_cast<float>(static_cast<T>(static_cast<float>(wn[j]) *
                static_cast<float>(static_cast<T>(lo[t] * r))));
            hi[t] = static_cast<float>(static_cast<T>(static_cast<float>(wn[j + D / 2]) *
                static_cast<float>(static_cast<T>(hi[t] * r))));
        }
    }
    T* dst = out + ((size_t)b * heads + h) * D;
#pragma unroll
    for (int t = 0; t < P; ++t) {
        const int j = lane + 32 * t;
        const float inv_freq = FREQS ? 1.f / freqs[j] : exp2f(-(static_cast<float>(j) / (D / 2)) * params[1]);
        const float theta = pos * inv_freq;
        const float c = cosf(theta);
        const float s = sinf(theta);
        dst[j] = static_cast<T>(lo[t] * c - hi[t] * s);
        dst[j + D / 2] = static_cast<T>(lo[t] * s + hi[t] * c);
    }
"#;

/// The compiled kernel, and the stand-ins for inputs a model does not have.
struct Kernel {
    cuda: CudaKernel,
    /// Read in place of frequencies a model has none of (the kernel's
    /// templates say not to read them).
    unused: Array,
}

impl Kernel {
    fn build_checked() -> Option<Kernel> {
        crate::model::cuda_kernel::built_and_checked(
            "queries and keys keep MLX's norm and rope",
            "queries and keys of decode steps are normed and roped by mlxbc's own CUDA kernel",
            Kernel::new,
            Kernel::self_check,
        )
    }

    fn new() -> Result<Kernel> {
        let inputs = ["y", "qw", "kw", "freqs", "params", "positions"];
        Ok(Kernel {
            cuda: CudaKernel::new("mlxbc_qk_norm_rope", &inputs, &["out"], SOURCE, true)?,
            unused: Array::from_slice(&[0.0f32], &[1]),
        })
    }

    /// `y` `[b, 1, W]`: out `[b, heads + kv_heads, 1, D]`.
    fn apply(&self, rope: &QkRope, y: &Array, norm: Option<(&Array, &Array)>, positions: &Array) -> Result<Array> {
        let (b, d) = (y.shape()[0], rope.head_dim);
        let heads = rope.heads + rope.kv_heads;
        let warps_per_block = 4;
        let blocks = (b * heads + warps_per_block - 1) / warps_per_block;
        let templates = [
            Template::Type(c"T", y.dtype()),
            Template::Int(c"D", d),
            Template::Int(c"HQ", rope.heads),
            Template::Int(c"NORM", i32::from(norm.is_some())),
            Template::Int(c"FREQS", i32::from(rope.freqs.is_some())),
        ];
        let launch = Launch {
            output_shape: &[b, heads, 1, d],
            output_dtype: y.dtype(),
            grid: (blocks * warps_per_block * 32, 1, 1),
            block: (warps_per_block * 32, 1, 1),
            templates: &templates,
        };
        // Stand-ins of the types the body declares them with (MLX types
        // each input by its dtype): `y` for the norms, f32 for frequencies.
        let (qw, kw) = norm.unwrap_or((y, y));
        let freqs = rope.freqs.as_ref().unwrap_or(&self.unused);
        self.cuda.apply(&[y, qw, kw, freqs, &rope.params, positions], &launch)
    }

    /// Against MLX's `rms_norm` and `rope` on random heads: with and without
    /// the norms, one position for every row and one per row, plain base and
    /// Llama 3's frequencies, both float types and both head widths. Passes
    /// when every value is within four of the float type's steps at the
    /// largest value: rounding, not a wrong rotation.
    fn self_check(&self) -> Result<String> {
        let mut worst = 0.0f32;
        let normal = |seed: u64, shape: &[i32]| -> Result<Array> {
            let key = mlx_rs::random::key(seed)?;
            Ok(mlx_rs::random::normal::<f32>(shape, None, None, &key)?)
        };
        let cases = [
            (Dtype::Float16, 128, true, false, vec![300]),
            (Dtype::Bfloat16, 64, false, true, vec![7, 1999, 0]),
            (Dtype::Float16, 64, true, false, vec![5000, 3]),
        ];
        for (seed, (dtype, d, norm, llama3, positions)) in cases.into_iter().enumerate() {
            let seed = seed as u64 * 7 + 101;
            let (heads, kv_heads, b) = (4, 2, positions.len() as i32);
            let freqs = llama3
                .then(|| {
                    normal(seed, &[d / 2])
                        .and_then(|f| Ok(f.abs()?.multiply(Array::from_f32(50.0))?.add(Array::from_f32(1.0))?))
                })
                .transpose()?;
            let rope = QkRope::new(heads, kv_heads, d, 10000.0, freqs.as_ref(), 1e-6)?;
            let y = normal(seed + 1, &[b, 1, (heads + 2 * kv_heads) * d])?
                .multiply(Array::from_f32(2.0))?
                .as_dtype(dtype)?;
            let qw = normal(seed + 2, &[d])?.as_dtype(dtype)?;
            let kw = normal(seed + 3, &[d])?.as_dtype(dtype)?;
            let norms = norm.then_some((&qw, &kw));
            let at = Array::from_slice(&positions, &[b]);
            let ours = self.apply(&rope, &y, norms, &at)?;
            // MLX's path: the parts as heads, normed, roped.
            let parts = y.split_at_indices(&[heads * d, (heads + kv_heads) * d], -1)?;
            let theirs = |part: &Array, n: i32, w: &Array| -> Result<Array> {
                // A contiguous copy for rope: the key part is a multi-row
                // view past its buffer's start, which MLX 0.32.2's CUDA rope
                // misreads (the model copies it too, families/llama). Once on
                // an H200 this case (no norm) failed by the values' own size
                // in one daemon of two started alike, and the kernel was
                // refused; which side was wrong is not known
                // (docs/measurements/h200-2026-12-07e-pass-attention.md).
                let x = part.reshape(&[b, n, 1, d])?;
                let x = if norm { fast::rms_norm(&x, Some(w), 1e-6)? } else { x.contiguous()? };
                let base = if llama3 { None } else { Some(10000.0) };
                Ok(fast::rope_dynamic(&x, d, false, base, 1.0, &at, freqs.as_ref())?)
            };
            let reference =
                mlx_rs::ops::concatenate(&[theirs(&parts[0], heads, &qw)?, theirs(&parts[1], kv_heads, &kw)?], 1)?;
            let scalar = |x: Array| -> Result<f32> {
                x.eval()?;
                Ok(x.item_exact::<f32>())
            };
            let f32s = |a: &Array| a.as_dtype(Dtype::Float32);
            let err = scalar(f32s(&ours)?.subtract(f32s(&reference)?)?.abs()?.max(None)?)?;
            let largest = scalar(f32s(&reference)?.abs()?.max(None)?)?;
            // Four of the float type's steps at the largest value: MLX may
            // take sine and cosine by fast approximations, whose error grows
            // with the angle (5,000 radians here); a wrong pairing, sign or
            // frequency is off by the values' own size.
            let step = if dtype == Dtype::Bfloat16 { 1.6e-2 } else { 4e-3 };
            if err.is_nan() || err > step * largest {
                bail!("{dtype:?}, head {d}, norm {norm}, llama3 {llama3}: max error {err:.2e} of {largest:.2e}");
            }
            worst = worst.max(err / largest);
        }
        Ok(format!("checked against MLX: max error {worst:.1e} of the largest value"))
    }
}
