//! Loading vision-language model directories as mlx-community ships them:
//! `config.json` (text_config, vision_config, image token ids),
//! `preprocessor_config.json`, `*.safetensors`, tokenizer and chat template.

use super::gemma3_vlm::Gemma3Vlm;
use super::image::{Preprocess, Resample};
use super::siglip::SiglipConfig;
use crate::model::gemma3_text::Gemma3TextConfig;
use crate::model::weights::TensorMap;
use crate::model::{chat_parts, read_json, Backbone, TextModel, VisionSpec};
use crate::options::ModelOptions;
use anyhow::{Context, Result};
use mlxbc_cache::TowerFingerprint;
use std::path::Path;

/// Tensor name prefixes that make up Gemma 3's tower (and so its fingerprint).
const GEMMA3_TOWER: &[&str] = &["vision_tower.", "multi_modal_projector."];

fn f32s(v: Option<&serde_json::Value>, default: [f32; 3]) -> [f32; 3] {
    match v.and_then(|a| a.as_array()) {
        Some(a) if a.len() == 3 => [0, 1, 2].map(|i| a[i].as_f64().unwrap_or(default[i] as f64) as f32),
        _ => default,
    }
}

/// The fingerprint of the tower tensors (`prefixes`) in a directory's safetensors files.
fn tower_fingerprint(
    dir: &Path,
    prefixes: &[&str],
    raw: &serde_json::Value,
    memo: Option<&sled::Tree>,
) -> Result<TowerFingerprint> {
    let mut files: Vec<_> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    let file_refs: Vec<&Path> = files.iter().map(|p| p.as_path()).collect();
    TowerFingerprint::compute(&file_refs, prefixes, &raw["vision_config"].to_string(), memo)
        .with_context(|| format!("fingerprinting the vision tower in {}", dir.display()))
}

/// Gemma 3 from a directory.
pub fn load_gemma3_dir(
    dir: &Path,
    raw: &serde_json::Value,
    form: ModelOptions,
    memo: Option<&sled::Tree>,
) -> Result<TextModel> {
    let text: Gemma3TextConfig =
        serde_json::from_value(raw["text_config"].clone()).context("config.json text_config")?;
    let vision: SiglipConfig =
        serde_json::from_value(raw["vision_config"].clone()).context("config.json vision_config")?;
    let image_token_id = raw.get("image_token_index").and_then(|v| v.as_u64()).unwrap_or(262144) as u32;
    let quantization = raw.get("quantization").or(raw.get("quantization_config"));
    let mut tensors = TensorMap::from_safetensors_dir(dir, quantization, form.form)?.with_fusion(form.fusion);
    let pre = read_json(&dir.join("preprocessor_config.json"))?.unwrap_or_default();
    let side =
        pre.get("size").and_then(|s| s.get("height")).and_then(|h| h.as_u64()).unwrap_or(vision.image_size as u64)
            as u32;
    let preprocess = Preprocess {
        height: side,
        width: side,
        resample: Resample::from_config(pre.get("resample"), Resample::BICUBIC),
        rescale: pre.get("rescale_factor").and_then(|r| r.as_f64()).unwrap_or(1.0 / 255.0) as f32,
        mean: f32s(pre.get("image_mean"), [0.5; 3]),
        std: f32s(pre.get("image_std"), [0.5; 3]),
    };
    let fingerprint = tower_fingerprint(dir, GEMMA3_TOWER, raw, memo)?;
    let (tokenizer, template, mut eos_ids) = chat_parts(dir, raw)?;
    eos_ids.extend(tokenizer.token_to_id("<end_of_turn>"));
    let vlm = Gemma3Vlm::load(text, vision, image_token_id, &mut tensors)?;
    let soft = tokenizer.id_to_token(image_token_id).unwrap_or_else(|| "<image_soft_token>".into());
    Ok(TextModel {
        backbone: Backbone::Gemma3(Box::new(vlm)),
        prompter: std::sync::Arc::new(crate::model::prompt::Prompter { tokenizer, template }),
        eos_ids,
        compiled_decode: Default::default(),
        vision: Some(VisionSpec {
            preprocess_key: preprocess.describe(),
            preprocess: Some(preprocess),
            fingerprint,
            // HF's Gemma 3 processor: each <start_of_image> becomes
            // "\n\n<start_of_image>" + one soft token per feature row + "<end_of_image>\n\n".
            placeholder: "<start_of_image>".into(),
            expansion_prefix: "\n\n<start_of_image>".into(),
            image_token: soft,
            expansion_suffix: "<end_of_image>\n\n".into(),
            image_token_id,
        }),
    })
}

/// Tensor name prefixes of Qwen2.5-VL's tower.
const QWEN25_TOWER: &[&str] = &["vision_tower."];

/// Qwen2.5-VL from an mlx-community style directory (`language_model.*`,
/// `vision_tower.*`; text hyper-parameters at the top of config.json).
pub fn load_qwen25_vl_dir(
    dir: &Path,
    raw: &serde_json::Value,
    form: ModelOptions,
    memo: Option<&sled::Tree>,
) -> Result<TextModel> {
    use super::qwen25_vl::{Qwen25Preprocess, Qwen25Vlm};
    use super::qwen25_vl_tower::{Qwen25VisionConfig, Qwen25VisionTower};
    use crate::model::config::TextConfig;
    use crate::model::transformer::Transformer;
    let mut text_json = raw.clone();
    text_json["model_type"] = "qwen2".into();
    let text = TextConfig::from_hf_json(&text_json.to_string())?;
    let vision: Qwen25VisionConfig =
        serde_json::from_value(raw["vision_config"].clone()).context("config.json vision_config")?;
    let image_token_id = raw.get("image_token_id").and_then(|v| v.as_u64()).unwrap_or(151655) as u32;
    let quantization = raw.get("quantization").or(raw.get("quantization_config"));
    let mut tensors = TensorMap::from_safetensors_dir(dir, quantization, form.form)?.with_fusion(form.fusion);
    let pre = read_json(&dir.join("preprocessor_config.json"))?.unwrap_or_default();
    let preprocess = Qwen25Preprocess {
        min_pixels: pre.get("min_pixels").and_then(|v| v.as_u64()).unwrap_or(56 * 56),
        resample: Resample::from_config(pre.get("resample"), Resample::BICUBIC),
        max_pixels: pre.get("max_pixels").and_then(|v| v.as_u64()).unwrap_or(28 * 28 * 1280),
        mean: f32s(pre.get("image_mean"), [0.481_454_66, 0.457_827_5, 0.408_210_73]),
        std: f32s(pre.get("image_std"), [0.268_629_54, 0.261_302_58, 0.275_777_1]),
    };
    let fingerprint = tower_fingerprint(dir, QWEN25_TOWER, raw, memo)?;
    let (tokenizer, template, eos_ids) = chat_parts(dir, raw)?;
    let tower = Qwen25VisionTower::load(vision, &mut tensors, "vision_tower")?;
    let text = Transformer::from_tensors(text, tensors.strip_prefix("language_model."))?;
    let image_token = tokenizer.id_to_token(image_token_id).unwrap_or_else(|| "<|image_pad|>".into());
    let key = preprocess.describe();
    Ok(TextModel {
        backbone: Backbone::Qwen25Vl(Box::new(Qwen25Vlm { text, tower, image_token_id, preprocess })),
        prompter: std::sync::Arc::new(crate::model::prompt::Prompter { tokenizer, template }),
        eos_ids,
        compiled_decode: Default::default(),
        vision: Some(VisionSpec {
            preprocess_key: key,
            preprocess: None,
            fingerprint,
            placeholder: image_token.clone(),
            expansion_prefix: String::new(),
            image_token,
            expansion_suffix: String::new(),
            image_token_id,
        }),
    })
}
