//! Llama, Qwen2 and Qwen3: one decoder-only transformer with small flags
//! (q/k/v biases, q/k norms, Llama 3 rope scaling), from GGUF files or
//! HF/MLX directories. Config → model, as mlx-lm's `llama.py`/`qwen2.py`/
//! `qwen3.py`; greedy ids equal mlx-lm's on the same weights.

pub mod config;
pub mod export;
pub mod model;

use crate::model::gguf::{gguf_number, Gguf};
use crate::model::options::ModelOptions;
use crate::model::weights::TensorMap;
use crate::model::{chat_parts, chat_template, chat_template::ChatTemplate, token_text, tokenizer, Model};
use anyhow::{Context, Result};
use config::TextConfig;
use model::Transformer;
use std::path::Path;

/// A GGUF file (any name: ollama keeps them as content-addressed blobs).
pub fn load_gguf(file: &Gguf, form: ModelOptions) -> Result<Model> {
    let has_output = file.has_tensor("output.weight");
    let embd_rows = file.rows("token_embd.weight").unwrap_or(0) as i32;
    let config = TextConfig::from_gguf(file, has_output, embd_rows)?;
    let qk_rows = config.architecture.gguf_qk_rows(config.num_heads, config.num_kv_heads);
    let tensors = TensorMap::from_gguf(file, qk_rows, form.form)?.with_options(&form);
    let tokenizer = tokenizer::from_gguf(file)?;
    let id = |key: &str| gguf_number(file, key).ok().map(|v| v as u32);
    let (bos, eos, eot) =
        (id("tokenizer.ggml.bos_token_id"), id("tokenizer.ggml.eos_token_id"), id("tokenizer.ggml.eot_token_id"));
    let source =
        file.string("tokenizer.chat_template").map(str::to_string).unwrap_or_else(|| chat_template::CHATML.to_string());
    let template = ChatTemplate::new(source, token_text(&tokenizer, bos), token_text(&tokenizer, eos))?;
    let eos_ids = [eos, eot].into_iter().flatten().collect();
    let lm = Transformer::from_tensors(config, tensors, form.shard.as_ref())?;
    Ok(Model::new(Box::new(lm), tokenizer, template, eos_ids, None))
}

/// An HF/MLX directory (`config.json`, `*.safetensors`, tokenizer files).
pub fn load_dir(dir: &Path, raw: &serde_json::Value, form: ModelOptions, _memo: Option<&sled::Tree>) -> Result<Model> {
    let config = TextConfig::from_hf_json(&raw.to_string()).context("config.json")?;
    let quantization = raw.get("quantization").or(raw.get("quantization_config"));
    let tensors = TensorMap::from_safetensors_dir(dir, quantization, form.form)?.with_options(&form);
    let (tokenizer, template, eos_ids) = chat_parts(dir, raw)?;
    let lm = Transformer::from_tensors(config, tensors, form.shard.as_ref())?;
    Ok(Model::new(Box::new(lm), tokenizer, template, eos_ids, None))
}
