//! A decoder read as a sentence embedder, as sentence-transformers ships
//! Qwen3-Embedding (and gte-Qwen2, SFR-Embedding): the directory of a chat
//! family's transformer (here the `llama` family's Qwen3) with
//! sentence-transformers' files beside it. The vector is the final norm's
//! output at the input's last token (last-token pooling; the tokenizer
//! ends each input with `<|endoftext|>`), normalized; a query is embedded
//! after its instruction (`config_sentence_transformers.json`'s `prompts`),
//! a document without; `dimensions` keeps the first values (Matryoshka).
//!
//! Checked against mlx-embeddings' `qwen3.py` on the same weights
//! (`numerics::embeddings`).

use crate::model::family::{Embedder, LanguageModel};
use crate::model::kv_cache::KvCache;
use crate::model::positions::MediaPositions;
use crate::model::sentence::{Pooling, SentenceSettings};
use anyhow::{bail, Context, Result};
use mlx_rs::Array;
use std::path::Path;

/// Hidden states of `inputs` (token ids of any lengths) through `lm` as
/// one batch, left-padded as the engine's batched prefill pads: every row's
/// last token is the batch's last position, and the cache's padding keeps
/// the padding out of attention (an empty input reads as one token 0).
pub fn left_padded(lm: &dyn LanguageModel, inputs: &[Vec<u32>]) -> Result<Array> {
    let longest = inputs.iter().map(Vec::len).max().unwrap_or(0).max(1);
    let mut ids = Vec::with_capacity(inputs.len() * longest);
    let mut pads = Vec::with_capacity(inputs.len());
    for input in inputs {
        let pad = longest - input.len().max(1);
        pads.push(pad as i32);
        ids.extend(std::iter::repeat_n(0, pad));
        ids.extend_from_slice(if input.is_empty() { &[0] } else { input });
    }
    let ids = Array::from_slice(&ids, &[inputs.len() as i32, longest as i32]);
    let mut cache = KvCache::batch(lm.num_layers(), pads);
    lm.forward(&lm.embed(&ids)?, &mut cache, &MediaPositions::default())
}

/// A loaded decoder embedder.
pub struct DecoderEmbedder {
    lm: Box<dyn LanguageModel>,
    architecture: &'static str,
    tokenizer: tokenizers::Tokenizer,
    settings: SentenceSettings,
    fingerprint: mlxbc_cache::TowerFingerprint,
    dimensions: usize,
    /// Special tokens the tokenizer puts after an input (Qwen3-Embedding's
    /// `<|endoftext|>`): kept when an input is truncated, as
    /// sentence-transformers' tokenizer keeps them.
    trailing: usize,
}

/// Wraps the decoder `lm` loaded from the sentence-transformers directory
/// `dir` (its `config.json` parsed as `raw`).
pub fn from_decoder(
    dir: &Path,
    raw: &serde_json::Value,
    lm: Box<dyn LanguageModel>,
    memo: Option<&sled::Tree>,
) -> Result<Box<dyn Embedder>> {
    let settings = SentenceSettings::read(dir, lm.context_length() as usize)?;
    if settings.pooling != Pooling::LastToken {
        bail!(
            "{}: a decoder embeds by its last token (1_Pooling's pooling_mode_lasttoken); {:?} pooling of a \
             causal model is not supported",
            dir.display(),
            settings.pooling
        );
    }
    let dimensions = raw.get("hidden_size").and_then(|h| h.as_u64()).context("config.json names no hidden_size")?;
    let mut tokenizer = crate::model::tokenizer::from_file(&dir.join("tokenizer.json"))?;
    tokenizer.with_padding(None);
    tokenizer.with_truncation(None).map_err(|e| anyhow::anyhow!("tokenizer: {e}"))?;
    let with = tokenizer.encode("a", true).map_err(|e| anyhow::anyhow!("tokenizer: {e}"))?;
    let trailing = with.get_special_tokens_mask().iter().rev().take_while(|&&s| s == 1).count();
    let architecture = lm.architecture();
    let fingerprint = crate::model::vlm_dir::weights_fingerprint(
        dir,
        &["model.", "layers.", "embed_tokens.", "norm."],
        &format!("decoder embedder {architecture} {raw} {}", settings.describe()),
        memo,
    )
    .with_context(|| format!("fingerprinting {}", dir.display()))?;
    Ok(Box::new(DecoderEmbedder {
        lm,
        architecture,
        tokenizer,
        settings,
        fingerprint,
        dimensions: dimensions as usize,
        trailing,
    }))
}

impl Embedder for DecoderEmbedder {
    fn architecture(&self) -> &'static str {
        self.architecture
    }

    fn dimensions(&self) -> usize {
        self.dimensions
    }

    fn max_tokens(&self) -> usize {
        self.settings.max_tokens
    }

    fn tokenize(&self, text: &str) -> Result<Vec<u32>> {
        crate::model::sentence::encode(&self.tokenizer, text)
    }

    fn vocabulary(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }

    fn truncate(&self, ids: &[u32]) -> Vec<u32> {
        crate::model::sentence::truncate(ids, self.max_tokens(), self.trailing)
    }

    fn embed(&self, inputs: &[Vec<u32>]) -> Result<Vec<Vec<f32>>> {
        let hidden = left_padded(&*self.lm, inputs)?;
        let states = self.lm.last_states(&hidden)?.as_dtype(mlx_rs::Dtype::Float32)?;
        let states = if self.settings.normalize {
            let norm = states.square()?.sum_axis(-1, true)?.sqrt()?;
            states.divide(mlx_rs::ops::maximum(norm, Array::from_f32(1e-12))?)?
        } else {
            states
        };
        states.eval()?;
        Ok(states.as_slice::<f32>().chunks(self.dimensions).map(<[f32]>::to_vec).collect())
    }

    fn fingerprint(&self) -> mlxbc_cache::TowerFingerprint {
        self.fingerprint
    }

    fn settings(&self) -> String {
        format!("decoder, {}", self.settings.describe())
    }

    fn prompt(&self, name: Option<&str>) -> Result<String> {
        self.settings.prompt(name).map(String::from)
    }
}
