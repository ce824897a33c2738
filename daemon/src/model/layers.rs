//! The two building blocks whose weights come in several forms: a linear
//! projection and a token embedding, each either dense or MLX affine-quantized.
//! Their arithmetic mirrors mlx-lm's `nn.Linear`, `nn.QuantizedLinear`,
//! `nn.Embedding` and `nn.QuantizedEmbedding`, so greedy ids match it exactly.
//! And the towers' LayerNorm (weight and bias), which every encoder has.

use crate::model::options::Fusion;
use crate::model::weights::TensorMap;
use anyhow::Result;
use mlx_rs::{fast, ops, Array};

/// LayerNorm with a weight and a bias, as the vision and audio towers use it
/// (`nn.LayerNorm`). The epsilon is the family's: mlx-vlm builds some bare
/// (MLX's default, 1e-5) and passes 1e-6 to others, and a tower's features
/// only match its reference with the same one.
pub struct LayerNorm {
    weight: Array,
    bias: Option<Array>,
    eps: f32,
}

impl LayerNorm {
    /// `{prefix}.weight` and `{prefix}.bias`, as f32.
    pub fn load(t: &mut TensorMap, prefix: &str, eps: f32) -> Result<Self> {
        Ok(Self { weight: t.float(&format!("{prefix}.weight"))?, bias: Some(t.float(&format!("{prefix}.bias"))?), eps })
    }

    /// `{prefix}.weight` and no bias (ModernBERT's norms).
    pub fn load_unbiased(t: &mut TensorMap, prefix: &str, eps: f32) -> Result<Self> {
        Ok(Self { weight: t.float(&format!("{prefix}.weight"))?, bias: None, eps })
    }

    /// Normalizes the last axis, then scales and shifts it.
    pub fn forward(&self, x: &Array) -> Result<Array> {
        Ok(fast::layer_norm(x, &self.weight, self.bias.as_ref(), self.eps)?)
    }

    /// Its scale, shift and epsilon.
    pub fn parts(&self) -> (&Array, Option<&Array>, f32) {
        (&self.weight, self.bias.as_ref(), self.eps)
    }
}

/// How quantized matrices serve a step (one row, a decode batch, a prompt
/// chunk): chosen per model at load, applied per step by row count
/// ([`Quantized::matmul`]).
///
/// MLX's CUDA quantized matmul does not batch a decode batch's 3-D input
/// (`[rows, 1, in]`; flattened it does, [`Quantized::packed_matmul`]): on an
/// H200 an 8B-shaped step's projections cost 5.7 ms for one row and 190
/// ms for 64 as 3-D inputs, while the
/// same weights dense cost 5-6.5 ms at any row count, and the packed
/// weights expanded inside the step a flat ~20 ms
/// (docs/measurements/gpu-2026-12-04-quantized-matmul-by-rows.md,
/// gpu-2026-12-04-real-size-batches.md). Metal's and the CPU's quantized
/// kernels do batch: there it stays [`Self::Packed`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum BatchWeights {
    /// The packed matmul at every row count.
    #[default]
    Packed,
    /// A dense copy (the scales' dtype) beside the packed weights, used at
    /// every row count: on an H200 it is faster even for one row (an 8B
    /// step's projections 4.8 ms against 6.3 packed; MLX's quantized
    /// matrix-vector kernel reads ~0.8 TB/s). 3.5x the packed bytes on top
    /// of them; the packed weights stay for a shard's cut and the budget's
    /// fallback.
    Dense,
    /// The packed weights expanded inside steps from [`EXPAND_FROM_ROWS`]
    /// rows, no copy kept: when the budget has no room for dense copies.
    Expand,
}

impl BatchWeights {
    /// The same choice where no copies may be made (a rank's shard, a
    /// budget without room): dense copies become expansion per step, which
    /// computes the same numbers.
    pub fn without_copies(self) -> Self {
        match self {
            BatchWeights::Dense => BatchWeights::Expand,
            other => other,
        }
    }

    /// How `mlxbc ps` names it.
    pub fn describe(self) -> &'static str {
        match self {
            BatchWeights::Packed => "packed",
            BatchWeights::Dense => "packed + dense copies",
            BatchWeights::Expand => "packed, expanded per batched step",
        }
    }
}

/// Rows from which expanding the packed weights inside the step beats the
/// packed matmul (H200: 20.4 ms against 17.7 at four rows, 28.5 at eight).
pub const EXPAND_FROM_ROWS: i32 = 6;

/// How the parts of a fused projection (q/k/v, gate/up) reach their
/// consumers in steps of more than one row: copied each (MLX 0.32.2's CUDA
/// rope misreads such views, [`FusedLinear::forward_adding`]),
/// or as views where the consumer reads them right (`MLXBC_SPLIT_PARTS`,
/// read at start; scripts/gpu/split_views_check.py says which do).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum SplitParts {
    /// One copy per part.
    Copy,
    /// Views; a part roped straight from the fused output is still copied
    /// (the default: an 8B model's 16-row step on an H100 serves ~10% more
    /// tokens a second than with copies, docs/measurements/h100-2026-12-05c-views-and-speculation.md).
    #[default]
    Views,
}

static SPLIT_VIEWS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);
static FLAT_QMM: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Sets how batched steps split fused projections (at start, before any
/// model loads; a packed matmul of several rows is flattened on CUDA).
pub fn configure(split: SplitParts) {
    FLAT_QMM.store(crate::model::options::cuda_available(), std::sync::atomic::Ordering::Relaxed);
    SPLIT_VIEWS.store(split == SplitParts::Views, std::sync::atomic::Ordering::Relaxed);
}

/// Whether fused projections hand their parts on as views ([`SplitParts::Views`]).
pub fn split_parts_as_views() -> bool {
    SPLIT_VIEWS.load(std::sync::atomic::Ordering::Relaxed)
}

/// `rms_norm(input) · weight`, not yet built: on CUDA a step of few rows
/// hands `input` to the 4-bit kernel, which normalizes as it reads it
/// ([`crate::model::w4a16::matmul_normed`]: one operation fewer for each of
/// a layer's two norms, and a one-row GPU step is bound by the count);
/// elsewhere [`Self::array`] builds MLX's `rms_norm`.
#[derive(Debug, Clone, Copy)]
pub struct RmsNormed<'a> {
    /// What is normalized (the residual stream).
    pub input: &'a Array,
    /// The norm's weight `[width]`.
    pub weight: &'a Array,
    /// Its epsilon.
    pub eps: f32,
}

impl RmsNormed<'_> {
    /// MLX's `rms_norm` of the input.
    pub fn array(&self) -> Result<Array> {
        Ok(fast::rms_norm(self.input, Some(self.weight), self.eps)?)
    }
}

/// MLX affine quantization of a weight matrix (`weight` packed in uint32).
#[derive(Debug, Clone)]
pub struct Quantized {
    pub weight: Array,
    pub scales: Array,
    pub biases: Array,
    pub group_size: i32,
    pub bits: i32,
    /// How steps use it ([`BatchWeights`]); set by [`Self::widen`].
    pub batch: BatchWeights,
    /// The dense copy when `batch` is [`BatchWeights::Dense`].
    pub dense: Option<Array>,
}

impl Quantized {
    /// Packed weights as read from a file (no dense copy).
    pub fn new(weight: Array, scales: Array, biases: Array, group_size: i32, bits: i32) -> Self {
        Self { weight, scales, biases, group_size, bits, batch: BatchWeights::Packed, dense: None }
    }

    /// Expands to a dense matrix of the scales' dtype.
    pub fn dequantize(&self) -> Result<Array> {
        Ok(ops::dequantize(&self.weight, &self.scales, &self.biases, self.group_size, self.bits)?)
    }

    /// The same weights serving steps as `batch` says (a dense copy,
    /// lazily built, for [`BatchWeights::Dense`]).
    pub fn widen(mut self, batch: BatchWeights) -> Result<Self> {
        self.dense = match batch {
            BatchWeights::Dense => Some(self.dequantize()?),
            _ => None,
        };
        self.batch = batch;
        Ok(self)
    }

    /// Another cut of the same matrix (a shard's rows or columns), serving
    /// steps as this one does.
    pub fn with_parts(&self, weight: Array, scales: Array, biases: Array) -> Result<Self> {
        Quantized::new(weight, scales, biases, self.group_size, self.bits).widen(self.batch)
    }

    /// `x W^T` over `x`'s last axis: on CUDA our W4A16 kernel for steps of
    /// few rows where it applies; else the dense copy when there is one, the
    /// packed weights expanded for a step of [`EXPAND_FROM_ROWS`] or more
    /// rows (all axes but the last) when so chosen, else the packed matmul.
    pub fn matmul(&self, x: &Array) -> Result<Array> {
        // On CUDA, steps of few rows read the packed bytes through our kernel
        // (faster than the dense copy: crate::model::w4a16).
        if let Some(y) = crate::model::w4a16::matmul(x, self)? {
            return Ok(y);
        }
        let rows: i32 = x.shape()[..x.ndim().saturating_sub(1)].iter().product();
        Ok(match (&self.dense, self.batch) {
            (Some(dense), _) if !PACKED_NOW.get() => dense_product(x, dense)?,
            (_, BatchWeights::Expand) if rows >= EXPAND_FROM_ROWS => x.matmul(self.dequantize()?.t())?,
            _ => self.packed_matmul(x, rows)?,
        })
    }

    /// MLX's quantized matmul over the packed weights. On CUDA a decode
    /// batch's `[rows, 1, in]` is flattened to `[rows, in]` first: MLX
    /// 0.32.2 runs a 3-D input as `rows` matrix-vector products, each
    /// reading every weight (cost linear in rows), and a 2-D one as one
    /// matrix product (scripts/gpu/qmm_rows.py).
    fn packed_matmul(&self, x: &Array, rows: i32) -> Result<Array> {
        let qmm = |x: &Array| {
            ops::quantized_matmul(x, &self.weight, &self.scales, &self.biases, true, self.group_size, self.bits)
        };
        let shape = x.shape();
        if shape.len() <= 2 || rows <= 1 || !FLAT_QMM.load(std::sync::atomic::Ordering::Relaxed) {
            return Ok(qmm(x)?);
        }
        let mut out = shape[..shape.len() - 1].to_vec();
        out.push(-1);
        Ok(qmm(&x.reshape(&[rows, shape[shape.len() - 1]])?)?.reshape(&out)?)
    }

    /// The arrays that hold it (the dense copy too).
    pub fn arrays(&self) -> Vec<&Array> {
        [Some(&self.weight), Some(&self.scales), Some(&self.biases), self.dense.as_ref()]
            .into_iter()
            .flatten()
            .collect()
    }

    /// Bytes it occupies (the dense copy too).
    pub fn nbytes(&self) -> usize {
        self.arrays().iter().map(|a| a.nbytes()).sum()
    }
}

thread_local! {
    /// Set while a graph is built on the packed weights ([`with_packed_weights`]).
    static PACKED_NOW: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// `MLXBC_PASS_WEIGHTS=packed` (read once): a verify pass's quantized
/// products read the packed weights (MLX's quantized matmul, one launch of
/// ~7 µs) instead of the dense copies (cuBLASLt, ~27 µs of host work a
/// product on an H100: docs/measurements/h100-2026-12-05b-batched-host.md).
/// For measuring on a GPU: on a small model a pass is host-bound, on an 8B
/// one the packed product of 8-16 rows takes the device ~2x the dense one.
pub fn pass_weights_packed() -> bool {
    static PACKED: std::sync::LazyLock<bool> = std::sync::LazyLock::new(|| {
        std::env::var("MLXBC_PASS_WEIGHTS").is_ok_and(|v| v.eq_ignore_ascii_case("packed"))
    });
    *PACKED
}

/// Builds `f`'s graph with quantized products on the packed weights (no
/// dense copy) when `packed`; the choice is made as the graph is built,
/// so `f` must build everything it wants so.
pub fn with_packed_weights<T>(packed: bool, f: impl FnOnce() -> T) -> T {
    let before = PACKED_NOW.replace(packed);
    let out = f();
    PACKED_NOW.set(before);
    out
}

/// `x Wᵀ` for a dense `w` `[out, in]`: on CUDA a step of 2-16 rows through
/// our kernel (no cuBLASLt heuristic per call: crate::model::dense_rows).
fn dense_product(x: &Array, w: &Array) -> Result<Array> {
    Ok(match crate::model::dense_rows::matmul(x, w)? {
        Some(y) => y,
        None => x.matmul(w.t())?,
    })
}

/// `y = x W^T (+ b)`.
#[derive(Debug, Clone)]
pub enum Linear {
    Dense { weight: Array, bias: Option<Array> },
    Quantized { q: Quantized, bias: Option<Array> },
}

impl Linear {
    /// Applies the projection to the last axis of `x`.
    pub fn forward(&self, x: &Array) -> Result<Array> {
        Ok(match self {
            Linear::Dense { weight, bias: None } => dense_product(x, weight)?,
            Linear::Dense { weight, bias: Some(b) } => match crate::model::dense_rows::matmul(x, weight)? {
                Some(y) => y.add(b)?,
                None => ops::addmm(b, x, weight.t(), None, None)?,
            },
            Linear::Quantized { q, bias } => {
                let y = q.matmul(x)?;
                match bias {
                    Some(b) => y.add(b)?,
                    None => y,
                }
            }
        })
    }

    /// The projection of `x`'s RMS norm: on CUDA, for steps of few rows of a
    /// 4-bit matrix, one kernel that normalizes as it reads
    /// ([`crate::model::w4a16::matmul_normed`]); else the norm, then
    /// [`Self::forward`].
    pub fn forward_normed(&self, x: RmsNormed) -> Result<Array> {
        if let Linear::Quantized { q, bias } = self {
            if let Some(y) = crate::model::w4a16::matmul_normed(x, q)? {
                return Ok(match bias {
                    Some(b) => y.add(b)?,
                    None => y,
                });
            }
        }
        self.forward(&x.array()?)
    }

    /// `residual + x W^T (+ b)`: on CUDA, for steps of few rows, one kernel
    /// that adds as it writes ([`crate::model::w4a16::matmul_add`]); else
    /// the projection, then the add. The same numbers either way: the
    /// kernel rounds the product before adding, as the two operations do.
    pub fn forward_plus(&self, x: &Array, residual: &Array) -> Result<Array> {
        if let Linear::Quantized { q, bias: None } = self {
            if let Some(y) = crate::model::w4a16::matmul_add(x, q, residual)? {
                return Ok(y);
            }
        }
        Ok(residual.add(self.forward(x)?)?)
    }

    /// Its weight `[out, in]`, dense (a quantized one's dense copy, or
    /// dequantized), and its bias.
    pub fn dense_weight(&self) -> Result<(Array, Option<Array>)> {
        Ok(match self {
            Linear::Dense { weight, bias } => (weight.clone(), bias.clone()),
            Linear::Quantized { q, bias } => match &q.dense {
                Some(d) => (d.clone(), bias.clone()),
                None => (q.dequantize()?, bias.clone()),
            },
        })
    }

    /// The arrays that hold the weights.
    pub fn arrays(&self) -> Vec<&Array> {
        match self {
            Linear::Dense { weight, bias } => [Some(weight), bias.as_ref()].into_iter().flatten().collect(),
            Linear::Quantized { q, bias } => q.arrays().into_iter().chain(bias.as_ref()).collect(),
        }
    }

    /// Output features (of each matrix, for a stack of experts' `[E, out, in]`).
    pub fn out_features(&self) -> i32 {
        let w = match self {
            Linear::Dense { weight, .. } => weight,
            Linear::Quantized { q, .. } => &q.weight,
        };
        w.shape()[w.ndim() - 2]
    }

    /// Bytes the weights occupy.
    pub fn nbytes(&self) -> usize {
        match self {
            Linear::Dense { weight, bias } => weight.nbytes() + bias.as_ref().map_or(0, |b| b.nbytes()),
            Linear::Quantized { q, bias } => q.nbytes() + bias.as_ref().map_or(0, |b| b.nbytes()),
        }
    }
}

/// Projections of the same input (q/k/v, or gate/up), stored as one matrix
/// when their weights share a form, so that one matmul computes them all:
/// each output feature is the same dot product as in its own matrix, so the
/// results are the separate projections' exactly, for fewer operations
/// (what bounds small-model decode on a GPU: docs/benchmarks.md "NVIDIA").
#[derive(Debug, Clone)]
pub enum FusedLinear {
    /// One matrix; `splits` are the output offsets where the parts begin (after the first).
    Fused { linear: Linear, splits: Vec<i32> },
    /// Forms that differ (GGUF files mix quantization types per tensor): one matmul each.
    Separate(Vec<Linear>),
}

impl FusedLinear {
    /// Fuses `parts` when all are dense of one dtype, or all quantized alike
    /// (bits, group size, scales' dtype), with biases on all or none, as
    /// `fusion` allows (`MLXBC_FUSE`, read once at start: crate::model::options).
    pub fn new(parts: Vec<Linear>, fusion: Fusion) -> Result<Self> {
        let quantized = parts.iter().any(|p| matches!(p, Linear::Quantized { .. }));
        if fusion == Fusion::Off || (quantized && fusion == Fusion::DenseOnly) {
            return Ok(FusedLinear::Separate(parts));
        }
        match fuse(&parts)? {
            Some(fused) => Ok(fused),
            None => Ok(FusedLinear::Separate(parts)),
        }
    }

    /// Each part's projection of `x`'s last axis, in order.
    pub fn forward(&self, x: &Array) -> Result<Vec<Array>> {
        self.forward_adding(x, None)
    }

    /// As [`Self::forward`], with `update` (a LoRA or DoRA adapter's for the
    /// group: the parts' outputs side by side) applied: to the fused output
    /// before it is split, or part by part.
    pub fn forward_adding(&self, x: &Array, update: Option<crate::model::lora::Update>) -> Result<Vec<Array>> {
        match self {
            FusedLinear::Fused { linear, splits } => {
                let y = linear.forward(x)?;
                let y = match update {
                    Some(u) => u.apply(&y)?,
                    None => y,
                };
                Self::parts_of(y, splits, x)
            }
            FusedLinear::Separate(parts) => {
                let ys: Vec<Array> = parts.iter().map(|p| p.forward(x)).collect::<Result<_>>()?;
                let Some(u) = update else { return Ok(ys) };
                let us = u.split(&split_points(parts))?;
                Ok(ys.iter().zip(&us).map(|(y, u)| u.apply(y)).collect::<std::result::Result<_, _>>()?)
            }
        }
    }

    /// The fused matrix's whole output for `x` (the parts side by side),
    /// `update` applied; `None` for separate projections.
    pub fn fused_output(&self, x: &Array, update: Option<&crate::model::lora::Update>) -> Result<Option<Array>> {
        let FusedLinear::Fused { linear, .. } = self else { return Ok(None) };
        let y = linear.forward(x)?;
        Ok(Some(match update {
            Some(u) => u.apply(&y)?,
            None => y,
        }))
    }

    /// [`Self::fused_output`] of `x`'s RMS norm with no update, the norm
    /// applied by the 4-bit kernel where it can be ([`Linear::forward_normed`]).
    pub fn fused_output_normed(&self, x: RmsNormed) -> Result<Option<Array>> {
        let FusedLinear::Fused { linear, .. } = self else { return Ok(None) };
        Ok(Some(linear.forward_normed(x)?))
    }

    /// The fused matrix, when this is one matrix of two equal parts (a
    /// fused gate/up projection).
    pub fn as_halves(&self) -> Option<&Linear> {
        match self {
            FusedLinear::Fused { linear, splits } if splits[..] == [linear.out_features() / 2] => Some(linear),
            _ => None,
        }
    }

    /// Whether the parts are one matrix (their outputs views of one buffer).
    pub fn is_fused(&self) -> bool {
        matches!(self, FusedLinear::Fused { .. })
    }

    /// The fused matrix's output `y` of input `x` cut into the parts.
    pub fn split_output(&self, y: Array, x: &Array) -> Result<Vec<Array>> {
        match self {
            FusedLinear::Fused { splits, .. } => Self::parts_of(y, splits, x),
            FusedLinear::Separate(_) => anyhow::bail!("separate projections have no fused output to split"),
        }
    }

    /// `y` (the fused output for input `x`) cut at `splits`.
    fn parts_of(y: Array, splits: &[i32], x: &Array) -> Result<Vec<Array>> {
        let parts = y.split_at_indices(splits, -1)?;
        // For more than one row (positions, or a batch's sequences)
        // each part is a strided view into one buffer, and MLX
        // 0.32.2's CUDA rope misreads such a view that starts past
        // the buffer's beginning (an H200: wrong keys in prefill,
        // garbage answers, and in batched decode illegal memory
        // accesses; exact for a single row:
        // scripts/gpu/fused_qmm_check.py). A copy per part is little
        // next to the matmuls' device time, but each is one more
        // operation in a host-bound step; one row's decode keeps the
        // views, and so does every step under [`SplitParts::Views`],
        // where the caller copies what it ropes straight from here.
        let rows = x.shape()[..x.shape().len().saturating_sub(1)].iter().product::<i32>();
        if rows > 1 && !split_parts_as_views() {
            Ok(parts.iter().map(Array::contiguous).collect::<std::result::Result<_, _>>()?)
        } else {
            Ok(parts)
        }
    }

    /// Part `index`'s weight `[out, in]`, dense (dequantized), and its bias.
    pub fn part_weight(&self, index: usize) -> Result<(Array, Option<Array>)> {
        use mlx_rs::ops::indexing::IndexOp;
        match self {
            FusedLinear::Fused { linear, splits } => {
                let (w, b) = linear.dense_weight()?;
                let ends: Vec<i32> = splits.iter().copied().chain([w.shape()[0]]).collect();
                anyhow::ensure!(index < ends.len(), "part {index} of {}", ends.len());
                let from = if index == 0 { 0 } else { ends[index - 1] };
                let to = ends[index];
                Ok((w.index((from..to, ..)), b.map(|b| b.index(from..to))))
            }
            FusedLinear::Separate(parts) => {
                parts.get(index).ok_or_else(|| anyhow::anyhow!("part {index} of {}", parts.len()))?.dense_weight()
            }
        }
    }

    /// Arrays that hold the weights (to evaluate after fusing).
    pub fn arrays(&self) -> Vec<&Array> {
        match self {
            FusedLinear::Fused { linear, .. } => linear.arrays(),
            FusedLinear::Separate(parts) => parts.iter().flat_map(Linear::arrays).collect(),
        }
    }

    /// Bytes the weights occupy.
    pub fn nbytes(&self) -> usize {
        match self {
            FusedLinear::Fused { linear, .. } => linear.nbytes(),
            FusedLinear::Separate(parts) => parts.iter().map(Linear::nbytes).sum(),
        }
    }
}

/// Where each of `parts` after the first begins in their outputs side by side.
fn split_points(parts: &[Linear]) -> Vec<i32> {
    let mut at = 0;
    parts[..parts.len().saturating_sub(1)]
        .iter()
        .map(|p| {
            at += p.out_features();
            at
        })
        .collect()
}

/// `parts` as one matrix, or `None` when their forms differ.
fn fuse(parts: &[Linear]) -> Result<Option<FusedLinear>> {
    let biases: Vec<&Array> = parts
        .iter()
        .filter_map(|p| match p {
            Linear::Dense { bias, .. } | Linear::Quantized { bias, .. } => bias.as_ref(),
        })
        .collect();
    if !biases.is_empty() && biases.len() != parts.len() {
        return Ok(None);
    }
    let bias = if biases.is_empty() { None } else { Some(ops::concatenate(&biases, 0)?) };
    let linear = match parts {
        [Linear::Dense { weight: first, .. }, ..] => {
            let weights: Option<Vec<&Array>> = parts
                .iter()
                .map(|p| match p {
                    Linear::Dense { weight, .. } if weight.dtype() == first.dtype() => Some(weight),
                    _ => None,
                })
                .collect();
            let Some(weights) = weights else { return Ok(None) };
            Linear::Dense { weight: ops::concatenate(&weights, 0)?, bias }
        }
        [Linear::Quantized { q: first, .. }, ..] => {
            let qs: Option<Vec<&Quantized>> = parts
                .iter()
                .map(|p| match p {
                    Linear::Quantized { q, .. }
                        if q.bits == first.bits
                            && q.group_size == first.group_size
                            && q.scales.dtype() == first.scales.dtype() =>
                    {
                        Some(q)
                    }
                    _ => None,
                })
                .collect();
            let Some(qs) = qs else { return Ok(None) };
            let cat = |f: fn(&Quantized) -> &Array| ops::concatenate(&qs.iter().map(|q| f(q)).collect::<Vec<_>>(), 0);
            // The parts' dense copies (lazy, never evaluated) give way to the whole's.
            let q = Quantized::new(
                cat(|q| &q.weight)?,
                cat(|q| &q.scales)?,
                cat(|q| &q.biases)?,
                first.group_size,
                first.bits,
            )
            .widen(first.batch)?;
            Linear::Quantized { q, bias }
        }
        [] => return Ok(None),
    };
    Ok(Some(FusedLinear::Fused { linear, splits: split_points(parts) }))
}

/// `silu(gate) * up` as one fused kernel (compiled once per thread,
/// shapeless), as mlx-lm's `swiglu`: one launch per layer instead of three.
pub fn swiglu(gate: &Array, up: &Array) -> Result<Array> {
    type Swiglu =
        Box<dyn for<'a> FnMut((&'a Array, &'a Array)) -> std::result::Result<Array, mlx_rs::error::Exception>>;
    thread_local! {
        static SWIGLU: std::cell::RefCell<Swiglu> = std::cell::RefCell::new(Box::new(
            mlx_rs::transforms::compile::compile(
                |(g, u): (&Array, &Array)| -> std::result::Result<Array, mlx_rs::error::Exception> {
                    g.multiply(mlx_rs::ops::sigmoid(g)?)?.multiply(u)
                },
                true,
            ),
        ));
    }
    Ok(SWIGLU.with(|f| (f.borrow_mut())((gate, up)))?)
}

/// Token id → vector lookup; doubles as the output head when embeddings are tied.
#[derive(Debug, Clone)]
pub enum Embedding {
    Dense(Array),
    Quantized(Quantized),
}

impl Embedding {
    /// Looks up `ids` (any shape) and appends the hidden axis.
    pub fn lookup(&self, ids: &Array) -> Result<Array> {
        Ok(match self {
            Embedding::Dense(w) => w.take_axis(ids, 0)?,
            Embedding::Quantized(q) => {
                let biases = q.biases.take_axis(ids, 0)?;
                ops::dequantize(
                    q.weight.take_axis(ids, 0)?,
                    q.scales.take_axis(ids, 0)?,
                    &biases,
                    q.group_size,
                    q.bits,
                )?
            }
        })
    }

    /// The tied output head: `x E^T`.
    pub fn as_linear(&self, x: &Array) -> Result<Array> {
        Ok(match self {
            Embedding::Dense(w) => x.matmul(w.t())?,
            Embedding::Quantized(q) => q.matmul(x)?,
        })
    }

    /// Rows of the table (its vocabulary).
    pub fn rows(&self) -> i32 {
        match self {
            Embedding::Dense(w) => w.shape()[0],
            Embedding::Quantized(q) => q.weight.shape()[0],
        }
    }

    /// Bytes the table occupies.
    pub fn nbytes(&self) -> usize {
        match self {
            Embedding::Dense(w) => w.nbytes(),
            Embedding::Quantized(q) => q.nbytes(),
        }
    }
}

/// `[b, l, n * d]` → `[b, n, l, d]`. With one position the data is already in
/// that order, so a reshape does it alone: one operation fewer per projection
/// and layer, and a GPU's decode step is bound by the count.
pub fn to_heads(y: &Array, b: i32, l: i32, n: i32) -> Result<Array> {
    Ok(if l == 1 { y.reshape(&[b, n, 1, -1])? } else { y.reshape(&[b, l, n, -1])?.transpose_axes(&[0, 2, 1, 3])? })
}

/// `[b, n, l, d]` → `[b, l, n * d]` (a reshape alone for one position).
pub fn from_heads(o: &Array) -> Result<Array> {
    let (b, l) = (o.shape()[0], o.shape()[2]);
    Ok(if l == 1 { o.reshape(&[b, 1, -1])? } else { o.transpose_axes(&[0, 2, 1, 3])?.reshape(&[b, l, -1])? })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quantized(rows: i32, cols: i32, bits: i32, bias: bool) -> Linear {
        let w = mlx_rs::random::normal::<f32>(&[rows, cols], None, None, None).unwrap();
        let (weight, scales, biases) = ops::quantize(&w, 32, bits).unwrap();
        let bias = bias.then(|| mlx_rs::random::normal::<f32>(&[rows], None, None, None).unwrap());
        Linear::Quantized { q: Quantized::new(weight, scales, biases, 32, bits), bias }
    }

    fn dense(rows: i32, cols: i32) -> Linear {
        Linear::Dense { weight: mlx_rs::random::normal::<f32>(&[rows, cols], None, None, None).unwrap(), bias: None }
    }

    /// The fused matmul's parts are the separate projections exactly, at one
    /// position (views) and at several (copies).
    fn assert_fused_equals_separate(parts: Vec<Linear>, expect_fused: bool) {
        let fused = FusedLinear::new(parts.clone(), Fusion::All).unwrap();
        assert_eq!(matches!(fused, FusedLinear::Fused { .. }), expect_fused);
        for len in [1, 5] {
            let x = mlx_rs::random::normal::<f32>(&[1, len, 64], None, None, None).unwrap();
            let got = fused.forward(&x).unwrap();
            assert_eq!(got.len(), parts.len());
            for (g, p) in got.iter().zip(&parts) {
                let want = p.forward(&x).unwrap();
                assert_eq!(g.shape(), want.shape());
                assert!(g.eq_values(&want).unwrap(), "part differs at {len} positions");
            }
            // The whole output, cut afterwards, is the same parts.
            match fused.fused_output(&x, None).unwrap() {
                Some(y) => {
                    for (g, w) in fused.split_output(y, &x).unwrap().iter().zip(&got) {
                        assert!(g.eq_values(w).unwrap(), "a part cut from the whole output differs");
                    }
                }
                None => assert!(!expect_fused, "a fused projection has a whole output"),
            }
        }
        let halves = parts.len() == 2 && parts[0].out_features() == parts[1].out_features();
        assert_eq!(fused.as_halves().is_some(), expect_fused && halves);
    }

    /// `residual + x W^T` is the projection then the add, exactly (on CUDA
    /// the kernel that adds as it writes checks itself against the same).
    #[test]
    fn forward_plus_is_the_projection_then_the_add() {
        for linear in [quantized(64, 64, 4, false), quantized(64, 64, 8, true), dense(64, 64)] {
            let x = mlx_rs::random::normal::<f32>(&[2, 1, 64], None, None, None).unwrap();
            let residual = mlx_rs::random::normal::<f32>(&[2, 1, 64], None, None, None).unwrap();
            let want = residual.add(linear.forward(&x).unwrap()).unwrap();
            assert!(linear.forward_plus(&x, &residual).unwrap().eq_values(&want).unwrap());
        }
    }

    #[test]
    fn quantized_projections_fuse_exactly() {
        assert_fused_equals_separate(
            vec![quantized(96, 64, 4, false), quantized(32, 64, 4, false), quantized(32, 64, 4, false)],
            true,
        );
        assert_fused_equals_separate(vec![quantized(64, 64, 8, true), quantized(64, 64, 8, true)], true);
    }

    #[test]
    fn dense_projections_fuse_exactly() {
        assert_fused_equals_separate(vec![dense(96, 64), dense(32, 64), dense(32, 64)], true);
    }

    /// The weights' form follows the choice and the step's rows: the dense
    /// copy at every row count; the expansion from its threshold, packed
    /// below it; both compute `x @ dequantize(W).T` exactly and stay within
    /// rounding of the packed matmul.
    #[test]
    fn batched_steps_use_the_form_their_rows_call_for() {
        let Linear::Quantized { q, .. } = quantized(96, 64, 4, false) else { unreachable!() };
        let packed = |x: &Array| ops::quantized_matmul(x, &q.weight, &q.scales, &q.biases, true, 32, 4).unwrap();
        let expanded = |x: &Array| x.matmul(q.dequantize().unwrap().t()).unwrap();
        let dense = q.clone().widen(BatchWeights::Dense).unwrap();
        let expand = q.clone().widen(BatchWeights::Expand).unwrap();
        assert!(dense.dense.is_some() && expand.dense.is_none());
        assert_eq!(dense.nbytes(), q.nbytes() + 96 * 64 * 4, "the f32 copy is counted");
        for (batch, rows) in [(1, 1), (2, 1), (1, 3), (4, 1), (8, 1), (2, 5)] {
            let x = mlx_rs::random::normal::<f32>(&[batch, rows, 64], None, None, None).unwrap();
            let n = batch * rows;
            assert!(dense.matmul(&x).unwrap().eq_values(expanded(&x)).unwrap(), "dense copy at {n} rows");
            let want_expand = if n >= EXPAND_FROM_ROWS { expanded(&x) } else { packed(&x) };
            assert!(expand.matmul(&x).unwrap().eq_values(&want_expand).unwrap(), "expanded at {n} rows");
            assert!(q.matmul(&x).unwrap().eq_values(packed(&x)).unwrap(), "packed at {n} rows");
            // A graph built on the packed weights (a verify pass so measured)
            // leaves the dense copy alone, and only while it is built.
            let on_packed = with_packed_weights(true, || dense.matmul(&x).unwrap());
            assert!(on_packed.eq_values(packed(&x)).unwrap(), "packed weights asked for at {n} rows");
            assert!(dense.matmul(&x).unwrap().eq_values(expanded(&x)).unwrap(), "the dense copy again at {n} rows");
            let gap: f32 = ops::abs(expanded(&x).subtract(packed(&x)).unwrap()).unwrap().max(None).unwrap().item_cast();
            assert!(gap < 1e-3, "dense and packed differ by {gap}");
        }
        // A shard's cut keeps the choice, with a copy of its own shape.
        let cut = dense.with_parts(q.weight.clone(), q.scales.clone(), q.biases.clone()).unwrap();
        assert_eq!(cut.batch, BatchWeights::Dense);
        assert_eq!(cut.dense.as_ref().unwrap().shape(), &[96, 64]);
    }

    #[test]
    fn mixed_forms_stay_separate() {
        // GGUF files mix block types per tensor (Q4_K_M: Q5_0 q/k, Q8_0 v, ...).
        assert_fused_equals_separate(vec![quantized(32, 64, 4, false), quantized(32, 64, 8, false)], false);
        assert_fused_equals_separate(vec![quantized(32, 64, 4, false), dense(32, 64)], false);
        assert_fused_equals_separate(vec![quantized(32, 64, 4, true), quantized(32, 64, 4, false)], false);
    }
}
