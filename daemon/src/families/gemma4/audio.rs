//! Gemma 4's audio tower and projector, op for op like mlx-vlm 0.7.10's
//! `gemma4/audio.py` (a Universal Speech Model Conformer) and
//! `MultimodalEmbedder`: two stride-2 3x3 convolutions over the log-mel
//! (each masked, layer-normed over channels, ReLU) and a linear map — one
//! position per 40 ms; Conformer blocks (half-step feed-forward, chunked
//! local self-attention with relative positions and soft-capped logits, a
//! gated causal depthwise convolution, half-step feed-forward) whose
//! linears clamp their inputs and outputs; an output projection; then a
//! scale-free RMS norm and a linear map to the decoder's width.

use super::vision::ClippedLinear;
use crate::model::family::PreparedAudio;
use crate::model::layers::Linear;
use crate::model::weights::TensorMap;
use anyhow::{bail, Result};
use mlx_rs::{fast, nn, ops, ops::indexing::IndexOp, Array};

/// `audio_config` of a Gemma 4 checkpoint (mlx-vlm's `AudioConfig` defaults).
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
pub struct Gemma4AudioConfig {
    #[serde(default = "d_hidden")]
    pub hidden_size: i32,
    #[serde(default = "d_layers")]
    pub num_hidden_layers: usize,
    #[serde(default = "d_heads")]
    pub num_attention_heads: i32,
    #[serde(default = "d_channels")]
    pub subsampling_conv_channels: Vec<i32>,
    #[serde(default = "d_kernel")]
    pub conv_kernel_size: i32,
    #[serde(default = "d_residual")]
    pub residual_weight: f32,
    #[serde(default = "d_chunk")]
    pub attention_chunk_size: i32,
    #[serde(default = "d_left")]
    pub attention_context_left: i32,
    #[serde(default)]
    pub attention_context_right: i32,
    #[serde(default = "d_cap")]
    pub attention_logit_cap: f32,
    #[serde(default = "d_invalid")]
    pub attention_invalid_logits_value: f32,
    #[serde(default = "d_eps")]
    pub rms_norm_eps: f32,
    #[serde(default = "d_clip")]
    pub gradient_clipping: f32,
    #[serde(default = "d_output")]
    pub output_proj_dims: Option<i32>,
}

fn d_hidden() -> i32 {
    1024
}
fn d_layers() -> usize {
    12
}
fn d_heads() -> i32 {
    8
}
fn d_channels() -> Vec<i32> {
    vec![128, 32]
}
fn d_kernel() -> i32 {
    5
}
fn d_residual() -> f32 {
    0.5
}
fn d_chunk() -> i32 {
    12
}
fn d_left() -> i32 {
    13
}
fn d_cap() -> f32 {
    50.0
}
fn d_invalid() -> f32 {
    -1e9
}
fn d_eps() -> f32 {
    1e-6
}
fn d_clip() -> f32 {
    1e10
}
fn d_output() -> Option<i32> {
    Some(1536)
}

/// The mel bins the subsampling stack is built for.
const MEL_BINS: i32 = 128;

struct ConvBlock {
    /// `[out, 3, 3, in]` (MLX layout).
    weight: Array,
    norm: Array,
}

struct FeedForward {
    pre_norm: Array,
    up: ClippedLinear,
    down: ClippedLinear,
    post_norm: Array,
}

struct Attention {
    q: ClippedLinear,
    k: ClippedLinear,
    v: ClippedLinear,
    post: ClippedLinear,
    relative_k: Linear,
    per_dim_scale: Array,
}

struct LightConv {
    pre_norm: Array,
    start: ClippedLinear,
    /// `[hidden, kernel, 1]`: one filter per channel.
    depthwise: Array,
    conv_norm: Array,
    end: ClippedLinear,
}

struct Block {
    ff1: FeedForward,
    attn: Attention,
    conv: LightConv,
    ff2: FeedForward,
    norm_pre_attn: Array,
    norm_post_attn: Array,
    norm_out: Array,
}

/// The audio tower and the projector into the decoder's width.
pub struct Gemma4AudioTower {
    pub config: Gemma4AudioConfig,
    convs: [ConvBlock; 2],
    input_proj: Linear,
    blocks: Vec<Block>,
    output_proj: Option<Linear>,
    projection: Linear,
}

impl Gemma4AudioTower {
    /// Loads `audio_tower.*` and `embed_audio.*`. A PyTorch-layout
    /// checkpoint's convolutions are turned to MLX's, as mlx-vlm's
    /// `sanitize` does.
    pub fn load(config: Gemma4AudioConfig, t: &mut TensorMap) -> Result<Self> {
        if config.subsampling_conv_channels.len() != 2 {
            bail!("Gemma 4's audio tower has two subsampling convolutions, not {:?}", config.subsampling_conv_channels);
        }
        if config.hidden_size % config.num_attention_heads != 0 {
            bail!("audio hidden_size {} is not a multiple of its heads", config.hidden_size);
        }
        let sub = "audio_tower.subsample_conv_projection";
        let mut conv = |i: usize, inputs: i32| -> Result<ConvBlock> {
            let mut weight = t.float(&format!("{sub}.layer{i}.conv.weight"))?;
            if weight.ndim() == 4 && weight.shape()[3] != inputs {
                weight = weight.transpose_axes(&[0, 2, 3, 1])?;
            }
            Ok(ConvBlock { weight, norm: t.float(&format!("{sub}.layer{i}.norm.weight"))? })
        };
        let convs = [conv(0, 1)?, conv(1, config.subsampling_conv_channels[0])?];
        let input_proj = t.linear(&format!("{sub}.input_proj_linear"))?;
        let mut blocks = Vec::with_capacity(config.num_hidden_layers);
        for i in 0..config.num_hidden_layers {
            let p = format!("audio_tower.layers.{i}");
            let clipped = |t: &mut TensorMap, name: &str| ClippedLinear::load(t, &format!("{p}.{name}"), true);
            let ff = |t: &mut TensorMap, name: &str| -> Result<FeedForward> {
                Ok(FeedForward {
                    pre_norm: t.float(&format!("{p}.{name}.pre_layer_norm.weight"))?,
                    up: clipped(t, &format!("{name}.ffw_layer_1"))?,
                    down: clipped(t, &format!("{name}.ffw_layer_2"))?,
                    post_norm: t.float(&format!("{p}.{name}.post_layer_norm.weight"))?,
                })
            };
            let ff1 = ff(t, "feed_forward1")?;
            let ff2 = ff(t, "feed_forward2")?;
            let attn = Attention {
                q: clipped(t, "self_attn.q_proj")?,
                k: clipped(t, "self_attn.k_proj")?,
                v: clipped(t, "self_attn.v_proj")?,
                post: clipped(t, "self_attn.post")?,
                relative_k: t.linear(&format!("{p}.self_attn.relative_k_proj"))?,
                per_dim_scale: t.float(&format!("{p}.self_attn.per_dim_scale"))?,
            };
            let mut depthwise = t.float(&format!("{p}.lconv1d.depthwise_conv1d.weight"))?;
            if depthwise.ndim() == 3 && depthwise.shape()[2] != 1 {
                depthwise = depthwise.transpose_axes(&[0, 2, 1])?;
            }
            let conv = LightConv {
                pre_norm: t.float(&format!("{p}.lconv1d.pre_layer_norm.weight"))?,
                start: clipped(t, "lconv1d.linear_start")?,
                depthwise,
                conv_norm: t.float(&format!("{p}.lconv1d.conv_norm.weight"))?,
                end: clipped(t, "lconv1d.linear_end")?,
            };
            let norm = |t: &mut TensorMap, n: &str| t.float(&format!("{p}.{n}.weight"));
            blocks.push(Block {
                ff1,
                attn,
                conv,
                ff2,
                norm_pre_attn: norm(t, "norm_pre_attn")?,
                norm_post_attn: norm(t, "norm_post_attn")?,
                norm_out: norm(t, "norm_out")?,
            });
        }
        let output_proj = match config.output_proj_dims {
            Some(_) => Some(t.linear("audio_tower.output_proj")?),
            None => None,
        };
        let projection = t.linear("embed_audio.embedding_projection")?;
        Ok(Self { config, convs, input_proj, blocks, output_proj, projection })
    }

    /// Soft tokens `[tokens, text_hidden]` of one prepared clip.
    pub fn encode(&self, audio: &PreparedAudio) -> Result<Array> {
        if audio.bins != MEL_BINS as usize || audio.values.len() != audio.frames * audio.bins {
            bail!("Gemma 4's audio tower takes {MEL_BINS}-bin frames, not {} bins", audio.bins);
        }
        let c = &self.config;
        let mel = Array::from_slice(&audio.values, &[1, audio.frames as i32, MEL_BINS, 1]);
        // Invalid (padding) positions per time step, halved by each stride.
        let mut invalid: Vec<bool> = (0..audio.frames).map(|f| f >= audio.valid_frames).collect();
        let mut x = mel;
        for conv in &self.convs {
            let mask = Array::from_slice(&invalid, &[1, invalid.len() as i32, 1, 1]);
            x = ops::select(&mask, Array::from_f32(0.0), &x)?;
            x = ops::conv2d(&x, &conv.weight, (2, 2), (1, 1), None, None)?;
            let t_out = x.shape()[1] as usize;
            invalid = invalid.iter().step_by(2).take(t_out).copied().collect();
            x = nn::relu(fast::layer_norm(&x, Some(&conv.norm), None, c.rms_norm_eps)?)?;
        }
        let s = x.shape().to_vec();
        let (t, width) = (s[1], s[2] * s[3]);
        let mut x = self.input_proj.forward(&x.reshape(&[1, t, width])?)?;
        let invalid_t = Array::from_slice(&invalid, &[1, t]);
        let valid_rows =
            Array::from_slice(&invalid.iter().map(|&b| if b { 0.0 } else { 1.0 }).collect::<Vec<f32>>(), &[1, t, 1]);
        let context_valid = self.context_valid(&invalid)?;
        let local = self.local_mask()?;
        for b in &self.blocks {
            x = self.feed_forward(&b.ff1, &x)?;
            let residual = x.clone();
            let y = fast::rms_norm(self.clip(&x)?, Some(&b.norm_pre_attn), 1e-6)?;
            let y = self.attend(&b.attn, &y, &context_valid, &local)?;
            let y = fast::rms_norm(self.clip(&y)?, Some(&b.norm_post_attn), 1e-6)?;
            x = residual.add(y)?.multiply(&valid_rows)?;
            x = self.light_conv(&b.conv, &x)?;
            x = self.feed_forward(&b.ff2, &x)?;
            x = fast::rms_norm(self.clip(&x)?, Some(&b.norm_out), 1e-6)?;
        }
        if let Some(out) = &self.output_proj {
            x = out.forward(&x)?;
        }
        let x = ops::select(&invalid_t.reshape(&[1, t, 1])?, Array::from_f32(0.0), &x)?;
        let tokens = audio.tokens as i32;
        if tokens > t {
            bail!("a clip of {tokens} soft tokens gave the audio tower only {t} positions");
        }
        let x = x.index((0, ..tokens, ..));
        self.projection.forward(&fast::rms_norm(&x, None::<&Array>, c.rms_norm_eps)?)
    }

    fn clip(&self, x: &Array) -> Result<Array> {
        let g = self.config.gradient_clipping;
        Ok(ops::clip(x, (Array::from_f32(-g), Array::from_f32(g)))?)
    }

    fn feed_forward(&self, f: &FeedForward, x: &Array) -> Result<Array> {
        let y = fast::rms_norm(self.clip(x)?, Some(&f.pre_norm), 1e-6)?;
        let y = f.down.forward(&nn::silu(f.up.forward(&y)?)?)?;
        let y = fast::rms_norm(self.clip(&y)?, Some(&f.post_norm), 1e-6)?;
        Ok(x.add(y.multiply(Array::from_f32(self.config.residual_weight))?)?)
    }

    fn light_conv(&self, l: &LightConv, x: &Array) -> Result<Array> {
        let c = &self.config;
        let y = l.start.forward(&fast::rms_norm(x, Some(&l.pre_norm), c.rms_norm_eps)?)?;
        let half = y.shape()[2] / 2;
        let y = y.index((.., .., ..half)).multiply(ops::sigmoid(y.index((.., .., half..)))?)?;
        // Causal: kernel - 1 zeros in front.
        let front = ops::zeros::<f32>(&[1, c.conv_kernel_size - 1, half])?;
        let y = ops::concatenate(&[front, y], 1)?;
        let y = ops::conv1d(&y, &l.depthwise, None, None, None, half)?;
        let y = fast::rms_norm(self.clip(&y)?, Some(&l.conv_norm), c.rms_norm_eps)?;
        Ok(l.end.forward(&nn::silu(y)?)?.add(x)?)
    }

    /// The chunk geometry: (chunk, past horizon, future horizon, context).
    fn geometry(&self) -> (i32, i32, i32, i32) {
        let c = &self.config;
        let (w, p, f) = (c.attention_chunk_size, (c.attention_context_left - 1).max(0), c.attention_context_right);
        (w, p, f, w + p + f)
    }

    /// `[chunk, context]`: which context slots a query of a chunk may see
    /// (strictly within the past and future horizons), mlx-vlm's
    /// `_build_causal_valid_mask`.
    fn local_mask(&self) -> Result<Array> {
        let (w, p, f, ctx) = self.geometry();
        let mut m = Vec::with_capacity((w * ctx) as usize);
        for q in 0..w {
            for k in 0..ctx {
                let dist = q + p - k;
                m.push((dist >= 0 && dist < p) || (dist < 0 && -dist < f));
            }
        }
        Ok(Array::from_slice(&m, &[w, ctx]))
    }

    /// `[blocks, context]`: which context slots of each query block hold a
    /// valid position (the time axis padded by the horizons).
    fn context_valid(&self, invalid: &[bool]) -> Result<Array> {
        let (w, p, f, ctx) = self.geometry();
        let t = invalid.len() as i32;
        let padded = t + p + f + w - 1;
        let blocks = (padded - ctx) / w + 1;
        let mut m = Vec::with_capacity((blocks * ctx) as usize);
        for u in 0..blocks {
            for k in 0..ctx {
                let i = u * w + k - p;
                m.push(i >= 0 && i < t && !invalid[i as usize]);
            }
        }
        Ok(Array::from_slice(&m, &[blocks, ctx]))
    }

    /// `x` `[1, T, ...]` gathered into `[1, blocks, context, ...]` windows
    /// (zeros past either end): mlx-vlm's `_extract_block_context`.
    fn windows(&self, x: &Array) -> Result<Array> {
        let (w, p, f, ctx) = self.geometry();
        let s = x.shape().to_vec();
        let mut rest = s[2..].to_vec();
        let zeros = |n: i32| -> Result<Array> {
            let mut shape = vec![1, n];
            shape.append(&mut rest.clone());
            Ok(ops::zeros::<f32>(&shape)?)
        };
        let padded = ops::concatenate(&[zeros(p)?, x.clone(), zeros(f + w - 1)?], 1)?;
        let blocks = (padded.shape()[1] - ctx) / w + 1;
        let idx: Vec<i32> = (0..blocks).flat_map(|u| (0..ctx).map(move |k| u * w + k)).collect();
        let gathered = padded.take_axis(Array::from_slice(&idx, &[blocks * ctx]), 1)?;
        let mut shape = vec![1, blocks, ctx];
        shape.append(&mut rest);
        Ok(gathered.reshape(&shape)?)
    }

    /// Chunked local attention with relative positions (`AudioAttention`).
    fn attend(&self, a: &Attention, x: &Array, context_valid: &Array, local: &Array) -> Result<Array> {
        let c = &self.config;
        let (w, p, f, ctx) = self.geometry();
        let t = x.shape()[1];
        let (n, h) = (c.num_attention_heads, c.hidden_size / c.num_attention_heads);
        let split = |y: Array| y.reshape(&[1, t, n, h]);
        let q_scale = (h as f32).powf(-0.5) / std::f32::consts::LN_2;
        let k_scale = (1.0 + std::f32::consts::E).ln() / std::f32::consts::LN_2;
        let q =
            split(a.q.forward(x)?)?.multiply(nn::softplus(&a.per_dim_scale)?.multiply(Array::from_f32(q_scale))?)?;
        let k = split(a.k.forward(x)?)?.multiply(Array::from_f32(k_scale))?;
        let v = split(a.v.forward(x)?)?;
        // Queries in chunks [1, U, W, N, H]; keys and values in windows [1, U, C, N, H].
        let blocks = (t + w - 1) / w;
        let q = ops::concatenate(&[q, ops::zeros::<f32>(&[1, blocks * w - t, n, h])?], 1)?
            .reshape(&[1, blocks, w, n, h])?;
        let kb = self.windows(&k)?;
        let vb = self.windows(&v)?;
        // Content term [1, N, U, W, C].
        let qp = q.transpose_axes(&[0, 3, 1, 2, 4])?;
        let ac = ops::matmul(&qp, kb.transpose_axes(&[0, 3, 1, 4, 2])?)?;
        // Position term: offsets p, p-1, ..., -f through sinusoids and relative_k.
        let span = p + f + 1;
        let half = c.hidden_size / 2;
        let increment = (10000f64).ln() / ((half - 1).max(1) as f64);
        let inv =
            ops::exp(ops::arange::<_, f32>(0.0, half as f32, 1.0)?.multiply(Array::from_f32(-increment as f32))?)?;
        let offsets: Vec<f32> = (0..span).map(|i| (p - i) as f32).collect();
        let scaled = Array::from_slice(&offsets, &[span, 1]).multiply(inv.reshape(&[1, half])?)?;
        let signal = ops::concatenate(&[ops::sin(&scaled)?, ops::cos(&scaled)?], 1)?;
        let rel = a.relative_k.forward(&signal)?.reshape(&[span, n, h])?.transpose_axes(&[1, 2, 0])?;
        let bd = ops::matmul(qp.reshape(&[1, n, blocks * w, h])?, &rel)?.reshape(&[1, n, blocks, w, span])?;
        // Relative shift: pad to C + 1, flatten, keep W * C, fold back.
        let bd = ops::concatenate(&[bd, ops::zeros::<f32>(&[1, n, blocks, w, ctx + 1 - span])?], 4)?
            .reshape(&[1, n, blocks, w * (ctx + 1)])?
            .index((.., .., .., ..w * ctx))
            .reshape(&[1, n, blocks, w, ctx])?;
        let cap = Array::from_f32(c.attention_logit_cap);
        let logits = ops::tanh(ac.add(bd)?.divide(&cap)?)?.multiply(&cap)?;
        let allowed =
            context_valid.reshape(&[1, 1, blocks, 1, ctx])?.logical_and(local.reshape(&[1, 1, 1, w, ctx])?)?;
        let logits = ops::select(&allowed, &logits, Array::from_f32(c.attention_invalid_logits_value))?;
        let probs = ops::softmax_axis(&logits, -1, None)?;
        // [1, N, U, W, C] @ [1, N, U, C, H] → [1, U, W, N, H].
        let context = ops::matmul(&probs, vb.transpose_axes(&[0, 3, 1, 2, 4])?)?.transpose_axes(&[0, 2, 3, 1, 4])?;
        let context = context.reshape(&[1, blocks * w, n * h])?.index((.., ..t, ..));
        a.post.forward(&context)
    }
}
