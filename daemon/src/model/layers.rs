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

    /// Output features.
    fn out_features(&self) -> i32 {
        match self {
            Linear::Dense { weight, .. } => weight.shape()[0],
            Linear::Quantized { q, .. } => q.weight.shape()[0],
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
/// when their weights share a form so that one matmul computes them all:
/// each output feature is the same dot product as in its own matrix, so the
/// results are the separate projections' exactly, for fewer kernel launches
/// (what bounds small-model decode on a GPU).
#[derive(Debug, Clone)]
pub enum FusedLinear {
    /// One matrix; `splits` are the output offsets where the parts begin (after the first).
    Fused { linear: Linear, splits: Vec<i32> },
    /// Forms differ (GGUF files mix quantization types per tensor): one matmul each.
    Separate(Vec<Linear>),
}

impl FusedLinear {
    /// Fuses `parts` when they are all dense alike (`MLXBC_FUSE=0` keeps
    /// them separate). Quantized parts stay separate: on MLX 0.32.2's CUDA
    /// backend the concatenated packed matrix gives wrong answers (measured on
    /// an H200: SmolLM2 answered nonsense fused, "Paris" separate), while on
    /// CPU it is exact; `MLXBC_FUSE=quantized` fuses them anyway, for testing.
    pub fn new(parts: Vec<Linear>) -> Result<Self> {
        let setting = std::env::var("MLXBC_FUSE");
        let quantized = parts.iter().any(|p| matches!(p, Linear::Quantized { .. }));
        if setting.as_deref() == Ok("0") || (quantized && setting.as_deref() != Ok("quantized")) {
            return Ok(FusedLinear::Separate(parts));
        }
        let sizes: Vec<i32> = parts.iter().map(Linear::out_features).collect();
        let splits = sizes
            .iter()
            .scan(0, |at, n| {
                *at += n;
                Some(*at)
            })
            .take(sizes.len() - 1)
            .collect();
        let biases = |parts: &[Linear]| -> Result<Option<Array>> {
            let all: Vec<&Array> = parts
                .iter()
                .filter_map(|p| match p {
                    Linear::Dense { bias, .. } | Linear::Quantized { bias, .. } => bias.as_ref(),
                })
                .collect();
            Ok(match all.len() {
                0 => None,
                n if n == parts.len() => Some(ops::concatenate(&all, 0)?),
                _ => return Err(anyhow::anyhow!("some parts have biases")),
            })
        };
        let fused = match parts.as_slice() {
            [Linear::Dense { weight: first, .. }, ..]
                if parts.iter().all(|p| matches!(p, Linear::Dense { weight, .. } if weight.dtype() == first.dtype())) =>
            {
                let weights: Vec<&Array> =
                    parts.iter().map(|p| if let Linear::Dense { weight, .. } = p { weight } else { unreachable!() }).collect();
                biases(&parts).ok().map(|bias| -> Result<Linear> {
                    Ok(Linear::Dense { weight: ops::concatenate(&weights, 0)?, bias })
                })
            }
            [Linear::Quantized { q: first, .. }, ..]
                if parts.iter().all(|p| matches!(p, Linear::Quantized { q, .. }
                    if q.bits == first.bits && q.group_size == first.group_size && q.scales.dtype() == first.scales.dtype())) =>
            {
                let quantized: Vec<&Quantized> =
                    parts.iter().map(|p| if let Linear::Quantized { q, .. } = p { q } else { unreachable!() }).collect();
                let cat = |f: fn(&Quantized) -> &Array| ops::concatenate(&quantized.iter().map(|q| f(q)).collect::<Vec<_>>(), 0);
                biases(&parts).ok().map(|bias| -> Result<Linear> {
                    Ok(Linear::Quantized {
                        q: Quantized {
                            weight: cat(|q| &q.weight)?,
                            scales: cat(|q| &q.scales)?,
                            biases: cat(|q| &q.biases)?,
                            group_size: first.group_size,
                            bits: first.bits,
                        },
                        bias,
                    })
                })
            }
            _ => None,
        };
        Ok(match fused {
            Some(linear) => FusedLinear::Fused { linear: linear?, splits },
            None => FusedLinear::Separate(parts),
        })
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
