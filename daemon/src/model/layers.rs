//! The two building blocks whose weights come in several forms: a linear
//! projection and a token embedding, each either dense or MLX affine-quantized.
//! Their arithmetic mirrors mlx-lm's `nn.Linear`, `nn.QuantizedLinear`,
//! `nn.Embedding` and `nn.QuantizedEmbedding`, so greedy ids match it exactly.

use anyhow::Result;
use mlx_rs::{ops, Array};

/// MLX affine quantization of a weight matrix (`weight` packed in uint32).
#[derive(Debug, Clone)]
pub struct Quantized {
    pub weight: Array,
    pub scales: Array,
    pub biases: Array,
    pub group_size: i32,
    pub bits: i32,
}

impl Quantized {
    /// Expands to a dense matrix of the scales' dtype.
    pub fn dequantize(&self) -> Result<Array> {
        Ok(ops::dequantize(&self.weight, &self.scales, &self.biases, self.group_size, self.bits)?)
    }
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
            Linear::Dense { weight, bias: None } => x.matmul(weight.t())?,
            Linear::Dense { weight, bias: Some(b) } => ops::addmm(b, x, weight.t(), None, None)?,
            Linear::Quantized { q, bias } => {
                let y = ops::quantized_matmul(x, &q.weight, &q.scales, &q.biases, true, q.group_size, q.bits)?;
                match bias {
                    Some(b) => y.add(b)?,
                    None => y,
                }
            }
        })
    }

    /// The arrays that hold the weights.
    pub fn arrays(&self) -> Vec<&Array> {
        match self {
            Linear::Dense { weight, bias } => [Some(weight), bias.as_ref()].into_iter().flatten().collect(),
            Linear::Quantized { q, bias } => {
                [Some(&q.weight), Some(&q.scales), Some(&q.biases), bias.as_ref()].into_iter().flatten().collect()
            }
        }
    }

    /// Bytes the weights occupy.
    pub fn nbytes(&self) -> usize {
        match self {
            Linear::Dense { weight, bias } => weight.nbytes() + bias.as_ref().map_or(0, |b| b.nbytes()),
            Linear::Quantized { q, bias } => {
                q.weight.nbytes() + q.scales.nbytes() + q.biases.nbytes() + bias.as_ref().map_or(0, |b| b.nbytes())
            }
        }
    }
}

/// Projections of the same input (q/k/v, or gate/up), stored as one matrix
/// when their weights are dense alike, so that one matmul computes them all:
/// each output feature is the same dot product as in its own matrix, so the
/// results are the separate projections' exactly, for fewer operations.
/// Quantized parts stay separate: on MLX 0.32.2's CUDA backend the
/// concatenated packed matrix gave wrong answers (an H200: SmolLM2 answered
/// nonsense fused, "Paris" separate), though it was exact on CPU.
#[derive(Debug, Clone)]
pub enum FusedLinear {
    /// One matrix; `splits` are the output offsets where the parts begin (after the first).
    Fused { linear: Linear, splits: Vec<i32> },
    /// Quantized, or forms that differ: one matmul each.
    Separate(Vec<Linear>),
}

impl FusedLinear {
    /// Fuses `parts` when all are dense of one dtype, with biases on all or
    /// none (`MLXBC_FUSE=0` keeps them separate).
    pub fn new(parts: Vec<Linear>) -> Result<Self> {
        let dense: Option<Vec<(&Array, Option<&Array>)>> = parts
            .iter()
            .map(|p| match p {
                Linear::Dense { weight, bias } => Some((weight, bias.as_ref())),
                Linear::Quantized { .. } => None,
            })
            .collect();
        let alike = |d: &[(&Array, Option<&Array>)]| {
            d.iter().all(|(w, b)| w.dtype() == d[0].0.dtype() && b.is_some() == d[0].1.is_some())
        };
        let dense = match dense {
            Some(d) if alike(&d) && std::env::var("MLXBC_FUSE").as_deref() != Ok("0") => d,
            _ => return Ok(FusedLinear::Separate(parts)),
        };
        let weights: Vec<&Array> = dense.iter().map(|(w, _)| *w).collect();
        let biases: Option<Vec<&Array>> = dense.iter().map(|(_, b)| *b).collect();
        let bias = biases.map(|b| ops::concatenate(&b, 0)).transpose()?;
        let mut at = 0;
        let splits = weights[..weights.len() - 1]
            .iter()
            .map(|w| {
                at += w.shape()[0];
                at
            })
            .collect();
        Ok(FusedLinear::Fused { linear: Linear::Dense { weight: ops::concatenate(&weights, 0)?, bias }, splits })
    }

    /// Each part's projection of `x`'s last axis, in order.
    pub fn forward(&self, x: &Array) -> Result<Vec<Array>> {
        match self {
            FusedLinear::Fused { linear, splits } => Ok(linear.forward(x)?.split_at_indices(splits, -1)?),
            FusedLinear::Separate(parts) => parts.iter().map(|p| p.forward(x)).collect(),
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
            Embedding::Quantized(q) => {
                ops::quantized_matmul(x, &q.weight, &q.scales, &q.biases, true, q.group_size, q.bits)?
            }
        })
    }

    /// Bytes the table occupies.
    pub fn nbytes(&self) -> usize {
        match self {
            Embedding::Dense(w) => w.nbytes(),
            Embedding::Quantized(q) => q.weight.nbytes() + q.scales.nbytes() + q.biases.nbytes(),
        }
    }
}
