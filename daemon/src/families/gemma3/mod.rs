//! Gemma 3: its text decoder (`text`), the SigLIP tower (`siglip`) and the
//! projector (`projector`), joined in `vision`; written op for op like
//! mlx-vlm's `gemma3` package.

pub mod projector;
pub mod siglip;
pub mod text;
pub mod vision;

use crate::model::image::{Preprocess, Resample};
use crate::model::options::ModelOptions;
use crate::model::vlm_dir::{quantization, three_floats, tower_fingerprint};
use crate::model::weights::TensorMap;
use crate::model::{chat_parts, read_json, MediaTower, Model, Placeholder};
use anyhow::{Context, Result};
use siglip::SiglipConfig;
use std::path::Path;
use std::sync::Arc;
use text::{Gemma3Text, Gemma3TextConfig};
use vision::Gemma3Tower;

/// Tensor name prefixes that make up Gemma 3's tower (and so its fingerprint).
const TOWER_TENSORS: &[&str] = &["vision_tower.", "multi_modal_projector."];

/// A Gemma 3 directory (`language_model.*`, `vision_tower.*`, `multi_modal_projector.*`).
pub fn load_dir(dir: &Path, raw: &serde_json::Value, form: ModelOptions, memo: Option<&sled::Tree>) -> Result<Model> {
    let text: Gemma3TextConfig =
        serde_json::from_value(raw["text_config"].clone()).context("config.json text_config")?;
    let vision: SiglipConfig =
        serde_json::from_value(raw["vision_config"].clone()).context("config.json vision_config")?;
    let image_token_id = raw.get("image_token_index").and_then(|v| v.as_u64()).unwrap_or(262144) as u32;
    let mut tensors = TensorMap::from_safetensors_dir(dir, quantization(raw), form.form)?.with_options(&form);
    let pre = read_json(&dir.join("preprocessor_config.json"))?.unwrap_or_default();
    let side =
        pre.get("size").and_then(|s| s.get("height")).and_then(|h| h.as_u64()).unwrap_or(vision.image_size as u64)
            as u32;
    let preprocess = Preprocess {
        height: side,
        width: side,
        resample: Resample::from_config(pre.get("resample"), Resample::BICUBIC),
        rescale: pre.get("rescale_factor").and_then(|r| r.as_f64()).unwrap_or(1.0 / 255.0) as f32,
        mean: three_floats(pre.get("image_mean"), [0.5; 3]),
        std: three_floats(pre.get("image_std"), [0.5; 3]),
    };
    let fingerprint = tower_fingerprint(dir, TOWER_TENSORS, raw, memo)?;
    let (tokenizer, template, mut eos_ids) = chat_parts(dir, raw)?;
    eos_ids.extend(tokenizer.token_to_id("<end_of_turn>"));
    let tower = Gemma3Tower::load(vision, text.mm_tokens_per_image, text.hidden_size, image_token_id, &mut tensors)?;
    let lm = Gemma3Text::load(text, &mut tensors, "language_model", form.shard.as_ref())?;
    let soft = tokenizer.id_to_token(image_token_id).unwrap_or_else(|| "<image_soft_token>".into());
    // HF's Gemma 3 processor: each <start_of_image> becomes
    // "\n\n<start_of_image>" + one soft token per feature row + "<end_of_image>\n\n".
    let placeholder = Placeholder {
        text: "<start_of_image>".into(),
        prefix: "\n\n<start_of_image>".into(),
        image_token: soft,
        suffix: "<end_of_image>\n\n".into(),
    };
    let vision = MediaTower::new(Box::new(tower), Arc::new(preprocess), fingerprint, placeholder, image_token_id);
    Ok(Model::new(Box::new(lm), tokenizer, template, eos_ids, Some(vision)))
}
