//! A GGUF model written out as an MLX model directory (safetensors,
//! `config.json`, tokenizer files) holding exactly the arrays the daemon
//! computes with, so that mlx-lm can run the very same weights: reference
//! token ids and side-by-side benchmarks.

use super::config::TextConfig;
use crate::model::gguf::{gguf_number, Gguf};
use crate::model::{token_text, tokenizer, weights};
use anyhow::{Context, Result};
use mlx_rs::{Array, Dtype};
use std::collections::BTreeMap;
use std::path::Path;

/// Writes `gguf` as an mlx-lm model directory at `out`; float tensors (dense
/// weights, norms, quantization scales and biases) in `dtype`.
pub fn gguf_to_mlx_dir(gguf: &Path, out: &Path, dtype: Dtype) -> Result<()> {
    let file = Gguf::open(gguf)?;
    let has_output = file.has_tensor("output.weight");
    let rows = file.rows("token_embd.weight").unwrap_or(0) as i32;
    let config = TextConfig::from_gguf(&file, has_output, rows)?;
    let tensors = weights::gguf_tensors(
        &file,
        config.architecture.gguf_qk_rows(config.num_heads, config.num_kv_heads),
        weights::gguf_to_hf_name,
    )?;
    // Sorted, so the same GGUF always gives the same file.
    let tensors: BTreeMap<String, Array> = tensors
        .into_iter()
        .map(|(k, a)| Ok((k, if a.dtype() == Dtype::Uint32 { a } else { a.as_dtype(dtype)? })))
        .collect::<Result<_>>()?;
    // Bits per quantized module; the most common becomes the default and
    // the others per-module entries, which mlx-lm's loader honours.
    let mut bits: BTreeMap<String, i32> = BTreeMap::new();
    for (name, w) in &tensors {
        if let Some(module) = name.strip_suffix(".scales") {
            let packed = tensors[&format!("{module}.weight")].shape()[1];
            // Groups of 32: 32 * bits / 32 packed words per group.
            bits.insert(module.to_string(), packed / w.shape()[1]);
        }
    }
    let mut counts: BTreeMap<i32, usize> = BTreeMap::new();
    bits.values().for_each(|b| *counts.entry(*b).or_default() += 1);
    let default_bits = counts.iter().max_by_key(|(_, n)| **n).map_or(4, |(b, _)| *b);
    let mut quantization = serde_json::json!({ "group_size": 32, "bits": default_bits });
    for (module, b) in bits.iter().filter(|(_, b)| **b != default_bits) {
        quantization[module] = serde_json::json!({ "group_size": 32, "bits": b });
    }

    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    Array::save_safetensors(&tensors, None, out.join("model.safetensors")).context("writing model.safetensors")?;
    let tokenizer = tokenizer::from_gguf(&file)?;
    tokenizer.save(out.join("tokenizer.json"), false).map_err(|e| anyhow::anyhow!("writing tokenizer.json: {e}"))?;
    let id = |key: &str| gguf_number(&file, key).ok().map(|v| v as u32);
    let (bos, eos, eot) =
        (id("tokenizer.ggml.bos_token_id"), id("tokenizer.ggml.eos_token_id"), id("tokenizer.ggml.eot_token_id"));
    let mut hf = config.to_hf_json();
    if !bits.is_empty() {
        hf["quantization"] = quantization;
    }
    hf["eos_token_id"] = serde_json::json!([eos, eot].into_iter().flatten().collect::<Vec<_>>());
    write_json(&out.join("config.json"), &hf)?;
    let mut tok_cfg = serde_json::json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token_text(&tokenizer, bos),
        "eos_token": token_text(&tokenizer, eos),
    });
    if let Some(t) = file.string("tokenizer.chat_template") {
        tok_cfg["chat_template"] = serde_json::json!(t);
    }
    write_json(&out.join("tokenizer_config.json"), &tok_cfg)
}

fn write_json(path: &Path, v: &serde_json::Value) -> Result<()> {
    std::fs::write(path, serde_json::to_string_pretty(v)? + "\n").with_context(|| format!("writing {}", path.display()))
}
