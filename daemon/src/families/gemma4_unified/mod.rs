//! Gemma 4 unified: Gemma 4's decoder (`gemma4::text`) with no tower —
//! images and video frames as model patches and audio as raw frames, each
//! through a few linear layers (`embedder`). Its prompts are Gemma 4's
//! (`<|image>` … `<image|>`, `mm:ss` frames, `<|audio>` … `<audio|>`), its
//! image sizing Gemma 4's, patches of 48 pixels one soft token each.
//!
//! Encoding is a few matrix products, so whether the feature store pays
//! here is a measurement (`scripts/bench images`, the unified rows); the
//! store is kept, as for every family: see docs/benchmarks.md.

pub mod embedder;

use super::gemma4::processor::Gemma4Preprocess;
use super::gemma4::text::{Gemma4Text, Gemma4TextConfig};
use super::gemma4::{
    audio_prompt, image_placeholder, image_processor_config, mlx_vlm_name, rescale_factor, soft_token_budget, token_id,
    video, video_preprocess, video_prompt,
};
use crate::model::image::Resample;
use crate::model::options::ModelOptions;
use crate::model::vlm_dir::{quantization, weights_fingerprint};
use crate::model::weights::TensorMap;
use crate::model::{chat_parts, read_json, MediaTower, Model};
use anyhow::{Context, Result};
use embedder::{UnifiedAudioConfig, UnifiedAudioFrames, UnifiedEmbedder, UnifiedVisionConfig};
use std::path::Path;
use std::sync::Arc;

/// Tensor name prefixes of the image path (its fingerprint), and the audio path's.
const VISION_TENSORS: &[&str] = &["vision_embedder.", "embed_vision."];
const AUDIO_TENSORS: &[&str] = &["embed_audio."];

/// A Gemma 4 unified directory (`language_model.*`, `vision_embedder.*`,
/// `embed_vision.*`, `embed_audio.*`).
pub fn load_dir(dir: &Path, raw: &serde_json::Value, form: ModelOptions, memo: Option<&sled::Tree>) -> Result<Model> {
    let text: Gemma4TextConfig =
        serde_json::from_value(raw["text_config"].clone()).context("config.json text_config")?;
    let vision: UnifiedVisionConfig =
        serde_json::from_value(raw["vision_config"].clone()).context("config.json vision_config")?;
    let audio: Option<UnifiedAudioConfig> = match raw.get("audio_config").filter(|c| !c.is_null()) {
        Some(c) => Some(serde_json::from_value(c.clone()).context("config.json audio_config")?),
        None => None,
    };
    let image_token_id = token_id(raw, "image_token_id", 258880);
    let mut tensors =
        TensorMap::from_safetensors_dir(dir, quantization(raw), form.form)?.with_options(&form).renamed(mlx_vlm_name);
    let ip = image_processor_config(dir)?;
    let preprocess = Gemma4Preprocess {
        patch: vision.patch_size,
        pool: vision.pooling_kernel_size,
        soft_tokens: soft_token_budget(&ip, vision.num_soft_tokens)?,
        rescale: rescale_factor(&ip),
        resample: Resample::from_config(ip.get("resample"), Resample::BICUBIC),
        model_patch: Some(vision.model_patch_size),
    };
    let video_preprocess = video_preprocess(dir, &preprocess)?;
    let fingerprint = weights_fingerprint(dir, VISION_TENSORS, &raw["vision_config"].to_string(), memo)
        .with_context(|| format!("fingerprinting the patch embedder in {}", dir.display()))?;
    let (tokenizer, template, mut eos_ids) = chat_parts(dir, raw)?;
    eos_ids.extend(tokenizer.token_to_id("<turn|>"));
    let mut embedder = UnifiedEmbedder::load(vision, audio.as_ref(), text.hidden_size, image_token_id, &mut tensors)?;
    let lm = Gemma4Text::load(text, &mut tensors, "language_model", form.shard.as_ref())?;
    let placeholder = image_placeholder(raw, &tokenizer);
    let video_prompt = video_preprocess.as_ref().and_then(|_| video_prompt(raw, &tokenizer, &placeholder));
    embedder.video_token_id = video_prompt.as_ref().map(|v| v.token_id);
    let (frames, audio_prompt) = match &audio {
        Some(a) => {
            let processor = read_json(&dir.join("processor_config.json"))?.unwrap_or_default();
            let max = processor.get("audio_seq_length").and_then(|v| v.as_u64()).unwrap_or(750) as usize;
            let frames = UnifiedAudioFrames { samples_per_token: a.audio_samples_per_token, max_tokens: max };
            let audio_fingerprint = weights_fingerprint(dir, AUDIO_TENSORS, &raw["audio_config"].to_string(), memo)
                .with_context(|| format!("fingerprinting the audio projector in {}", dir.display()))?;
            use crate::model::family::AudioPreprocessor;
            let prompt = audio_prompt(raw, &tokenizer, frames.describe(), audio_fingerprint);
            embedder.audio_token_id = Some(prompt.token_id);
            (Some(Box::new(frames) as Box<dyn AudioPreprocessor>), Some(prompt))
        }
        None => (None, None),
    };
    let media =
        video::Gemma4Media { image: preprocess, video: video_prompt.as_ref().and(video_preprocess), audio: frames };
    let mut vision = MediaTower::new(Box::new(embedder), Arc::new(media), fingerprint, placeholder, image_token_id);
    vision.video = video_prompt;
    vision.audio = audio_prompt;
    Ok(Model::new(Box::new(lm), tokenizer, template, eos_ids, Some(vision)))
}
