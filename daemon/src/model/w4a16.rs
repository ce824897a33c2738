//! A 4-bit weight × f16/bf16 activation matmul for steps of few rows, on CUDA.
//!
//! MLX 0.32's CUDA quantized matrix-vector kernel reads an 8B model's packed
//! weights at ~0.75 TB/s (6.3 ms of projections a token on an H200), and its
//! quantized matmul costs time in proportion to the rows, so the daemon
//! served every step from dense f16 copies (4.8 ms a token, 3.5x the memory:
//! docs/measurements/gpu-2026-12-04-real-size-batches.md). This kernel of
//! our own (through MLX's custom-kernel API, compiled by NVRTC on first use
//! and kept in MLX's kernel cache) reads the packed bytes once per step of
//! up to `MLXBC_W4A16_ROWS` rows: each warp takes a few output features, each
//! lane 16 bytes (32 values, one group) of each at a time, and turns nibbles
//! into floats with bit operations (no integer conversion).
//!
//! Two more forms of the same kernel take work off the host, whose ~6 µs
//! of launching per operation bounds a one-row step once the weights are
//! read this fast: [`matmul_add`] adds the residual as it writes (o_proj
//! and the MLP's down projection), [`gate_up_swiglu`] computes a fused
//! gate/up projection's rows in pairs (gate j beside up j) and writes
//! their SwiGLU — four operations fewer a layer. And the forms that read
//! the input through the RMS norm in front of them ([`matmul_normed`],
//! [`gate_up_swiglu_normed`]: the layer's two norms) take two more.
//!
//! The kernel checks itself at its first use in the process against MLX's
//! dequantized weights in f32 ([`Kernel::self_check`]); if it disagrees it
//! is not used and the log says why. Off CUDA (Metal, CPU) nothing changes:
//! their quantized kernels batch.

use crate::model::cuda_kernel::{CudaKernel, Launch, Template};
use crate::model::layers::{Quantized, RmsNormed};
use anyhow::{bail, Result};
use mlx_rs::{fast, ops, Array, Dtype};
use std::cell::OnceCell;
use std::sync::atomic::{AtomicI32, Ordering};

/// Steps of up to this many rows (all axes but the last) use the kernel by
/// default; `MLXBC_W4A16_ROWS=N` for steps of up to N rows, 0 never. On an
/// H100 (docs/measurements/h100-2026-12-06c-w4a16-lora.md, two daemons,
/// rounds interleaved), 8B shape: one stream 213 against 147 tok/s, 2
/// clients 374 against 249, 4 clients 525 against 441, 16 clients equal;
/// the Qwen2.5-0.5B shape's one stream 514 against 440. (On 12-05 it made
/// one stream slower, 110 against 131: the host's work per step was then
/// the bound; since the step's host work shrank, MLX's packed
/// matrix-vector kernel, reading ~0.75 TB/s, was.)
pub const DEFAULT_ROWS: i32 = 4;

/// The process's limit (set once at start by `mlxbcd`'s main).
static ROWS: AtomicI32 = AtomicI32::new(DEFAULT_ROWS);

/// Sets the row limit (from `EngineOptions`, at start); 0 turns the kernel off.
pub fn configure(rows: i32) {
    ROWS.store(rows.max(0), Ordering::Relaxed);
}

thread_local! {
    /// This thread's kernel, built (and checked) on first use; `None` when
    /// not on CUDA or when it failed its check.
    static KERNEL: OnceCell<Option<Kernel>> = const { OnceCell::new() };
}

/// `x W^T` for packed 4-bit `q` through the kernel, or `None` where it does
/// not apply (not CUDA, more rows than the limit, another form or dtype, a
/// strided weight view, or the kernel failed its check): the caller takes
/// MLX's path.
pub fn matmul(x: &Array, q: &Quantized) -> Result<Option<Array>> {
    run(Form::Plain, x, q, None, None)
}

/// `residual + x W^T`, the sum written by the kernel (rounded as MLX's
/// separate matmul and add round it), or `None` as [`matmul`].
pub fn matmul_add(x: &Array, q: &Quantized, residual: &Array) -> Result<Option<Array>> {
    run(Form::Residual, x, q, Some(residual), None)
}

/// `swiglu(x G^T, x U^T)` for a fused gate/up matrix `q` (G's rows, then
/// U's), each product and each step of the SwiGLU rounded to the float
/// type: `[.., out / 2]`; or `None` as [`matmul`]. The self-check holds it
/// to MLX's matmul and compiled `swiglu` within rounding.
pub fn gate_up_swiglu(x: &Array, q: &Quantized) -> Result<Option<Array>> {
    run(Form::GateUpSwiglu, x, q, None, None)
}

/// `rms_norm(x) W^T` for `x` = [`RmsNormed`], the norm applied by the
/// kernel as it reads the input (rounded as MLX's `rms_norm` rounds it);
/// or `None` as [`matmul`], and also where the norm's weight is not one
/// contiguous vector of x's float type or `MLXBC_STEP_FUSION` is `off` or
/// `no-norm`.
pub fn matmul_normed(x: RmsNormed, q: &Quantized) -> Result<Option<Array>> {
    run_normed(Form::Plain, x, q)
}

/// [`gate_up_swiglu`] of `rms_norm(x)`, the norm applied as in [`matmul_normed`].
pub fn gate_up_swiglu_normed(x: RmsNormed, q: &Quantized) -> Result<Option<Array>> {
    run_normed(Form::GateUpSwiglu, x, q)
}

fn run_normed(form: Form, x: RmsNormed, q: &Quantized) -> Result<Option<Array>> {
    let width = *x.input.shape().last().unwrap_or(&0);
    let rows: i32 = x.input.shape()[..x.input.ndim().saturating_sub(1)].iter().product();
    let g = x.weight;
    // One row only: every warp sums its rows' squares and normalizes as it
    // reads, so the device's work grows with rows × warps. On an H100 (8B
    // shape) one row gained (5.55 against 6.0 ms a step, host-bound) and
    // 4-row steps lost (2.3-2.9 ms of device waiting against 0.07).
    if rows != 1
        || !crate::model::cuda_kernel::norm_fusion_on()
        || g.shape() != [width]
        || g.dtype() != x.input.dtype()
        || !row_contiguous(g)
    {
        return Ok(None);
    }
    run(form, x.input, q, None, Some((g, x.eps)))
}

/// What the kernel does around its product.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Form {
    /// `x W^T`.
    Plain,
    /// `res + x W^T`.
    Residual,
    /// `swiglu(x W^T's halves)`.
    GateUpSwiglu,
}

impl Form {
    /// Features written, of `n` weight rows.
    fn outputs(self, n: i32) -> i32 {
        match self {
            Form::GateUpSwiglu => n / 2,
            _ => n,
        }
    }
}

/// The kernel in `form` over `x` (RMS-normed first by `norm`'s weight and
/// epsilon, when given), or `None` where it does not apply.
fn run(
    form: Form,
    x: &Array,
    q: &Quantized,
    residual: Option<&Array>,
    norm: Option<(&Array, f32)>,
) -> Result<Option<Array>> {
    let width = *x.shape().last().unwrap_or(&0);
    let rows: i32 = x.shape()[..x.ndim().saturating_sub(1)].iter().product();
    run_as(form, Input { x, rows, width, output: &output_shape(form, x, q) }, q, residual, norm)
}

/// `residual + o W^T` for an attention output `o` `[b, heads, 1, d]` (one
/// position a row) read as the `[b, heads · d]` rows it holds in memory:
/// the reshape to `[b, 1, heads · d]` before o_proj would be one more
/// operation a layer. `None` as [`matmul_add`], and where `o` is not of
/// that shape or `residual` not `[b, 1, heads · d]`-shaped for `q`.
pub fn matmul_add_heads(o: &Array, q: &Quantized, residual: &Array) -> Result<Option<Array>> {
    let s = o.shape();
    if s.len() != 4 || s[2] != 1 || residual.shape().len() != 3 || residual.shape()[..2] != [s[0], 1] {
        return Ok(None);
    }
    let input = Input { x: o, rows: s[0], width: s[1] * s[3], output: residual.shape() };
    run_as(Form::Residual, input, q, Some(residual), None)
}

/// The kernel's input: `x` as `rows` rows of `width` values in memory
/// order, and the output's shape (`rows` rows of the features written).
#[derive(Clone, Copy)]
struct Input<'a> {
    x: &'a Array,
    rows: i32,
    width: i32,
    output: &'a [i32],
}

/// [`run`] over an [`Input`].
fn run_as(
    form: Form,
    input: Input,
    q: &Quantized,
    residual: Option<&Array>,
    norm: Option<(&Array, f32)>,
) -> Result<Option<Array>> {
    let limit = ROWS.load(Ordering::Relaxed);
    let Input { x, rows, width, output } = input;
    if rows < 1
        || rows > limit
        || (form != Form::Plain && !crate::model::cuda_kernel::step_fusion_on())
        // Pairs of outputs per warp (`takes` asks output features by 8s).
        || (form == Form::GateUpSwiglu && variant().0 % 2 != 0)
        || !Kernel::takes(x, q, width)
    {
        return Ok(None);
    }
    let features = form.outputs(q.weight.shape()[0]);
    if output.iter().product::<i32>() != rows * features || output.last() != Some(&features) {
        return Ok(None);
    }
    if residual.is_some_and(|r| r.shape() != output || r.dtype() != x.dtype()) {
        return Ok(None);
    }
    KERNEL.with(|cell| match cell.get_or_init(Kernel::build_checked) {
        Some(kernel) => Ok(Some(kernel.apply(form, input, q, residual, norm)?)),
        None => Ok(None),
    })
}

/// `x`'s shape with its last axis the features `form` writes of `q`'s.
fn output_shape(form: Form, x: &Array, q: &Quantized) -> Vec<i32> {
    let mut shape = x.shape().to_vec();
    *shape.last_mut().expect("x has an axis") = form.outputs(q.weight.shape()[0]);
    shape
}

/// How a step runs: output features a warp computes, warps a block, how
/// nibbles become floats (1: a byte permute). (4, 4, 1) was the best or
/// within 1% of it at 1, 2, 4, 8 and 16 rows on an H100
/// (docs/measurements/h100-2026-12-05-w4a16.md).
fn variant() -> (i32, i32, i32) {
    FORCED_VARIANT.unwrap_or((4, 4, 1))
}

/// `MLXBC_W4A16_VARIANT=R,NW,DQ` (read once): one variant at every row
/// count, for measuring the choices on a device.
static FORCED_VARIANT: std::sync::LazyLock<Option<(i32, i32, i32)>> = std::sync::LazyLock::new(|| {
    let v = std::env::var("MLXBC_W4A16_VARIANT").ok()?;
    let parts: Vec<i32> = v.split(',').filter_map(|p| p.trim().parse().ok()).collect();
    match parts[..] {
        [r, nw, dq] if [1, 2, 4, 8].contains(&r) && (1..=8).contains(&nw) && (0..=1).contains(&dq) => Some((r, nw, dq)),
        _ => {
            tracing::warn!("MLXBC_W4A16_VARIANT = {v:?} is not R,NW,DQ (R 1, 2, 4 or 8; NW 1-8; DQ 0 or 1): ignored");
            None
        }
    }
});

/// Declares the names the body uses from MLX's shape arguments, and how it
/// reads x (as it is, or RMS-normed: `normed`), which weight rows a warp
/// takes and how it writes out, per [`Form`].
fn prelude(form: Form, normed: bool) -> String {
    let rows = match form {
        // The warp's outputs in pairs: gate j, then up j (U's rows follow G's).
        Form::GateUpSwiglu => {
            "auto wrow = [&](int n0, int r) -> int { return (r & 1) ? N / 2 + n0 / 2 + r / 2 : n0 / 2 + r / 2; };"
        }
        _ => "auto wrow = [&](int n0, int r) -> int { return n0 + r; };",
    };
    let store = match form {
        Form::Plain => "auto store = [&](int m, int n0, int r, float v, float) { out[(size_t)m * N + n0 + r] = static_cast<T>(v); };",
        // Rounded first, then added: what MLX's matmul and add would give.
        Form::Residual => RESIDUAL_STORE,
        Form::GateUpSwiglu => SWIGLU_STORE,
    };
    let read = if normed { NORMED_READ } else { PLAIN_READ };
    format!(
        "const int K = w_shape[1] * 8;\n    const int N = w_shape[0];\n    const int GROUP = K / scales_shape[1];\n    \
         {read}\n    {rows}\n    {store}\n"
    )
}

/// x read as it is.
const PLAIN_READ: &str = r#"auto prepare = [&]() {};
    auto load8 = [&](int m, int k) -> uint4 { return *reinterpret_cast<const uint4*>(x + (size_t)m * K + k); };"#;

/// x read RMS-normed: each warp first sums its rows' squares (its lanes
/// across K: x is a few KB, read again from cache), then `load8` hands the
/// body `T(gamma · T(x · rsqrt(mean(x²) + eps)))`, MLX's `rms_norm` with its
/// rounding. `EPS_BITS` is the epsilon's f32 bits (a template argument: no
/// input array to make per step).
const NORMED_READ: &str = r#"float rn[ROWS];
    auto prepare = [&]() {
        const int ln = threadIdx.x & 31;
#pragma unroll
        for (int m = 0; m < ROWS; ++m) {
            float ss = 0.f;
            for (int k = ln * 8; k < K; k += 256) {
                const uint4 v = *reinterpret_cast<const uint4*>(x + (size_t)m * K + k);
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    const float f = static_cast<float>(reinterpret_cast<const T*>(&v)[i]);
                    ss = fmaf(f, f, ss);
                }
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
            rn[m] = rsqrtf(ss / K + __int_as_float(EPS_BITS));
        }
    };
    auto load8 = [&](int m, int k) -> uint4 {
        const uint4 v = *reinterpret_cast<const uint4*>(x + (size_t)m * K + k);
        uint4 o;
        const T* a = reinterpret_cast<const T*>(&v);
        T* b = reinterpret_cast<T*>(&o);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const float xn = static_cast<float>(static_cast<T>(static_cast<float>(a[i]) * rn[m]));
            b[i] = static_cast<T>(static_cast<float>(gamma[k + i]) * xn);
        }
        return o;
    };"#;

/// `res + x W^T`, the product rounded to T before the add.
const RESIDUAL_STORE: &str = r#"auto store = [&](int m, int n0, int r, float v, float) {
        const size_t i = (size_t)m * N + n0 + r;
        out[i] = static_cast<T>(static_cast<float>(static_cast<T>(v)) + static_cast<float>(res[i]));
    };"#;

/// The even lane of a (gate, up) pair writes `gate * sigmoid(gate) * up`,
/// each product and operation rounded to T (MLX's compiled `swiglu` may
/// round its sigmoid otherwise: within the self-check's tolerance).
const SWIGLU_STORE: &str = r#"auto store = [&](int m, int n0, int r, float v, float other) {
        if (r & 1) return;
        const float g = static_cast<float>(static_cast<T>(v));
        const float u = static_cast<float>(static_cast<T>(other));
        const float s = static_cast<float>(static_cast<T>(1.f / (1.f + expf(-g))));
        const float p = static_cast<float>(static_cast<T>(g * s));
        out[(size_t)m * (N / 2) + n0 / 2 + r / 2] = static_cast<T>(p * u);
    };"#;

/// The kernel's body (shared with scripts/gpu/w4a16_cupy.py, which checks
/// and times it on the device without MLX).
const BODY: &str = include_str!("w4a16_body.cu");

/// The compiled kernel, one per [`Form`] (and per input: as it is, or
/// RMS-normed).
struct Kernel {
    plain: CudaKernel,
    residual: CudaKernel,
    gate_up_swiglu: CudaKernel,
    plain_normed: CudaKernel,
    gate_up_swiglu_normed: CudaKernel,
}

/// True when `a` is row-contiguous from its first element (no copy needed).
fn row_contiguous(a: &Array) -> bool {
    let shape = a.shape();
    let mut expect = 1usize;
    for (dim, stride) in shape.iter().zip(a.strides()).rev() {
        if *dim != 1 && *stride != expect {
            return false;
        }
        expect *= *dim as usize;
    }
    true
}

impl Kernel {
    /// Forms the kernel takes: 4-bit, groups of a multiple of 32, a 2-D
    /// row-contiguous weight, scales and biases of x's float type (f16 or
    /// bf16), `k` a multiple of 32 matching the weight, output features a
    /// multiple of the variant's.
    fn takes(x: &Array, q: &Quantized, k: i32) -> bool {
        let w = &q.weight;
        q.bits == 4
            && q.group_size % 32 == 0
            && k % 32 == 0
            && k % q.group_size == 0
            && w.ndim() == 2
            && w.dtype() == Dtype::Uint32
            && w.shape()[1] * 8 == k
            && w.shape()[0] % 8 == 0
            && matches!(x.dtype(), Dtype::Float16 | Dtype::Bfloat16)
            && q.scales.dtype() == x.dtype()
            && q.biases.dtype() == x.dtype()
            && q.scales.shape() == [w.shape()[0], k / q.group_size]
            && q.biases.shape() == q.scales.shape()
            && [w, &q.scales, &q.biases].iter().all(|a| row_contiguous(a))
    }

    /// Builds the kernel and checks it, on CUDA only; `None` (and a log
    /// line) when it cannot be built or disagrees with MLX.
    fn build_checked() -> Option<Kernel> {
        let used = format!("4-bit steps of up to {} rows use mlxbc's own CUDA kernel", ROWS.load(Ordering::Relaxed));
        crate::model::cuda_kernel::built_and_checked(
            "4-bit weights keep MLX's matmul (W4A16)",
            &used,
            Kernel::new,
            Kernel::self_check,
        )
    }

    fn new() -> Result<Kernel> {
        // Row-contiguous inputs: `x` may be a view, which MLX then copies
        // (the weights are checked contiguous by `takes`).
        let kernel = |name: &str, form: Form, normed: bool| {
            let inputs: &[&str] = match (form, normed) {
                (Form::Residual, _) => &["x", "w", "scales", "biases", "res"],
                (_, true) => &["x", "w", "scales", "biases", "gamma"],
                _ => &["x", "w", "scales", "biases"],
            };
            CudaKernel::new(name, inputs, &["out"], &format!("{}{BODY}", prelude(form, normed)), true)
        };
        Ok(Kernel {
            plain: kernel("mlxbc_w4a16", Form::Plain, false)?,
            residual: kernel("mlxbc_w4a16_res", Form::Residual, false)?,
            gate_up_swiglu: kernel("mlxbc_w4a16_gate_up_swiglu", Form::GateUpSwiglu, false)?,
            plain_normed: kernel("mlxbc_w4a16_normed", Form::Plain, true)?,
            gate_up_swiglu_normed: kernel("mlxbc_w4a16_gate_up_swiglu_normed", Form::GateUpSwiglu, true)?,
        })
    }

    /// The input's rows `[rows, k]` (RMS-normed by `norm`'s weight `[k]`
    /// and epsilon first, when given) times `q`'s dequantized weights
    /// transposed, `[rows, n]` in the input's output shape, plus `residual`
    /// (of that shape) for [`Form::Residual`]; for [`Form::GateUpSwiglu`]
    /// the SwiGLU of its halves, `[rows, n / 2]`. Every array is read in
    /// its own shape (the body takes K from the weight and the rows as a
    /// template argument): a reshape around the kernel would be one more
    /// operation in a step bound by their count.
    fn apply(
        &self,
        form: Form,
        input: Input,
        q: &Quantized,
        residual: Option<&Array>,
        norm: Option<(&Array, f32)>,
    ) -> Result<Array> {
        let Input { x, rows, output, .. } = input;
        let n = q.weight.shape()[0];
        let (r, warps, dq) = variant();
        let blocks = (n / r + warps - 1) / warps;
        let mut templates = vec![
            Template::Type(c"T", x.dtype()),
            Template::Int(c"ROWS", rows),
            Template::Int(c"R", r),
            Template::Int(c"NW", warps),
            Template::Int(c"DQ", dq),
        ];
        if let Some((_, eps)) = norm {
            // The bits of a positive f32 fit an i32 as they are.
            templates.push(Template::Int(c"EPS_BITS", eps.to_bits() as i32));
        }
        let launch = Launch {
            output_shape: output,
            output_dtype: x.dtype(),
            grid: (blocks * warps * 32, 1, 1),
            block: (warps * 32, 1, 1),
            templates: &templates,
        };
        let (cuda, extra) = match (form, residual, norm) {
            (Form::Plain, _, None) => (&self.plain, None),
            (Form::GateUpSwiglu, _, None) => (&self.gate_up_swiglu, None),
            (Form::Plain, _, Some((gamma, _))) => (&self.plain_normed, Some(gamma)),
            (Form::GateUpSwiglu, _, Some((gamma, _))) => (&self.gate_up_swiglu_normed, Some(gamma)),
            (Form::Residual, Some(r), None) => (&self.residual, Some(r)),
            (Form::Residual, _, _) => bail!("the residual form of the W4A16 kernel needs a residual and no norm"),
        };
        let inputs: Vec<&Array> = [x, &q.weight, &q.scales, &q.biases].into_iter().chain(extra).collect();
        cuda.apply(&inputs, &launch)
    }

    /// Runs the kernel in each form on random weights (both float types,
    /// groups of 32 and 64, one row and several, a strided input) and
    /// compares with the dequantized weights' product in f32 (the residual
    /// added; the SwiGLU of its halves; for the normed forms, of MLX's
    /// `rms_norm` of the input). Passes when the kernel's largest
    /// error is within twice that of MLX's own quantized matmul (and
    /// operations) in the same dtype, plus 1e-3 of the largest value:
    /// rounding, not a wrong nibble.
    fn self_check(&self) -> Result<String> {
        let mut worst = (0.0f32, 0.0f32);
        let normal = |seed: u64, shape: &[i32]| -> Result<Array> {
            // Keys of its own: the check leaves MLX's global random state alone.
            let key = mlx_rs::random::key(seed)?;
            Ok(mlx_rs::random::normal::<f32>(shape, None, None, &key)?)
        };
        for (seed, (dtype, group, rows)) in
            [(Dtype::Float16, 64, 1), (Dtype::Bfloat16, 32, 3), (Dtype::Float16, 32, 2)].into_iter().enumerate()
        {
            let (n, k) = (264, 640);
            let w = normal(seed as u64 * 3 + 11, &[n, k])?.multiply(Array::from_f32(0.02))?.as_dtype(dtype)?;
            let (packed, scales, biases) = ops::quantize(&w, group, 4)?;
            let q = Quantized::new(packed, scales, biases, group, 4);
            let seed = seed as u64 * 5;
            // A transposed (strided) view, which MLX copies to rows first.
            let x = normal(seed + 12, &[k, rows])?.as_dtype(dtype)?.t();
            let residual = normal(seed + 13, &[rows, n])?.as_dtype(dtype)?;
            // A norm's weight around 1 and a model's epsilon, for the normed forms.
            let gamma =
                normal(seed + 14, &[k])?.multiply(Array::from_f32(0.1))?.add(Array::from_f32(1.0))?.as_dtype(dtype)?;
            let eps = 1e-6f32;
            let normed = fast::rms_norm(&x, Some(&gamma), eps)?;
            let dequantized = q.dequantize()?.as_dtype(Dtype::Float32)?;
            let exact_of = |x: &Array| -> Result<Array> { Ok(x.as_dtype(Dtype::Float32)?.matmul(dequantized.t())?) };
            let packed_of = |x: &Array| -> Result<Array> {
                Ok(ops::quantized_matmul(x, &q.weight, &q.scales, &q.biases, true, group, 4)?)
            };
            let (exact, packed) = (exact_of(&x)?, packed_of(&x)?);
            // The SwiGLU of the product's halves (gate rows, then up rows).
            let swiglu_of = |y: &Array| -> Result<Array> {
                let halves = y.split_at_indices(&[n / 2], -1)?;
                crate::model::layers::swiglu(&halves[0], &halves[1])
            };
            let forms = [
                (Form::Plain, false),
                (Form::Residual, false),
                (Form::GateUpSwiglu, false),
                (Form::Plain, true),
                (Form::GateUpSwiglu, true),
            ];
            for (form, with_norm) in forms {
                // The normed forms against MLX's rms_norm, then the product.
                let (exact, packed) =
                    if with_norm { (exact_of(&normed)?, packed_of(&normed)?) } else { (exact.clone(), packed.clone()) };
                let (reference, theirs) = match form {
                    Form::Plain => (exact, packed),
                    Form::Residual => (exact.add(residual.as_dtype(Dtype::Float32)?)?, packed.add(&residual)?),
                    Form::GateUpSwiglu => (swiglu_of(&exact)?, swiglu_of(&packed)?),
                };
                let res = (form == Form::Residual).then_some(&residual);
                let norm = with_norm.then_some((&gamma, eps));
                let input = Input { x: &x, rows, width: k, output: &output_shape(form, &x, &q) };
                let ours = self.apply(form, input, &q, res, norm)?;
                // Evaluated here, so a kernel that fails to compile is an error
                // returned (the kernel is then not used), not a panic in `item`.
                let scalar = |x: Array| -> Result<f32> {
                    x.eval()?;
                    Ok(x.item_exact::<f32>())
                };
                let err = |y: &Array| -> Result<f32> {
                    scalar(y.as_dtype(Dtype::Float32)?.subtract(&reference)?.abs()?.max(None)?)
                };
                let (e_ours, e_mlx) = (err(&ours)?, err(&theirs)?);
                let largest = scalar(reference.abs()?.max(None)?)?;
                if e_ours.is_nan() || e_ours > 2.0 * e_mlx + 1e-3 * largest {
                    let normed = if with_norm { " (normed)" } else { "" };
                    bail!(
                        "{form:?}{normed}, {dtype:?}, group {group}, {rows} rows: max error {e_ours:.2e} against MLX's {e_mlx:.2e}"
                    );
                }
                worst = (worst.0.max(e_ours), worst.1.max(e_mlx));
            }
        }
        Ok(format!("checked against MLX: max error {:.1e}, MLX's own {:.1e}", worst.0, worst.1))
    }
}
