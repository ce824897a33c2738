//! The tokenizer we rebuild from GGUF metadata, and the chat template we
//! render, against independent references: the HF tokenizer that
//! `transformers` rebuilt from the same GGUF (tests/fixtures/tokenizers), and
//! the prompt ids mlx-lm produced (tests/fixtures/reference).

use mlxbc_daemon::model::{tokenizer, weights::WeightForm, TextModel};
use mlxbc_shared::{ChatMessage, Role};
use std::path::PathBuf;

fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// The fixture directory; a missing fixture fails with how to get it.
fn fixture(rel: &str) -> PathBuf {
    let root = std::env::var_os("MLXBC_TEST_FIXTURES").map(PathBuf::from).unwrap_or_else(|| workspace().join("target/test-fixtures"));
    let p = root.join(rel);
    assert!(p.exists(), "missing test fixture {} — run scripts/test-fixtures (or scripts/test) first", p.display());
    p
}

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
    let file = mlx_rs::io::GgufFile::load(smollm2_gguf()).unwrap();
    let ours = tokenizer::from_gguf(&file).unwrap();
    let reference = tokenizer::from_file(&workspace().join("tests/fixtures/tokenizers/smollm2-135m-instruct/tokenizer.json")).unwrap();
    for text in CORPUS {
        let a = ours.encode(*text, false).unwrap();
        let b = reference.encode(*text, false).unwrap();
        assert_eq!(a.get_ids(), b.get_ids(), "token ids differ for {text:?}");
        assert_eq!(ours.decode(a.get_ids(), false).unwrap(), *text, "round trip of {text:?}");
    }
}

#[test]
fn stream_decoder_never_splits_a_character() {
    let file = mlx_rs::io::GgufFile::load(smollm2_gguf()).unwrap();
    let tok = tokenizer::from_gguf(&file).unwrap();
    let text = "東京 🦀 déjà";
    let ids = tok.encode(text, false).unwrap().get_ids().to_vec();
    let mut dec = tokenizer::StreamDecoder::new();
    let mut out = String::new();
    for id in ids {
        if let Some(piece) = dec.push(&tok, id).unwrap() {
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
            images: vec![],
        })
        .collect()
}

#[test]
fn chat_prompts_tokenize_exactly_like_mlx_lm() {
    let golden: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(workspace().join("tests/fixtures/reference/smollm2-mlx.json")).unwrap()).unwrap();
    for path in [smollm2_gguf(), fixture("mlx/smollm2-mlx")] {
        let model = TextModel::load(&path, WeightForm::DenseF32, None).unwrap();
        for case in golden["cases"].as_array().unwrap() {
            let prompt = model.template.render(&messages(case)).unwrap();
            let ids = model.encode(&prompt).unwrap();
            let want: Vec<u32> = case["prompt_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
            assert_eq!(ids, want, "prompt ids differ for {} with {}", case["messages"], path.display());
        }
        assert!(model.eos_ids.contains(&2), "<|im_end|> (2) must end generation for {}", path.display());
    }
}
