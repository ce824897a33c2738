//! Tokenizers: rebuilt from GGUF metadata (`tokenizer.ggml.*`) into the
//! `tokenizers` crate's JSON form, or read from an HF `tokenizer.json`.
//! Also the streaming detokenizer that never splits a UTF-8 character.

use super::gguf::Gguf;
use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use tokenizers::Tokenizer;

/// GGUF token types (llama.cpp `llama_token_type`).
const TOKEN_TYPE_CONTROL: i32 = 3;
const TOKEN_TYPE_USER_DEFINED: i32 = 4;

/// GPT-2's pre-tokenizer split, as `ByteLevel(use_regex=true)` applies it.
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_SPLIT: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The pre-tokenizer a GGUF `tokenizer.ggml.pre` name stands for (llama.cpp's table).
fn pre_tokenizer_for(pre: &str) -> Result<Value> {
    let split = |pattern: &str| {
        json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}
        ]})
    };
    Ok(match pre {
        "default" | "gpt2" | "gpt-2" | "smollm" | "starcoder" | "refact" | "olmo" | "jina-es" => {
            json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true})
        }
        "llama-bpe" | "llama3" | "smaug-bpe" | "falcon3" | "pixtral" => split(LLAMA3_SPLIT),
        "qwen2" | "deepseek-r1-qwen" | "megrez" => split(QWEN2_SPLIT),
        other => bail!("unsupported GGUF pre-tokenizer {other:?} (supported: gpt2/smollm, llama-bpe, qwen2)"),
    })
}

/// Builds the tokenizer a GGUF file describes (BPE models, `tokenizer.ggml.model = gpt2`).
pub fn from_gguf(file: &Gguf) -> Result<Tokenizer> {
    let model = super::gguf::gguf_string(file, "tokenizer.ggml.model")?;
    if model != "gpt2" {
        bail!("unsupported GGUF tokenizer model {model:?} (supported: gpt2 byte-level BPE)");
    }
    let tokens = file.strings("tokenizer.ggml.tokens").context("GGUF has no tokenizer.ggml.tokens")?;
    let merges = file.strings("tokenizer.ggml.merges").context("GGUF has no tokenizer.ggml.merges")?;
    let types: Vec<i32> = match file.ints("tokenizer.ggml.token_type") {
        Some(t) => t.into_iter().map(|t| t as i32).collect(),
        None => vec![1; tokens.len()],
    };
    let pre = super::gguf::gguf_string(file, "tokenizer.ggml.pre").unwrap_or_else(|_| "default".into());
    let vocab: serde_json::Map<String, Value> = tokens.iter().enumerate().map(|(i, t)| (t.clone(), json!(i))).collect();
    let added: Vec<Value> = tokens
        .iter()
        .enumerate()
        .filter(|(i, _)| matches!(types.get(*i), Some(&TOKEN_TYPE_CONTROL) | Some(&TOKEN_TYPE_USER_DEFINED)))
        .map(|(i, t)| {
            json!({"id": i, "content": t, "single_word": false, "lstrip": false, "rstrip": false,
                   "normalized": false, "special": true})
        })
        .collect();
    let spec = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer_for(&pre)?,
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": merges}
    });
    spec.to_string().parse::<Tokenizer>().map_err(|e| anyhow::anyhow!("building tokenizer from GGUF metadata: {e}"))
}

/// Reads `tokenizer.json`.
pub fn from_file(path: &std::path::Path) -> Result<Tokenizer> {
    Tokenizer::from_file(path).map_err(|e| anyhow::anyhow!("reading tokenizer at {}: {e}", path.display()))
}

/// Why `draft`'s token ids do not mean what `target`'s do (a draft model
/// must share its target's tokenizer: the target verifies the draft's ids
/// as its own): the vocabulary, every token's id, and the added (special)
/// tokens must agree. Whether a token is flagged special may differ (a
/// GGUF's tokenizer flags what a `tokenizer.json` may not).
pub fn disagreement(target: &Tokenizer, draft: &Tokenizer) -> Option<String> {
    let (a, b) = (target.get_vocab(true), draft.get_vocab(true));
    if a.len() != b.len() {
        return Some(format!("its vocabulary has {} tokens, the model's {}", b.len(), a.len()));
    }
    if let Some((token, id)) = a.iter().find(|(token, id)| b.get(*token) != Some(id)) {
        return Some(match b.get(token) {
            Some(other) => format!("token {token:?} is id {id} for the model and {other} for the draft"),
            None => format!("the model's token {token:?} (id {id}) is not in the draft's vocabulary"),
        });
    }
    let added = |t: &Tokenizer| -> std::collections::BTreeMap<u32, String> {
        t.get_added_tokens_decoder().into_iter().map(|(id, t)| (id, t.content)).collect()
    };
    let (a, b) = (added(target), added(draft));
    let differ = a.iter().find(|(id, content)| b.get(id) != Some(content)).map(|(id, c)| (*id, c.clone()));
    let differ =
        differ.or_else(|| b.iter().find(|(id, content)| a.get(id) != Some(content)).map(|(id, c)| (*id, c.clone())));
    differ.map(|(id, content)| format!("their added (special) tokens differ, first at id {id} ({content:?})"))
}

/// llguidance's parser factory for a tokenizer (for constrained decoding,
/// `crate::decoding::constraint`): the tokenizer as llguidance sees it, with
/// the model's end-of-sequence ids (allowed where the grammar may end).
pub fn constraint_factory(
    tokenizer: &tokenizers::Tokenizer,
    eos_ids: &[u32],
) -> anyhow::Result<std::sync::Arc<llguidance::ParserFactory>> {
    let mut bytes = toktrie_hf_tokenizers::ByteTokenizer::from_tokenizer(tokenizer.clone())?;
    if !eos_ids.is_empty() {
        bytes.set_eos_tokens(eos_ids);
    }
    let env = bytes.into_tok_env(None)?;
    let mut f = llguidance::ParserFactory::new_simple(&env)?;
    f.quiet();
    Ok(std::sync::Arc::new(f))
}
