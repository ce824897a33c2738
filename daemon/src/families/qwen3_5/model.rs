//! Qwen3.5's hybrid decoder, op for op as mlx-vlm 0.7.10's
//! `qwen3_5/language.py`: three Gated DeltaNet layers (a depthwise causal
//! convolution over q, k, v, then the gated delta rule's recurrent state)
//! per gated-attention layer (q/k norms, partial rotary with interleaved
//! multimodal rope, a sigmoid output gate). The DeltaNet layers keep their
//! convolution window and recurrent state in the cache's recurrent slots,
//! the attention layers keys and values in its KV slots.

use super::config::Qwen35TextConfig;
use super::gated_delta;
use crate::distributed::Shard;
use crate::model::batch_attention;
use crate::model::family::LanguageModel;
use crate::model::kv_cache::KvCache;
use crate::model::layers::swiglu;
use crate::model::layers::{Embedding, Linear};
use crate::model::positions::{MediaPositions, MropePositions};
use crate::model::sharding::Split;
use crate::model::weights::TensorMap;
use anyhow::{ensure, Result};
use mlx_rs::fast::{self, ScaledDotProductAttentionMask};
use mlx_rs::ops::indexing::{Ellipsis, IndexOp};
use mlx_rs::ops::{self, expand_dims};
use mlx_rs::{Array, Dtype};

/// Gated DeltaNet: linear attention with a learned decay and a delta-rule write.
struct GatedDeltaNet {
    in_proj_qkv: Linear,
    in_proj_z: Linear,
    in_proj_b: Linear,
    in_proj_a: Linear,
    /// Depthwise convolution `[channels, kernel, 1]` (MLX layout).
    conv_weight: Array,
    dt_bias: Array,
    a_log: Array,
    /// RMSNorm over each value head, gated by silu(z).
    norm: Array,
    out_proj: Linear,
}

/// Full attention with a sigmoid gate on its output.
struct GatedAttention {
    /// Queries and the gate, interleaved per head (`2 * head_dim` each).
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    q_norm: Array,
    k_norm: Array,
}

enum Mixer {
    /// A DeltaNet layer and its recurrent slot.
    Linear(GatedDeltaNet, usize),
    /// An attention layer and its KV slot.
    Attention(GatedAttention, usize),
}

struct Layer {
    mixer: Mixer,
    input_layernorm: Array,
    post_attention_layernorm: Array,
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
}

/// A loaded Qwen3.5 text decoder.
pub struct Qwen35 {
    config: Qwen35TextConfig,
    embed_tokens: Embedding,
    layers: Vec<Layer>,
    norm: Array,
    lm_head: Option<Linear>,
    /// The rope's inverse frequencies `[rotary_dim / 2]`.
    inv_freq: Array,
    attention_layers: usize,
    /// This rank's attention heads (all of them unless split).
    heads: i32,
    kv_heads: i32,
    /// How the decoder is cut over a group (see [`Split`]).
    split: Split,
}

impl Qwen35 {
    /// Builds the decoder from tensors under mlx-vlm's names
    /// (`model.layers.N.{linear_attn,self_attn,mlp}`, `model.embed_tokens`);
    /// with `shard`, this rank's part: the gated attention by heads, the
    /// MLP by features and the vocabulary by blocks as [`Split`] cuts them;
    /// the Gated DeltaNet layers replicated (every rank runs every
    /// recurrent head: a quarter of the layers' weights, no collective, and
    /// each rank's recurrent state is the whole one).
    pub fn from_tensors(config: Qwen35TextConfig, mut t: TensorMap, shard: Option<&Shard>) -> Result<Self> {
        let c = &config;
        let mut split =
            Split::plan(shard, c.num_attention_heads, &[c.num_key_value_heads], c.intermediate_size, c.vocab_size);
        if split.shard.is_some() {
            split.notes.push("recurrent (Gated DeltaNet) layers replicated".to_string());
        }
        let (att, mlp, ff, hd) = (split.attention, split.mlp, c.intermediate_size, c.head_dim());
        let (q_width, kv_width) = (c.num_attention_heads * hd, c.num_key_value_heads * hd);
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        let (mut kv_slots, mut state_slots) = (0, 0);
        for i in 0..config.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let mixer = if config.is_attention(i) {
                let a = format!("{p}.self_attn");
                kv_slots += 1;
                Mixer::Attention(
                    GatedAttention {
                        // Queries and gates interleave per head: a block of
                        // heads is a block of rows.
                        q_proj: split.rows(t.linear(&format!("{a}.q_proj"))?, 2 * q_width, att)?,
                        k_proj: split.rows(t.linear(&format!("{a}.k_proj"))?, kv_width, att)?,
                        v_proj: split.rows(t.linear(&format!("{a}.v_proj"))?, kv_width, att)?,
                        o_proj: split.cols(t.linear(&format!("{a}.o_proj"))?, q_width, att)?,
                        q_norm: t.float(&format!("{a}.q_norm.weight"))?,
                        k_norm: t.float(&format!("{a}.k_norm.weight"))?,
                    },
                    kv_slots - 1,
                )
            } else {
                let a = format!("{p}.linear_attn");
                let conv_weight = t.float(&format!("{a}.conv1d.weight"))?;
                ensure!(
                    conv_weight.ndim() == 3 && conv_weight.shape()[2] == 1,
                    "{a}.conv1d.weight is {:?}, not MLX's [channels, kernel, 1] (convert the checkpoint with mlx-vlm)",
                    conv_weight.shape()
                );
                state_slots += 1;
                Mixer::Linear(
                    GatedDeltaNet {
                        in_proj_qkv: t.linear(&format!("{a}.in_proj_qkv"))?,
                        in_proj_z: t.linear(&format!("{a}.in_proj_z"))?,
                        in_proj_b: t.linear(&format!("{a}.in_proj_b"))?,
                        in_proj_a: t.linear(&format!("{a}.in_proj_a"))?,
                        conv_weight,
                        dt_bias: t.float(&format!("{a}.dt_bias"))?,
                        a_log: t.float(&format!("{a}.A_log"))?,
                        norm: t.float(&format!("{a}.norm.weight"))?,
                        out_proj: t.linear(&format!("{a}.out_proj"))?,
                    },
                    state_slots - 1,
                )
            };
            layers.push(Layer {
                mixer,
                input_layernorm: t.float(&format!("{p}.input_layernorm.weight"))?,
                post_attention_layernorm: t.float(&format!("{p}.post_attention_layernorm.weight"))?,
                gate_proj: split.rows(t.linear(&format!("{p}.mlp.gate_proj"))?, ff, mlp)?,
                up_proj: split.rows(t.linear(&format!("{p}.mlp.up_proj"))?, ff, mlp)?,
                down_proj: split.cols(t.linear(&format!("{p}.mlp.down_proj"))?, ff, mlp)?,
            });
        }
        ensure!(kv_slots > 0, "a Qwen3.5 decoder without attention layers");
        let lm_head = if !config.tie_word_embeddings && t.has("lm_head.weight") {
            Some(split.vocab_head(t.linear("lm_head")?)?)
        } else {
            None
        };
        split.log();
        let rot = config.rotary_dim();
        let steps = ops::arange::<_, f32>(0.0, rot as f32, 2.0)?.divide(Array::from_f32(rot as f32))?;
        let inv_freq = Array::from_f32(1.0).divide(ops::power(Array::from_f32(config.rope().rope_theta), &steps)?)?;
        inv_freq.eval()?;
        Ok(Self {
            embed_tokens: split.vocab_rows(t.embedding("model.embed_tokens")?)?,
            norm: t.float("model.norm.weight")?,
            layers,
            lm_head,
            inv_freq,
            attention_layers: kv_slots,
            heads: split.heads(config.num_attention_heads),
            kv_heads: split.heads(config.num_key_value_heads),
            split,
            config,
        })
    }

    /// cos and sin `[rows, 1, L, rotary_dim]` for `l` positions from the
    /// cache's next one: each row's own positions when rows are padded; the
    /// prompt's multimodal positions (then `offset + delta`) when it has them.
    fn rope_cos_sin(
        &self,
        cache: &KvCache,
        mrope: Option<&MropePositions>,
        l: i32,
        dtype: Dtype,
    ) -> Result<(Array, Array)> {
        let half = self.inv_freq.shape()[0];
        let section = &self.config.rope().mrope_section;
        // mlx-vlm's interleaved selector (as Qwen3-VL's).
        let axis_of: Vec<usize> = (0..half as usize)
            .map(|i| match i % 3 {
                1 if i < 3 * section[1] as usize => 1,
                2 if i < 3 * section[2] as usize => 2,
                _ => 0,
            })
            .collect();
        let offset = cache.offset;
        let starts: Vec<i64> = cache.paddings().iter().map(|&p| (offset - p) as i64).collect();
        let rows = if cache.is_padded() { starts.len() as i32 } else { 1 };
        let mut positions = Vec::with_capacity((rows * l * half) as usize);
        for &start in starts.iter().take(rows as usize) {
            for p in start..start + l as i64 {
                let pos = match mrope {
                    Some((prompt, _)) if (p as usize) < prompt.len() => prompt[p as usize],
                    Some((_, delta)) => [p + delta; 3],
                    None => [p; 3],
                };
                positions.extend(axis_of.iter().map(|&a| pos[a] as f32));
            }
        }
        let freqs = Array::from_slice(&positions, &[rows, 1, l, half]).multiply(&self.inv_freq)?;
        let emb = ops::concatenate(&[&freqs, &freqs], -1)?;
        Ok((ops::cos(&emb)?.as_dtype(dtype)?, ops::sin(&emb)?.as_dtype(dtype)?))
    }

    fn attention(
        &self,
        a: &GatedAttention,
        slot: usize,
        x: &Array,
        cache: &mut KvCache,
        rope: &(Array, Array),
    ) -> Result<Array> {
        let c = &self.config;
        let (b, l) = (x.shape()[0], x.shape()[1]);
        let hd = c.head_dim();
        let (heads, kv_heads) = (self.heads, self.kv_heads);
        let qg = a.q_proj.forward(x)?.reshape(&[b, l, heads, 2 * hd])?;
        let parts = qg.split_equal(2, -1)?;
        let gate = parts[1].reshape(&[b, l, -1])?;
        let q = fast::rms_norm(&parts[0], Some(&a.q_norm), c.rms_norm_eps)?.transpose_axes(&[0, 2, 1, 3])?;
        let k = a.k_proj.forward(x)?.reshape(&[b, l, kv_heads, hd])?;
        let k = fast::rms_norm(&k, Some(&a.k_norm), c.rms_norm_eps)?.transpose_axes(&[0, 2, 1, 3])?;
        let v = a.v_proj.forward(x)?.reshape(&[b, l, kv_heads, hd])?.transpose_axes(&[0, 2, 1, 3])?;
        let (q, k) = (partial_rotary(&q, rope)?, partial_rotary(&k, rope)?);
        let offset = cache.offset;
        let (k, v) = cache.update(slot, k, v)?;
        let scale = (hd as f64).powf(-0.5) as f32;
        let o = match batch_attention::padded(&q, &k, &v, scale, cache, offset, None)? {
            Some(o) => o,
            None => {
                let mask = if l > 1 { Some(ScaledDotProductAttentionMask::Causal) } else { None };
                fast::scaled_dot_product_attention(&q, &k, &v, scale, mask, None)?
            }
        };
        let o = o.transpose_axes(&[0, 2, 1, 3])?.reshape(&[b, l, -1])?;
        self.split.sum(a.o_proj.forward(&o.multiply(ops::sigmoid(&gate)?)?)?, self.split.attention)
    }

    fn delta_net(&self, g: &GatedDeltaNet, slot: usize, x: &Array, cache: &mut KvCache) -> Result<Array> {
        let c = &self.config;
        let (b, s) = (x.shape()[0], x.shape()[1]);
        let (hk, hv) = (c.linear_num_key_heads, c.linear_num_value_heads);
        let (dk, dv) = (c.linear_key_head_dim, c.linear_value_head_dim);
        let key_dim = hk * dk;
        let kernel = c.linear_conv_kernel_dim;
        let conv_dim = 2 * key_dim + hv * dv;
        let mixed = g.in_proj_qkv.forward(x)?;
        let z = g.in_proj_z.forward(x)?.reshape(&[b, s, hv, dv])?;
        let (gate_b, gate_a) = (g.in_proj_b.forward(x)?, g.in_proj_a.forward(x)?);
        let (conv_state, state) = match cache.state(slot) {
            Some([conv, state]) if conv.shape()[0] == b => (conv.clone(), state.clone()),
            _ => (ops::zeros_dtype(&[b, kernel - 1, conv_dim], x.dtype())?, ops::zeros::<f32>(&[b, hv, dv, dk])?),
        };
        let conv_input = ops::concatenate(&[&conv_state, &mixed], 1)?;
        let window = conv_input.index((.., s..s + kernel - 1, ..));
        let conv = if s == 1 && matches!(g.conv_weight.dtype(), Dtype::Bfloat16 | Dtype::Float16) {
            // mlx-vlm's one-token path for half-precision weights: the
            // window times the taps, summed in float32.
            let w = g.conv_weight.index((.., .., 0)).transpose()?.as_dtype(Dtype::Float32)?;
            let out = conv_input.as_dtype(Dtype::Float32)?.multiply(expand_dims(&w, 0)?)?.sum_axis(1, None)?;
            expand_dims(&out.as_dtype(conv_input.dtype())?, 1)?
        } else {
            ops::conv1d(&conv_input, &g.conv_weight, 1, 0, 1, conv_dim)?
        };
        let conv = silu(&conv)?;
        let q = conv.index((Ellipsis, ..key_dim)).reshape(&[b, s, hk, dk])?;
        let k = conv.index((Ellipsis, key_dim..2 * key_dim)).reshape(&[b, s, hk, dk])?;
        let v = conv.index((Ellipsis, 2 * key_dim..)).reshape(&[b, s, hv, dv])?;
        // L2-normalized q and k (as RMSNorm with eps / width), q also scaled by 1/Dk.
        let inv_scale = (dk as f64).powf(-0.5);
        let eps = 1e-6 / dk as f32;
        let q = fast::rms_norm(&q, None, eps)?.multiply(Array::from_f32((inv_scale * inv_scale) as f32))?;
        let k = fast::rms_norm(&k, None, eps)?.multiply(Array::from_f32(inv_scale as f32))?;
        let (decay, beta) = gated_delta::gates(&g.a_log, &gate_a, &gate_b, &g.dt_bias)?;
        let (y, state) = if s > 1 {
            gated_delta::chunked(&q, &k, &v, &decay, &beta, &state)?
        } else {
            gated_delta::step(&q, &k, &v, &decay, &beta, &state)?
        };
        cache.set_state(slot, vec![window, state]);
        // RMSNorm per value head, times silu(z) in float32.
        let normed = fast::rms_norm(&y, Some(&g.norm), c.rms_norm_eps)?;
        let gated =
            silu(&z.as_dtype(Dtype::Float32)?)?.multiply(normed.as_dtype(Dtype::Float32)?)?.as_dtype(y.dtype())?;
        g.out_proj.forward(&gated.reshape(&[b, s, -1])?)
    }
}

fn silu(x: &Array) -> Result<Array> {
    Ok(x.multiply(ops::sigmoid(x)?)?)
}

/// The rope on the first `rotary_dim` dimensions of each head
/// (`x * cos + rotate_half(x) * sin`), the rest passed through.
fn partial_rotary(x: &Array, (cos, sin): &(Array, Array)) -> Result<Array> {
    let rot = cos.shape()[3];
    let (turned, kept) = (x.index((Ellipsis, ..rot)), x.index((Ellipsis, rot..)));
    let (lo, hi) = (turned.index((Ellipsis, ..rot / 2)), turned.index((Ellipsis, rot / 2..)));
    let rotated = ops::concatenate(&[&ops::negative(&hi)?, &lo], -1)?;
    let embedded = turned.multiply(cos)?.add(rotated.multiply(sin)?)?.as_dtype(x.dtype())?;
    Ok(ops::concatenate(&[&embedded, &kept], -1)?)
}

impl LanguageModel for Qwen35 {
    fn architecture(&self) -> &'static str {
        "qwen3_5"
    }

    /// The attention layers: the cache's KV slots (the DeltaNet layers keep
    /// recurrent states instead).
    fn num_layers(&self) -> usize {
        self.attention_layers
    }

    fn context_length(&self) -> u32 {
        self.config.max_position_embeddings
    }

    fn embed(&self, ids: &Array) -> Result<Array> {
        self.split.lookup(&self.embed_tokens, ids)
    }

    fn forward(&self, embeds: &Array, cache: &mut KvCache, media: &MediaPositions) -> Result<Array> {
        let c = &self.config;
        let l = embeds.shape()[1];
        let rope = self.rope_cos_sin(cache, media.mrope, l, embeds.dtype())?;
        let mut h = embeds.clone();
        for layer in &self.layers {
            let x = fast::rms_norm(&h, Some(&layer.input_layernorm), c.rms_norm_eps)?;
            let r = match &layer.mixer {
                Mixer::Linear(g, slot) => self.delta_net(g, *slot, &x, cache)?,
                Mixer::Attention(a, slot) => self.attention(a, *slot, &x, cache, &rope)?,
            };
            let h2 = h.add(&r)?;
            let x = fast::rms_norm(&h2, Some(&layer.post_attention_layernorm), c.rms_norm_eps)?;
            let m = layer.down_proj.forward(&swiglu(&layer.gate_proj.forward(&x)?, &layer.up_proj.forward(&x)?)?)?;
            h = h2.add(&self.split.sum(m, self.split.mlp)?)?;
        }
        cache.offset += l;
        Ok(h)
    }

    fn logits(&self, hidden: &Array) -> Result<Array> {
        let (b, l) = (hidden.shape()[0], hidden.shape()[1]);
        let last = if l == 1 { hidden.clone() } else { hidden.index((.., l - 1..l, ..)) };
        let x = fast::rms_norm(&last, Some(&self.norm), self.config.rms_norm_eps)?;
        let logits = match &self.lm_head {
            Some(head) => head.forward(&x)?,
            None => self.embed_tokens.as_linear(&x)?,
        };
        self.split.gather_vocab(logits.reshape(&[b, -1])?)
    }

    fn recurrent(&self) -> bool {
        true
    }

    fn split_description(&self) -> Option<String> {
        self.split.describe()
    }
}
