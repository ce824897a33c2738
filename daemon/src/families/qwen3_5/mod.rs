//! Qwen3.5: the hybrid decoder (`model`: Gated DeltaNet and gated
//! attention, `gated_delta`: the recurrence) with Qwen3-VL's vision tower
//! without deepstack, as mlx-vlm 0.7.10's `qwen3_5` package. Images and
//! video take Qwen3-VL's preprocessing, prompt and rope positions.

pub mod config;
pub mod gated_delta;
pub mod model;

use crate::families::qwen3_vl;
use crate::model::family::{LanguageModel, Prepared, VisionTower};
use crate::model::options::ModelOptions;
use crate::model::positions::Deepstack;
use crate::model::weights::TensorMap;
use crate::model::Model;
use anyhow::{ensure, Result};
use mlx_rs::Array;
use std::path::Path;

/// A Qwen3.5 directory as mlx-community ships it (`language_model.*`,
/// `vision_tower.*`, text hyper-parameters under `text_config`).
pub fn load_dir(dir: &Path, raw: &serde_json::Value, form: ModelOptions, memo: Option<&sled::Tree>) -> Result<Model> {
    let mut text_json = raw.get("text_config").cloned().unwrap_or_else(|| raw.clone());
    if text_json.get("tie_word_embeddings").is_none() {
        text_json["tie_word_embeddings"] = raw.get("tie_word_embeddings").cloned().unwrap_or(false.into());
    }
    let text = config::Qwen35TextConfig::from_json(&text_json)?;
    let shard = form.shard.clone();
    let build = |tensors: TensorMap| -> Result<Box<dyn LanguageModel>> {
        Ok(Box::new(model::Qwen35::from_tensors(
            text.clone(),
            tensors.strip_prefix("language_model."),
            shard.as_ref(),
        )?))
    };
    let wrap = |tower: qwen3_vl::vision::Qwen3Tower| -> Result<Box<dyn VisionTower>> {
        ensure!(
            tower.tower.deepstack_count() == 0,
            "Qwen3.5's tower has no deepstack mergers (its deepstack_visual_indexes must be empty)"
        );
        Ok(Box::new(TextPositionsPlain(Box::new(tower))))
    };
    qwen3_vl::load_parts(dir, raw, form, memo, &text_json, build, wrap)
}

/// Qwen3-VL's tower as Qwen3.5 uses it; a prompt without media gets plain
/// positions (they equal its multimodal ones), so its rows can join a
/// padded decode batch.
struct TextPositionsPlain(Box<dyn VisionTower>);

impl VisionTower for TextPositionsPlain {
    fn encode(&self, prepared: &Prepared) -> Result<Array> {
        self.0.encode(prepared)
    }

    fn splice(&self, lm: &dyn LanguageModel, ids: &[u32], features: &[Array]) -> Result<Array> {
        self.0.splice(lm, ids, features)
    }

    fn rope_positions(&self, ids: &[u32], features: &[Array]) -> Option<(Vec<[i64; 3]>, i64)> {
        if features.is_empty() {
            return None;
        }
        self.0.rope_positions(ids, features)
    }

    fn deepstack(&self, ids: &[u32], features: &[Array]) -> Result<Option<Deepstack>> {
        self.0.deepstack(ids, features)
    }
}
