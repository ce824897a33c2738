//! Attention of a padded batch's decode step without a padding mask, and of
//! a few query positions (a verify pass) without MLX's unfused path.
//!
//! Rows of different lengths share one KV buffer aligned at their ends
//! (`KvCache`'s left padding), so each row must not see the positions
//! before its own start. MLX expresses that as an array mask, and on CUDA
//! (MLX 0.32) an array mask leaves the fused decode kernel for the unfused
//! path: on an 8B shape, 2.4 ms of a 16-row step against 1.3 without a mask,
//! 7.2 against 3.6 at 64 rows (docs/measurements/gpu-2026-12-04-real-size-batches.md).
//! Here the rows' starts are data instead: one CUDA kernel of our own
//! (through MLX's custom-kernel API, compiled by NVRTC on first use and kept
//! in MLX's kernel cache) reads each row's keys from its start on, with an
//! online softmax per warp and the warps combined at the end.
//!
//! The same kernel takes up to [`MOST_QUERIES`] query positions at the end
//! of each row's keys, causal among them: a speculative verify pass of
//! 2-16 positions. MLX 0.32's CUDA attention fuses only one query position;
//! more go to cuDNN (which mlxbcd turns off: a plan per new key length,
//! docs/measurements/gpu-2026-12-04-batch-attention.md) or to its unfused
//! path, about ten operations a layer, two of them cuBLAS batched products
//! whose host launch costs ~4x an ordinary one
//! (docs/measurements/h100-2026-12-05b-batched-host.md). One launch here.
//!
//! The same kernel serves a compiled one-row decode step ([`decode_to`]):
//! there the keys end at the position, given as data, so one compiled graph
//! serves every position of a fixed-capacity buffer without a mask.
//!
//! The kernel checks itself at its first use in the process against MLX's
//! masked attention in f32 ([`Kernel::self_check`]); if it disagrees, it is
//! not used and the log says why. Off CUDA (Metal, CPU), the masked path
//! stays: their fused kernels take the mask.

use crate::model::cuda_kernel::{CudaKernel, Launch, Template};
use crate::model::kv_cache::KvCache;
use anyhow::{bail, Result};
use mlx_rs::{fast, fast::ScaledDotProductAttentionMask, Array, Dtype};
use std::cell::OnceCell;
use std::sync::atomic::{AtomicU8, Ordering};

/// How a padded batch's decode step attends.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum BatchAttention {
    /// The device's best: our kernel on CUDA, MLX's masked attention elsewhere.
    #[default]
    Auto,
    /// MLX's attention with a padding mask, everywhere (`MLXBC_BATCH_ATTENTION=mask`).
    Mask,
}

/// The process's choice, set once at start by `mlxbcd`'s main (0 auto, 1 mask).
static CHOICE: AtomicU8 = AtomicU8::new(0);

/// Sets how padded batches attend (from `EngineOptions`, at start).
pub fn configure(choice: BatchAttention) {
    CHOICE.store(u8::from(choice == BatchAttention::Mask), Ordering::Relaxed);
}

thread_local! {
    /// This thread's kernel, built (and checked) on first use; `None` when
    /// not on CUDA or when it failed its check.
    static KERNEL: OnceCell<Option<Kernel>> = const { OnceCell::new() };
}

/// Query positions the kernel takes at once (a verify pass is 1 + at most
/// 8 drafts wide; a prompt's short last chunk may also be few).
pub const MOST_QUERIES: i32 = 16;

/// `MLXBC_PASS_ATTENTION=mlx` (read once): calls of several query
/// positions keep MLX's attention (for measuring the kernel against).
fn few_queries_on() -> bool {
    static MLX: std::sync::LazyLock<bool> =
        std::sync::LazyLock::new(|| std::env::var("MLXBC_PASS_ATTENTION").is_ok_and(|v| v.eq_ignore_ascii_case("mlx")));
    !*MLX
}

/// `o = softmax(q·kᵀ·scale)·v` for `L` query positions per row (1 to
/// [`MOST_QUERIES`]), `q` `[rows, heads, L, head_dim]`, `k`/`v` `[rows,
/// kv_heads, keys, head_dim]`: row `r` attends to keys `starts[r]..ends[r]`
/// (`starts` `[rows]`, `ends` `[rows]` or `[1]` for every row, int32;
/// `None`: every key from the start on), its queries being the last `L` of
/// those keys' positions, causal among them (query `i` sees up to
/// `ends[r] - L + i`). `None` when the kernel does not apply here (not
/// CUDA, switched off, a shape it does not take, or it failed its check):
/// the caller masks.
pub fn decode_rows(
    q: &Array,
    k: &Array,
    v: &Array,
    scale: f32,
    starts: &Array,
    ends: Option<&Array>,
) -> Result<Option<Array>> {
    if CHOICE.load(Ordering::Relaxed) != 0 || !Kernel::takes(q, k, v) || (q.shape()[2] > 1 && !few_queries_on()) {
        return Ok(None);
    }
    KERNEL.with(|cell| match cell.get_or_init(Kernel::build_checked) {
        Some(kernel) => kernel.apply(q, k, v, scale, starts, ends.unwrap_or(&kernel.unbounded)).map(Some),
        None => Ok(None),
    })
}

/// A one-row decode step's attention over a fixed-capacity cache buffer
/// (the compiled decode step's `k`, `v` `[1, kv_heads, capacity, head_dim]`),
/// the positions up to `position` (`[1]` int32, data: the same graph
/// serves every position); `None` as for [`decode_rows`].
pub fn decode_to(q: &Array, k: &Array, v: &Array, scale: f32, position: &Array) -> Result<Option<Array>> {
    // Off CUDA, nothing is added to the caller's (traced) graph.
    if CHOICE.load(Ordering::Relaxed) != 0 || !KERNEL.with(|cell| cell.get_or_init(Kernel::build_checked).is_some()) {
        return Ok(None);
    }
    let starts = Array::from_slice(&[0i32], &[1]);
    let ends = position.as_dtype(Dtype::Int32)?.add(Array::from_int(1))?;
    decode_rows(q, k, v, scale, &starts, Some(&ends))
}

/// Causal attention of `L` (2 to [`MOST_QUERIES`]) query positions over an
/// unpadded `cache` whose last `L` keys are theirs (a one-row verify pass,
/// a short prompt chunk) through the kernel, every row from its first key
/// (`KvCache::row_starts`, made once a pass, not once a layer); `None`
/// where it does not apply: the caller takes MLX's causal attention.
pub fn few_queries(q: &Array, k: &Array, v: &Array, scale: f32, cache: &mut KvCache) -> Result<Option<Array>> {
    let (l, total) = (q.shape()[2], k.shape()[2]);
    // Off CUDA the starts are not made at all (decode_to does the same).
    if !(2..=MOST_QUERIES).contains(&l) || !KERNEL.with(|cell| cell.get_or_init(Kernel::build_checked).is_some()) {
        return Ok(None);
    }
    decode_rows(q, k, v, scale, &cache.row_starts(total, None)?, None)
}

/// Attention of a padded batch's rows (`None` when `cache` is not
/// padded): a decode step or a verify pass of up to [`MOST_QUERIES`]
/// positions (without a sliding window) through [`decode_rows`] where it
/// applies, else MLX's attention with the padding mask. `k`, `v` are the
/// cache's views after this step's update, `offset` its length before.
pub fn padded(
    q: &Array,
    k: &Array,
    v: &Array,
    scale: f32,
    cache: &mut KvCache,
    offset: i32,
    window: Option<i32>,
) -> Result<Option<Array>> {
    if !cache.is_padded() {
        return Ok(None);
    }
    let (l, total) = (q.shape()[2], k.shape()[2]);
    if total == offset + l && (l == 1 || (l <= MOST_QUERIES && window.is_none())) {
        if let Some(o) = decode_rows(q, k, v, scale, &cache.row_starts(total, window)?, None)? {
            return Ok(Some(o));
        }
    }
    let Some(mask) = cache.padding_mask(offset, l, total, window)? else {
        bail!("a padded cache without a padding mask");
    };
    let mask = ScaledDotProductAttentionMask::Array(&mask);
    Ok(Some(fast::scaled_dot_product_attention(q, k, v, scale, mask, None)?))
}

/// Warps per (row, head): keys are dealt round-robin among them.
const WARPS: i32 = 16;

const SOURCE: &str = r#"
    // q [rows, heads, L, D]; k, v [rows, kv_heads, keys, D] (strided views
    // of the cache); starts [rows]; ends [rows] or [1]; out [rows, heads,
    // L, D] row-contiguous. Row r's query i (one block each) reads keys
    // starts[r] .. min(keys, ends[r]) - (L - 1 - i): the queries are the
    // last L positions, causal among themselves.
    constexpr int PER = D / 32;
    const int head = blockIdx.x;
    const int row = blockIdx.y;
    const int query = blockIdx.z;
    const int queries = q_shape[2];
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int heads = q_shape[1];
    const int kv_head = head / (heads / k_shape[1]);
    const int keys = min(k_shape[2], ends[ends_shape[0] == 1 ? 0 : row]) - (queries - 1 - query);
    const float scale = __int_as_float(SCALE_BITS);
    // -inf (MLX 0.32's kernel header has no `inf`).
    const float neg_inf = -__int_as_float(0x7f800000);

    const auto* qp = q + row * q_strides[0] + head * q_strides[1] + query * q_strides[2] + lane * PER;
    const auto* kp = k + row * k_strides[0] + kv_head * k_strides[1] + lane * PER;
    const auto* vp = v + row * v_strides[0] + kv_head * v_strides[1] + lane * PER;
    float qv[PER];
    float acc[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        qv[i] = static_cast<float>(qp[i]) * scale;
        acc[i] = 0.f;
    }
    // Online softmax over this warp's keys: `best` the running maximum,
    // `total` the sum of exp(score - best), `acc` the weighted values.
    float best = neg_inf;
    float total = 0.f;
    for (int t = starts[row] + warp; t < keys; t += NW) {
        const auto* kr = kp + t * k_strides[2];
        float score = 0.f;
#pragma unroll
        for (int i = 0; i < PER; ++i) score += qv[i] * static_cast<float>(kr[i]);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) score += __shfl_xor_sync(0xffffffffu, score, o);
        const float next = fmaxf(best, score);
        const float keep = __expf(best - next);
        const float w = __expf(score - next);
        total = total * keep + w;
        const auto* vr = vp + t * v_strides[2];
#pragma unroll
        for (int i = 0; i < PER; ++i) acc[i] = acc[i] * keep + w * static_cast<float>(vr[i]);
        best = next;
    }
    __shared__ float warp_best[NW];
    __shared__ float warp_total[NW];
    __shared__ float warp_acc[NW][D];
    if (lane == 0) {
        warp_best[warp] = best;
        warp_total[warp] = total;
    }
#pragma unroll
    for (int i = 0; i < PER; ++i) warp_acc[warp][lane * PER + i] = acc[i];
    __syncthreads();
    // Every row sees at least its own position, so some warp has a finite
    // maximum; a warp that saw no key weighs exp(-inf) = 0.
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float m = neg_inf;
        for (int w = 0; w < NW; ++w) m = fmaxf(m, warp_best[w]);
        float sum = 0.f;
        float o = 0.f;
        for (int w = 0; w < NW; ++w) {
            const float f = __expf(warp_best[w] - m);
            sum += warp_total[w] * f;
            o += warp_acc[w][d] * f;
        }
        out[((row * heads + head) * queries + query) * D + d] = static_cast<T>(o / sum);
    }
"#;

/// The compiled kernel, and `ends` for rows that read to the last key.
struct Kernel {
    cuda: CudaKernel,
    /// `ends` when every row reads to the last key (made once, not per call).
    unbounded: Array,
}

impl Kernel {
    /// Shapes the kernel takes: 1 to [`MOST_QUERIES`] query positions (no
    /// more than the keys), a head dim that is a multiple of 32 up to 512,
    /// whole key-value groups, each head's vectors contiguous, a float type.
    fn takes(q: &Array, k: &Array, v: &Array) -> bool {
        let (qs, ks) = (q.shape(), k.shape());
        qs.len() == 4
            && ks.len() == 4
            && (1..=MOST_QUERIES).contains(&qs[2])
            && ks[2] >= qs[2]
            && qs[3] % 32 == 0
            && qs[3] <= 512
            && ks[3] == qs[3]
            && v.shape() == ks
            && ks[1] > 0
            && qs[1] % ks[1] == 0
            && qs[0] == ks[0]
            && [q, k, v].iter().all(|a| a.strides().last() == Some(&1))
            && matches!(q.dtype(), Dtype::Float16 | Dtype::Bfloat16 | Dtype::Float32)
            && k.dtype() == q.dtype()
            && v.dtype() == q.dtype()
    }

    /// Builds the kernel and checks it, on CUDA only; `None` (and a log
    /// line) when it cannot be built or disagrees with MLX.
    fn build_checked() -> Option<Kernel> {
        crate::model::cuda_kernel::built_and_checked(
            "padded batches keep the masked attention",
            "padded batches attend with mlxbc's own CUDA kernel",
            Kernel::new,
            Kernel::self_check,
        )
    }

    fn new() -> Result<Kernel> {
        let cuda = CudaKernel::new(
            "mlxbc_padded_decode_attention",
            &["q", "k", "v", "starts", "ends"],
            &["out"],
            SOURCE,
            false,
        )?;
        Ok(Kernel { cuda, unbounded: Array::from_slice(&[i32::MAX], &[1]) })
    }

    fn apply(&self, q: &Array, k: &Array, v: &Array, scale: f32, starts: &Array, ends: &Array) -> Result<Array> {
        let (rows, heads, queries, dim) = (q.shape()[0], q.shape()[1], q.shape()[2], q.shape()[3]);
        let (starts, ends) = (starts.as_dtype(Dtype::Int32)?, ends.as_dtype(Dtype::Int32)?);
        let threads = WARPS * 32;
        let templates = [
            Template::Type(c"T", q.dtype()),
            Template::Int(c"D", dim),
            Template::Int(c"NW", WARPS),
            Template::Int(c"SCALE_BITS", scale.to_bits() as i32),
        ];
        let launch = Launch {
            output_shape: &[rows, heads, queries, dim],
            output_dtype: q.dtype(),
            grid: (heads * threads, rows, queries),
            block: (threads, 1, 1),
            templates: &templates,
        };
        self.cuda.apply(&[q, k, v, &starts, &ends], &launch)
    }

    /// Runs the kernel on random inputs of the shapes batches and verify
    /// passes have (rows of different starts and ends, one query position
    /// and four causal ones read through a transposed view, grouped heads,
    /// strided key/value views, each float type and head dim a model may
    /// bring) and compares with MLX's masked attention computed in f32.
    /// Passes when the kernel's largest error is within twice MLX's own in
    /// the same dtype (plus 1e-3 of the largest value): rounding, not a
    /// wrong key.
    fn self_check(&self) -> Result<String> {
        use mlx_rs::ops::{arange, indexing::IndexOp};
        let mut worst = (0.0f32, 0.0f32);
        let cases = [(Dtype::Float16, 128), (Dtype::Bfloat16, 64), (Dtype::Float16, 256), (Dtype::Float32, 96)];
        for ((dtype, dim), queries) in cases.into_iter().flat_map(|c| [(c, 1), (c, 4)]) {
            let (rows, heads, kv_heads, keys, capacity) = (3, 8, 2, 37, 48);
            // Keys of its own: the check leaves MLX's global random state alone.
            let normal = |seed: u64, shape: &[i32]| -> Result<Array> {
                let key = mlx_rs::random::key(seed)?;
                Ok(mlx_rs::random::normal::<f32>(shape, None, None, &key)?)
            };
            let seed = dim as u64 + queries as u64;
            // As a pass's q comes: `[rows, L, heads, dim]` seen as `[rows, heads, L, dim]`.
            let q = normal(seed, &[rows, queries, heads, dim])?.transpose_axes(&[0, 2, 1, 3])?;
            let k_buf = normal(seed + 1, &[rows, kv_heads, capacity, dim])?;
            let v_buf = normal(seed + 2, &[rows, kv_heads, capacity, dim])?;
            let (k, v) = (k_buf.index((.., .., ..keys, ..)), v_buf.index((.., .., ..keys, ..)));
            // The last row's first query sees exactly one key.
            let starts = Array::from_slice(&[0i32, 7, keys - queries], &[rows]);
            let ends = Array::from_slice(&[keys - 5, keys, keys], &[rows]);
            let positions = arange::<_, i32>(0, keys, 1)?.reshape(&[1, 1, 1, keys])?;
            // Query i sees up to `ends - (L - 1 - i)`.
            let behind = arange::<_, i32>(1 - queries, 1, 1)?.reshape(&[1, 1, queries, 1])?;
            let allowed = positions
                .ge(&starts.reshape(&[rows, 1, 1, 1])?)?
                .logical_and(&positions.lt(&ends.reshape(&[rows, 1, 1, 1])?.add(&behind)?)?)?;
            let scale = (dim as f32).powf(-0.5);
            let masked = |q: &Array, k: &Array, v: &Array| -> Result<Array> {
                let mask = ScaledDotProductAttentionMask::Array(&allowed);
                Ok(fast::scaled_dot_product_attention(q, k, v, scale, mask, None)?.as_dtype(Dtype::Float32)?)
            };
            let reference = masked(&q, &k, &v)?;
            let (qd, kd, vd) = (q.as_dtype(dtype)?, k_buf.as_dtype(dtype)?, v_buf.as_dtype(dtype)?);
            let (kd, vd) = (kd.index((.., .., ..keys, ..)), vd.index((.., .., ..keys, ..)));
            let theirs = masked(&qd, &kd, &vd)?;
            let ours = self.apply(&qd, &kd, &vd, scale, &starts, &ends)?.as_dtype(Dtype::Float32)?;
            // Evaluated here, so a kernel that fails to compile is an error
            // returned (the kernel is then not used), not a panic in `item`.
            let scalar = |x: Array| -> Result<f32> {
                x.eval()?;
                Ok(x.item_exact::<f32>())
            };
            let err = |x: &Array| -> Result<f32> { scalar(x.subtract(&reference)?.abs()?.max(None)?) };
            let (e_ours, e_mlx) = (err(&ours)?, err(&theirs)?);
            let largest = scalar(reference.abs()?.max(None)?)?;
            // A NaN (a broken kernel) fails too.
            if e_ours.is_nan() || e_ours > 2.0 * e_mlx + 1e-3 * largest {
                bail!("{dtype:?}, head dim {dim}, {queries} queries: max error {e_ours:.2e} against MLX's {e_mlx:.2e}");
            }
            worst = (worst.0.max(e_ours), worst.1.max(e_mlx));
        }
        Ok(format!("checked against MLX: max error {:.1e}, MLX's own {:.1e}", worst.0, worst.1))
    }
}
