//! Tokenizers: rebuilt from GGUF metadata (`tokenizer.ggml.*`) into the
//! `tokenizers` crate's JSON form, or read from an HF `tokenizer.json`.
//! Also the streaming detokenizer that never splits a UTF-8 character.

use super::gguf::Gguf;
use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use tokenizers::Tokenizer;

/// GGUF token types (llama.cpp `llama_token_type`).
const TOKEN_TYPE_UNKNOWN: i32 = 2;
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

/// Builds the WordPiece tokenizer of a BERT GGUF file
/// (`tokenizer.ggml.model = bert`), as Hugging Face's `BertTokenizerFast`
/// of the same vocabulary tokenizes: llama.cpp's converter stores each
/// piece in its "phantom space" form (a word's first piece `x` as `▁x`, a
/// continuation `##x` as `x`, control tokens as they are), undone here; the
/// text is lower-cased and stripped of accents unless the file says
/// otherwise (`tokenizer.ggml.normalizer.lowercase` / `.strip_accents`,
/// llama.cpp's defaults: lower-case, and strip accents where it lower-cases);
/// `[CLS] text [SEP]`, and `[CLS] a [SEP] b [SEP]` with b's type 1 for a pair.
pub fn wordpiece_from_gguf(file: &Gguf) -> Result<Tokenizer> {
    let tokens = file.strings("tokenizer.ggml.tokens").context("GGUF has no tokenizer.ggml.tokens")?;
    let types: Vec<i32> = match file.ints("tokenizer.ggml.token_type") {
        Some(t) => t.into_iter().map(|t| t as i32).collect(),
        None => vec![1; tokens.len()],
    };
    let mut vocab = serde_json::Map::new();
    let mut pieces = Vec::with_capacity(tokens.len());
    for (i, t) in tokens.iter().enumerate() {
        let piece = match (types.get(i), t.strip_prefix('\u{2581}')) {
            (Some(&TOKEN_TYPE_CONTROL), _) => t.clone(),
            (_, Some(word_start)) => word_start.to_string(),
            (_, None) => format!("##{t}"),
        };
        // A vocabulary holds each piece once; a later duplicate keeps the first id.
        vocab.entry(piece.clone()).or_insert(json!(i));
        pieces.push(piece);
    }
    let id = |key: &str| file.number(key).map(|v| v as usize).filter(|&i| i < pieces.len());
    let cls =
        id("tokenizer.ggml.cls_token_id").or(id("tokenizer.ggml.bos_token_id")).context("GGUF names no [CLS] token")?;
    let sep = id("tokenizer.ggml.seperator_token_id")
        .or(id("tokenizer.ggml.eos_token_id"))
        .context("GGUF names no [SEP] token")?;
    let unk = id("tokenizer.ggml.unknown_token_id").map_or_else(|| "[UNK]".to_string(), |i| pieces[i].clone());
    let added: Vec<Value> = pieces
        .iter()
        .enumerate()
        .filter(|(i, _)| types.get(*i) == Some(&TOKEN_TYPE_CONTROL))
        .map(|(i, t)| {
            json!({"id": i, "content": t, "single_word": false, "lstrip": false, "rstrip": false,
                   "normalized": false, "special": true})
        })
        .collect();
    let (cls_piece, sep_piece) = (&pieces[cls], &pieces[sep]);
    let flag = |key: &str| file.number(key).map(|v| v != 0.0);
    let lowercase = flag("tokenizer.ggml.normalizer.lowercase").unwrap_or(true);
    let strip_accents = flag("tokenizer.ggml.normalizer.strip_accents").unwrap_or(lowercase);
    let spec = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": {"type": "BertNormalizer", "clean_text": true, "handle_chinese_chars": true,
                       "strip_accents": strip_accents, "lowercase": lowercase},
        "pre_tokenizer": {"type": "BertPreTokenizer"},
        "post_processor": {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": cls_piece, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                       {"SpecialToken": {"id": sep_piece, "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": cls_piece, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": sep_piece, "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}},
                     {"SpecialToken": {"id": sep_piece, "type_id": 1}}],
            "special_tokens": {
                cls_piece.as_str(): {"id": cls_piece, "ids": [cls], "tokens": [cls_piece]},
                sep_piece.as_str(): {"id": sep_piece, "ids": [sep], "tokens": [sep_piece]}}},
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": true},
        "model": {"type": "WordPiece", "unk_token": unk, "continuing_subword_prefix": "##",
                  "max_input_chars_per_word": 100, "vocab": vocab}
    });
    spec.to_string()
        .parse::<Tokenizer>()
        .map_err(|e| anyhow::anyhow!("building a WordPiece tokenizer from GGUF metadata: {e}"))
}

/// Builds the SentencePiece Unigram tokenizer of a GGUF whose vocabulary
/// llama.cpp names `t5` (`tokenizer.ggml.model`): XLM-RoBERTa's, as its
/// converter writes bge-m3 and multilingual-e5 (pieces in fairseq's order,
/// `<s> <pad> </s> <unk>` first), and T5's. As llama.cpp's UGM tokenizer
/// reads the file: the normalizer's precompiled charsmap
/// (`tokenizer.ggml.precompiled_charsmap`, SentencePiece's nmt_nfkc), then,
/// with `tokenizer.ggml.remove_extra_whitespaces`, whitespace stripped at
/// both ends and runs of it made one; spaces as `▁`, one put before the
/// text with `tokenizer.ggml.add_space_prefix`; the pieces' scores
/// (`tokenizer.ggml.scores`) chosen by Viterbi; control and user-defined
/// tokens matched whole; `<s> text </s>` (a pair: `<s> a </s></s> b </s>`).
/// Checked against llama.cpp's `llama-tokenize` and the model's
/// `tokenizer.json` (numerics `an_xlm_roberta_gguf_...`).
pub fn unigram_from_gguf(file: &Gguf) -> Result<Tokenizer> {
    let tokens = file.strings("tokenizer.ggml.tokens").context("GGUF has no tokenizer.ggml.tokens")?;
    let scores = file.floats("tokenizer.ggml.scores").context(
        "GGUF's SentencePiece (t5) vocabulary has no tokenizer.ggml.scores: not a Unigram vocabulary llama.cpp \
         could read either",
    )?;
    if scores.len() != tokens.len() {
        bail!("GGUF has {} tokens but {} scores", tokens.len(), scores.len());
    }
    let types: Vec<i32> = match file.ints("tokenizer.ggml.token_type") {
        Some(t) => t.into_iter().map(|t| t as i32).collect(),
        None => vec![1; tokens.len()],
    };
    let id = |key: &str| file.number(key).map(|v| v as usize).filter(|&i| i < tokens.len());
    let unk = id("tokenizer.ggml.unknown_token_id")
        .or_else(|| types.iter().position(|&t| t == TOKEN_TYPE_UNKNOWN))
        .context("GGUF names no unknown token")?;
    let bos = id("tokenizer.ggml.bos_token_id").context("GGUF names no <s> (bos) token")?;
    let eos = id("tokenizer.ggml.eos_token_id").context("GGUF names no </s> (eos) token")?;
    let added: Vec<Value> = (0..tokens.len())
        .filter(|&i| matches!(types[i], TOKEN_TYPE_CONTROL | TOKEN_TYPE_USER_DEFINED | TOKEN_TYPE_UNKNOWN))
        .map(|i| {
            json!({"id": i, "content": tokens[i], "single_word": false, "lstrip": false, "rstrip": false,
                   "normalized": false, "special": types[i] != TOKEN_TYPE_USER_DEFINED})
        })
        .collect();
    let flag = |key: &str, default: bool| file.number(key).map_or(default, |v| v != 0.0);
    let mut normalizers = Vec::new();
    if let Some(map) = file.ints("tokenizer.ggml.precompiled_charsmap").filter(|m| !m.is_empty()) {
        let bytes: Vec<u8> = map.iter().map(|&b| b as u8).collect();
        use base64::Engine as _;
        let encoded = base64::engine::general_purpose::STANDARD.encode(bytes);
        normalizers.push(json!({"type": "Precompiled", "precompiled_charsmap": encoded}));
    }
    if flag("tokenizer.ggml.remove_extra_whitespaces", true) {
        normalizers.push(json!({"type": "Strip", "strip_left": true, "strip_right": true}));
        normalizers.push(json!({"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": " "}));
    }
    let prepend = if flag("tokenizer.ggml.add_space_prefix", true) { "always" } else { "never" };
    let metaspace = json!({"type": "Metaspace", "replacement": "\u{2581}", "prepend_scheme": prepend, "split": true});
    let (bos_piece, eos_piece) = (&tokens[bos], &tokens[eos]);
    let special = |piece: &str| json!({"SpecialToken": {"id": piece, "type_id": 0}});
    let sequence = |name: &str| json!({"Sequence": {"id": name, "type_id": 0}});
    let vocab: Vec<Value> = tokens.iter().zip(&scores).map(|(t, s)| json!([t, s])).collect();
    let spec = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": {"type": "Sequence", "normalizers": normalizers},
        "pre_tokenizer": metaspace,
        "post_processor": {"type": "TemplateProcessing",
            "single": [special(bos_piece), sequence("A"), special(eos_piece)],
            "pair": [special(bos_piece), sequence("A"), special(eos_piece), special(eos_piece), sequence("B"),
                     special(eos_piece)],
            "special_tokens": {
                bos_piece.as_str(): {"id": bos_piece, "ids": [bos], "tokens": [bos_piece]},
                eos_piece.as_str(): {"id": eos_piece, "ids": [eos], "tokens": [eos_piece]}}},
        "decoder": metaspace,
        "model": {"type": "Unigram", "unk_id": unk, "vocab": vocab, "byte_fallback": false}
    });
    spec.to_string()
        .parse::<Tokenizer>()
        .map_err(|e| anyhow::anyhow!("building a SentencePiece Unigram tokenizer from GGUF metadata: {e}"))
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
