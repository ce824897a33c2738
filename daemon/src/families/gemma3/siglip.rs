//! The SigLIP vision tower (Gemma 3's), op for op like mlx-vlm's
//! `gemma3/vision.py`: conv patch embedding + learned positions, pre-norm
//! encoder layers (LayerNorm, multi-head attention with biases, tanh-GELU
//! MLP), and a final LayerNorm.

use crate::model::layers::{LayerNorm, Linear};
use crate::model::weights::TensorMap;
use anyhow::Result;
use mlx_rs::{fast, nn, ops, Array};

/// Shape of a SigLIP tower (`vision_config` in config.json).
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
pub struct SiglipConfig {
    pub hidden_size: i32,
    pub intermediate_size: i32,
    pub num_hidden_layers: i32,
    pub num_attention_heads: i32,
    pub patch_size: i32,
    #[serde(default = "default_image_size")]
    pub image_size: i32,
    #[serde(default = "default_eps")]
    pub layer_norm_eps: f32,
}

fn default_image_size() -> i32 {
    224
}
fn default_eps() -> f32 {
    1e-6
}

struct EncoderLayer {
    norm1: LayerNorm,
    q: Linear,
    k: Linear,
    v: Linear,
    out: Linear,
    norm2: LayerNorm,
    fc1: Linear,
    fc2: Linear,
}

/// A loaded SigLIP tower.
pub struct SiglipTower {
    pub config: SiglipConfig,
    patch_weight: Array,
    patch_bias: Array,
    positions: Array,
    layers: Vec<EncoderLayer>,
    post_norm: LayerNorm,
}

impl SiglipTower {
    /// Loads `prefix.embeddings...`, `prefix.encoder.layers.N...`, `prefix.post_layernorm`.
    pub fn load(config: SiglipConfig, t: &mut TensorMap, prefix: &str) -> Result<Self> {
        let eps = config.layer_norm_eps;
        let mut layers = Vec::new();
        for i in 0..config.num_hidden_layers {
            let p = format!("{prefix}.encoder.layers.{i}");
            layers.push(EncoderLayer {
                norm1: LayerNorm::load(t, &format!("{p}.layer_norm1"), eps)?,
                q: t.linear(&format!("{p}.self_attn.q_proj"))?,
                k: t.linear(&format!("{p}.self_attn.k_proj"))?,
                v: t.linear(&format!("{p}.self_attn.v_proj"))?,
                out: t.linear(&format!("{p}.self_attn.out_proj"))?,
                norm2: LayerNorm::load(t, &format!("{p}.layer_norm2"), eps)?,
                fc1: t.linear(&format!("{p}.mlp.fc1"))?,
                fc2: t.linear(&format!("{p}.mlp.fc2"))?,
            });
        }
        let mut patch_weight = t.float(&format!("{prefix}.embeddings.patch_embedding.weight"))?;
        // PyTorch checkpoints store conv weights [out, in, kh, kw]; MLX wants [out, kh, kw, in].
        if patch_weight.shape()[1] == 3 && patch_weight.shape()[3] != 3 {
            patch_weight = patch_weight.transpose_axes(&[0, 2, 3, 1])?;
        }
        Ok(Self {
            patch_bias: t.float(&format!("{prefix}.embeddings.patch_embedding.bias"))?,
            positions: t.float(&format!("{prefix}.embeddings.position_embedding.weight"))?,
            // mlx-vlm builds post_layernorm with LayerNorm's default eps (1e-5).
            post_norm: LayerNorm::load(t, &format!("{prefix}.post_layernorm"), 1e-5)?,
            patch_weight,
            layers,
            config,
        })
    }

    /// Pixels `[B, H, W, 3]` → patch features `[B, patches, hidden]`.
    pub fn forward(&self, pixels: &Array) -> Result<Array> {
        let p = self.config.patch_size;
        let x = ops::conv2d(pixels, &self.patch_weight, (p, p), None, None, None)?.add(&self.patch_bias)?;
        let (b, h, w, d) = (x.shape()[0], x.shape()[1], x.shape()[2], x.shape()[3]);
        let mut x = x.reshape(&[b, h * w, d])?.add(&self.positions)?;
        let heads = self.config.num_attention_heads;
        let scale = ((d / heads) as f64).powf(-0.5) as f32;
        for l in &self.layers {
            let y = l.norm1.forward(&x)?;
            let split = |a: Array| -> Result<Array> {
                Ok(a.reshape(&[b, -1, heads, d / heads])?.transpose_axes(&[0, 2, 1, 3])?)
            };
            let (q, k, v) = (split(l.q.forward(&y)?)?, split(l.k.forward(&y)?)?, split(l.v.forward(&y)?)?);
            let o = fast::scaled_dot_product_attention(&q, &k, &v, scale, None, None)?;
            let o = o.transpose_axes(&[0, 2, 1, 3])?.reshape(&[b, -1, d])?;
            let h2 = x.add(&l.out.forward(&o)?)?;
            let m = l.fc2.forward(&nn::gelu_approximate(l.fc1.forward(&l.norm2.forward(&h2)?)?)?)?;
            x = h2.add(&m)?;
        }
        self.post_norm.forward(&x)
    }
}
