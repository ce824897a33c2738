//! BERT embedders as GGUF files, the way llama.cpp's converter writes them
//! (`general.architecture = bert`): ollama's `all-minilm`, `bge`,
//! `mxbai-embed-large`, `snowflake-arctic-embed` and llama-server's BERT
//! embedders, and XLM-RoBERTa ones (ollama's `bge-m3`, multilingual-e5).
//! The same encoder as a sentence-transformers directory, its
//! tensors under GGUF names, its shape in `bert.*` metadata, its WordPiece
//! vocabulary in llama.cpp's phantom-space form
//! (`model::tokenizer::wordpiece_from_gguf`) or its SentencePiece one
//! (`unigram_from_gguf`), its pooling in `bert.pooling_type`. Vectors are normalized, as ollama and llama-server
//! return them.
//!
//! Checked against the sentence-transformers directory the file was
//! written from (`scripts/fixtures/bert_to_gguf.py`, llama.cpp's gguf-py):
//! the same token ids, vectors within f16 (or Q8_0) rounding of them
//! (e2e `embeddings::a_bert_gguf_embeds_as_its_directory_does`); an
//! XLM-RoBERTa GGUF against llama.cpp's own `llama-tokenize` and
//! `llama-embedding` on it (scripts/fixtures/xlmr_gguf_reference.py,
//! numerics `an_xlm_roberta_gguf_...`).

use super::config::BertConfig;
use super::model::BertEncoder;
use crate::model::family::Embedder;
use crate::model::gguf::{gguf_number, Gguf};
use crate::model::options::ModelOptions;
use crate::model::sentence::{Pooling, SentenceSettings};
use crate::model::weights::{GgufQkRows, TensorMap};
use anyhow::{bail, Context, Result};

/// Loads a BERT GGUF file.
pub fn load_gguf(file: &Gguf, options: ModelOptions, memo: Option<&sled::Tree>) -> Result<Box<dyn Embedder>> {
    if file.has_tensor("cls.output.weight") || file.has_tensor("cls.weight") {
        bail!(
            "{} is a reranker's GGUF (a classifier head): rerankers are served from their \
             sentence-transformers directory, not GGUF, for now",
            file.path().display()
        );
    }
    // llama.cpp writes XLM-RoBERTa embedders (bge-m3, multilingual-e5) as
    // `bert` too, with a SentencePiece vocabulary (`t5`) and the position
    // rows before the padding id's cut off (so positions count from 0 here).
    let tokenizer = match file.string("tokenizer.ggml.model") {
        Some("bert") => crate::model::tokenizer::wordpiece_from_gguf(file)?,
        Some("t5") => crate::model::tokenizer::unigram_from_gguf(file)
            .with_context(|| format!("{}: its SentencePiece (t5) vocabulary", file.path().display()))?,
        other => bail!(
            "{}: a BERT GGUF with a {} tokenizer is not supported (WordPiece, `bert`, and SentencePiece, `t5`, are)",
            file.path().display(),
            other.unwrap_or("missing")
        ),
    };
    if file.has_tensor("blk.0.attn_qkv.weight") {
        bail!(
            "{}: a BERT GGUF with fused q/k/v projections is not supported (separate ones are)",
            file.path().display()
        );
    }
    let int = |key: &str| -> Result<i64> { Ok(gguf_number(file, &format!("bert.{key}"))? as i64) };
    // The position rows the file holds (its context length says the same).
    let positions = file.rows("position_embd.weight").map_or_else(|| int("context_length"), |r| Ok(r as i64))?;
    let raw = serde_json::json!({
        "model_type": "bert",
        "hidden_size": int("embedding_length")?,
        "num_hidden_layers": int("block_count")?,
        "num_attention_heads": int("attention.head_count")?,
        "max_position_embeddings": positions,
        "layer_norm_eps": gguf_number(file, "bert.attention.layer_norm_epsilon").unwrap_or(1e-12),
    });
    let config = BertConfig::from_json(&raw).context("the GGUF's bert.* metadata")?;
    let mut t = TensorMap::from_gguf_named(file, GgufQkRows::AsHf, hf_name, options.form)?;
    let encoder = BertEncoder::load(config.clone(), &mut t)?;
    let settings = gguf_settings(file, "bert", encoder.positions())?;
    let fingerprint = mlxbc_cache::TowerFingerprint::of_file(
        file.path(),
        &format!("bert gguf {config:?} {}", settings.describe()),
        memo,
    )
    .with_context(|| format!("fingerprinting {}", file.path().display()))?;
    super::assemble(Box::new(encoder), "bert", None, settings, tokenizer, fingerprint)
}

/// How an embedder's GGUF (architecture `arch`) says to pool: llama.cpp's
/// `{arch}.pooling_type` (1 mean, 2 CLS, 3 last token; none given: mean);
/// normalized, as ollama and llama-server return vectors; no prompts (the
/// caller writes them, as with ollama).
pub(crate) fn gguf_settings(file: &Gguf, arch: &str, max_tokens: usize) -> Result<SentenceSettings> {
    let key = format!("{arch}.pooling_type");
    let pooling = match file.number(&key).map(|p| p as i64) {
        None | Some(1) => Pooling::Mean,
        Some(2) => Pooling::Cls,
        Some(3) => Pooling::LastToken,
        Some(other) => bail!("{key} {other} is not an embedding's pooling (1 mean, 2 CLS, 3 last token)"),
    };
    Ok(SentenceSettings { pooling, normalize: true, max_tokens, prompts: Default::default(), default_prompt: None })
}

/// A BERT GGUF module's name in a Hugging Face `BertModel` checkpoint
/// (gguf-py's `TensorNameMap` for `MODEL_ARCH.BERT`, read backwards).
fn hf_name(module: &str) -> Option<String> {
    let parts: Vec<&str> = module.split('.').collect();
    Some(match parts.as_slice() {
        ["token_embd"] => "embeddings.word_embeddings".into(),
        ["position_embd"] => "embeddings.position_embeddings".into(),
        ["token_types"] => "embeddings.token_type_embeddings".into(),
        ["token_embd_norm"] => "embeddings.LayerNorm".into(),
        ["blk", n, kind] => {
            let hf = match *kind {
                "attn_q" => "attention.self.query",
                "attn_k" => "attention.self.key",
                "attn_v" => "attention.self.value",
                "attn_output" => "attention.output.dense",
                "attn_output_norm" => "attention.output.LayerNorm",
                "ffn_up" => "intermediate.dense",
                "ffn_down" => "output.dense",
                "layer_output_norm" => "output.LayerNorm",
                _ => return None,
            };
            format!("encoder.layer.{n}.{hf}")
        }
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    /// Every tensor llama.cpp's converter writes for a BERT maps back to the
    /// name `BertEncoder::load` reads.
    #[test]
    fn gguf_names_map_to_bert_names() {
        for (gguf, hf) in [
            ("token_embd", "embeddings.word_embeddings"),
            ("token_embd_norm", "embeddings.LayerNorm"),
            ("blk.5.attn_q", "encoder.layer.5.attention.self.query"),
            ("blk.0.layer_output_norm", "encoder.layer.0.output.LayerNorm"),
            ("blk.11.ffn_down", "encoder.layer.11.output.dense"),
        ] {
            assert_eq!(super::hf_name(gguf).as_deref(), Some(hf));
        }
        assert_eq!(super::hf_name("blk.0.attn_qkv"), None);
        assert_eq!(super::hf_name("output_norm"), None);
    }
}
