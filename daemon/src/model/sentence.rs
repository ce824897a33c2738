//! How sentence-transformers turns a model's token states into one vector,
//! as its directory says: `modules.json` (the modules in order: a
//! `Normalize` module normalizes), `1_Pooling/config.json` (mean, CLS or
//! last-token pooling), `sentence_bert_config.json` (`max_seq_length`) and
//! `config_sentence_transformers.json` (`prompts`: the instruction put
//! before a query, or a document, as Qwen3-Embedding and E5 want).
//! Shared by the encoder family (`families/bert`) and decoder embedders
//! (`model::decoder_embedder`).

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
    /// Named instructions put before an input (`query`, `document`, ...),
    /// and the one used when a request names none.
    pub prompts: std::collections::BTreeMap<String, String>,
    pub default_prompt: Option<String>,
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
        let (prompts, default_prompt) = read_prompts(dir)?;
        Ok(Self { pooling, normalize, max_tokens, prompts, default_prompt })
    }

    /// True when `dir` is a sentence-transformers directory (its
    /// `modules.json` names a pooling module): a decoder there embeds.
    pub fn is_sentence_dir(dir: &Path) -> bool {
        crate::model::read_json(&dir.join("modules.json")).ok().flatten().is_some_and(|m| {
            m.as_array().is_some_and(|m| {
                m.iter().any(|x| x.get("type").and_then(|t| t.as_str()).is_some_and(|t| t.ends_with(".Pooling")))
            })
        })
    }

    /// The instruction to put before an input for `prompt` (a name in
    /// `prompts`; `None`: the directory's default, if any), or why not.
    pub fn prompt(&self, prompt: Option<&str>) -> Result<&str> {
        match prompt.or(self.default_prompt.as_deref()) {
            None => Ok(""),
            Some(name) => match self.prompts.get(name) {
                Some(p) => Ok(p),
                // Cohere's input types name the same two.
                None => match name {
                    "search_query" if self.prompts.contains_key("query") => Ok(&self.prompts["query"]),
                    "search_document" if self.prompts.contains_key("document") => Ok(&self.prompts["document"]),
                    // A model without instructions embeds queries and documents alike.
                    "query" | "document" | "search_query" | "search_document" if self.prompts.is_empty() => Ok(""),
                    _ => bail!(
                        "no prompt {name:?} in this model's config_sentence_transformers.json (it has: {})",
                        if self.prompts.is_empty() {
                            "none".to_string()
                        } else {
                            self.prompts.keys().cloned().collect::<Vec<_>>().join(", ")
                        }
                    ),
                },
            },
        }
    }

    /// A cross-encoder's (a reranker of pairs, no pooling of its own: its
    /// head reads `[CLS]`): `model_max_length` from tokenizer_config.json
    /// within `positions`, as `CrossEncoder` truncates.
    pub fn for_pairs(dir: &Path, positions: usize) -> Result<Self> {
        let config = crate::model::read_json(&dir.join("tokenizer_config.json"))?;
        let max_tokens =
            config.and_then(|c| c.get("model_max_length")?.as_u64()).map_or(positions, |m| (m as usize).min(positions));
        Ok(Self {
            pooling: Pooling::Cls,
            normalize: false,
            max_tokens,
            prompts: Default::default(),
            default_prompt: None,
        })
    }

    /// The settings as the feature store's key and `mlxbc ps` show them
    /// (the prompts are not: they are part of the text that is hashed).
    pub fn describe(&self) -> String {
        format!("{:?} pooling, normalize {}, max {} tokens", self.pooling, self.normalize, self.max_tokens)
    }
}

/// Token ids of `text` with the tokenizer's special tokens, stripped of
/// surrounding whitespace first, as sentence-transformers strips each text
/// (its instruction included; a byte-level tokenizer would read it).
pub fn encode(tokenizer: &tokenizers::Tokenizer, text: &str) -> Result<Vec<u32>> {
    let enc = tokenizer.encode(text.trim(), true).map_err(|e| anyhow::anyhow!("tokenizing: {e}"))?;
    Ok(enc.get_ids().to_vec())
}

/// `ids` cut to `max` tokens as a tokenizer truncates before it adds its
/// special tokens: the first ones, then the `trailing` special tokens it
/// ends every input with (BERT's `[SEP]`, Qwen3-Embedding's `<|endoftext|>`).
pub fn truncate(ids: &[u32], max: usize, trailing: usize) -> Vec<u32> {
    let max = max.max(trailing + 1);
    if ids.len() <= max {
        return ids.to_vec();
    }
    let mut out = ids[..max - trailing].to_vec();
    out.extend_from_slice(&ids[ids.len() - trailing..]);
    out
}

/// `config_sentence_transformers.json`'s `prompts` and `default_prompt_name`.
fn read_prompts(dir: &Path) -> Result<(std::collections::BTreeMap<String, String>, Option<String>)> {
    let Some(c) = crate::model::read_json(&dir.join("config_sentence_transformers.json"))? else {
        return Ok(Default::default());
    };
    let prompts = c
        .get("prompts")
        .and_then(|p| p.as_object())
        .map(|p| p.iter().filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string()))).collect())
        .unwrap_or_default();
    let default = c.get("default_prompt_name").and_then(|d| d.as_str()).map(String::from);
    Ok((prompts, default))
}

#[cfg(test)]
mod tests {
    /// The first tokens, then the special tokens every input ends with.
    #[test]
    fn truncation_keeps_the_closing_special_tokens() {
        let ids = [101, 1, 2, 3, 4, 5, 102];
        assert_eq!(super::truncate(&ids, 4, 1), vec![101, 1, 2, 102]);
        assert_eq!(super::truncate(&ids, 4, 2), vec![101, 1, 5, 102]);
        assert_eq!(super::truncate(&ids, 7, 1), ids.to_vec());
        assert_eq!(super::truncate(&ids, 0, 1), vec![101, 102], "never fewer than one token and the closing one");
    }
}
