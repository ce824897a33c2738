//! Model families, one folder each (Config → layers → model, as
//! candle-transformers and mlx-lm write them), and the one table that maps
//! a checkpoint to its family. Each family implements the seams of
//! `crate::model::family` and builds a `crate::model::Model`; nothing
//! outside this folder names a family. Adding one: docs/adding-a-family.md.

pub mod gemma3;
pub mod llama;
pub mod qwen2_5_vl;

use crate::model::gguf::{gguf_string, Gguf};
use crate::model::Model;
use crate::options::ModelOptions;
use anyhow::{bail, Context, Result};
use std::path::Path;

/// Loads a model directory: its files, its parsed `config.json`, how to
/// hold the weights, and the store's memo of tower fingerprints.
pub type DirLoader = fn(&Path, &serde_json::Value, ModelOptions, Option<&sled::Tree>) -> Result<Model>;

/// Loads an opened GGUF file.
pub type GgufLoader = fn(&Gguf, ModelOptions) -> Result<Model>;

/// One family: the names checkpoints give it, and its loaders.
pub struct Family {
    /// `config.json`'s `model_type` values.
    pub model_types: &'static [&'static str],
    /// GGUF `general.architecture` values.
    pub gguf_architectures: &'static [&'static str],
    pub load_dir: DirLoader,
    pub load_gguf: Option<GgufLoader>,
}

/// Every family served.
pub const FAMILIES: &[Family] = &[
    Family {
        model_types: &["llama", "mistral", "qwen2", "qwen3"],
        gguf_architectures: &["llama", "mistral", "qwen2", "qwen3"],
        load_dir: llama::load_dir,
        load_gguf: Some(llama::load_gguf),
    },
    Family { model_types: &["gemma3"], gguf_architectures: &[], load_dir: gemma3::load_dir, load_gguf: None },
    Family { model_types: &["qwen2_5_vl"], gguf_architectures: &[], load_dir: qwen2_5_vl::load_dir, load_gguf: None },
];

/// The `model_type`s and GGUF architectures served, for error messages.
fn supported() -> String {
    let mut names: Vec<&str> = FAMILIES.iter().flat_map(|f| f.model_types.iter().copied()).collect();
    names.dedup();
    names.join(", ")
}

/// Loads a `.gguf` file or a model directory with its family's loader.
/// `memo` remembers tower fingerprints per weight-file identity.
pub fn load(path: &Path, options: impl Into<ModelOptions>, memo: Option<&sled::Tree>) -> Result<Model> {
    let options = options.into();
    if path.is_dir() {
        let text = std::fs::read_to_string(path.join("config.json"))
            .with_context(|| format!("reading {}/config.json", path.display()))?;
        let raw: serde_json::Value = serde_json::from_str(&text).context("parsing config.json")?;
        let Some(model_type) = raw.get("model_type").and_then(|t| t.as_str()) else {
            bail!("{}/config.json names no model_type", path.display());
        };
        let Some(family) = FAMILIES.iter().find(|f| f.model_types.contains(&model_type)) else {
            bail!("unsupported architecture {model_type:?} (supported: {})", supported());
        };
        (family.load_dir)(path, &raw, options, memo)
    } else if path.is_file() {
        let file = Gguf::open(path).with_context(|| format!("reading GGUF at {}", path.display()))?;
        let arch = gguf_string(&file, "general.architecture")?;
        let loader = FAMILIES.iter().find(|f| f.gguf_architectures.contains(&arch.as_str())).and_then(|f| f.load_gguf);
        let Some(load_gguf) = loader else {
            bail!("unsupported architecture {arch:?} in GGUF (supported: {})", supported());
        };
        load_gguf(&file, options)
    } else {
        bail!("model path {} does not exist", path.display())
    }
}
