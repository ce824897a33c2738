//! The BERT encoder (post-norm transformer, absolute positions), op for op
//! as Hugging Face's `BertModel` and mlx-embeddings' `bert.py` compute it.

use super::config::BertConfig;
use super::native::NativeLayer;
use crate::model::layers::{from_heads, to_heads, Embedding, LayerNorm, Linear};
use crate::model::weights::TensorMap;
use crate::model::{cpu_math, cpu_native};
use anyhow::{Context, Result};
use mlx_rs::fast::{self, ScaledDotProductAttentionMask};
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{nn, Array};

pub(super) struct Layer {
    pub(super) query: Linear,
    pub(super) key: Linear,
    pub(super) value: Linear,
    pub(super) attention_out: Linear,
    pub(super) attention_norm: LayerNorm,
    pub(super) intermediate: Linear,
    pub(super) output: Linear,
    pub(super) output_norm: LayerNorm,
}

/// The encoder's weights.
pub struct BertEncoder {
    config: BertConfig,
    words: Embedding,
    positions: Array,
    /// One row per token type (segment A, B of a pair).
    token_types: Array,
    embeddings_norm: LayerNorm,
    layers: Vec<Layer>,
    /// On MLX's CPU backend: GELU and attention's softmax from multiplies
    /// and adds (`model::cpu_math`), 3-4x faster there than MLX's `erf`
    /// and `exp`; attention as two matrix products around that softmax.
    pub cpu_math: bool,
    /// On the CPU with native math and a CBLAS: the layers as
    /// `super::native` runs them (`None` where a weight is not dense f32).
    native: Option<Vec<NativeLayer>>,
}

impl BertEncoder {
    /// Loads `t` (names without a `bert.` prefix).
    pub fn load(config: BertConfig, t: &mut TensorMap) -> Result<Self> {
        let eps = config.layer_norm_eps;
        let words = t.embedding("embeddings.word_embeddings")?;
        let positions = t.float("embeddings.position_embeddings.weight")?;
        let token_types = t.float("embeddings.token_type_embeddings.weight")?;
        let embeddings_norm = LayerNorm::load(t, "embeddings.LayerNorm", eps)?;
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for i in 0..config.num_hidden_layers {
            let p = format!("encoder.layer.{i}");
            layers.push(Layer {
                query: t.linear(&format!("{p}.attention.self.query"))?,
                key: t.linear(&format!("{p}.attention.self.key"))?,
                value: t.linear(&format!("{p}.attention.self.value"))?,
                attention_out: t.linear(&format!("{p}.attention.output.dense"))?,
                attention_norm: LayerNorm::load(t, &format!("{p}.attention.output.LayerNorm"), eps)?,
                intermediate: t.linear(&format!("{p}.intermediate.dense"))?,
                output: t.linear(&format!("{p}.output.dense"))?,
                output_norm: LayerNorm::load(t, &format!("{p}.output.LayerNorm"), eps)?,
            });
        }
        Ok(Self { config, words, positions, token_types, embeddings_norm, layers, cpu_math: false, native: None })
    }

    /// Bytes of a row's largest intermediate at `tokens` tokens: its
    /// attention scores (heads × tokens²) or its FFN's activations (taken
    /// as 4 × hidden per token, as BERTs are built), f32.
    pub fn row_bytes(&self, tokens: usize) -> usize {
        let heads = self.config.num_attention_heads as usize;
        4 * (heads * tokens * tokens).max(4 * self.config.hidden_size as usize * tokens)
    }

    /// Width of its token states (and of a mean or CLS vector).
    pub fn hidden_size(&self) -> usize {
        self.config.hidden_size as usize
    }

    /// Positions a text may have (the position rows after the first one
    /// a text takes).
    pub fn positions(&self) -> usize {
        (self.config.max_position_embeddings - self.config.first_position()).max(0) as usize
    }

    /// Token states `[B, L, hidden]` of right-padded `ids` `[B, L]`, where
    /// `keep` (`[B, L]`, bool) marks the real tokens: padding is never
    /// attended to. `types` (`[B, L]`, int32) says each token's segment of
    /// a pair; `None`: all of the first (a single text).
    pub fn forward(&self, ids: &Array, keep: &Array, types: Option<&Array>) -> Result<Array> {
        let (b, l) = (ids.shape()[0], ids.shape()[1]);
        let n = self.config.num_attention_heads;
        let scale = 1.0 / (self.config.head_dim() as f32).sqrt();
        let segments = match types {
            Some(t) => self.token_types.take_axis(t, 0)?,
            None => self.token_types.index(0),
        };
        let first = self.config.first_position();
        let x = self.words.lookup(ids)?.add(self.positions.index(first..first + l))?.add(&segments)?;
        let mut x = self.embeddings_norm.forward(&x)?;
        let mask = keep.reshape(&[b, 1, 1, l])?;
        // The CPU path's mask as a bias: -1e9 at padding (its softmax
        // takes e^-87 there, 1.6e-38 of the row's largest).
        let bias = if self.cpu_math { Some(padding_bias(&mask)?) } else { None };
        if let (Some(layers), Some(sgemm), Some(bias)) = (&self.native, cpu_native::sgemm(), &bias) {
            return super::native::forward(sgemm, layers, &x, bias, n as usize);
        }
        for layer in &self.layers {
            let o = match self.attention_in_place(layer, &x, n, scale, bias.as_ref())? {
                Some(o) => o,
                None => {
                    let q = to_heads(&layer.query.forward(&x)?, b, l, n)?;
                    let k = to_heads(&layer.key.forward(&x)?, b, l, n)?;
                    let v = to_heads(&layer.value.forward(&x)?, b, l, n)?;
                    from_heads(&attend(&q, &k, &v, scale, &mask, bias.as_ref())?)?
                }
            };
            x = self.add_norm(&layer.attention_out.forward(&o)?, &x, &layer.attention_norm)?;
            let h = layer.intermediate.forward(&x)?;
            let h = if self.cpu_math { cpu_math::gelu(&h)? } else { nn::gelu(h)? };
            x = self.add_norm(&layer.output.forward(&h)?, &x, &layer.output_norm)?;
        }
        Ok(x)
    }

    /// On the CPU (`cpu_bias`, native math): attention `[B, L, hidden]`
    /// with each head read where the projections put it
    /// (`cpu_native::attention`); `None` elsewhere, or where no CBLAS is
    /// found.
    fn attention_in_place(
        &self,
        layer: &Layer,
        x: &Array,
        heads: i32,
        scale: f32,
        cpu_bias: Option<&Array>,
    ) -> Result<Option<Array>> {
        let Some(bias) = cpu_bias.filter(|_| cpu_math::native()) else { return Ok(None) };
        let (q, k, v) = (layer.query.forward(x)?, layer.key.forward(x)?, layer.value.forward(x)?);
        Ok(crate::model::cpu_native::attention(&q, &k, &v, heads as usize, scale, bias)?)
    }

    /// Whether its layers run natively (`super::native`).
    #[cfg(test)]
    pub(super) fn computes_natively(&self) -> bool {
        self.native.is_some()
    }

    /// `norm(a + b)`: on the CPU by `cpu_math` (one pass on every core).
    fn add_norm(&self, a: &Array, b: &Array, norm: &LayerNorm) -> Result<Array> {
        if self.cpu_math {
            cpu_math::add_layer_norm(a, b, norm)
        } else {
            norm.forward(&a.add(b)?)
        }
    }
}

/// The CPU path's padding mask (`[B, 1, 1, L]`, bool) as a bias: -1e9 at
/// padding (its softmax takes e^-87 there, 1.6e-38 of the row's largest).
pub(crate) fn padding_bias(mask: &Array) -> Result<Array> {
    Ok(mlx_rs::ops::select(mask, Array::from_f32(0.0), Array::from_f32(-1e9))?)
}

/// Attention over q, k, v `[B, heads, L, d]` where `mask` (`[B, 1, 1, L]`,
/// bool) marks the keys to attend to: MLX's fused attention, or on the CPU
/// (`cpu_bias`: `padding_bias(mask)`) two matrix products around
/// `cpu_math`'s softmax.
pub(crate) fn attend(
    q: &Array,
    k: &Array,
    v: &Array,
    scale: f32,
    mask: &Array,
    cpu_bias: Option<&Array>,
) -> Result<Array> {
    Ok(match cpu_bias {
        Some(bias) => {
            let scores = q.multiply(Array::from_f32(scale))?.matmul(k.transpose_axes(&[0, 1, 3, 2])?)?;
            cpu_math::softmax_biased(&scores, bias)?.matmul(v)?
        }
        None => fast::scaled_dot_product_attention(q, k, v, scale, ScaledDotProductAttentionMask::Array(mask), None)?,
    })
}

impl super::Encoder for BertEncoder {
    fn forward(&self, ids: &Array, keep: &Array, types: Option<&Array>) -> Result<Array> {
        BertEncoder::forward(self, ids, keep, types)
    }

    fn row_bytes(&self, tokens: usize) -> usize {
        BertEncoder::row_bytes(self, tokens)
    }

    fn hidden_size(&self) -> usize {
        BertEncoder::hidden_size(self)
    }

    fn use_cpu_math(&mut self, on: bool) {
        self.cpu_math = on;
        let native = on && cpu_math::native() && cpu_native::sgemm().is_some();
        self.native = if native { self.layers.iter().map(NativeLayer::of).collect() } else { None };
    }
}

/// A cross-encoder's head (`BertForSequenceClassification`): the pooler
/// (a dense layer and tanh over `[CLS]`'s state) and the classifier.
pub struct ClassifierHead {
    pooler: Linear,
    classifier: Linear,
    /// Outputs of the classifier (1 for a relevance score).
    pub labels: usize,
}

impl ClassifierHead {
    /// Loads `pooler.dense` and `classifier` from `t`.
    pub fn load(t: &mut TensorMap) -> Result<Self> {
        let pooler = t.linear("pooler.dense")?;
        let labels = t.rows("classifier.weight").context("missing tensor classifier.weight")? as usize;
        let classifier = t.linear("classifier")?;
        Ok(Self { pooler, classifier, labels })
    }

    /// Logits `[B, labels]` of token states `[B, L, hidden]`.
    pub fn forward(&self, states: &Array) -> Result<Array> {
        let pooled = mlx_rs::ops::tanh(&self.pooler.forward(&states.index((.., 0, ..)))?)?;
        self.classifier.forward(&pooled)
    }
}
