//! Qwen2.5-VL: a Qwen2 decoder (the llama family's, with multimodal rope)
//! and its own vision tower (`tower`), preprocessing and splice (`vision`),
//! and rope positions (`mrope`); as mlx-vlm's `qwen2_5_vl` package.

pub mod mrope;
pub mod tower;
pub mod vision;

use crate::families::llama::{config::TextConfig, model::Transformer};
use crate::model::image::Resample;
use crate::model::options::ModelOptions;
use crate::model::vlm_dir::{quantization, three_floats, tower_fingerprint};
use crate::model::weights::TensorMap;
use crate::model::{chat_parts, read_json, MediaTower, Model, Placeholder};
use anyhow::{Context, Result};
use std::path::Path;
use std::sync::Arc;
use tower::{Qwen25VisionConfig, Qwen25VisionTower};
use vision::{Qwen25Preprocess, Qwen25Tower};

/// Tensor name prefixes of Qwen2.5-VL's tower.
const TOWER_TENSORS: &[&str] = &["vision_tower."];

/// A Qwen2.5-VL directory as mlx-community ships it (`language_model.*`,
/// `vision_tower.*`; text hyper-parameters at the top of config.json).
pub fn load_dir(dir: &Path, raw: &serde_json::Value, form: ModelOptions, memo: Option<&sled::Tree>) -> Result<Model> {
    let mut text_json = raw.clone();
    text_json["model_type"] = "qwen2".into();
    let text = TextConfig::from_hf_json(&text_json.to_string())?;
    let vision: Qwen25VisionConfig =
        serde_json::from_value(raw["vision_config"].clone()).context("config.json vision_config")?;
    let image_token_id = raw.get("image_token_id").and_then(|v| v.as_u64()).unwrap_or(151655) as u32;
    let mut tensors = TensorMap::from_safetensors_dir(dir, quantization(raw), form.form)?.with_options(&form);
    let pre = read_json(&dir.join("preprocessor_config.json"))?.unwrap_or_default();
    let preprocess = Qwen25Preprocess {
        min_pixels: pre.get("min_pixels").and_then(|v| v.as_u64()).unwrap_or(56 * 56),
        resample: Resample::from_config(pre.get("resample"), Resample::BICUBIC),
        max_pixels: pre.get("max_pixels").and_then(|v| v.as_u64()).unwrap_or(28 * 28 * 1280),
        mean: three_floats(pre.get("image_mean"), [0.481_454_66, 0.457_827_5, 0.408_210_73]),
        std: three_floats(pre.get("image_std"), [0.268_629_54, 0.261_302_6, 0.275_777_1]),
        patch_size: vision.patch_size as u32,
        merge_size: vision.spatial_merge_size as u32,
        temporal_patch_size: vision.temporal_patch_size as u32,
    };
    let fingerprint = tower_fingerprint(dir, TOWER_TENSORS, raw, memo)?;
    let (tokenizer, template, eos_ids) = chat_parts(dir, raw)?;
    let tower = Qwen25VisionTower::load(vision, &mut tensors, "vision_tower")?;
    let lm = Transformer::from_tensors(text, tensors.strip_prefix("language_model."), form.shard.as_ref())?;
    let image_token = tokenizer.id_to_token(image_token_id).unwrap_or_else(|| "<|image_pad|>".into());
    let placeholder =
        Placeholder { text: image_token.clone(), prefix: String::new(), image_token, suffix: String::new() };
    let tower = Qwen25Tower { tower, image_token_id };
    let vision = MediaTower::new(Box::new(tower), Arc::new(preprocess), fingerprint, placeholder, image_token_id);
    Ok(Model::new(Box::new(lm), tokenizer, template, eos_ids, Some(vision)))
}
