//! Gemma 4 (the E2B/E4B shape and the dense 31B): its text decoder
//! (`text`), vision tower and projector (`vision`) and image processor
//! (`processor`), written op for op like mlx-vlm 0.7.10's `gemma4` package.
//! Video frames go through the image tower one by one (`video`); a
//! checkpoint with an `audio_config` also hears (`audio`, its frontend in
//! `audio_features`), its clips' features stored under the audio tower's
//! own fingerprint.

pub mod audio;
pub mod audio_features;
pub mod moe;
pub mod processor;
pub mod text;
pub mod video;
pub mod vision;

use crate::model::options::ModelOptions;
use crate::model::vlm_dir::{quantization, tower_fingerprint, weights_fingerprint};
use crate::model::weights::TensorMap;
use crate::model::{chat_parts, read_json, AudioPrompt, MediaTower, Model, Placeholder, VideoPrompt, VideoTimestamps};
use anyhow::{bail, Context, Result};
use processor::Gemma4Preprocess;
use std::path::Path;
use std::sync::Arc;
use text::{Gemma4Text, Gemma4TextConfig};
use vision::{Gemma4Tower, Gemma4VisionConfig};

/// Tensor name prefixes that make up Gemma 4's image path (and so its fingerprint).
const TOWER_TENSORS: &[&str] = &["vision_tower.", "embed_vision."];
/// And its audio path's.
const AUDIO_TENSORS: &[&str] = &["audio_tower.", "embed_audio."];

/// mlx-vlm's names for a checkpoint's tensors: HF's `model.` dropped and
/// `language_model.X` as `language_model.model.X` (mlx-community
/// directories already have them).
pub(crate) fn mlx_vlm_name(name: &str) -> String {
    let name = name.strip_prefix("model.").unwrap_or(name);
    match name.strip_prefix("language_model.") {
        Some(rest) if !rest.starts_with("model.") => format!("language_model.model.{rest}"),
        _ => name.to_string(),
    }
}

/// The image processor's settings: `processor_config.json`'s
/// `image_processor`, or a flat `preprocessor_config.json`.
pub(crate) fn image_processor_config(dir: &Path) -> Result<serde_json::Value> {
    if let Some(p) = read_json(&dir.join("processor_config.json"))? {
        if let Some(ip) = p.get("image_processor") {
            return Ok(ip.clone());
        }
    }
    Ok(read_json(&dir.join("preprocessor_config.json"))?.unwrap_or_default())
}

/// The video processor's settings: `processor_config.json`'s
/// `video_processor`, or `video_preprocessor_config.json`; `None` when the
/// checkpoint has neither (it then takes no video).
pub(crate) fn video_processor_config(dir: &Path) -> Result<Option<serde_json::Value>> {
    if let Some(p) = read_json(&dir.join("processor_config.json"))? {
        if let Some(vp) = p.get("video_processor") {
            return Ok(Some(vp.clone()));
        }
    }
    read_json(&dir.join("video_preprocessor_config.json"))
}

/// A budget from a processor config, checked against Gemma 4's.
pub(crate) fn soft_token_budget(config: &serde_json::Value, default: u32) -> Result<u32> {
    let budget = config.get("max_soft_tokens").and_then(|v| v.as_u64()).map_or(default, |v| v as u32);
    if !processor::SOFT_TOKEN_BUDGETS.contains(&budget) {
        bail!("Gemma 4's max_soft_tokens must be one of {:?}, not {budget}", processor::SOFT_TOKEN_BUDGETS);
    }
    Ok(budget)
}

/// Gemma 4's token ids from `config.json`, with its defaults.
pub(crate) fn token_id(raw: &serde_json::Value, key: &str, default: u64) -> u32 {
    raw.get(key).and_then(|v| v.as_u64()).unwrap_or(default) as u32
}

/// A token's text by id, or `fallback` where the vocabulary lacks it.
fn token_text(tokenizer: &tokenizers::Tokenizer, id: u32, fallback: &str) -> String {
    tokenizer.id_to_token(id).unwrap_or_else(|| fallback.into())
}

/// HF's Gemma 4 processor: each image token the template writes becomes
/// `<|image>` + one image token per soft token + `<image|>`.
pub(crate) fn image_placeholder(raw: &serde_json::Value, tokenizer: &tokenizers::Tokenizer) -> Placeholder {
    let image = token_text(tokenizer, token_id(raw, "image_token_id", 258880), "<|image|>");
    Placeholder {
        text: image.clone(),
        prefix: token_text(tokenizer, token_id(raw, "boi_token_id", 255999), "<|image>"),
        image_token: image,
        suffix: token_text(tokenizer, token_id(raw, "eoi_token_id", 258882), "<image|>"),
    }
}

/// Each video frame: `mm:ss <|image>` + the video token per soft token +
/// `<image|>`; `None` when the checkpoint names no video token.
pub(crate) fn video_prompt(
    raw: &serde_json::Value,
    tokenizer: &tokenizers::Tokenizer,
    placeholder: &Placeholder,
) -> Option<VideoPrompt> {
    let id = raw.get("video_token_id").and_then(|v| v.as_u64())? as u32;
    let token = token_text(tokenizer, id, "<|video|>");
    Some(VideoPrompt {
        text: token.clone(),
        start: placeholder.prefix.clone(),
        token,
        end: placeholder.suffix.clone(),
        token_id: id,
        timestamps: VideoTimestamps::MinutesSeconds,
    })
}

/// A clip: `<|audio>` + the audio token per soft token + `<audio|>`.
pub(crate) fn audio_prompt(
    raw: &serde_json::Value,
    tokenizer: &tokenizers::Tokenizer,
    frontend_key: String,
    fingerprint: mlxbc_cache::TowerFingerprint,
) -> AudioPrompt {
    let id = token_id(raw, "audio_token_id", 258881);
    let text = token_text(tokenizer, id, "<|audio|>");
    // The unified config calls the end-of-audio id `eoa_token_index`.
    let eoa = raw.get("eoa_token_id").or_else(|| raw.get("eoa_token_index")).and_then(|v| v.as_u64()).unwrap_or(258883);
    AudioPrompt {
        text: text.clone(),
        prefix: token_text(tokenizer, token_id(raw, "boa_token_id", 256000), "<|audio>"),
        token: text,
        suffix: token_text(tokenizer, eoa as u32, "<audio|>"),
        token_id: id,
        frontend_key,
        fingerprint,
    }
}

/// The image processor's rescale factor (1/255 unless set).
pub(crate) fn rescale_factor(config: &serde_json::Value) -> f32 {
    config.get("rescale_factor").and_then(|r| r.as_f64()).unwrap_or(1.0 / 255.0) as f32
}

/// Video frames: the video budget (70 unless set) over `frames`'
/// geometry, always bicubic (PIL's, as mlx-vlm's video processor
/// resizes); `None` when the checkpoint has no video processor config.
pub(crate) fn video_preprocess(dir: &Path, frames: &Gemma4Preprocess) -> Result<Option<video::Gemma4VideoPreprocess>> {
    let Some(vp) = video_processor_config(dir)? else { return Ok(None) };
    let frames = Gemma4Preprocess {
        soft_tokens: soft_token_budget(&vp, 70)?,
        rescale: rescale_factor(&vp),
        resample: crate::model::image::Resample::BICUBIC,
        ..frames.clone()
    };
    let num_frames = vp.get("num_frames").and_then(|v| v.as_u64()).unwrap_or(32) as u32;
    Ok(Some(video::Gemma4VideoPreprocess { sampling: video::sampling(num_frames), frames }))
}

/// A Gemma 4 directory (`language_model.*`, `vision_tower.*`, `embed_vision.*`,
/// and `audio_tower.*`, `embed_audio.*` on the E models).
pub fn load_dir(dir: &Path, raw: &serde_json::Value, form: ModelOptions, memo: Option<&sled::Tree>) -> Result<Model> {
    let text: Gemma4TextConfig =
        serde_json::from_value(raw["text_config"].clone()).context("config.json text_config")?;
    let vision: Gemma4VisionConfig =
        serde_json::from_value(raw["vision_config"].clone()).context("config.json vision_config")?;
    let image_token_id = token_id(raw, "image_token_id", 258880);
    let mut tensors =
        TensorMap::from_safetensors_dir(dir, quantization(raw), form.form)?.with_options(&form).renamed(mlx_vlm_name);
    let ip = image_processor_config(dir)?;
    let soft_tokens = soft_token_budget(&ip, vision.default_output_length)?;
    let mut preprocess = vision::preprocess_for(&vision, soft_tokens, rescale_factor(&ip));
    preprocess.resample =
        crate::model::image::Resample::from_config(ip.get("resample"), crate::model::image::Resample::BICUBIC);
    let video_preprocess = video_preprocess(dir, &preprocess)?;
    let fingerprint = tower_fingerprint(dir, TOWER_TENSORS, raw, memo)?;
    let (tokenizer, template, mut eos_ids) = chat_parts(dir, raw)?;
    eos_ids.extend(tokenizer.token_to_id("<turn|>"));
    let mut tower = Gemma4Tower::load(vision, text.hidden_size, image_token_id, &mut tensors)?;
    let lm = Gemma4Text::load(text, &mut tensors, "language_model", form.shard.as_ref())?;
    let placeholder = image_placeholder(raw, &tokenizer);
    let video_prompt = video_preprocess.as_ref().and_then(|_| video_prompt(raw, &tokenizer, &placeholder));
    tower.video_token_id = video_prompt.as_ref().map(|v| v.token_id);
    let (audio_frontend, audio_prompt) = match raw.get("audio_config").filter(|c| !c.is_null()) {
        Some(config) => {
            let config: audio::Gemma4AudioConfig =
                serde_json::from_value(config.clone()).context("config.json audio_config")?;
            let processor = read_json(&dir.join("processor_config.json"))?.unwrap_or_default();
            let fe = processor.get("feature_extractor").cloned().unwrap_or_default();
            let ms = processor.get("audio_ms_per_token").and_then(|v| v.as_f64()).unwrap_or(40.0);
            let max = processor.get("audio_seq_length").and_then(|v| v.as_u64()).unwrap_or(750) as usize;
            let frontend = audio_features::Gemma4AudioFrontend::from_config(&fe, ms, max);
            if frontend.sampling_rate != crate::audio::decode::TARGET_RATE {
                bail!("Gemma 4's audio frontend must read 16 kHz, not {} Hz", frontend.sampling_rate);
            }
            let audio_fingerprint = weights_fingerprint(dir, AUDIO_TENSORS, &raw["audio_config"].to_string(), memo)
                .with_context(|| format!("fingerprinting the audio tower in {}", dir.display()))?;
            let prompt = audio_prompt(raw, &tokenizer, frontend.describe(), audio_fingerprint);
            tower.audio = Some((audio::Gemma4AudioTower::load(config, &mut tensors)?, prompt.token_id));
            (Some(frontend), Some(prompt))
        }
        None => (None, None),
    };
    let media = video::Gemma4Media {
        image: preprocess,
        video: video_prompt.as_ref().and(video_preprocess),
        audio: audio_frontend.map(|f| Box::new(f) as Box<dyn crate::model::family::AudioPreprocessor>),
    };
    let mut vision = MediaTower::new(Box::new(tower), Arc::new(media), fingerprint, placeholder, image_token_id);
    vision.video = video_prompt;
    vision.audio = audio_prompt;
    Ok(Model::new(Box::new(lm), tokenizer, template, eos_ids, Some(vision)))
}

#[cfg(test)]
mod tests {
    #[test]
    fn checkpoint_names_become_mlx_vlm_names() {
        use super::mlx_vlm_name as n;
        assert_eq!(
            n("model.language_model.layers.0.mlp.up_proj.weight"),
            "language_model.model.layers.0.mlp.up_proj.weight"
        );
        assert_eq!(n("language_model.model.norm.weight"), "language_model.model.norm.weight");
        assert_eq!(
            n("model.vision_tower.encoder.layers.0.mlp.up_proj.linear.weight"),
            "vision_tower.encoder.layers.0.mlp.up_proj.linear.weight"
        );
        assert_eq!(n("embed_vision.embedding_projection.weight"), "embed_vision.embedding_projection.weight");
    }
}
