//! The ModernBERT encoder (pre-norm transformer, rotary positions, a gated
//! GELU MLP, layers that alternate whole-text and sliding-window
//! attention), op for op as Hugging Face's `ModernBertModel` and
//! mlx-embeddings' `modernbert.py` compute it.

use super::config::ModernBertConfig;
use crate::model::cpu_math;
use crate::model::layers::{from_heads, Embedding, LayerNorm, Linear};
use crate::model::weights::TensorMap;
use anyhow::Result;
use mlx_rs::fast::{self, ScaledDotProductAttentionMask};
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{nn, Array};

/// What a masked position adds to a score (as the references do: -1e9,
/// whose softmax weight is 0 in f32 and f16 alike).
const MASKED: f32 = -1e9;

struct Layer {
    /// None for the first layer (the embeddings' norm stands before it).
    attn_norm: Option<LayerNorm>,
    qkv: Linear,
    attn_out: Linear,
    mlp_norm: LayerNorm,
    /// Input and gate halves side by side.
    mlp_in: Linear,
    mlp_out: Linear,
    /// Attends to the whole text (else within the window), with this rope base.
    global: bool,
    rope_theta: f32,
}

/// The encoder's weights.
pub struct ModernBertEncoder {
    config: ModernBertConfig,
    words: Embedding,
    embeddings_norm: LayerNorm,
    layers: Vec<Layer>,
    final_norm: LayerNorm,
    /// On MLX's CPU backend: GELU and softmax from multiplies and adds.
    cpu_math: bool,
    /// Copy q and k before rope (CUDA: see `forward`).
    copy_for_rope: bool,
}

impl ModernBertEncoder {
    /// Loads `t` (names without a `model.` prefix).
    pub fn load(config: ModernBertConfig, t: &mut TensorMap) -> Result<Self> {
        let eps = config.norm_eps;
        let norm = |t: &mut TensorMap, name: &str| {
            if config.norm_bias {
                LayerNorm::load(t, name, eps)
            } else {
                LayerNorm::load_unbiased(t, name, eps)
            }
        };
        let words = t.embedding("embeddings.tok_embeddings")?;
        let embeddings_norm = norm(t, "embeddings.norm")?;
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for i in 0..config.num_hidden_layers {
            let p = format!("layers.{i}");
            let global = config.is_global(i);
            layers.push(Layer {
                attn_norm: if i == 0 { None } else { Some(norm(t, &format!("{p}.attn_norm"))?) },
                qkv: t.linear(&format!("{p}.attn.Wqkv"))?,
                attn_out: t.linear(&format!("{p}.attn.Wo"))?,
                mlp_norm: norm(t, &format!("{p}.mlp_norm"))?,
                mlp_in: t.linear(&format!("{p}.mlp.Wi"))?,
                mlp_out: t.linear(&format!("{p}.mlp.Wo"))?,
                global,
                rope_theta: match (global, config.local_rope_theta) {
                    (false, Some(local)) => local,
                    _ => config.global_rope_theta,
                },
            });
        }
        let final_norm = norm(t, "final_norm")?;
        let copy_for_rope = crate::model::options::cuda_available();
        Ok(Self { config, words, embeddings_norm, layers, final_norm, cpu_math: false, copy_for_rope })
    }

    /// Positions a text may have.
    pub fn positions(&self) -> usize {
        self.config.max_position_embeddings.max(0) as usize
    }

    /// Attention over q, k, v `[B, heads, L, head_dim]` with an additive mask.
    fn attend(&self, q: &Array, k: &Array, v: &Array, bias: &Array) -> Result<Array> {
        let scale = 1.0 / (self.config.head_dim() as f32).sqrt();
        Ok(if self.cpu_math {
            let scores = q.multiply(Array::from_f32(scale))?.matmul(k.transpose_axes(&[0, 1, 3, 2])?)?;
            cpu_math::softmax_biased(&scores, bias)?.matmul(v)?
        } else {
            fast::scaled_dot_product_attention(q, k, v, scale, ScaledDotProductAttentionMask::Array(bias), None)?
        })
    }
}

impl crate::families::bert::Encoder for ModernBertEncoder {
    fn forward(&self, ids: &Array, keep: &Array, _types: Option<&Array>) -> Result<Array> {
        let (b, l) = (ids.shape()[0], ids.shape()[1]);
        let (heads, d) = (self.config.num_attention_heads, self.config.head_dim());
        let mut x = self.embeddings_norm.forward(&self.words.lookup(ids)?)?;
        let dtype = x.dtype();
        // Padding is never attended to; the window layers see only
        // positions within half the window on either side.
        let masked = Array::from_f32(MASKED);
        let padding = mlx_rs::ops::select(&keep.reshape(&[b, 1, 1, l])?, Array::from_f32(0.0), &masked)?;
        let at = mlx_rs::ops::arange::<_, i32>(0, l, 1)?;
        let distance = mlx_rs::ops::abs(at.reshape(&[l, 1])?.subtract(at.reshape(&[1, l])?)?)?;
        let inside = distance.le(Array::from_int(self.config.local_attention / 2))?.reshape(&[1, 1, l, l])?;
        let global_bias = padding.as_dtype(dtype)?;
        // Outside the window -1e9 whatever the padding says (the
        // references replace, they do not add).
        let local_bias = mlx_rs::ops::select(&inside, &padding, &masked)?.as_dtype(dtype)?;
        for layer in &self.layers {
            let h = match &layer.attn_norm {
                Some(n) => n.forward(&x)?,
                None => x.clone(),
            };
            // [B, L, 3, heads, d] → q, k, v [B, heads, L, d].
            let qkv = layer.qkv.forward(&h)?.reshape(&[b, l, 3, heads, d])?.transpose_axes(&[2, 0, 3, 1, 4])?;
            // On CUDA, copies, not views into the fused output: MLX 0.32.2's
            // CUDA rope misreads a multi-row view that starts past its
            // buffer's beginning (docs/measurements/h100-2026-12-05b-batched-host.md).
            let rope = |y: Array| {
                let y = if self.copy_for_rope { y.contiguous()? } else { y };
                fast::rope(y, d, false, layer.rope_theta, 1.0, 0, None)
            };
            let (q, k, v) = (rope(qkv.index(0))?, rope(qkv.index(1))?, qkv.index(2));
            let bias = if layer.global { &global_bias } else { &local_bias };
            let o = layer.attn_out.forward(&from_heads(&self.attend(&q, &k, &v, bias)?)?)?;
            x = x.add(&o)?;
            let gated = layer.mlp_in.forward(&layer.mlp_norm.forward(&x)?)?;
            let half = gated.shape()[2] / 2;
            let (input, gate) = (gated.index((.., .., ..half)), gated.index((.., .., half..)));
            let act = if self.cpu_math { cpu_math::gelu(&input)? } else { nn::gelu(input)? };
            x = x.add(&layer.mlp_out.forward(&act.multiply(&gate)?)?)?;
        }
        self.final_norm.forward(&x)
    }

    fn row_bytes(&self, tokens: usize) -> usize {
        let heads = self.config.num_attention_heads as usize;
        let width = 2 * self.config.intermediate_size as usize;
        4 * (heads * tokens * tokens).max(width * tokens)
    }

    fn hidden_size(&self) -> usize {
        self.config.hidden_size as usize
    }

    fn use_cpu_math(&mut self, on: bool) {
        self.cpu_math = on;
    }
}
