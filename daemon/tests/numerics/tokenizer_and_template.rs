//! The tokenizer we rebuild from GGUF metadata, and the chat template we
//! render, against independent references: the HF tokenizer that
//! `transformers` rebuilt from the same GGUF (tests/fixtures/tokenizers), and
//! the prompt ids mlx-lm produced (tests/fixtures/reference).

use mlxbc_daemon::model::{tokenizer, weights::WeightForm};
use mlxbc_shared::{ChatMessage, Role};
use std::path::PathBuf;

use crate::common::*;

fn smollm2_gguf() -> PathBuf {
    fixture("models/SmolLM2-135M-Instruct.Q4_1.gguf")
}

const CORPUS: &[&str] = &[
    "What is the capital of France?",
    "Hello, world! 123 4567 89.01",
    "  leading and trailing spaces  ",
    "fn main() {\n    println!(\"{}\", x + 1);\n}\n",
    "naïve café — déjà vu; 東京は日本の首都です。 Привет мир",
    "emoji: 🦀🚀 and combining e\u{301}",
    "tabs\tand\r\nwindows newlines\n\n\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "I'm sure they'll've done it; we'd known. DON'T SHOUT",
    "https://example.com/path?query=1&b=2#frag",
];

#[test]
fn gguf_tokenizer_matches_the_hf_reference_on_a_varied_corpus() {
    let file = mlxbc_daemon::model::gguf::Gguf::open(&smollm2_gguf()).unwrap();
    let ours = tokenizer::from_gguf(&file).unwrap();
    let reference =
        tokenizer::from_file(&workspace().join("tests/fixtures/tokenizers/smollm2-135m-instruct/tokenizer.json"))
            .unwrap();
    for text in CORPUS {
        let a = ours.encode(*text, false).unwrap();
        let b = reference.encode(*text, false).unwrap();
        assert_eq!(a.get_ids(), b.get_ids(), "token ids differ for {text:?}");
        assert_eq!(ours.decode(a.get_ids(), false).unwrap(), *text, "round trip of {text:?}");
    }
}

#[test]
fn stream_decoder_never_splits_a_character() {
    let file = mlxbc_daemon::model::gguf::Gguf::open(&smollm2_gguf()).unwrap();
    let tok = tokenizer::from_gguf(&file).unwrap();
    let text = "東京 🦀 déjà";
    let ids = tok.encode(text, false).unwrap().get_ids().to_vec();
    // The GGUF-built tokenizer streams through tokenizers' decode_stream, as the engine does.
    let mut dec = tok.decode_stream(true);
    let mut out = String::new();
    for id in ids {
        if let Some(piece) = dec.step(id).unwrap() {
            assert!(!piece.contains('\u{FFFD}'), "piece {piece:?} holds a replacement character");
            out.push_str(&piece);
        }
    }
    assert_eq!(out, text);
}

fn messages(case: &serde_json::Value) -> Vec<ChatMessage> {
    case["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| ChatMessage {
            role: match m["role"].as_str().unwrap() {
                "system" => Role::System,
                "assistant" => Role::Assistant,
                _ => Role::User,
            },
            content: m["content"].as_str().unwrap().to_string(),
            media: vec![],
            tool_calls: vec![],
            tool_call_id: None,
        })
        .collect()
}

#[test]
fn chat_prompts_tokenize_exactly_like_mlx_lm() {
    let golden: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(workspace().join("tests/fixtures/reference/smollm2-mlx.json")).unwrap(),
    )
    .unwrap();
    for path in [smollm2_gguf(), fixture("mlx/smollm2-mlx")] {
        let model = mlxbc_daemon::families::load(&path, WeightForm::DenseF32, None).unwrap();
        for case in golden["cases"].as_array().unwrap() {
            let prompt = model.prompter.template.render(&messages(case)).unwrap();
            let ids = model.encode(&prompt).unwrap();
            let want: Vec<u32> =
                case["prompt_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
            assert_eq!(ids, want, "prompt ids differ for {} with {}", case["messages"], path.display());
        }
        assert!(model.eos_ids.contains(&2), "<|im_end|> (2) must end generation for {}", path.display());
    }
}

/// The VLM fixtures' tokenizers (rebuilt from the Gemma 3 and Qwen2.5 GGUF
/// metadata by scripts/fixtures/gguf_tokenizer.py) against independent
/// references: SentencePiece itself for Gemma 3, and transformers' GGUF
/// loader for Qwen2.5 (tests/fixtures/reference/tokenizers.json, made by
/// scripts/goldens/tokenizer_goldens.py).
#[test]
fn vlm_fixture_tokenizers_match_sentencepiece_and_transformers() {
    let golden = reference_json("tokenizers.json");
    for (family, dir) in [("gemma3", "mlx/tiny-gemma3-vlm"), ("qwen2.5", "mlx/tiny-qwen25-vl")] {
        let tok = tokenizer::from_file(&fixture(dir).join("tokenizer.json")).unwrap();
        let cases = golden[family]["cases"].as_array().unwrap();
        assert!(cases.len() > 10);
        for case in cases {
            let text = case[0].as_str().unwrap();
            let want: Vec<u32> = serde_json::from_value(case[1].clone()).unwrap();
            let got = tok.encode(text, false).unwrap().get_ids().to_vec();
            assert_eq!(got, want, "{family} ({}): {text:?}", golden[family]["reference"]);
            // And back: byte fallback and "▁" decode to the original text.
            assert_eq!(tok.decode(&got, false).unwrap(), text, "{family}: decoding {text:?}");
        }
    }
}
