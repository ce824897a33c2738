//! Whisper's encoder (the audio tower) and text decoder, op for op as
//! mlx-whisper 0.4.3 writes them (`whisper.py`), so greedy ids match it:
//! attention scales q and k by `d_head^-0.25` each and takes a precise
//! softmax; the decoder's causal mask is additive `-1e9`; GELU is exact.
//! Weights load from the Hugging Face names; mlx-whisper's names are
//! mapped onto them first ([`hf_name`]).

use super::config::WhisperConfig;
use crate::model::layers::{Embedding, LayerNorm, Linear};
use crate::model::weights::TensorMap;
use anyhow::{Context, Result};
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{nn, ops, Array, Dtype};

/// Whisper's LayerNorm epsilon (PyTorch's and MLX's default).
const LAYER_NORM_EPS: f32 = 1e-5;

struct Attention {
    query: Linear,
    key: Linear,
    value: Linear,
    out: Linear,
    heads: i32,
}

impl Attention {
    fn load(t: &mut TensorMap, prefix: &str, heads: i32) -> Result<Self> {
        Ok(Self {
            query: t.linear(&format!("{prefix}.q_proj"))?,
            key: t.linear(&format!("{prefix}.k_proj"))?,
            value: t.linear(&format!("{prefix}.v_proj"))?,
            out: t.linear(&format!("{prefix}.out_proj"))?,
            heads,
        })
    }

    /// `softmax(q k^T + mask) v` as mlx-whisper's `qkv_attention` computes it.
    fn attend(&self, q: &Array, k: &Array, v: &Array, mask: Option<&Array>) -> Result<Array> {
        let (b, l, d) = (q.shape()[0], q.shape()[1], q.shape()[2]);
        let h = self.heads;
        let scale = Array::from_f32(((d / h) as f32).powf(-0.25));
        let q = q.reshape(&[b, l, h, -1])?.transpose_axes(&[0, 2, 1, 3])?.multiply(&scale)?;
        let k = k.reshape(&[b, k.shape()[1], h, -1])?.transpose_axes(&[0, 2, 3, 1])?.multiply(&scale)?;
        let v = v.reshape(&[b, v.shape()[1], h, -1])?.transpose_axes(&[0, 2, 1, 3])?;
        let mut qk = q.matmul(&k)?;
        if let Some(m) = mask {
            qk = qk.add(m)?;
        }
        let w = ops::softmax_axis(&qk, -1, true)?;
        Ok(w.matmul(&v)?.transpose_axes(&[0, 2, 1, 3])?.reshape(&[b, l, d])?)
    }
}

struct Mlp {
    norm: LayerNorm,
    fc1: Linear,
    fc2: Linear,
}

impl Mlp {
    fn load(t: &mut TensorMap, prefix: &str) -> Result<Self> {
        Ok(Self {
            norm: LayerNorm::load(t, &format!("{prefix}.final_layer_norm"), LAYER_NORM_EPS)?,
            fc1: t.linear(&format!("{prefix}.fc1"))?,
            fc2: t.linear(&format!("{prefix}.fc2"))?,
        })
    }
    fn residual(&self, x: &Array) -> Result<Array> {
        Ok(x.add(&self.fc2.forward(&nn::gelu(self.fc1.forward(&self.norm.forward(x)?)?)?)?)?)
    }
}

struct EncoderLayer {
    norm: LayerNorm,
    attn: Attention,
    mlp: Mlp,
}

/// The audio tower: two convolutions, sinusoidal positions, pre-norm layers.
pub struct Encoder {
    conv1: (Array, Array),
    conv2: (Array, Array),
    positions: Array,
    layers: Vec<EncoderLayer>,
    norm: LayerNorm,
}

/// A conv weight in MLX's `[out, k, in]` (PyTorch and HF store `[out, in, k]`).
fn conv_weight(t: &mut TensorMap, name: &str) -> Result<Array> {
    let w = t.float(name)?;
    Ok(if w.shape()[2] != 3 { w } else { w.transpose_axes(&[0, 2, 1])? })
}

/// Whisper's sinusoidal position table (mlx-whisper's `sinusoids`).
fn sinusoids(length: i32, channels: i32) -> Result<Array> {
    let inc = (10_000f32).ln() / (channels / 2 - 1) as f32;
    let inv = ops::arange::<_, f32>(None, channels / 2, None)?.multiply(Array::from_f32(-inc))?.exp()?;
    let t = ops::arange::<_, f32>(None, length, None)?.reshape(&[length, 1])?.multiply(inv.reshape(&[1, -1])?)?;
    Ok(ops::concatenate(&[t.sin()?, t.cos()?], 1)?)
}

impl Encoder {
    fn load(c: &WhisperConfig, t: &mut TensorMap) -> Result<Self> {
        let p = "model.encoder";
        let mut layers = Vec::new();
        for i in 0..c.audio_layers {
            let l = format!("{p}.layers.{i}");
            layers.push(EncoderLayer {
                norm: LayerNorm::load(t, &format!("{l}.self_attn_layer_norm"), LAYER_NORM_EPS)?,
                attn: Attention::load(t, &format!("{l}.self_attn"), c.audio_heads)?,
                mlp: Mlp::load(t, &l)?,
            });
        }
        // mlx-whisper computes the table; HF checkpoints store the same one.
        let positions = match t.has(&format!("{p}.embed_positions.weight")) {
            true => t.float(&format!("{p}.embed_positions.weight"))?,
            false => sinusoids(c.audio_ctx, c.audio_state)?.as_dtype(t.float_dtype())?,
        };
        Ok(Self {
            conv1: (conv_weight(t, &format!("{p}.conv1.weight"))?, t.float(&format!("{p}.conv1.bias"))?),
            conv2: (conv_weight(t, &format!("{p}.conv2.weight"))?, t.float(&format!("{p}.conv2.bias"))?),
            positions,
            layers,
            norm: LayerNorm::load(t, &format!("{p}.layer_norm"), LAYER_NORM_EPS)?,
        })
    }

    /// One window's log-mel `[1, 3000, n_mels]` → features `[1, 1500, d]`.
    pub fn forward(&self, mel: &Array) -> Result<Array> {
        let x = nn::gelu(ops::conv1d(mel, &self.conv1.0, 1, 1, 1, 1)?.add(&self.conv1.1)?)?;
        let x = nn::gelu(ops::conv1d(&x, &self.conv2.0, 2, 1, 1, 1)?.add(&self.conv2.1)?)?;
        let mut x = x.add(&self.positions)?;
        for l in &self.layers {
            let y = l.norm.forward(&x)?;
            let (q, k, v) = (l.attn.query.forward(&y)?, l.attn.key.forward(&y)?, l.attn.value.forward(&y)?);
            x = x.add(&l.attn.out.forward(&l.attn.attend(&q, &k, &v, None)?)?)?;
            x = l.mlp.residual(&x)?;
        }
        self.norm.forward(&x)
    }
}

struct DecoderLayer {
    self_norm: LayerNorm,
    self_attn: Attention,
    cross_norm: LayerNorm,
    cross_attn: Attention,
    mlp: Mlp,
}

/// The text decoder: token and learned position embeddings, layers with
/// self- and cross-attention, the tied output head.
pub struct Decoder {
    tokens: Embedding,
    positions: Array,
    layers: Vec<DecoderLayer>,
    norm: LayerNorm,
    /// Longest token sequence (positions in the table).
    pub context: usize,
}

/// The cross-attention keys and values of one window's features, per layer
/// (computed once per window, as mlx-whisper's kv cache holds them).
pub struct CrossKv(Vec<(Array, Array)>);

/// Self-attention keys and values so far, per layer.
#[derive(Default)]
pub struct SelfKv(Vec<(Array, Array)>);

impl SelfKv {
    /// Positions already decoded.
    pub fn len(&self) -> i32 {
        self.0.first().map_or(0, |(k, _)| k.shape()[1])
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Decoder {
    fn load(c: &WhisperConfig, t: &mut TensorMap) -> Result<Self> {
        let p = "model.decoder";
        let mut layers = Vec::new();
        for i in 0..c.text_layers {
            let l = format!("{p}.layers.{i}");
            layers.push(DecoderLayer {
                self_norm: LayerNorm::load(t, &format!("{l}.self_attn_layer_norm"), LAYER_NORM_EPS)?,
                self_attn: Attention::load(t, &format!("{l}.self_attn"), c.text_heads)?,
                cross_norm: LayerNorm::load(t, &format!("{l}.encoder_attn_layer_norm"), LAYER_NORM_EPS)?,
                cross_attn: Attention::load(t, &format!("{l}.encoder_attn"), c.text_heads)?,
                mlp: Mlp::load(t, &l)?,
            });
        }
        Ok(Self {
            tokens: t.embedding(&format!("{p}.embed_tokens"))?,
            positions: t.float(&format!("{p}.embed_positions.weight"))?,
            layers,
            norm: LayerNorm::load(t, &format!("{p}.layer_norm"), LAYER_NORM_EPS)?,
            context: c.text_ctx,
        })
    }

    /// The cross-attention keys and values of `features` `[1, 1500, d]`.
    pub fn cross_kv(&self, features: &Array) -> Result<CrossKv> {
        let kv = self
            .layers
            .iter()
            .map(|l| Ok((l.cross_attn.key.forward(features)?, l.cross_attn.value.forward(features)?)))
            .collect::<Result<_>>()?;
        Ok(CrossKv(kv))
    }

    /// Logits `[1, L, vocab]` (f32) of `ids` `[1, L]` at the next positions
    /// of `cache`, which grows by `L`.
    pub fn forward(&self, ids: &Array, cross: &CrossKv, cache: &mut SelfKv) -> Result<Array> {
        let offset = cache.len();
        let l = ids.shape()[1];
        let mut x = self.tokens.lookup(ids)?.add(self.positions.index(offset..offset + l))?;
        // mlx-whisper slices its causal mask to the query length: one new
        // token sees everything, a first call of L tokens is causal.
        let mask = (l > 1).then(|| causal_mask(l)).transpose()?;
        let first = cache.0.is_empty();
        for (i, layer) in self.layers.iter().enumerate() {
            let y = layer.self_norm.forward(&x)?;
            let a = &layer.self_attn;
            let (q, mut k, mut v) = (a.query.forward(&y)?, a.key.forward(&y)?, a.value.forward(&y)?);
            if !first {
                let (pk, pv) = &cache.0[i];
                k = ops::concatenate(&[pk, &k], 1)?;
                v = ops::concatenate(&[pv, &v], 1)?;
            }
            x = x.add(&a.out.forward(&a.attend(&q, &k, &v, mask.as_ref())?)?)?;
            if first {
                cache.0.push((k, v));
            } else {
                cache.0[i] = (k, v);
            }
            let y = layer.cross_norm.forward(&x)?;
            let c = &layer.cross_attn;
            let (ck, cv) = &cross.0[i];
            x = x.add(&c.out.forward(&c.attend(&c.query.forward(&y)?, ck, cv, None)?)?)?;
            x = layer.mlp.residual(&x)?;
        }
        let x = self.norm.forward(&x)?;
        Ok(self.tokens.as_linear(&x)?.as_dtype(Dtype::Float32)?)
    }
}

/// `nn.MultiHeadAttention.create_additive_causal_mask(l)`: -1e9 above the diagonal.
fn causal_mask(l: i32) -> Result<Array> {
    let i = ops::arange::<_, i32>(None, l, None)?;
    let above = i.reshape(&[l, 1])?.lt(i.reshape(&[1, l])?)?;
    Ok(above.as_dtype(Dtype::Float32)?.multiply(Array::from_f32(-1e9))?)
}

/// Encoder and decoder of one checkpoint.
pub struct WhisperNet {
    pub encoder: Encoder,
    pub decoder: Decoder,
}

impl WhisperNet {
    /// Builds both halves from `t` (HF names).
    pub fn load(c: &WhisperConfig, t: &mut TensorMap) -> Result<Self> {
        let encoder = Encoder::load(c, t).context("the encoder's weights")?;
        let decoder = Decoder::load(c, t).context("the decoder's weights")?;
        Ok(Self { encoder, decoder })
    }

    /// Every weight array (to evaluate at load, and to fingerprint).
    pub fn eval(&self) -> Result<()> {
        let mut all: Vec<&Array> = vec![&self.encoder.conv1.0, &self.encoder.conv2.0, &self.encoder.positions];
        for l in &self.encoder.layers {
            all.extend(l.attn.query.arrays());
            all.extend(l.mlp.fc1.arrays());
        }
        all.push(&self.decoder.positions);
        mlx_rs::transforms::eval(all)?;
        Ok(())
    }
}

/// mlx-whisper's tensor name for HF's: `encoder.blocks.0.attn.query.weight`
/// → `model.encoder.layers.0.self_attn.q_proj.weight`.
pub fn hf_name(mlx: &str) -> String {
    const RENAMES: &[(&str, &str)] = &[
        (".blocks.", ".layers."),
        (".cross_attn_ln.", ".encoder_attn_layer_norm."),
        (".attn_ln.", ".self_attn_layer_norm."),
        (".cross_attn.", ".encoder_attn."),
        (".attn.", ".self_attn."),
        (".query.", ".q_proj."),
        (".key.", ".k_proj."),
        (".value.", ".v_proj."),
        (".out.", ".out_proj."),
        (".mlp_ln.", ".final_layer_norm."),
        (".mlp1.", ".fc1."),
        (".mlp2.", ".fc2."),
        ("encoder.ln_post.", "encoder.layer_norm."),
        ("decoder.ln.", "decoder.layer_norm."),
        ("decoder.token_embedding.", "decoder.embed_tokens."),
    ];
    let mut n = format!(".{mlx}");
    for (from, to) in RENAMES {
        n = n.replace(from, to);
    }
    let n = n.trim_start_matches('.');
    if n == "decoder.positional_embedding" {
        return "model.decoder.embed_positions.weight".into();
    }
    format!("model.{n}")
}

#[cfg(test)]
mod tests {
    #[test]
    fn mlx_whisper_names_map_to_hf_names() {
        for (mlx, hf) in [
            ("encoder.blocks.0.attn.query.weight", "model.encoder.layers.0.self_attn.q_proj.weight"),
            ("decoder.blocks.3.cross_attn.key.weight", "model.decoder.layers.3.encoder_attn.k_proj.weight"),
            ("decoder.blocks.3.cross_attn_ln.bias", "model.decoder.layers.3.encoder_attn_layer_norm.bias"),
            ("encoder.blocks.1.mlp2.scales", "model.encoder.layers.1.fc2.scales"),
            ("encoder.ln_post.weight", "model.encoder.layer_norm.weight"),
            ("decoder.token_embedding.weight", "model.decoder.embed_tokens.weight"),
            ("decoder.positional_embedding", "model.decoder.embed_positions.weight"),
            ("encoder.conv1.weight", "model.encoder.conv1.weight"),
        ] {
            assert_eq!(super::hf_name(mlx), hf);
        }
    }
}
