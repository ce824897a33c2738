//! How sentence-transformers turns an encoder's token states into one
//! vector, as its directory says: `modules.json` (the modules in order: a
//! `Normalize` module normalizes), `1_Pooling/config.json` (mean, CLS or
//! last-token pooling) and `sentence_bert_config.json` (`max_seq_length`).

use anyhow::{bail, Context, Result};
use std::path::Path;

/// Which token states make the vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pooling {
    /// The mean of the input's token states (padding excluded).
    Mean,
    /// The first token's state (`[CLS]`).
    Cls,
    /// The last (non-padding) token's state.
    LastToken,
}

/// A sentence-transformers directory's pooling, normalization and length.
#[derive(Debug, Clone, PartialEq)]
pub struct SentenceSettings {
    pub pooling: Pooling,
    pub normalize: bool,
    /// Tokens an input may have, special tokens included.
    pub max_tokens: usize,
}

impl SentenceSettings {
    /// Reads `dir`'s sentence-transformers files; a bare encoder directory
    /// (no `modules.json`) pools by mean and normalizes, as
    /// sentence-transformers does when it wraps one, within `positions`.
    pub fn read(dir: &Path, positions: usize) -> Result<Self> {
        let json = |name: &str| -> Result<Option<serde_json::Value>> { crate::model::read_json(&dir.join(name)) };
        let modules = json("modules.json")?;
        let types: Vec<String> = modules
            .as_ref()
            .and_then(|m| m.as_array())
            .map(|m| m.iter().filter_map(|x| x.get("type")?.as_str().map(String::from)).collect())
            .unwrap_or_default();
        let normalize = modules.is_none() || types.iter().any(|t| t.ends_with(".Normalize"));
        let pooling_dir = modules
            .as_ref()
            .and_then(|m| m.as_array())
            .and_then(|m| {
                m.iter().find(|x| x.get("type").and_then(|t| t.as_str()).is_some_and(|t| t.ends_with(".Pooling")))
            })
            .and_then(|x| x.get("path")?.as_str().map(String::from))
            .unwrap_or_else(|| "1_Pooling".into());
        let pooling = match json(&format!("{pooling_dir}/config.json"))? {
            None => Pooling::Mean,
            Some(p) => {
                let on = |k: &str| p.get(k).and_then(|v| v.as_bool()).unwrap_or(false);
                match (on("pooling_mode_mean_tokens"), on("pooling_mode_cls_token"), on("pooling_mode_lasttoken")) {
                    (true, false, false) => Pooling::Mean,
                    (false, true, false) => Pooling::Cls,
                    (false, false, true) => Pooling::LastToken,
                    _ => bail!(
                        "{}: only one of mean, CLS or last-token pooling is supported",
                        dir.join(&pooling_dir).display()
                    ),
                }
            }
        };
        let max_tokens = json("sentence_bert_config.json")
            .context("reading sentence_bert_config.json")?
            .and_then(|c| c.get("max_seq_length")?.as_u64())
            .map_or(positions, |m| (m as usize).min(positions));
        Ok(Self { pooling, normalize, max_tokens })
    }

    /// A cross-encoder's (a reranker of pairs, no pooling of its own: its
    /// head reads `[CLS]`): `model_max_length` from tokenizer_config.json
    /// within `positions`, as `CrossEncoder` truncates.
    pub fn for_pairs(dir: &Path, positions: usize) -> Result<Self> {
        let config = crate::model::read_json(&dir.join("tokenizer_config.json"))?;
        let max_tokens =
            config.and_then(|c| c.get("model_max_length")?.as_u64()).map_or(positions, |m| (m as usize).min(positions));
        Ok(Self { pooling: Pooling::Cls, normalize: false, max_tokens })
    }

    /// The settings as the feature store's key and `mlxbc ps` show them.
    pub fn describe(&self) -> String {
        format!("{:?} pooling, normalize {}, max {} tokens", self.pooling, self.normalize, self.max_tokens)
    }
}
