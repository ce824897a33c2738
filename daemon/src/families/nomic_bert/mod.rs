//! nomic-bert sentence embedders: nomic-embed-text v1 and v1.5 as
//! sentence-transformers ships them (a directory: `NomicBertModel`'s
//! weights, its search prompts) and as GGUF files the way llama.cpp's
//! converter writes them (`general.architecture = nomic-bert`: ollama's
//! `nomic-embed-text`, the most pulled embedder there). The encoder
//! (`model`), its shape (`config`), the GGUF's names (`gguf`); pooling,
//! batching and the store as every embedder has them
//! (`families::bert::assemble`).
//!
//! Checked against llama.cpp's own `llama-embedding` on a tiny random
//! nomic-bert written as GGUF (scripts/fixtures/nomic_reference.py;
//! `numerics::embeddings`): no Python nomic-bert runs here.

mod config;
mod gguf;
mod model;

pub use gguf::load_gguf;

use crate::model::family::Embedder;
use crate::model::options::ModelOptions;
use crate::model::weights::TensorMap;
use anyhow::Result;
use std::path::Path;

/// Loads a sentence-transformers (or bare `NomicBertModel`) directory.
pub fn load_dir(
    dir: &Path,
    raw: &serde_json::Value,
    options: ModelOptions,
    memo: Option<&sled::Tree>,
) -> Result<Box<dyn Embedder>> {
    let config = config::NomicBertConfig::from_json(raw)?;
    let t = TensorMap::from_safetensors_dir(dir, crate::model::vlm_dir::quantization(raw), options.form)?;
    let mut t = if t.has("bert.emb_ln.weight") { t.strip_prefix("bert.") } else { t };
    let encoder = model::NomicBertEncoder::load(config.clone(), &mut t)?;
    let positions = encoder.positions();
    crate::families::bert::embedder_from_dir(
        dir,
        Box::new(encoder),
        positions,
        "nomic-bert",
        &["embeddings.", "emb_ln.", "encoder.", "bert."],
        &format!("{config:?}"),
        memo,
    )
}
