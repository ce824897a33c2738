//! ModernBERT sentence embedders as sentence-transformers ships them
//! (modernbert-embed-base, gte-modernbert-base): the encoder (`model`), its
//! shape (`config`); pooling, normalization and length from the directory
//! (`model::sentence`), batching and the store as every embedder has them
//! (`families::bert::assemble`).
//!
//! Checked against mlx-embeddings' `modernbert.py` on the same weights
//! (scripts/fixtures/modernbert_reference.py; `numerics::embeddings`).

mod config;
mod model;

use crate::model::family::Embedder;
use crate::model::options::ModelOptions;
use crate::model::weights::TensorMap;
use anyhow::Result;
use std::path::Path;

/// Loads a sentence-transformers (or bare `ModernBertModel`) directory; a
/// full checkpoint's `model.` prefix is dropped with its heads.
pub fn load_dir(
    dir: &Path,
    raw: &serde_json::Value,
    options: ModelOptions,
    memo: Option<&sled::Tree>,
) -> Result<Box<dyn Embedder>> {
    let config = config::ModernBertConfig::from_json(raw)?;
    let t = TensorMap::from_safetensors_dir(dir, crate::model::vlm_dir::quantization(raw), options.form)?;
    if t.has("classifier.weight") {
        anyhow::bail!("{}: a ModernBERT classifier (a reranker) is not served yet; its embedders are", dir.display());
    }
    let prefixed = t.has("model.embeddings.tok_embeddings.weight");
    let mut t = if prefixed { t.strip_prefix("model.") } else { t };
    let encoder = model::ModernBertEncoder::load(config.clone(), &mut t)?;
    let positions = encoder.positions();
    let prefixes: &[&str] = if prefixed { &["model."] } else { &["embeddings.", "layers.", "final_norm."] };
    crate::families::bert::embedder_from_dir(
        dir,
        Box::new(encoder),
        positions,
        "modernbert",
        prefixes,
        &format!("{config:?}"),
        memo,
    )
}
