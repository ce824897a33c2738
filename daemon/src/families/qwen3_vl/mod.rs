//! Qwen3-VL: a Qwen3 decoder (the llama family's, with interleaved
//! multimodal rope and deepstack injection) and its own vision tower
//! (`tower`, `vision`); as mlx-vlm's `qwen3_vl` package. Preprocessing and
//! rope positions are Qwen2.5-VL's with 16-pixel patches.

pub mod tower;
pub mod video;
pub mod vision;

use crate::families::llama::{config::TextConfig, model::Transformer};
use crate::families::qwen2_5_vl::vision::Qwen25Preprocess;
use crate::model::family::{LanguageModel, VisionTower};
use crate::model::image::Resample;
use crate::model::options::ModelOptions;
use crate::model::video::Sampling;
use crate::model::vlm_dir::{quantization, three_floats, tower_fingerprint};
use crate::model::weights::TensorMap;
use crate::model::{chat_parts, read_json, MediaTower, Model, Placeholder, VideoPrompt, VideoTimestamps};
use anyhow::{Context, Result};
use std::path::Path;
use std::sync::Arc;
use tower::{Qwen3VisionConfig, Qwen3VisionTower};
use video::{Qwen3Preprocess, Qwen3VideoPreprocess};
use vision::Qwen3Tower;

/// Tensor name prefixes of Qwen3-VL's tower.
const TOWER_TENSORS: &[&str] = &["vision_tower."];

/// A Qwen3-VL directory as mlx-community ships it (`language_model.*`,
/// `vision_tower.*`; text hyper-parameters under `text_config`).
pub fn load_dir(dir: &Path, raw: &serde_json::Value, form: ModelOptions, memo: Option<&sled::Tree>) -> Result<Model> {
    let mut text_json = raw.get("text_config").cloned().context("config.json has no text_config")?;
    text_json["model_type"] = "qwen3".into();
    if text_json.get("tie_word_embeddings").is_none() {
        text_json["tie_word_embeddings"] = raw.get("tie_word_embeddings").cloned().unwrap_or(false.into());
    }
    let text = TextConfig::from_hf_json(&text_json.to_string())?;
    let shard = form.shard.clone();
    let lm = |t: TensorMap| -> Result<Box<dyn LanguageModel>> {
        Ok(Box::new(Transformer::from_tensors(text, t.strip_prefix("language_model."), shard.as_ref())?))
    };
    load_parts(dir, raw, form, memo, &text_json, lm, |tower| Ok(Box::new(tower)))
}

/// A directory of Qwen3-VL's layout with the language model `lm` builds
/// from its tensors and the tower `wrap` makes of Qwen3-VL's (Qwen3.5
/// shares the tower, the preprocessing and the prompt).
pub(crate) fn load_parts(
    dir: &Path,
    raw: &serde_json::Value,
    form: ModelOptions,
    memo: Option<&sled::Tree>,
    text_json: &serde_json::Value,
    lm: impl FnOnce(TensorMap) -> Result<Box<dyn LanguageModel>>,
    wrap: impl FnOnce(Qwen3Tower) -> Result<Box<dyn VisionTower>>,
) -> Result<Model> {
    let vision: Qwen3VisionConfig =
        serde_json::from_value(raw["vision_config"].clone()).context("config.json vision_config")?;
    let image_token_id = raw.get("image_token_id").and_then(|v| v.as_u64()).unwrap_or(151655) as u32;
    let mut tensors = TensorMap::from_safetensors_dir(dir, quantization(raw), form.form)?.with_options(&form);
    let pre = read_json(&dir.join("preprocessor_config.json"))?.unwrap_or_default();
    let pixels = |size_key: &str, key: &str, default: u64| config_int(&pre, size_key, key, default);
    let preprocess = Qwen25Preprocess {
        min_pixels: pixels("shortest_edge", "min_pixels", 65_536),
        max_pixels: pixels("longest_edge", "max_pixels", 16_777_216),
        resample: Resample::from_config(pre.get("resample"), Resample::BICUBIC),
        mean: three_floats(pre.get("image_mean"), [0.5; 3]),
        std: three_floats(pre.get("image_std"), [0.5; 3]),
        patch_size: vision.patch_size as u32,
        merge_size: vision.spatial_merge_size as u32,
        temporal_patch_size: vision.temporal_patch_size as u32,
    };
    let video = video_preprocess(dir, &vision)?;
    let preprocess = Qwen3Preprocess { image: preprocess, video };
    let fingerprint = tower_fingerprint(dir, TOWER_TENSORS, raw, memo)?;
    let mut eos_source = raw.clone();
    if eos_source.get("eos_token_id").is_none() {
        eos_source["eos_token_id"] = text_json.get("eos_token_id").cloned().unwrap_or(serde_json::Value::Null);
    }
    let (tokenizer, template, eos_ids) = chat_parts(dir, &eos_source)?;
    let tower = Qwen3VisionTower::load(vision, &mut tensors, "vision_tower")?;
    let lm = lm(tensors)?;
    let image_token = tokenizer.id_to_token(image_token_id).unwrap_or_else(|| "<|image_pad|>".into());
    let placeholder =
        Placeholder { text: image_token.clone(), prefix: String::new(), image_token, suffix: String::new() };
    let video_token_id = raw.get("video_token_id").and_then(|v| v.as_u64()).unwrap_or(151656) as u32;
    let token = |id: u32, default: &str| tokenizer.id_to_token(id).unwrap_or_else(|| default.into());
    let start_id = raw.get("vision_start_token_id").and_then(|v| v.as_u64()).unwrap_or(151652) as u32;
    let (start, end) = (token(start_id, "<|vision_start|>"), token(start_id + 1, "<|vision_end|>"));
    let video_token = token(video_token_id, "<|video_pad|>");
    let video_prompt = VideoPrompt {
        text: format!("{start}{video_token}{end}"),
        start,
        token: video_token,
        end,
        token_id: video_token_id,
        timestamps: VideoTimestamps::Seconds,
    };
    let tower = wrap(Qwen3Tower { tower, image_token_id, video_token_id })?;
    let mut vision = MediaTower::new(tower, Arc::new(preprocess), fingerprint, placeholder, image_token_id);
    vision.video = Some(video_prompt);
    Ok(Model::new(lm, tokenizer, template, eos_ids, Some(vision)))
}

/// `video_preprocessor_config.json` (HF's Qwen3-VL form: the budget as
/// `size` {shortest_edge, longest_edge}); HF's defaults where it is absent.
fn video_preprocess(dir: &Path, vision: &Qwen3VisionConfig) -> Result<Qwen3VideoPreprocess> {
    let pre = read_json(&dir.join("video_preprocessor_config.json"))?.unwrap_or_default();
    let int = |size_key: &str, key: &str, default: u64| config_int(&pre, size_key, key, default);
    let temporal = vision.temporal_patch_size as u32;
    Ok(Qwen3VideoPreprocess {
        sampling: Sampling {
            fps: pre.get("fps").and_then(|v| v.as_f64()).unwrap_or(2.0),
            min_frames: int("", "min_frames", 4) as u32,
            max_frames: int("", "max_frames", 768) as u32,
            frame_factor: temporal,
        },
        frames: Qwen25Preprocess {
            min_pixels: int("shortest_edge", "min_pixels", 128 * 32 * 32),
            max_pixels: int("longest_edge", "max_pixels", 32 * 32 * 768),
            resample: Resample::BICUBIC,
            mean: three_floats(pre.get("image_mean"), [0.5; 3]),
            std: three_floats(pre.get("image_std"), [0.5; 3]),
            patch_size: vision.patch_size as u32,
            merge_size: vision.spatial_merge_size as u32,
            temporal_patch_size: temporal,
        },
    })
}

/// A processor config's integer `key`, else `size.{size_key}` (HF's
/// Qwen3-VL configs give the pixel budget as `size` {shortest_edge,
/// longest_edge}; older files as min/max_pixels), else `default`.
fn config_int(pre: &serde_json::Value, size_key: &str, key: &str, default: u64) -> u64 {
    pre.get(key).or_else(|| pre.get("size").and_then(|s| s.get(size_key))).and_then(|v| v.as_u64()).unwrap_or(default)
}
