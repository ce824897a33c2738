//! A dense matmul for steps of 2 to 16 rows, on CUDA.
//!
//! MLX 0.32's CUDA matmul sends a product of more than one row to
//! cuBLASLt, and asks cuBLASLt for a heuristic on every call: ~27 µs of
//! host work a product against ~6 µs for an ordinary launch
//! (docs/measurements/h100-2026-12-05b-batched-host.md). A decode batch of
//! a few rows and a speculative verify pass (one row, 2-9 positions) are
//! host-bound on a GPU, and make ~100-250 such products a step (~3 ms of
//! an 8B shape's 16-row step). This kernel of our own (MLX's custom-kernel
//! API, compiled by NVRTC once per float type and kept in MLX's kernel
//! cache) reads each weight row once for every row of the step: each warp
//! takes a few output features, each lane 16 bytes of each at a time, and
//! keeps up to [`MOST_ROWS`] sums per feature. The row count is data, not
//! a template: a new pass width compiles nothing.
//!
//! The kernel checks itself at its first use in the process against MLX's
//! matmul in f32 ([`Kernel::self_check`]); if it disagrees it is not used
//! and the log says why. Off CUDA nothing changes.
//!
//! **Off unless `MLXBC_DENSE_ROWS=on`.** Measured on an H200
//! (docs/measurements/h200-2026-12-07e-pass-attention.md): it takes ~1.7 ms
//! of launching off a verify pass of Qwen2.5-Coder-0.5B, but on the 8B
//! shape's decode batches its device time is ~3x cuBLAS's (16 clients
//! 467 against 1,457 tok/s): a warp of four output features with up to 16
//! sums each keeps too few loads in flight to read 16 GB of dense weights
//! at HBM speed. It needs more features per block (or split K) before it
//! can serve models whose products are not host-bound.

use crate::model::cuda_kernel::{CudaKernel, Launch, Template};
use anyhow::{bail, Result};
use mlx_rs::{Array, Dtype};
use std::cell::OnceCell;

/// Rows a step may have for the kernel (one row is MLX's matrix-vector
/// kernel's, which launches as cheaply).
pub const MOST_ROWS: i32 = 16;

/// Output features a warp computes, and warps a block.
const R: i32 = 4;
const WARPS: i32 = 4;

/// `MLXBC_DENSE_ROWS=on` (read once): the kernel serves dense products of
/// 2-16 rows; otherwise MLX's matmul does (see the module's note).
fn switched_on() -> bool {
    static ON: std::sync::LazyLock<bool> =
        std::sync::LazyLock::new(|| std::env::var("MLXBC_DENSE_ROWS").is_ok_and(|v| v.eq_ignore_ascii_case("on")));
    *ON
}

thread_local! {
    /// This thread's kernel, built (and checked) on first use; `None` when
    /// not on CUDA or when it failed its check.
    static KERNEL: OnceCell<Option<Kernel>> = const { OnceCell::new() };
}

/// `x Wᵀ` for `x` `[.., in]` of 2 to [`MOST_ROWS`] rows (all axes but the
/// last) and a dense `w` `[out, in]` of x's dtype, through the kernel; `None`
/// where it does not apply (not CUDA, not switched on, another row count,
/// dtype or layout, or the kernel failed its check): the caller takes
/// MLX's matmul.
pub fn matmul(x: &Array, w: &Array) -> Result<Option<Array>> {
    let width = *x.shape().last().unwrap_or(&0);
    let rows: i32 = x.shape()[..x.ndim().saturating_sub(1)].iter().product();
    if !(2..=MOST_ROWS).contains(&rows) || !switched_on() || !Kernel::takes(x, w, width) {
        return Ok(None);
    }
    KERNEL.with(|cell| match cell.get_or_init(Kernel::build_checked) {
        Some(kernel) => {
            let mut shape = x.shape().to_vec();
            *shape.last_mut().expect("x has an axis") = w.shape()[0];
            Ok(Some(kernel.apply(&x.reshape(&[rows, width])?, w, rows)?.reshape(&shape)?))
        }
        None => Ok(None),
    })
}

const SOURCE: &str = r#"
    // out[m, n] = sum_k x[m, k] * w[n, k] for m < rows (<= MAXROWS).
    // x [rows, K], w [N, K] row-contiguous T, rows 16-byte aligned
    // (K * sizeof(T) % 16 == 0); out [rows, N]. Each warp takes R
    // output features; each lane 16 bytes (VEC values) of each of their
    // weight rows at a time, so a warp reads its rows once, coalesced, for
    // every row of x.
    constexpr int VEC = 16 / sizeof(T);
    const int rows = x_shape[0];
    const int K = x_shape[1];
    const int N = w_shape[0];
    const int chunks = K / VEC;
    const int lane = threadIdx.x & 31;
    const int n0 = (blockIdx.x * NW + (threadIdx.x >> 5)) * R;
    if (n0 >= N) return;
    const uint4* w4 = reinterpret_cast<const uint4*>(w);
    const uint4* x4 = reinterpret_cast<const uint4*>(x);
    float acc[MAXROWS][R];
#pragma unroll
    for (int m = 0; m < MAXROWS; ++m) {
#pragma unroll
        for (int r = 0; r < R; ++r) acc[m][r] = 0.f;
    }
    for (int c = lane; c < chunks; c += 32) {
        // The weights' values as floats once, then every row against them.
        float wf[R][VEC];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            uint4 wv = {0u, 0u, 0u, 0u};
            if (n0 + r < N) wv = __ldg(w4 + (size_t)(n0 + r) * chunks + c);
#pragma unroll
            for (int i = 0; i < VEC; ++i) wf[r][i] = static_cast<float>(reinterpret_cast<const T*>(&wv)[i]);
        }
#pragma unroll
        for (int m = 0; m < MAXROWS; ++m) {
            if (m < rows) {
                const uint4 xv = x4[(size_t)m * chunks + c];
#pragma unroll
                for (int i = 0; i < VEC; ++i) {
                    const float xi = static_cast<float>(reinterpret_cast<const T*>(&xv)[i]);
#pragma unroll
                    for (int r = 0; r < R; ++r) acc[m][r] = fmaf(wf[r][i], xi, acc[m][r]);
                }
            }
        }
    }
#pragma unroll
    for (int m = 0; m < MAXROWS; ++m) {
        if (m < rows) {
#pragma unroll
            for (int r = 0; r < R; ++r) {
                float v = acc[m][r];
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
                // Lane r * MAXROWS + m's share: spread the stores over lanes.
                if (lane == ((r * MAXROWS + m) & 31) && n0 + r < N) out[(size_t)m * N + n0 + r] = static_cast<T>(v);
            }
        }
    }
"#;

/// The compiled kernel.
struct Kernel {
    cuda: CudaKernel,
}

impl Kernel {
    /// A float type shared by x and w, w `[out, in]` row-contiguous, rows
    /// of whole 16-byte chunks.
    fn takes(x: &Array, w: &Array, width: i32) -> bool {
        let bytes = match x.dtype() {
            Dtype::Float16 | Dtype::Bfloat16 => 2,
            Dtype::Float32 => 4,
            _ => return false,
        };
        w.ndim() == 2
            && w.dtype() == x.dtype()
            && w.shape()[1] == width
            && (width * bytes) % 16 == 0
            && w.strides() == [width as usize, 1]
    }

    fn build_checked() -> Option<Kernel> {
        crate::model::cuda_kernel::built_and_checked(
            "dense products of few rows keep MLX's matmul",
            &format!("dense products of 2-{MOST_ROWS} rows use mlxbc's own CUDA kernel"),
            || Ok(Kernel { cuda: CudaKernel::new("mlxbc_dense_rows", &["x", "w"], &["out"], SOURCE, true)? }),
            Kernel::self_check,
        )
    }

    fn apply(&self, x: &Array, w: &Array, rows: i32) -> Result<Array> {
        let n = w.shape()[0];
        let blocks = (n + R * WARPS - 1) / (R * WARPS);
        let templates = [
            Template::Type(c"T", x.dtype()),
            Template::Int(c"R", R),
            Template::Int(c"NW", WARPS),
            Template::Int(c"MAXROWS", MOST_ROWS),
        ];
        let launch = Launch {
            output_shape: &[rows, n],
            output_dtype: x.dtype(),
            grid: (blocks * WARPS * 32, 1, 1),
            block: (WARPS * 32, 1, 1),
            templates: &templates,
        };
        self.cuda.apply(&[x, w], &launch)
    }

    /// Runs the kernel on random weights (each float type; 2, 9 and 16
    /// rows; an output count that is not a multiple of a warp's features;
    /// a transposed input, which MLX copies to rows first) and compares with
    /// the product in f32. Passes when the kernel's largest error is within
    /// twice that of MLX's own matmul in the same dtype, plus 1e-3 of the
    /// largest value: rounding, not a wrong row.
    fn self_check(&self) -> Result<String> {
        let mut worst = (0.0f32, 0.0f32);
        let normal = |seed: u64, shape: &[i32]| -> Result<Array> {
            // Keys of its own: the check leaves MLX's global random state alone.
            let key = mlx_rs::random::key(seed)?;
            Ok(mlx_rs::random::normal::<f32>(shape, None, None, &key)?)
        };
        for (seed, (dtype, rows)) in
            [(Dtype::Float16, 2), (Dtype::Bfloat16, 9), (Dtype::Float32, 16), (Dtype::Float16, 16)]
                .into_iter()
                .enumerate()
        {
            let (n, k) = (262, 640);
            let seed = seed as u64 * 3;
            let w = normal(seed + 21, &[n, k])?.multiply(Array::from_f32(0.02))?.as_dtype(dtype)?;
            let x = normal(seed + 22, &[k, rows])?.as_dtype(dtype)?.t();
            let exact = x.as_dtype(Dtype::Float32)?.matmul(w.as_dtype(Dtype::Float32)?.t())?;
            let theirs = x.matmul(w.t())?;
            let ours = self.apply(&x, &w, rows)?;
            // Evaluated here, so a kernel that fails to compile is an error
            // returned (the kernel is then not used), not a panic in `item`.
            let scalar = |x: Array| -> Result<f32> {
                x.eval()?;
                Ok(x.item_exact::<f32>())
            };
            let err =
                |y: &Array| -> Result<f32> { scalar(y.as_dtype(Dtype::Float32)?.subtract(&exact)?.abs()?.max(None)?) };
            let (e_ours, e_mlx) = (err(&ours)?, err(&theirs)?);
            let largest = scalar(exact.abs()?.max(None)?)?;
            if e_ours.is_nan() || e_ours > 2.0 * e_mlx + 1e-3 * largest {
                bail!("{dtype:?}, {rows} rows: max error {e_ours:.2e} against MLX's {e_mlx:.2e}");
            }
            worst = (worst.0.max(e_ours), worst.1.max(e_mlx));
        }
        Ok(format!("checked against MLX: max error {:.1e}, MLX's own {:.1e}", worst.0, worst.1))
    }
}
