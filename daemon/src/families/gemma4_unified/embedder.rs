//! Gemma 4 unified's encoder-free media path, op for op like mlx-vlm
//! 0.7.10's `gemma4_unified` (`VisionEmbedder`, `MultimodalEmbedder`):
//! an image's 48x48 model patches through LayerNorm → Linear → LayerNorm,
//! plus learned x and y position rows, LayerNorm, then a scale-free RMS
//! norm and a linear map to the decoder's width — one soft token per
//! patch; audio as raw 640-sample frames (40 ms each) through the audio
//! projector alone. Video frames are images.

use crate::families::gemma4::vision::splice_with_pad_rows;
use crate::model::family::{AudioPreprocessor, LanguageModel, Prepared, PreparedAudio, VisionTower};
use crate::model::layers::{LayerNorm, Linear};
use crate::model::weights::TensorMap;
use anyhow::{bail, Result};
use mlx_rs::{fast, ops::indexing::IndexOp, Array};

/// `vision_config` of a unified checkpoint (mlx-vlm's defaults).
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
pub struct UnifiedVisionConfig {
    #[serde(default = "d_patch")]
    pub patch_size: u32,
    #[serde(default = "d_pool")]
    pub pooling_kernel_size: u32,
    #[serde(default = "d_model_patch")]
    pub model_patch_size: u32,
    #[serde(default = "d_posemb")]
    pub mm_posemb_size: i32,
    #[serde(default = "d_soft_tokens")]
    pub num_soft_tokens: u32,
    #[serde(default = "d_eps")]
    pub rms_norm_eps: f32,
}

/// `audio_config` of a unified checkpoint.
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
pub struct UnifiedAudioConfig {
    #[serde(default = "d_samples")]
    pub audio_samples_per_token: usize,
    #[serde(default = "d_eps")]
    pub rms_norm_eps: f32,
}

fn d_patch() -> u32 {
    16
}
fn d_pool() -> u32 {
    3
}
fn d_model_patch() -> u32 {
    48
}
fn d_posemb() -> i32 {
    1120
}
fn d_soft_tokens() -> u32 {
    280
}
fn d_eps() -> f32 {
    1e-6
}
fn d_samples() -> usize {
    640
}

/// PyTorch's/MLX's `LayerNorm` default epsilon (mlx-vlm builds them bare).
const LAYER_NORM_EPS: f32 = 1e-5;

/// The patch embedder and both projectors.
pub struct UnifiedEmbedder {
    pub vision: UnifiedVisionConfig,
    audio_eps: f32,
    ln1: LayerNorm,
    dense: Linear,
    ln2: LayerNorm,
    /// `[positions, 2, width]`: the x row, the y row.
    positions: Array,
    pos_norm: LayerNorm,
    embed_vision: Linear,
    /// `None` without an audio config.
    embed_audio: Option<Linear>,
    pub image_token_id: u32,
    pub video_token_id: Option<u32>,
    pub audio_token_id: Option<u32>,
    text_hidden: i32,
}

impl UnifiedEmbedder {
    /// Loads `vision_embedder.*`, `embed_vision.*` and, with an audio
    /// config, `embed_audio.*`.
    pub fn load(
        vision: UnifiedVisionConfig,
        audio: Option<&UnifiedAudioConfig>,
        text_hidden: i32,
        image_token_id: u32,
        t: &mut TensorMap,
    ) -> Result<Self> {
        let ve = "vision_embedder";
        Ok(Self {
            ln1: LayerNorm::load(t, &format!("{ve}.patch_ln1"), LAYER_NORM_EPS)?,
            dense: t.linear(&format!("{ve}.patch_dense"))?,
            ln2: LayerNorm::load(t, &format!("{ve}.patch_ln2"), LAYER_NORM_EPS)?,
            positions: t.float(&format!("{ve}.pos_embedding"))?,
            pos_norm: LayerNorm::load(t, &format!("{ve}.pos_norm"), LAYER_NORM_EPS)?,
            embed_vision: t.linear("embed_vision.embedding_projection")?,
            embed_audio: match audio {
                Some(_) => Some(t.linear("embed_audio.embedding_projection")?),
                None => None,
            },
            audio_eps: audio.map_or(1e-6, |a| a.rms_norm_eps),
            vision,
            image_token_id,
            video_token_id: None,
            audio_token_id: None,
            text_hidden,
        })
    }
}

impl VisionTower for UnifiedEmbedder {
    /// Soft tokens `[patches, text_hidden]` of `[patches, 48 * 48 * 3]`
    /// model patches on a `(1, rows, cols)` grid.
    fn encode(&self, prepared: &Prepared) -> Result<Array> {
        let Some((_, rows, cols)) = prepared.grid else { bail!("Gemma 4 unified takes model patches with their grid") };
        let n = (rows * cols) as i32;
        let side = self.vision.model_patch_size as i32;
        if prepared.shape != [n, side * side * 3] {
            bail!("Gemma 4 unified takes [{n}, {}] model patches, not {:?}", side * side * 3, prepared.shape);
        }
        let table = self.positions.shape()[0];
        if rows as i32 > table || cols as i32 > table {
            bail!("an image of {rows}x{cols} patches is past the position table ({table})");
        }
        let patches = Array::from_slice(&prepared.values, &prepared.shape);
        let x = self.ln2.forward(&self.dense.forward(&self.ln1.forward(&patches)?)?)?;
        // Patch i sits at column i % cols, row i / cols.
        let col: Vec<i32> = (0..n).map(|i| i % cols as i32).collect();
        let row: Vec<i32> = (0..n).map(|i| i / cols as i32).collect();
        let by_x = self.positions.index((.., 0, ..)).take_axis(Array::from_slice(&col, &[n]), 0)?;
        let by_y = self.positions.index((.., 1, ..)).take_axis(Array::from_slice(&row, &[n]), 0)?;
        let x = self.pos_norm.forward(&x.add(by_x.add(&by_y)?)?)?;
        self.embed_vision.forward(&fast::rms_norm(&x, None::<&Array>, self.vision.rms_norm_eps)?)
    }

    fn encode_audio(&self, audio: &PreparedAudio) -> Result<Array> {
        let Some(project) = &self.embed_audio else { bail!("this Gemma 4 unified checkpoint has no audio projector") };
        if audio.values.len() != audio.frames * audio.bins || audio.tokens > audio.frames {
            bail!("malformed audio frames: {} values for {} x {}", audio.values.len(), audio.frames, audio.bins);
        }
        let frames = Array::from_slice(&audio.values, &[audio.frames as i32, audio.bins as i32]);
        let frames = frames.index((..audio.tokens as i32, ..));
        project.forward(&fast::rms_norm(&frames, None::<&Array>, self.audio_eps)?)
    }

    fn splice(&self, lm: &dyn LanguageModel, ids: &[u32], features: &[Array]) -> Result<Array> {
        let media: Vec<u32> =
            std::iter::once(self.image_token_id).chain(self.video_token_id).chain(self.audio_token_id).collect();
        splice_with_pad_rows(lm, ids, &media, features, self.text_hidden)
    }
}

/// Gemma 4 unified's audio "frontend": the samples padded with zeros to
/// whole frames of `samples_per_token`, one token per frame, at most
/// `max_tokens`.
#[derive(Debug, Clone, PartialEq)]
pub struct UnifiedAudioFrames {
    pub samples_per_token: usize,
    pub max_tokens: usize,
}

impl AudioPreprocessor for UnifiedAudioFrames {
    fn describe(&self) -> String {
        format!("gemma4-unified-audio;frame={};max={}", self.samples_per_token, self.max_tokens)
    }

    fn prepare(&self, samples: &[f32]) -> Result<PreparedAudio, String> {
        if samples.is_empty() {
            return Err("the audio has no samples".into());
        }
        let frames = samples.len().div_ceil(self.samples_per_token);
        if frames > self.max_tokens {
            let seconds = |n: usize| n as f64 * self.samples_per_token as f64 / 16_000.0;
            return Err(format!(
                "the audio is {:.1} s long; Gemma 4 hears at most {:.0} s per clip: split it",
                samples.len() as f64 / 16_000.0,
                seconds(self.max_tokens)
            ));
        }
        let mut values = samples.to_vec();
        values.resize(frames * self.samples_per_token, 0.0);
        Ok(PreparedAudio { values, frames, bins: self.samples_per_token, valid_frames: frames, tokens: frames })
    }
}
