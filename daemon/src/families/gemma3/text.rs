//! Gemma 3's text decoder, op for op like mlx-vlm's `gemma3/language.py`:
//! embeddings scaled by sqrt(hidden) (rounded through bf16, as the reference
//! does), `1 + weight` RMS norms, q/k norms, four norms per block, a
//! tanh-GELU gated MLP, and sliding-window layers (local rope base) between
//! every `sliding_window_pattern`-th global layer.

use crate::distributed::Shard;
use crate::model::batch_attention;
use crate::model::family::{LanguageModel, MediaAttention};
use crate::model::kv_cache::KvCache;
use crate::model::layers::{from_heads, to_heads, Embedding, Linear};
use crate::model::positions::MediaPositions;
use crate::model::sharding::Split;
use crate::model::weights::TensorMap;
use anyhow::{bail, Result};
use mlx_rs::{
    fast::{self, ScaledDotProductAttentionMask},
    nn, ops, Array, Dtype,
};

/// `text_config` of a Gemma 3 checkpoint.
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
pub struct Gemma3TextConfig {
    pub hidden_size: i32,
    pub num_hidden_layers: i32,
    pub intermediate_size: i32,
    #[serde(default = "d_heads")]
    pub num_attention_heads: i32,
    #[serde(default = "d_head_dim")]
    pub head_dim: i32,
    #[serde(default = "d_eps")]
    pub rms_norm_eps: f32,
    #[serde(default = "d_vocab")]
    pub vocab_size: i32,
    #[serde(default = "d_kv_heads")]
    pub num_key_value_heads: i32,
    #[serde(default = "d_global_base")]
    pub rope_global_base_freq: f32,
    #[serde(default = "d_local_base")]
    pub rope_local_base_freq: f32,
    #[serde(default = "d_head_dim_f")]
    pub query_pre_attn_scalar: f32,
    #[serde(default = "d_window")]
    pub sliding_window: i32,
    #[serde(default = "d_pattern")]
    pub sliding_window_pattern: i32,
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    #[serde(default = "d_mm_tokens")]
    pub mm_tokens_per_image: i32,
    #[serde(default = "d_ctx")]
    pub max_position_embeddings: u32,
}

fn d_heads() -> i32 {
    8
}
fn d_head_dim() -> i32 {
    256
}
fn d_head_dim_f() -> f32 {
    256.0
}
fn d_eps() -> f32 {
    1e-6
}
fn d_vocab() -> i32 {
    262208
}
fn d_kv_heads() -> i32 {
    4
}
fn d_global_base() -> f32 {
    1_000_000.0
}
fn d_local_base() -> f32 {
    10_000.0
}
fn d_window() -> i32 {
    1024
}
fn d_pattern() -> i32 {
    6
}
fn d_mm_tokens() -> i32 {
    256
}
fn d_ctx() -> u32 {
    4096
}

struct Block {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    q_norm: Array,
    k_norm: Array,
    gate: Linear,
    up: Linear,
    down: Linear,
    input_norm: Array,
    post_attn_norm: Array,
    pre_ff_norm: Array,
    post_ff_norm: Array,
    sliding: bool,
}

/// A loaded Gemma 3 text decoder.
pub struct Gemma3Text {
    pub config: Gemma3TextConfig,
    embed: Embedding,
    blocks: Vec<Block>,
    norm: Array,
    lm_head: Option<Linear>,
    embed_scale: Array,
    global_rope_scale: f32,
    /// Attend bidirectionally within each image during prefill (Gemma 3's
    /// training and HF's behaviour). mlx-vlm 0.7.10 attends causally: its
    /// 4-D mask is dropped on the way to the language model.
    pub bidirectional_images: bool,
    /// This rank's heads (all of them unless attention is split).
    heads: i32,
    kv_heads: i32,
    /// How the decoder is cut over a group (see [`Split`]).
    split: Split,
}

/// Gemma's RMS norm weight is stored as an offset from 1.
fn norm(t: &mut TensorMap, name: &str) -> Result<Array> {
    Ok(t.float(name)?.add(Array::from_f32(1.0))?)
}

impl Gemma3Text {
    /// Loads `prefix.model.*` (and `prefix.lm_head` when untied); with
    /// `shard`, only this rank's part (mlx-lm's cut, see [`Split`]): the
    /// norms after o and down see the ranks' summed products.
    pub fn load(config: Gemma3TextConfig, t: &mut TensorMap, prefix: &str, shard: Option<&Shard>) -> Result<Self> {
        let c = &config;
        let split =
            Split::plan(shard, c.num_attention_heads, &[c.num_key_value_heads], c.intermediate_size, c.vocab_size);
        let (q_width, kv_width) = (c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim);
        let (att, mlp, ff) = (split.attention, split.mlp, c.intermediate_size);
        let mut blocks = Vec::new();
        for i in 0..config.num_hidden_layers {
            let p = format!("{prefix}.model.layers.{i}");
            blocks.push(Block {
                q: split.rows(t.linear(&format!("{p}.self_attn.q_proj"))?, q_width, att)?,
                k: split.rows(t.linear(&format!("{p}.self_attn.k_proj"))?, kv_width, att)?,
                v: split.rows(t.linear(&format!("{p}.self_attn.v_proj"))?, kv_width, att)?,
                o: split.cols(t.linear(&format!("{p}.self_attn.o_proj"))?, q_width, att)?,
                q_norm: norm(t, &format!("{p}.self_attn.q_norm.weight"))?,
                k_norm: norm(t, &format!("{p}.self_attn.k_norm.weight"))?,
                gate: split.rows(t.linear(&format!("{p}.mlp.gate_proj"))?, ff, mlp)?,
                up: split.rows(t.linear(&format!("{p}.mlp.up_proj"))?, ff, mlp)?,
                down: split.cols(t.linear(&format!("{p}.mlp.down_proj"))?, ff, mlp)?,
                input_norm: norm(t, &format!("{p}.input_layernorm.weight"))?,
                post_attn_norm: norm(t, &format!("{p}.post_attention_layernorm.weight"))?,
                pre_ff_norm: norm(t, &format!("{p}.pre_feedforward_layernorm.weight"))?,
                post_ff_norm: norm(t, &format!("{p}.post_feedforward_layernorm.weight"))?,
                sliding: (i + 1) % config.sliding_window_pattern != 0,
            });
        }
        let lm_head = if t.has(&format!("{prefix}.lm_head.weight")) {
            Some(split.vocab_head(t.linear(&format!("{prefix}.lm_head"))?)?)
        } else {
            None
        };
        split.log();
        // mlx-vlm: h *= mx.array(hidden_size ** 0.5, mx.bfloat16).astype(h.dtype)
        let embed_scale = Array::from_f32((config.hidden_size as f64).sqrt() as f32)
            .as_dtype(Dtype::Bfloat16)?
            .as_dtype(Dtype::Float32)?;
        let global_rope_scale =
            match config.rope_scaling.as_ref().and_then(|s| s.get("factor")).and_then(|f| f.as_f64()) {
                Some(f) => (1.0 / f) as f32,
                None => 1.0,
            };
        Ok(Self {
            embed: split.vocab_rows(t.embedding(&format!("{prefix}.model.embed_tokens"))?)?,
            norm: norm(t, &format!("{prefix}.model.norm.weight"))?,
            blocks,
            lm_head,
            embed_scale,
            global_rope_scale,
            bidirectional_images: true,
            heads: split.heads(config.num_attention_heads),
            kv_heads: split.heads(config.num_key_value_heads),
            split,
            config,
        })
    }

    /// Unscaled token embeddings `[B, L, hidden]` (scaling happens in [`Self::hidden`]).
    pub fn embed(&self, ids: &Array) -> Result<Array> {
        self.split.lookup(&self.embed, ids)
    }

    /// Runs embeddings `[B, L, hidden]` through the blocks, appending to
    /// `cache`; returns the final normed hidden states. With `blocks`
    /// (one row), `blocks[pos]` names the image each absolute position
    /// belongs to (-1: text); positions of one image then attend to each
    /// other in both directions, as Gemma 3 was trained (HF's
    /// `token_type_ids` mask); everything else stays causal.
    pub fn hidden(&self, embeds: &Array, cache: &mut KvCache, blocks: Option<&[i32]>) -> Result<Array> {
        let c = &self.config;
        let (rows, l) = (embeds.shape()[0], embeds.shape()[1]);
        let offset = cache.offset;
        // Padded rows each start their positions after their padding.
        let row_offsets = cache.is_padded().then(|| cache.row_offsets());
        if row_offsets.is_some() && blocks.is_some() {
            bail!("image blocks are for a single-row prefill");
        }
        let mut h = embeds.multiply(&self.embed_scale)?;
        for (i, b) in self.blocks.iter().enumerate() {
            let x = fast::rms_norm(&h, Some(&b.input_norm), c.rms_norm_eps)?;
            let split = |y: Array, n: i32, w: &Array| -> Result<Array> {
                Ok(fast::rms_norm(to_heads(&y, rows, l, n)?, Some(w), c.rms_norm_eps)?)
            };
            let q = split(b.q.forward(&x)?, self.heads, &b.q_norm)?;
            let k = split(b.k.forward(&x)?, self.kv_heads, &b.k_norm)?;
            let v = to_heads(&b.v.forward(&x)?, rows, l, self.kv_heads)?;
            let (base, scale) = if b.sliding {
                (c.rope_local_base_freq, 1.0)
            } else {
                (c.rope_global_base_freq, self.global_rope_scale)
            };
            let (q, k) = match &row_offsets {
                Some(at) => (
                    fast::rope_dynamic(&q, c.head_dim, false, base, scale, at, None)?,
                    fast::rope_dynamic(&k, c.head_dim, false, base, scale, at, None)?,
                ),
                None => (
                    fast::rope(&q, c.head_dim, false, base, scale, offset, None)?,
                    fast::rope(&k, c.head_dim, false, base, scale, offset, None)?,
                ),
            };
            let (k, v) = cache.update(i, k, v)?;
            let window = b.sliding.then_some(c.sliding_window);
            let scale = (c.query_pre_attn_scalar as f64).powf(-0.5) as f32;
            let o = match batch_attention::padded(&q, &k, &v, scale, cache, offset, window)? {
                Some(o) => o,
                None => attend(&q, k, v, scale, window, offset, blocks)?,
            };
            let o = from_heads(&o)?;
            let o = self.split.sum(b.o.forward(&o)?, self.split.attention)?;
            let r = fast::rms_norm(&o, Some(&b.post_attn_norm), c.rms_norm_eps)?;
            let h2 = h.add(&r)?;
            let x = fast::rms_norm(&h2, Some(&b.pre_ff_norm), c.rms_norm_eps)?;
            let m = b.down.forward(&nn::gelu_approximate(b.gate.forward(&x)?)?.multiply(b.up.forward(&x)?)?)?;
            let m = self.split.sum(m, self.split.mlp)?;
            h = h2.add(fast::rms_norm(&m, Some(&b.post_ff_norm), c.rms_norm_eps)?)?;
        }
        cache.offset += l;
        Ok(fast::rms_norm(&h, Some(&self.norm), c.rms_norm_eps)?)
    }

    /// Logits `[B, vocab]` of each row's last position of normed hidden states.
    pub fn logits_last(&self, hidden: &Array) -> Result<Array> {
        let (rows, l) = (hidden.shape()[0], hidden.shape()[1]);
        let last = if l == 1 { hidden.clone() } else { hidden.take_axis(Array::from_slice(&[l - 1], &[1]), 1)? };
        let logits = match &self.lm_head {
            Some(h) => h.forward(&last)?,
            None => self.embed.as_linear(&last)?,
        };
        self.split.gather_vocab(logits.reshape(&[rows, -1])?)
    }
}

impl LanguageModel for Gemma3Text {
    fn architecture(&self) -> &'static str {
        "gemma3"
    }

    fn num_layers(&self) -> usize {
        self.blocks.len()
    }

    fn context_length(&self) -> u32 {
        self.config.max_position_embeddings
    }

    fn embed(&self, ids: &Array) -> Result<Array> {
        Gemma3Text::embed(self, ids)
    }

    fn forward(&self, embeds: &Array, cache: &mut KvCache, media: &MediaPositions) -> Result<Array> {
        self.hidden(embeds, cache, media.image_blocks.filter(|_| self.bidirectional_images))
    }

    fn logits(&self, hidden: &Array) -> Result<Array> {
        self.logits_last(hidden)
    }

    fn split_description(&self) -> Option<String> {
        self.split.describe()
    }

    fn media_attention(&self) -> MediaAttention {
        if self.bidirectional_images {
            MediaAttention::BidirectionalWithinImage
        } else {
            MediaAttention::Causal
        }
    }
}

/// One row's attention over its cached keys, as Gemma's masks have it:
/// causal, within the last `window` keys on a sliding layer, and — with
/// `blocks` (per absolute position, the image it belongs to, -1 for text)
/// — both ways between positions of one image. Shared by Gemma 3 and 4.
pub fn attend(
    q: &Array,
    k: Array,
    v: Array,
    scale: f32,
    window: Option<i32>,
    offset: i32,
    blocks: Option<&[i32]>,
) -> Result<Array> {
    let (l, total) = (q.shape()[2], k.shape()[2]);
    let queries_in_image = blocks.is_some_and(|b| b[offset as usize..(offset + l) as usize].iter().any(|&x| x >= 0));
    if l > 1 && queries_in_image {
        let b = blocks.unwrap();
        let allowed: Vec<bool> = (offset..offset + l)
            .flat_map(|i| {
                (0..total).map(move |j| {
                    let causal = j <= i && window.is_none_or(|w| i - j < w);
                    causal || (b[i as usize] >= 0 && b[i as usize] == b[j as usize])
                })
            })
            .collect();
        let mask = Array::from_slice(&allowed, &[l, total]);
        return Ok(fast::scaled_dot_product_attention(
            q,
            &k,
            &v,
            scale,
            ScaledDotProductAttentionMask::Array(&mask),
            None,
        )?);
    }
    let window = match window {
        Some(w) if total > w => w,
        _ => {
            let mask = if l > 1 { Some(ScaledDotProductAttentionMask::Causal) } else { None };
            return Ok(fast::scaled_dot_product_attention(q, &k, &v, scale, mask, None)?);
        }
    };
    // Query i (absolute offset + i) sees keys j with 0 <= pos_i - j < window.
    let qpos = ops::arange::<_, i32>(offset, offset + l, None)?.reshape(&[l, 1])?;
    let kpos = ops::arange::<_, i32>(0, total, None)?.reshape(&[1, total])?;
    let diff = qpos.subtract(&kpos)?;
    let allowed = diff.ge(Array::from_int(0))?.logical_and(&diff.lt(Array::from_int(window))?)?;
    Ok(fast::scaled_dot_product_attention(q, &k, &v, scale, ScaledDotProductAttentionMask::Array(&allowed), None)?)
}
