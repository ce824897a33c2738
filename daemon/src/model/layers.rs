//! The two building blocks whose weights come in several forms: a linear
//! projection and a token embedding, each either dense or MLX affine-quantized.
//! Their arithmetic mirrors mlx-lm's `nn.Linear`, `nn.QuantizedLinear`,
//! `nn.Embedding` and `nn.QuantizedEmbedding`, so greedy ids match it exactly.

use anyhow::Result;
use mlx_rs::{ops, Array};

/// MLX affine quantization of a weight matrix (`weight` packed in uint32).
#[derive(Debug)]
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
#[derive(Debug)]
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

/// Token id → vector lookup; doubles as the output head when embeddings are tied.
#[derive(Debug)]
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
