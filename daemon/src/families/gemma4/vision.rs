//! Gemma 4's vision tower and projector, op for op like mlx-vlm 0.7.10's
//! `gemma4/vision.py` and `MultimodalEmbedder`: 16-pixel patches through a
//! linear map, a learned position table per axis, pre/post-normed blocks
//! whose linears clamp their inputs and outputs (bounds stored in the
//! weights) with q/k norms, a scale-free v norm and 2-D rope (half the
//! head rotated by the column, half by the row), full attention, a 3x3
//! average pool times sqrt(hidden); then a scale-free RMS norm and a linear
//! map to the decoder's width.

use super::processor::Gemma4Preprocess;
use crate::model::family::{LanguageModel, Prepared, PreparedAudio, VisionTower};
use crate::model::layers::Linear;
use crate::model::weights::TensorMap;
use anyhow::{bail, Result};
use mlx_rs::{fast, nn, ops, ops::indexing::IndexOp, Array};

/// `vision_config` of a Gemma 4 checkpoint (mlx-vlm's `VisionConfig` defaults).
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
pub struct Gemma4VisionConfig {
    #[serde(default = "d_hidden")]
    pub hidden_size: i32,
    #[serde(default = "d_layers")]
    pub num_hidden_layers: i32,
    #[serde(default = "d_heads")]
    pub num_attention_heads: i32,
    #[serde(default = "d_heads")]
    pub num_key_value_heads: i32,
    #[serde(default = "d_head_dim")]
    pub head_dim: i32,
    #[serde(default = "d_eps")]
    pub rms_norm_eps: f32,
    #[serde(default = "d_patch")]
    pub patch_size: i32,
    #[serde(default = "d_pool")]
    pub pooling_kernel_size: i32,
    #[serde(default = "d_output")]
    pub default_output_length: u32,
    #[serde(default)]
    pub use_clipped_linears: bool,
    #[serde(default)]
    pub standardize: bool,
    #[serde(default)]
    pub rope_parameters: Option<serde_json::Value>,
}

fn d_hidden() -> i32 {
    768
}
fn d_layers() -> i32 {
    16
}
fn d_heads() -> i32 {
    12
}
fn d_head_dim() -> i32 {
    64
}
fn d_eps() -> f32 {
    1e-6
}
fn d_patch() -> i32 {
    16
}
fn d_pool() -> i32 {
    3
}
fn d_output() -> u32 {
    280
}

/// A linear whose input and output are clamped to bounds stored beside it
/// (`input_min`, ...), as Gemma 4's `ClippableLinear`.
pub(super) struct ClippedLinear {
    linear: Linear,
    input: Option<(Array, Array)>,
    output: Option<(Array, Array)>,
}

impl ClippedLinear {
    pub(super) fn load(t: &mut TensorMap, prefix: &str, clipped: bool) -> Result<Self> {
        let mut bounds = |lo: &str, hi: &str| -> Result<Option<(Array, Array)>> {
            let (lo, hi) = (format!("{prefix}.{lo}"), format!("{prefix}.{hi}"));
            Ok(if clipped && t.has(&lo) && t.has(&hi) { Some((t.float(&lo)?, t.float(&hi)?)) } else { None })
        };
        let input = bounds("input_min", "input_max")?;
        let output = bounds("output_min", "output_max")?;
        Ok(Self { linear: t.linear(&format!("{prefix}.linear"))?, input, output })
    }

    pub(super) fn forward(&self, x: &Array) -> Result<Array> {
        let clamp = |x: Array, b: &Option<(Array, Array)>| -> Result<Array> {
            Ok(match b {
                Some((lo, hi)) => ops::minimum(ops::maximum(&x, lo)?, hi)?,
                None => x,
            })
        };
        clamp(self.linear.forward(&clamp(x.clone(), &self.input)?)?, &self.output)
    }
}

struct Block {
    q: ClippedLinear,
    k: ClippedLinear,
    v: ClippedLinear,
    o: ClippedLinear,
    q_norm: Array,
    k_norm: Array,
    gate: ClippedLinear,
    up: ClippedLinear,
    down: ClippedLinear,
    input_norm: Array,
    post_attn_norm: Array,
    pre_ff_norm: Array,
    post_ff_norm: Array,
}

/// The tower and the projector into the decoder's width.
pub struct Gemma4Tower {
    pub config: Gemma4VisionConfig,
    input_proj: Linear,
    /// `[2, positions, hidden]`: the column's row, the row's row.
    position_table: Array,
    blocks: Vec<Block>,
    standardize: Option<(Array, Array)>,
    projection: Linear,
    rope_base: f32,
    pub image_token_id: u32,
    /// Set by the loader when the checkpoint takes video: its frames'
    /// token (each frame a run of it).
    pub video_token_id: Option<u32>,
    /// Set by the loader when the checkpoint hears: its audio tower and
    /// the token its soft tokens take.
    pub audio: Option<(super::audio::Gemma4AudioTower, u32)>,
    /// The decoder's width (rows of spliced features).
    pub text_hidden: i32,
}

impl Gemma4Tower {
    /// Loads `vision_tower.*` and `embed_vision.*`.
    pub fn load(config: Gemma4VisionConfig, text_hidden: i32, image_token_id: u32, t: &mut TensorMap) -> Result<Self> {
        if config.head_dim % 4 != 0 {
            bail!("Gemma 4's 2-D rope needs a head size divisible by 4 (vision head_dim {})", config.head_dim);
        }
        let clip = config.use_clipped_linears;
        let mut blocks = Vec::new();
        for i in 0..config.num_hidden_layers {
            let p = format!("vision_tower.encoder.layers.{i}");
            let mut lin = |n: &str| ClippedLinear::load(t, &format!("{p}.{n}"), clip);
            blocks.push(Block {
                q: lin("self_attn.q_proj")?,
                k: lin("self_attn.k_proj")?,
                v: lin("self_attn.v_proj")?,
                o: lin("self_attn.o_proj")?,
                gate: lin("mlp.gate_proj")?,
                up: lin("mlp.up_proj")?,
                down: lin("mlp.down_proj")?,
                q_norm: t.float(&format!("{p}.self_attn.q_norm.weight"))?,
                k_norm: t.float(&format!("{p}.self_attn.k_norm.weight"))?,
                input_norm: t.float(&format!("{p}.input_layernorm.weight"))?,
                post_attn_norm: t.float(&format!("{p}.post_attention_layernorm.weight"))?,
                pre_ff_norm: t.float(&format!("{p}.pre_feedforward_layernorm.weight"))?,
                post_ff_norm: t.float(&format!("{p}.post_feedforward_layernorm.weight"))?,
            });
        }
        let standardize = if config.standardize {
            Some((t.float("vision_tower.std_bias")?, t.float("vision_tower.std_scale")?))
        } else {
            None
        };
        let rope_base =
            config.rope_parameters.as_ref().and_then(|p| p.get("rope_theta")).and_then(|v| v.as_f64()).unwrap_or(100.0)
                as f32;
        Ok(Self {
            input_proj: t.linear("vision_tower.patch_embedder.input_proj")?,
            position_table: t.float("vision_tower.patch_embedder.position_embedding_table")?,
            blocks,
            standardize,
            projection: t.linear("embed_vision.embedding_projection")?,
            rope_base,
            image_token_id,
            video_token_id: None,
            audio: None,
            text_hidden,
            config,
        })
    }

    /// Soft tokens `[rows, text_hidden]` of pixels `[1, 3, H, W]` in [0, 1]
    /// (H and W whole multiples of patch × pool, as the processor makes them).
    pub fn encode_pixels(&self, pixels: &Array) -> Result<Array> {
        let c = &self.config;
        let (p, k) = (c.patch_size, c.pooling_kernel_size);
        let s = pixels.shape();
        if s.len() != 4 || s[0] != 1 || s[1] != 3 || s[2] % (p * k) != 0 || s[3] % (p * k) != 0 {
            bail!("Gemma 4's tower takes [1, 3, H, W] with H and W multiples of {}, not {s:?}", p * k);
        }
        let (ph, pw) = (s[2] / p, s[3] / p);
        let n = ph * pw;
        let patches =
            pixels.reshape(&[1, 3, ph, p, pw, p])?.transpose_axes(&[0, 2, 4, 3, 5, 1])?.reshape(&[1, n, 3 * p * p])?;
        let patches = patches.subtract(Array::from_f32(0.5))?.multiply(Array::from_f32(2.0))?;
        // Patch i sits at column i % pw, row i / pw.
        let cols: Vec<i32> = (0..n).map(|i| i % pw).collect();
        let rows: Vec<i32> = (0..n).map(|i| i / pw).collect();
        let table_len = self.position_table.shape()[1];
        if pw > table_len || ph > table_len {
            bail!("an image of {ph}x{pw} patches is past the position table ({table_len})");
        }
        let (cols, rows) = (Array::from_slice(&cols, &[n]), Array::from_slice(&rows, &[n]));
        let by_col = self.position_table.index(0).take_axis(&cols, 0)?;
        let by_row = self.position_table.index(1).take_axis(&rows, 0)?;
        let mut x = self.input_proj.forward(&patches)?.add(by_col.add(&by_row)?)?;
        let (cos, sin) = self.rope_tables(&cols, &rows)?;
        let (heads, hd, eps) = (c.num_attention_heads, c.head_dim, c.rms_norm_eps);
        for b in &self.blocks {
            let y = fast::rms_norm(&x, Some(&b.input_norm), eps)?;
            let split = |a: Array, h: i32| a.reshape(&[1, n, h, hd]);
            let q = fast::rms_norm(split(b.q.forward(&y)?, heads)?, Some(&b.q_norm), eps)?;
            let kk = fast::rms_norm(split(b.k.forward(&y)?, c.num_key_value_heads)?, Some(&b.k_norm), eps)?;
            let v = fast::rms_norm(split(b.v.forward(&y)?, c.num_key_value_heads)?, None::<&Array>, eps)?;
            let q = rotate_2d(&q, &cos, &sin)?.transpose_axes(&[0, 2, 1, 3])?;
            let kk = rotate_2d(&kk, &cos, &sin)?.transpose_axes(&[0, 2, 1, 3])?;
            let v = v.transpose_axes(&[0, 2, 1, 3])?;
            let o = fast::scaled_dot_product_attention(&q, &kk, &v, 1.0, None, None)?;
            let o = o.transpose_axes(&[0, 2, 1, 3])?.reshape(&[1, n, heads * hd])?;
            let h2 = x.add(fast::rms_norm(b.o.forward(&o)?, Some(&b.post_attn_norm), eps)?)?;
            let y = fast::rms_norm(&h2, Some(&b.pre_ff_norm), eps)?;
            let m = b.down.forward(&nn::gelu_approximate(b.gate.forward(&y)?)?.multiply(b.up.forward(&y)?)?)?;
            x = h2.add(fast::rms_norm(&m, Some(&b.post_ff_norm), eps)?)?;
        }
        // k x k average pool over the patch grid, pooled cells row-major.
        let d = c.hidden_size;
        let pooled = x
            .reshape(&[ph / k, k, pw / k, k, d])?
            .mean_axes(&[1, 3], None)?
            .reshape(&[(ph / k) * (pw / k), d])?
            .multiply(Array::from_f32((d as f64).sqrt() as f32))?;
        let pooled = match &self.standardize {
            Some((bias, scale)) => pooled.subtract(bias)?.multiply(scale)?,
            None => pooled,
        };
        self.projection.forward(&fast::rms_norm(&pooled, None::<&Array>, eps)?)
    }

    /// Cosines and sines `[n, 1, head_dim]` of the 2-D rope: the first half
    /// of the head turns with the column, the second with the row, each
    /// half with timescales base^(2i / half) duplicated across its halves.
    fn rope_tables(&self, cols: &Array, rows: &Array) -> Result<(Array, Array)> {
        let half = self.config.head_dim / 2;
        let exps = ops::arange::<_, f32>(0.0, (half / 2) as f32, 1.0)?.multiply(Array::from_f32(2.0 / half as f32))?;
        let timescale = ops::power(Array::from_f32(self.rope_base), &exps)?;
        let angles = |pos: &Array| -> Result<Array> {
            let a = pos.as_dtype(mlx_rs::Dtype::Float32)?.reshape(&[-1, 1])?.divide(&timescale)?;
            Ok(ops::concatenate(&[a.clone(), a], 1)?)
        };
        let both = ops::concatenate(&[angles(cols)?, angles(rows)?], 1)?;
        let n = both.shape()[0];
        let shape = [n, 1, 2 * half];
        Ok((ops::cos(&both)?.reshape(&shape)?, ops::sin(&both)?.reshape(&shape)?))
    }
}

/// `x * cos + rotate_half(x) * sin` within each half of the head, as
/// mlx-vlm's `apply_multidimensional_rope` (x: `[1, n, heads, head_dim]`).
fn rotate_2d(x: &Array, cos: &Array, sin: &Array) -> Result<Array> {
    let hd = x.shape()[3];
    let (half, quarter) = (hd / 2, hd / 4);
    let mut parts = Vec::new();
    for d in 0..2 {
        let part = x.index((.., .., .., d * half..(d + 1) * half));
        let (a, b) = (part.index((.., .., .., ..quarter)), part.index((.., .., .., quarter..)));
        parts.push(ops::concatenate(&[b.negative()?, a], 3)?);
    }
    let rotated = ops::concatenate(&parts, 3)?;
    Ok(x.multiply(cos)?.add(rotated.multiply(sin)?)?)
}

/// Gemma 4's splice (shared by unified): runs of `media` tokens take the
/// next feature array in the decoder's part of the row (`width`) and the
/// pad id's per-layer embeddings in the rest (mlx-vlm maps media ids to 0
/// for that lookup); text runs their own embeddings.
pub(crate) fn splice_with_pad_rows(
    lm: &dyn LanguageModel,
    ids: &[u32],
    media: &[u32],
    features: &[Array],
    width: i32,
) -> Result<Array> {
    let text = |seg: &[u32]| lm.embed(&Array::from_slice(seg, &[1, seg.len() as i32]));
    let image = |f: &Array, run: usize| -> Result<Array> {
        if f.shape()[0] as usize != run || f.shape()[1] != width {
            bail!("a medium has {:?} features but the prompt holds {run} placeholders", f.shape());
        }
        let pad = lm.embed(&Array::from_slice(&vec![0u32; run], &[1, run as i32]))?;
        let features = f.reshape(&[1, run as i32, width])?;
        if pad.shape()[2] == width {
            return Ok(features);
        }
        Ok(ops::concatenate(&[features, pad.index((.., .., width..))], 2)?)
    };
    crate::model::splice::splice_tokens(ids, media, features, text, image)
}

impl VisionTower for Gemma4Tower {
    fn encode(&self, prepared: &Prepared) -> Result<Array> {
        self.encode_pixels(&Array::from_slice(&prepared.values, &prepared.shape))
    }

    fn encode_audio(&self, audio: &PreparedAudio) -> Result<Array> {
        match &self.audio {
            Some((tower, _)) => tower.encode(audio),
            None => bail!("this Gemma 4 checkpoint has no audio tower"),
        }
    }

    /// Image rows take the features in the decoder's part of the row and
    /// the pad id's per-layer embeddings in the rest (mlx-vlm: media ids
    /// become 0 for the per-layer lookup).
    fn splice(&self, lm: &dyn LanguageModel, ids: &[u32], images: &[Array]) -> Result<Array> {
        let media: Vec<u32> = std::iter::once(self.image_token_id)
            .chain(self.video_token_id)
            .chain(self.audio.as_ref().map(|(_, id)| *id))
            .collect();
        splice_with_pad_rows(lm, ids, &media, images, self.text_hidden)
    }
}

/// What [`Gemma4Preprocess`] needs from the tower's config.
pub fn preprocess_for(config: &Gemma4VisionConfig, soft_tokens: u32, rescale: f32) -> Gemma4Preprocess {
    Gemma4Preprocess {
        patch: config.patch_size as u32,
        pool: config.pooling_kernel_size as u32,
        soft_tokens,
        rescale,
        resample: crate::model::image::Resample::BICUBIC,
        model_patch: None,
    }
}
