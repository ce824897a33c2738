//! The BERT encoder (post-norm transformer, absolute positions), op for op
//! as Hugging Face's `BertModel` and mlx-embeddings' `bert.py` compute it.

use super::config::BertConfig;
use crate::model::layers::{from_heads, to_heads, Embedding, LayerNorm, Linear};
use crate::model::weights::TensorMap;
use anyhow::Result;
use mlx_rs::fast::{self, ScaledDotProductAttentionMask};
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{nn, Array};

struct Layer {
    query: Linear,
    key: Linear,
    value: Linear,
    attention_out: Linear,
    attention_norm: LayerNorm,
    intermediate: Linear,
    output: Linear,
    output_norm: LayerNorm,
}

/// The encoder's weights.
pub struct BertEncoder {
    config: BertConfig,
    words: Embedding,
    positions: Array,
    /// Token type 0's row (single-sequence inputs).
    token_type: Array,
    embeddings_norm: LayerNorm,
    layers: Vec<Layer>,
}

impl BertEncoder {
    /// Loads `t` (names without a `bert.` prefix).
    pub fn load(config: BertConfig, t: &mut TensorMap) -> Result<Self> {
        let eps = config.layer_norm_eps;
        let words = t.embedding("embeddings.word_embeddings")?;
        let positions = t.float("embeddings.position_embeddings.weight")?;
        let token_type = t.float("embeddings.token_type_embeddings.weight")?.index(0);
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
        Ok(Self { config, words, positions, token_type, embeddings_norm, layers })
    }

    /// Positions the model was trained for.
    pub fn positions(&self) -> usize {
        self.config.max_position_embeddings as usize
    }

    /// Token states `[B, L, hidden]` of right-padded `ids` `[B, L]`, where
    /// `keep` (`[B, L]`, bool) marks the real tokens: padding is never
    /// attended to.
    pub fn forward(&self, ids: &Array, keep: &Array) -> Result<Array> {
        let (b, l) = (ids.shape()[0], ids.shape()[1]);
        let n = self.config.num_attention_heads;
        let scale = 1.0 / (self.config.head_dim() as f32).sqrt();
        let x = self.words.lookup(ids)?.add(self.positions.index(..l))?.add(&self.token_type)?;
        let mut x = self.embeddings_norm.forward(&x)?;
        let mask = keep.reshape(&[b, 1, 1, l])?;
        for layer in &self.layers {
            let q = to_heads(&layer.query.forward(&x)?, b, l, n)?;
            let k = to_heads(&layer.key.forward(&x)?, b, l, n)?;
            let v = to_heads(&layer.value.forward(&x)?, b, l, n)?;
            let o = fast::scaled_dot_product_attention(
                &q,
                &k,
                &v,
                scale,
                ScaledDotProductAttentionMask::Array(&mask),
                None,
            )?;
            let o = layer.attention_out.forward(&from_heads(&o)?)?;
            x = layer.attention_norm.forward(&o.add(&x)?)?;
            let h = nn::gelu(layer.intermediate.forward(&x)?)?;
            x = layer.output_norm.forward(&layer.output.forward(&h)?.add(&x)?)?;
        }
        Ok(x)
    }
}
