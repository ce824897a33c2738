//! What every vision-language model directory (as mlx-community ships
//! them: `config.json` with `text_config`/`vision_config`,
//! `preprocessor_config.json`, `*.safetensors`) is read with, whatever its
//! family.

use anyhow::{Context, Result};
use mlxbc_cache::TowerFingerprint;
use std::path::Path;

/// Three floats from a processor config (`image_mean`, `image_std`), or `default`.
pub fn three_floats(v: Option<&serde_json::Value>, default: [f32; 3]) -> [f32; 3] {
    match v.and_then(|a| a.as_array()) {
        Some(a) if a.len() == 3 => [0, 1, 2].map(|i| a[i].as_f64().unwrap_or(default[i] as f64) as f32),
        _ => default,
    }
}

/// The fingerprint of the tower: the tensors under `prefixes` in the
/// directory's safetensors files, and `config.json`'s `vision_config`.
/// `memo` remembers it per weight-file identity, so a reload hashes nothing.
pub fn tower_fingerprint(
    dir: &Path,
    prefixes: &[&str],
    raw: &serde_json::Value,
    memo: Option<&sled::Tree>,
) -> Result<TowerFingerprint> {
    weights_fingerprint(dir, prefixes, &raw["vision_config"].to_string(), memo)
        .with_context(|| format!("fingerprinting the vision tower in {}", dir.display()))
}

/// The fingerprint of the tensors under `prefixes` in the directory's
/// safetensors files and of `config` (the text of the tower's settings).
pub fn weights_fingerprint(
    dir: &Path,
    prefixes: &[&str],
    config: &str,
    memo: Option<&sled::Tree>,
) -> Result<TowerFingerprint> {
    let mut files: Vec<_> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    let file_refs: Vec<&Path> = files.iter().map(|p| p.as_path()).collect();
    Ok(TowerFingerprint::compute(&file_refs, prefixes, config, memo)?)
}

/// `config.json`'s quantization section, under either name.
pub fn quantization(raw: &serde_json::Value) -> Option<&serde_json::Value> {
    raw.get("quantization").or(raw.get("quantization_config"))
}
