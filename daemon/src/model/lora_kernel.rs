//! A LoRA update of a decode step as two small CUDA kernels of our own.
//!
//! A plain LoRA group adds `(x A) B` to its projection's output: two
//! matrix products, which MLX 0.32's CUDA backend runs through cuBLASLt,
//! building descriptors and asking for a heuristic on every call (~27 µs of
//! the host's time each for a 16-row step against ~6 µs for a custom
//! kernel: docs/measurements/h100-2026-12-05b-batched-host.md). A decode
//! step of a batch is bound by the host's work per operation, so on an 8B
//! shape 16 clients under one adapter ran at half the bare base's speed
//! (docs/measurements/h100-2026-12-06b-draft-rows.md). Here the same update
//! is one pass that computes each row's `x A` in f32 over slices of its
//! features (`lora_xa`) and one that adds `(x A) B` to the output
//! (`lora_add`, summing the slices: no atomics, the same order every
//! step), for one adapter shared
//! by every row or a stacked adapter per row ([`crate::model::lora::RowAdapters`]).
//! The adapter's products are tiny (rank a few dozen); the kernels read `A`
//! once per row and `B` once per output, coalesced.
//!
//! The kernels check themselves against MLX's products at their first use
//! in the process ([`Kernels::self_check`]); if they disagree they are not
//! used and the log says why. Off CUDA nothing changes, and steps of more
//! than [`MOST_ROWS`] rows (prefill) keep MLX's matmuls, which are efficient
//! there. `MLXBC_LORA_KERNEL=off` keeps MLX's matmuls everywhere (for
//! side-by-side runs).

use crate::model::cuda_kernel::{CudaKernel, Launch, Template};
use anyhow::{bail, Result};
use mlx_rs::{ops, Array, Dtype};
use std::cell::OnceCell;

/// Steps of up to this many rows (positions of every sequence) use the
/// kernels: decode steps and speculation's verify passes of a batch.
pub const MOST_ROWS: i32 = 128;

/// Threads of a block of either kernel; also the largest rank (Σ of a
/// group's parts') they take.
const THREADS: i32 = 256;

/// Slices of the input features that `lora_xa` sums apart (a block each).
const SPLIT: i32 = 16;

/// `MLXBC_LORA_KERNEL=off` (read once): MLX's matmuls for every LoRA update.
static OFF: std::sync::LazyLock<bool> =
    std::sync::LazyLock::new(|| std::env::var("MLXBC_LORA_KERNEL").is_ok_and(|v| v.eq_ignore_ascii_case("off")));

thread_local! {
    /// This thread's kernels, built (and checked) on first use; `None` when
    /// not on CUDA or when they failed their check.
    static KERNELS: OnceCell<Option<Kernels>> = const { OnceCell::new() };
}

/// `y + (x a) b` through the kernels, or `None` where they do not apply
/// (not CUDA, turned off, more rows than [`MOST_ROWS`], a rank over 256,
/// another dtype, shapes not as below, or the kernels failed their check):
/// the caller takes MLX's path.
///
/// `x` `[rows, L, in]` (or `[M, in]`), `y` the same with `out` last; `a`
/// `[in, R]` and `b` `[R, out]` for every row, or stacked per row `[rows,
/// in, R]` and `[rows, R, out]` (then row `m` of the flattened `M = rows ·
/// L` uses adapter row `m / L`).
pub fn add(y: &Array, x: &Array, a: &Array, b: &Array) -> Result<Option<Array>> {
    if *OFF {
        return Ok(None);
    }
    let Some(shapes) = Shapes::of(y, x, a, b) else { return Ok(None) };
    KERNELS.with(|cell| match cell.get_or_init(Kernels::build_checked) {
        Some(k) => Ok(Some(k.apply(y, x, a, b, &shapes)?)),
        None => Ok(None),
    })
}

/// What one call computes over.
struct Shapes {
    /// Rows of the flattened input.
    m: i32,
    /// Input features.
    k: i32,
    /// The adapter's rank (Σ of the group's parts').
    r: i32,
    /// Output features.
    n: i32,
    /// Positions per stacked adapter row (0: one adapter for every row).
    per: i32,
}

impl Shapes {
    fn of(y: &Array, x: &Array, a: &Array, b: &Array) -> Option<Shapes> {
        let (xs, ys) = (x.shape(), y.shape());
        let k = *xs.last()?;
        let n = *ys.last()?;
        let m: i32 = xs[..xs.len() - 1].iter().product();
        let dtype = x.dtype();
        let dtypes_ok = matches!(dtype, Dtype::Float16 | Dtype::Bfloat16 | Dtype::Float32)
            && [y.dtype(), a.dtype(), b.dtype()].iter().all(|&d| d == dtype);
        if !dtypes_ok || !(1..=MOST_ROWS).contains(&m) || ys[..ys.len() - 1] != xs[..xs.len() - 1] {
            return None;
        }
        let (r, per) = match (a.shape(), b.shape()) {
            ([ak, ar], [br, bn]) if *ak == k && br == ar && *bn == n => (*ar, 0),
            ([rows, ak, ar], [brows, br, bn]) if *ak == k && br == ar && *bn == n && rows == brows => {
                // Stacked: one adapter row per sequence of x `[rows, L, in]`.
                if xs.len() != 3 || xs[0] != *rows {
                    return None;
                }
                (*ar, xs[1])
            }
            _ => return None,
        };
        (1..=THREADS).contains(&r).then_some(Shapes { m, k, r, n, per })
    }
}

/// `partial[m, s, j] = Σ_k x[m, k] a[k, j]` over slice `s` of the `SPLIT`
/// slices of `k`, in f32, one block a (row, slice): thread `t` walks the
/// slice's adapter elements `t, t + active, ...` (contiguous across the
/// block, so `a` is read coalesced), each thread always on column `t % R`
/// (`active` is a multiple of R); then the columns' sums are added. Slices
/// give a step of few rows enough blocks, and each thread few elements.
const XA_BODY: &str = r#"
    const int K = x_shape[1];
    const int R = STACKED ? a_shape[2] : a_shape[1];
    const int PER = STACKED ? x_shape[0] / a_shape[0] : 0;
    const int m = blockIdx.x / SPLIT;
    const int s = blockIdx.x % SPLIT;
    const int t = threadIdx.x;
    const int chunk = (K + SPLIT - 1) / SPLIT;
    const int k0 = min(K, s * chunk);
    const int k1 = min(K, k0 + chunk);
    const int active = (THREADS / R) * R;
    const T* ap = a + (PER > 0 ? (size_t)(m / PER) * K * R : 0);
    const T* xp = x + (size_t)m * K;
    float acc = 0.f;
    if (t < active) {
#pragma unroll 4
        for (int e = k0 * R + t; e < k1 * R; e += active) {
            acc = fmaf(static_cast<float>(xp[e / R]), static_cast<float>(ap[e]), acc);
        }
    }
    __shared__ float sums[THREADS];
    sums[t] = acc;
    __syncthreads();
    if (t < R) {
        float v = 0.f;
        for (int i = t; i < active; i += R) v += sums[i];
        partial[((size_t)m * SPLIT + s) * R + t] = v;
    }
"#;

/// `out[m, n] = y[m, n] + Σ_j xa[m, j] b[j, n]`, one block a (row, tile of
/// THREADS outputs): the row's `xa` summed from its slices into shared
/// memory once, then a thread an output (neighbouring threads read
/// neighbouring `b`), rounded once.
const ADD_BODY: &str = r#"
    const int N = y_shape[1];
    const int R = partial_shape[2];
    const int PER = STACKED ? y_shape[0] / b_shape[0] : 0;
    const int tiles = (N + THREADS - 1) / THREADS;
    const int m = blockIdx.x / tiles;
    const int t = threadIdx.x;
    const int n = (blockIdx.x % tiles) * THREADS + t;
    __shared__ float xs[THREADS];
    if (t < R) {
        float v = 0.f;
        for (int s = 0; s < SPLIT; ++s) v += partial[((size_t)m * SPLIT + s) * R + t];
        xs[t] = v;
    }
    __syncthreads();
    if (n >= N) return;
    const T* bp = b + (PER > 0 ? (size_t)(m / PER) * R * N : 0);
    float acc = 0.f;
    for (int j = 0; j < R; ++j) acc = fmaf(xs[j], static_cast<float>(bp[(size_t)j * N + n]), acc);
    out[(size_t)m * N + n] = static_cast<T>(static_cast<float>(y[(size_t)m * N + n]) + acc);
"#;

/// The two compiled kernels.
struct Kernels {
    xa: CudaKernel,
    add: CudaKernel,
}

impl Kernels {
    fn build_checked() -> Option<Kernels> {
        let used = format!("LoRA updates of steps of up to {MOST_ROWS} rows use mlxbc's own CUDA kernels");
        crate::model::cuda_kernel::built_and_checked(
            "LoRA updates keep MLX's matmuls",
            &used,
            Kernels::new,
            Kernels::self_check,
        )
    }

    fn new() -> Result<Kernels> {
        // Row-contiguous inputs: MLX copies a view first.
        Ok(Kernels {
            xa: CudaKernel::new("mlxbc_lora_xa", &["x", "a"], &["partial"], XA_BODY, true)?,
            add: CudaKernel::new("mlxbc_lora_add", &["y", "partial", "b"], &["out"], ADD_BODY, true)?,
        })
    }

    fn apply(&self, y: &Array, x: &Array, a: &Array, b: &Array, s: &Shapes) -> Result<Array> {
        let dtype = x.dtype();
        let x2 = x.reshape(&[s.m, s.k])?;
        let y2 = y.reshape(&[s.m, s.n])?;
        // The rank and positions per adapter row are read from the shapes,
        // not made template constants: each new constant would compile
        // the kernels again (NVRTC) in front of a request.
        let templates = [
            Template::Type(c"T", dtype),
            Template::Int(c"STACKED", i32::from(s.per > 0)),
            Template::Int(c"THREADS", THREADS),
            Template::Int(c"SPLIT", SPLIT),
        ];
        let partial = self.xa.apply(
            &[&x2, a],
            &Launch {
                output_shape: &[s.m, SPLIT, s.r],
                output_dtype: Dtype::Float32,
                grid: (s.m * SPLIT * THREADS, 1, 1),
                block: (THREADS, 1, 1),
                templates: &templates,
            },
        )?;
        let tiles = (s.n + THREADS - 1) / THREADS;
        let out = self.add.apply(
            &[&y2, &partial, b],
            &Launch {
                output_shape: &[s.m, s.n],
                output_dtype: dtype,
                grid: (s.m * tiles * THREADS, 1, 1),
                block: (THREADS, 1, 1),
                templates: &templates,
            },
        )?;
        Ok(out.reshape(y.shape())?)
    }

    /// Runs the kernels on random inputs (f16 and bf16, one adapter for
    /// every row and one stacked per row with two positions each, ranks
    /// that divide the block and one that does not) and compares with
    /// `y + (x a) b` in f32. Passes when the kernels' largest error is
    /// within twice MLX's own path's in the same dtype (plus 1e-3 of the
    /// largest value): rounding, not a wrong element.
    fn self_check(&self) -> Result<String> {
        let mut worst = (0.0f32, 0.0f32);
        let normal = |seed: u64, shape: &[i32], scale: f32, dtype: Dtype| -> Result<Array> {
            // Keys of its own: the check leaves MLX's global random state alone.
            let key = mlx_rs::random::key(seed)?;
            Ok(mlx_rs::random::normal::<f32>(shape, None, None, &key)?
                .multiply(Array::from_f32(scale))?
                .as_dtype(dtype)?)
        };
        let f32 = Dtype::Float32;
        for (case, (dtype, rank, stacked)) in
            [(Dtype::Float16, 24, false), (Dtype::Bfloat16, 32, true), (Dtype::Float16, 7, true)]
                .into_iter()
                .enumerate()
        {
            let seed = case as u64 * 5 + 101;
            let (rows, positions, k, n) = (3, if stacked { 2 } else { 1 }, 640, 264);
            let lead: &[i32] = if stacked { &[rows] } else { &[] };
            let x = normal(seed, &[rows, positions, k], 1.0, dtype)?;
            let y = normal(seed + 1, &[rows, positions, n], 1.0, dtype)?;
            let a = normal(seed + 2, &[lead, &[k, rank][..]].concat(), 0.05, dtype)?;
            let b = normal(seed + 3, &[lead, &[rank, n][..]].concat(), 0.05, dtype)?;
            let reference =
                y.as_dtype(f32)?.add(x.as_dtype(f32)?.matmul(a.as_dtype(f32)?)?.matmul(b.as_dtype(f32)?)?)?;
            let theirs = ops::addmm(&y, x.matmul(&a)?, &b, 1.0, 1.0)?;
            let Some(shapes) = Shapes::of(&y, &x, &a, &b) else { bail!("case {case}: shapes refused") };
            let ours = self.apply(&y, &x, &a, &b, &shapes)?;
            // Evaluated here, so a kernel that fails to compile is an error
            // returned (the kernels are then not used), not a panic in `item`.
            let scalar = |v: Array| -> Result<f32> {
                v.eval()?;
                Ok(v.item_exact::<f32>())
            };
            let err = |v: &Array| -> Result<f32> { scalar(v.as_dtype(f32)?.subtract(&reference)?.abs()?.max(None)?) };
            let (e_ours, e_mlx) = (err(&ours)?, err(&theirs)?);
            let largest = scalar(reference.abs()?.max(None)?)?;
            if ours.shape() != y.shape() || e_ours.is_nan() || e_ours > 2.0 * e_mlx + 1e-3 * largest {
                bail!("{dtype:?}, rank {rank}, stacked {stacked}: max error {e_ours:.2e} against MLX's {e_mlx:.2e}");
            }
            worst = (worst.0.max(e_ours), worst.1.max(e_mlx));
        }
        Ok(format!("checked against MLX: max error {:.1e}, MLX's own {:.1e}", worst.0, worst.1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn zeros(shape: &[i32], dtype: Dtype) -> Array {
        ops::zeros_dtype(shape, dtype).unwrap()
    }

    #[test]
    fn the_kernels_take_a_decode_step_under_one_adapter_or_one_per_row_and_nothing_else() {
        let h = Dtype::Float16;
        // One adapter for 16 rows of one position: a plain product pair.
        let s =
            Shapes::of(&zeros(&[16, 1, 96], h), &zeros(&[16, 1, 64], h), &zeros(&[64, 24], h), &zeros(&[24, 96], h))
                .expect("one adapter");
        assert_eq!((s.m, s.k, s.r, s.n, s.per), (16, 64, 24, 96, 0));
        // Stacked per row, 3 positions a row (a verify pass): row m uses adapter m / 3.
        let s =
            Shapes::of(&zeros(&[4, 3, 96], h), &zeros(&[4, 3, 64], h), &zeros(&[4, 64, 8], h), &zeros(&[4, 8, 96], h))
                .expect("stacked");
        assert_eq!((s.m, s.r, s.per), (12, 8, 3));
        let refused = [
            // A prefill chunk: MLX's matmuls are efficient there.
            (vec![1, 512, 96], vec![1, 512, 64], vec![64, 8], vec![8, 96], h),
            // A rank over a block's threads.
            (vec![2, 1, 96], vec![2, 1, 64], vec![64, 300], vec![300, 96], h),
            // A and B that do not chain.
            (vec![2, 1, 96], vec![2, 1, 64], vec![64, 8], vec![16, 96], h),
            // Stacked for another number of rows.
            (vec![2, 1, 96], vec![2, 1, 64], vec![3, 64, 8], vec![3, 8, 96], h),
            // Integer data.
            (vec![2, 1, 96], vec![2, 1, 64], vec![64, 8], vec![8, 96], Dtype::Int32),
        ];
        for (y, x, a, b, dtype) in refused {
            let arrays = [&y, &x, &a, &b].map(|shape| zeros(shape, dtype));
            assert!(Shapes::of(&arrays[0], &arrays[1], &arrays[2], &arrays[3]).is_none(), "{y:?} {x:?} {a:?} {b:?}");
        }
        // Off CUDA the update is MLX's: no kernel is built.
        let (y, x, a, b) = (zeros(&[2, 1, 96], h), zeros(&[2, 1, 64], h), zeros(&[64, 8], h), zeros(&[8, 96], h));
        assert!(add(&y, &x, &a, &b).unwrap().is_none());
    }
}
