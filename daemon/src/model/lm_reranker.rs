//! A decoder read as a reranker, as Qwen ships Qwen3-Reranker: a chat
//! family's causal LM (here the `llama` family's Qwen3) asked whether a
//! document meets a query, the relevance being the probability of "yes"
//! against "no" at the answer's first position:
//! `softmax([logit("no"), logit("yes")])[1]`, as the model card's code
//! (and vLLM's `classifier_from_token`) computes it. The prompt is the model
//! card's: a system turn saying to answer "yes" or "no", then
//! `<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}`,
//! then an empty thinking block; a pair longer than the model reads is cut
//! at its end (the document's tail), prefix and suffix kept.
//!
//! Its directory is an ordinary Qwen3 checkpoint (no file says "reranker"),
//! so it is recognized by its name, as Hugging Face and mlx-community name
//! them (`Qwen3-Reranker-0.6B`, `Qwen3-Reranker-4B-4bit`, ...): a Qwen3
//! directory whose name holds "reranker".
//!
//! Checked against mlx-lm's `qwen3.py` and the model card's transformers
//! code on the same weights (`numerics::embeddings`).

use crate::model::family::{Embedder, LanguageModel};
use anyhow::{bail, Context, Result};
use mlx_rs::Array;
use std::path::Path;

/// The model card's system turn and the user turn's opening.
const PREFIX: &str = "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and \
                      the Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n\
                      <|im_start|>user\n";
/// The user turn's end and the assistant's empty thinking block.
const SUFFIX: &str = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n";
/// The model card's default instruction.
pub const DEFAULT_INSTRUCTION: &str = "Given a web search query, retrieve relevant passages that answer the query";
/// The model card's `max_length` for a whole prompt.
const MAX_TOKENS: usize = 8192;

/// True when `dir` (its `config.json` parsed as `raw`) holds a decoder
/// reranker: a Qwen3 causal LM whose directory is named as a reranker (in
/// a Hugging Face cache, the repository's folder above `snapshots/`).
pub fn is_reranker_dir(dir: &Path, raw: &serde_json::Value) -> bool {
    let qwen3 = raw.get("model_type").and_then(|t| t.as_str()) == Some("qwen3");
    let name = |p: &Path| p.file_name().and_then(|n| n.to_str()).map(str::to_ascii_lowercase);
    let named = name(dir).is_some_and(|n| n.contains("reranker"))
        || dir.parent().is_some_and(|snapshots| {
            name(snapshots).as_deref() == Some("snapshots")
                && snapshots.parent().and_then(name).is_some_and(|n| n.contains("reranker"))
        });
    qwen3 && named
}

/// A loaded decoder reranker.
pub struct LmReranker {
    lm: Box<dyn LanguageModel>,
    architecture: &'static str,
    tokenizer: tokenizers::Tokenizer,
    prefix: Vec<u32>,
    suffix: Vec<u32>,
    /// The ids of "yes" and "no", whose logits are compared.
    yes: u32,
    no: u32,
    max_tokens: usize,
    fingerprint: mlxbc_cache::TowerFingerprint,
}

/// Wraps the decoder `lm` loaded from the reranker directory `dir` (its
/// `config.json` parsed as `raw`).
pub fn from_decoder(
    dir: &Path,
    raw: &serde_json::Value,
    lm: Box<dyn LanguageModel>,
    memo: Option<&sled::Tree>,
) -> Result<Box<dyn Embedder>> {
    let mut tokenizer = crate::model::tokenizer::from_file(&dir.join("tokenizer.json"))?;
    tokenizer.with_padding(None);
    tokenizer.with_truncation(None).map_err(|e| anyhow::anyhow!("tokenizer: {e}"))?;
    let token = |t: &str| {
        tokenizer.token_to_id(t).with_context(|| format!("{}: the tokenizer has no {t:?} token", dir.display()))
    };
    let (yes, no) = (token("yes")?, token("no")?);
    let ids = |text: &str| -> Result<Vec<u32>> {
        Ok(tokenizer.encode(text, false).map_err(|e| anyhow::anyhow!("tokenizer: {e}"))?.get_ids().to_vec())
    };
    let (prefix, suffix) = (ids(PREFIX)?, ids(SUFFIX)?);
    let max_tokens = MAX_TOKENS.min(lm.context_length() as usize);
    if max_tokens <= prefix.len() + suffix.len() + 8 {
        bail!("{}: a context of {max_tokens} tokens leaves no room for a query and a document", dir.display());
    }
    let architecture = lm.architecture();
    let fingerprint = crate::model::vlm_dir::weights_fingerprint(
        dir,
        &["model.", "layers.", "embed_tokens.", "norm.", "lm_head."],
        &format!("lm reranker {architecture} {raw} {PREFIX} {SUFFIX} {max_tokens}"),
        memo,
    )
    .with_context(|| format!("fingerprinting {}", dir.display()))?;
    Ok(Box::new(LmReranker { lm, architecture, tokenizer, prefix, suffix, yes, no, max_tokens, fingerprint }))
}

impl Embedder for LmReranker {
    fn architecture(&self) -> &'static str {
        "qwen3 reranker"
    }

    fn dimensions(&self) -> usize {
        1
    }

    fn max_tokens(&self) -> usize {
        self.max_tokens
    }

    fn tokenize(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self.tokenizer.encode(text, false).map_err(|e| anyhow::anyhow!("tokenizing: {e}"))?.get_ids().to_vec())
    }

    fn vocabulary(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }

    fn truncate(&self, ids: &[u32]) -> Vec<u32> {
        ids[..ids.len().min(self.max_tokens)].to_vec()
    }

    fn reranks(&self) -> bool {
        true
    }

    fn takes_instruction(&self) -> bool {
        true
    }

    fn tokenize_pair(&self, query: &str, document: &str, instruction: Option<&str>) -> Result<Vec<u32>> {
        let instruction = instruction.unwrap_or(DEFAULT_INSTRUCTION);
        let mut pair =
            self.tokenize(&format!("<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"))?;
        pair.truncate(self.max_tokens - self.prefix.len() - self.suffix.len());
        Ok([&self.prefix[..], &pair, &self.suffix].concat())
    }

    fn embed(&self, inputs: &[Vec<u32>]) -> Result<Vec<Vec<f32>>> {
        let hidden = crate::model::decoder_embedder::left_padded(&*self.lm, inputs)?;
        let logits = self.lm.logits(&hidden)?.as_dtype(mlx_rs::Dtype::Float32)?;
        let pick = Array::from_slice(&[self.no as i32, self.yes as i32], &[2]);
        let no_yes = logits.take_axis(&pick, -1)?;
        let probabilities = mlx_rs::ops::softmax_axis(&no_yes, -1, None)?;
        probabilities.eval()?;
        // Each row's [p(no), p(yes)]: the score is p(yes).
        Ok(probabilities.as_slice::<f32>().chunks(2).map(|p| vec![p[1]]).collect())
    }

    fn fingerprint(&self) -> mlxbc_cache::TowerFingerprint {
        self.fingerprint
    }

    fn settings(&self) -> String {
        format!("{} reranker (yes/no), max {} tokens", self.architecture, self.max_tokens)
    }
}
