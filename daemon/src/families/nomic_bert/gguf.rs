//! nomic-bert embedders as GGUF files, the way llama.cpp's converter
//! writes them (`conversion/bert.py`'s `NomicBertModel`): ollama's
//! `nomic-embed-text`. Its tensors under GGUF names, its shape in
//! `nomic-bert.*` metadata, its WordPiece vocabulary in llama.cpp's
//! phantom-space form (`model::tokenizer::wordpiece_from_gguf`), its pooling
//! in `nomic-bert.pooling_type`. Vectors are normalized, as ollama and
//! llama-server return them; the search prompts (`search_query: `, ...) are
//! the caller's to write, as with ollama.

use super::config::NomicBertConfig;
use super::model::NomicBertEncoder;
use crate::model::family::Embedder;
use crate::model::gguf::{gguf_number, Gguf};
use crate::model::options::ModelOptions;
use crate::model::weights::{GgufQkRows, TensorMap};
use anyhow::{bail, Context, Result};

/// Loads a nomic-bert GGUF file.
pub fn load_gguf(file: &Gguf, options: ModelOptions, memo: Option<&sled::Tree>) -> Result<Box<dyn Embedder>> {
    match file.string("tokenizer.ggml.model") {
        Some("bert") => {}
        other => bail!(
            "{}: a nomic-bert GGUF with a {} tokenizer is not supported (WordPiece, `bert`, is)",
            file.path().display(),
            other.unwrap_or("missing")
        ),
    }
    if !file.has_tensor("blk.0.attn_qkv.weight") {
        bail!(
            "{}: a nomic-bert GGUF with separate q/k/v projections is not supported (fused ones, as llama.cpp's \
             converter writes them, are)",
            file.path().display()
        );
    }
    let int = |key: &str| -> Result<i64> { Ok(gguf_number(file, &format!("nomic-bert.{key}"))? as i64) };
    let raw = serde_json::json!({
        "model_type": "nomic_bert",
        "n_embd": int("embedding_length")?,
        "n_layer": int("block_count")?,
        "n_head": int("attention.head_count")?,
        "n_inner": int("feed_forward_length")?,
        "n_positions": int("context_length")?,
        "layer_norm_epsilon": gguf_number(file, "nomic-bert.attention.layer_norm_epsilon").unwrap_or(1e-12),
        "rotary_emb_base": gguf_number(file, "nomic-bert.rope.freq_base").unwrap_or(10_000.0),
    });
    let config = NomicBertConfig::from_json(&raw).context("the GGUF's nomic-bert.* metadata")?;
    let mut t = TensorMap::from_gguf_named(file, GgufQkRows::AsHf, hf_name, options.form)?;
    let encoder = NomicBertEncoder::load(config.clone(), &mut t)?;
    let settings = crate::families::bert::gguf_settings(file, "nomic-bert", encoder.positions())?;
    let tokenizer = crate::model::tokenizer::wordpiece_from_gguf(file)?;
    let fingerprint = mlxbc_cache::TowerFingerprint::of_file(
        file.path(),
        &format!("nomic-bert gguf {config:?} {}", settings.describe()),
        memo,
    )
    .with_context(|| format!("fingerprinting {}", file.path().display()))?;
    crate::families::bert::assemble(Box::new(encoder), "nomic-bert", None, settings, tokenizer, fingerprint)
}

/// A nomic-bert GGUF module's name in a Hugging Face `NomicBertModel`
/// checkpoint (gguf-py's `TensorNameMap` for `MODEL_ARCH.NOMIC_BERT`, read
/// backwards).
fn hf_name(module: &str) -> Option<String> {
    let parts: Vec<&str> = module.split('.').collect();
    Some(match parts.as_slice() {
        ["token_embd"] => "embeddings.word_embeddings".into(),
        ["token_types"] => "embeddings.token_type_embeddings".into(),
        ["token_embd_norm"] => "emb_ln".into(),
        ["blk", n, kind] => {
            let hf = match *kind {
                "attn_qkv" => "attn.Wqkv",
                "attn_output" => "attn.out_proj",
                "attn_output_norm" => "norm1",
                "ffn_up" => "mlp.fc11",
                "ffn_gate" => "mlp.fc12",
                "ffn_down" => "mlp.fc2",
                "layer_output_norm" => "norm2",
                _ => return None,
            };
            format!("encoder.layers.{n}.{hf}")
        }
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    /// Every tensor llama.cpp's converter writes for a nomic-bert maps back
    /// to the name `NomicBertEncoder::load` reads.
    #[test]
    fn gguf_names_map_to_nomic_names() {
        for (gguf, hf) in [
            ("token_embd", "embeddings.word_embeddings"),
            ("token_types", "embeddings.token_type_embeddings"),
            ("token_embd_norm", "emb_ln"),
            ("blk.3.attn_qkv", "encoder.layers.3.attn.Wqkv"),
            ("blk.0.ffn_up", "encoder.layers.0.mlp.fc11"),
            ("blk.0.ffn_gate", "encoder.layers.0.mlp.fc12"),
            ("blk.11.layer_output_norm", "encoder.layers.11.norm2"),
        ] {
            assert_eq!(super::hf_name(gguf).as_deref(), Some(hf));
        }
        assert_eq!(super::hf_name("blk.0.attn_q"), None);
        assert_eq!(super::hf_name("position_embd"), None);
    }
}
