//! The nomic-bert encoder (nomic-embed-text v1 and v1.5): BERT's post-norm
//! layers with rotary positions instead of a position table, a fused
//! q/k/v projection and a SwiGLU MLP, op for op as llama.cpp's `nomic-bert`
//! graph (`src/models/bert.cpp`) and Hugging Face's `NomicBertModel`
//! compute it.

use super::config::NomicBertConfig;
use crate::families::bert::{attend, padding_bias};
use crate::model::layers::{from_heads, Embedding, LayerNorm, Linear};
use crate::model::weights::TensorMap;
use anyhow::Result;
use mlx_rs::fast;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{nn, Array};

struct Layer {
    qkv: Linear,
    attention_out: Linear,
    attention_norm: LayerNorm,
    /// `fc11`: the MLP's input half.
    up: Linear,
    /// `fc12`: the half that goes through SiLU.
    gate: Linear,
    /// `fc2`.
    down: Linear,
    output_norm: LayerNorm,
}

/// The encoder's weights.
pub struct NomicBertEncoder {
    config: NomicBertConfig,
    words: Embedding,
    /// One row per token type; a single text is all of the first.
    token_types: Option<Array>,
    embeddings_norm: LayerNorm,
    layers: Vec<Layer>,
    /// On MLX's CPU backend: attention's softmax from multiplies and adds
    /// (`bert::attend`).
    cpu_math: bool,
    /// Copy q and k before rope (CUDA: MLX 0.32.2's CUDA rope misreads a
    /// multi-row view that starts past its buffer's beginning,
    /// docs/measurements/h100-2026-12-05b-batched-host.md).
    copy_for_rope: bool,
}

impl NomicBertEncoder {
    /// Loads `t` (Hugging Face's names, no prefix).
    pub fn load(config: NomicBertConfig, t: &mut TensorMap) -> Result<Self> {
        let eps = config.layer_norm_epsilon;
        let words = t.embedding("embeddings.word_embeddings")?;
        let token_types = if t.has("embeddings.token_type_embeddings.weight") {
            Some(t.float("embeddings.token_type_embeddings.weight")?)
        } else {
            None
        };
        let embeddings_norm = LayerNorm::load(t, "emb_ln", eps)?;
        let mut layers = Vec::with_capacity(config.n_layer);
        for i in 0..config.n_layer {
            let p = format!("encoder.layers.{i}");
            layers.push(Layer {
                qkv: t.linear(&format!("{p}.attn.Wqkv"))?,
                attention_out: t.linear(&format!("{p}.attn.out_proj"))?,
                attention_norm: LayerNorm::load(t, &format!("{p}.norm1"), eps)?,
                up: t.linear(&format!("{p}.mlp.fc11"))?,
                gate: t.linear(&format!("{p}.mlp.fc12"))?,
                down: t.linear(&format!("{p}.mlp.fc2"))?,
                output_norm: LayerNorm::load(t, &format!("{p}.norm2"), eps)?,
            });
        }
        let copy_for_rope = crate::model::options::cuda_available();
        Ok(Self { config, words, token_types, embeddings_norm, layers, cpu_math: false, copy_for_rope })
    }

    /// Positions a text may have.
    pub fn positions(&self) -> usize {
        self.config.positions().max(0) as usize
    }
}

impl crate::families::bert::Encoder for NomicBertEncoder {
    fn forward(&self, ids: &Array, keep: &Array, types: Option<&Array>) -> Result<Array> {
        let (b, l) = (ids.shape()[0], ids.shape()[1]);
        let (heads, d) = (self.config.n_head, self.config.head_dim());
        let scale = 1.0 / (d as f32).sqrt();
        let mut x = self.words.lookup(ids)?;
        if let Some(rows) = &self.token_types {
            x = x.add(match types {
                Some(t) => rows.take_axis(t, 0)?,
                None => rows.index(0),
            })?;
        }
        let mut x = self.embeddings_norm.forward(&x)?;
        let mask = keep.reshape(&[b, 1, 1, l])?;
        let bias = if self.cpu_math { Some(padding_bias(&mask)?) } else { None };
        let traditional = self.config.rotary_emb_interleaved;
        for layer in &self.layers {
            // [B, L, 3, heads, d] → q, k, v [B, heads, L, d].
            let qkv = layer.qkv.forward(&x)?.reshape(&[b, l, 3, heads, d])?.transpose_axes(&[2, 0, 3, 1, 4])?;
            let rope = |y: Array| {
                let y = if self.copy_for_rope { y.contiguous()? } else { y };
                fast::rope(y, d, traditional, self.config.rotary_emb_base, 1.0, 0, None)
            };
            let (q, k, v) = (rope(qkv.index(0))?, rope(qkv.index(1))?, qkv.index(2));
            let o = attend(&q, &k, &v, scale, &mask, bias.as_ref())?;
            let o = layer.attention_out.forward(&from_heads(&o)?)?;
            x = layer.attention_norm.forward(&o.add(&x)?)?;
            let h = layer.up.forward(&x)?.multiply(nn::silu(layer.gate.forward(&x)?)?)?;
            x = layer.output_norm.forward(&layer.down.forward(&h)?.add(&x)?)?;
        }
        Ok(x)
    }

    fn row_bytes(&self, tokens: usize) -> usize {
        let heads = self.config.n_head as usize;
        4 * (heads * tokens * tokens).max(2 * self.config.inner() as usize * tokens)
    }

    fn hidden_size(&self) -> usize {
        self.config.n_embd as usize
    }

    fn use_cpu_math(&mut self, on: bool) {
        self.cpu_math = on;
    }
}
