//! Streaming detokenization on the real tokenizers of the served families,
//! with tokenizers' own `decode_stream` (what the engine streams with): the
//! pieces, concatenated, are the whole decode (less bytes that never became
//! a character), and no piece holds half a character — on real text and on
//! id sequences as a model may produce them. (The daemon had its own stream
//! decoder; it used the same prefix/read-offset scheme and gave the same
//! pieces on every case here, so it was deleted.)

use mlxbc_daemon::model::tokenizer::from_file;
use tokenizers::Tokenizer;

use crate::common::*;

/// Text with multi-byte characters split over byte tokens, leading spaces,
/// newlines, CJK, accents and emoji.
const TEXTS: &[&str] = &[
    "Hello, world! The café serves crème brûlée.",
    " leading space and  two spaces\nnew line",
    "日本語のテキストと中文。",
    "emoji 🦊🐕‍🦺 and flags 🇫🇷 end",
    "mixed: naïve façade — “quotes” … ✓",
];

fn tokenizers() -> Vec<(&'static str, Tokenizer)> {
    ["mlx/smollm2-mlx", "mlx/tiny-gemma3-vlm", "mlx/tiny-qwen25-vl"]
        .into_iter()
        .map(|rel| {
            let path = fixture(rel).join("tokenizer.json");
            (rel, from_file(&path).unwrap_or_else(|e| panic!("{e:#} (build the fixtures with scripts/test-fixtures)")))
        })
        .collect()
}

/// The streamed pieces of `ids`, concatenated.
fn streamed(name: &str, tok: &Tokenizer, ids: &[u32]) -> String {
    let mut stream = tok.decode_stream(true);
    let mut out = String::new();
    for &id in ids {
        match stream.step(id) {
            Ok(Some(piece)) => {
                assert!(!piece.ends_with('\u{FFFD}'), "{name}: a piece ending in half a character: {piece:?}");
                out.push_str(&piece);
            }
            Ok(None) => {}
            Err(e) => panic!("{name}: decode_stream failed on {ids:?}: {e}"),
        }
    }
    out
}

/// Id sequences as a model may produce them: not the canonical encoding of
/// any text (lone byte tokens, pieces in odd orders), seeded.
fn odd_sequences(tok: &Tokenizer) -> Vec<Vec<u32>> {
    let vocab = tok.get_vocab_size(true) as u64;
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    (0..300).map(|_| (0..24).map(|_| (next() % vocab) as u32).collect()).collect()
}

#[test]
fn streamed_text_is_the_whole_decode_on_every_family_tokenizer() {
    for (name, tok) in tokenizers() {
        for text in TEXTS {
            let ids = tok.encode(*text, false).unwrap().get_ids().to_vec();
            let whole = tok.decode(&ids, true).unwrap();
            assert_eq!(streamed(name, &tok, &ids), whole, "{name}: streamed text differs for {text:?}");
        }
    }
}

#[test]
fn odd_id_sequences_stream_their_whole_decode() {
    for (name, tok) in tokenizers() {
        for ids in odd_sequences(&tok) {
            let whole = tok.decode(&ids, true).unwrap();
            let got = streamed(name, &tok, &ids);
            // Only a last piece ending in bytes that never became a
            // character stays back.
            let rest = whole
                .strip_prefix(got.as_str())
                .unwrap_or_else(|| panic!("{name}: {got:?} is not a prefix of {whole:?}"));
            assert!(rest.is_empty() || rest.ends_with('\u{FFFD}'), "{name}: {rest:?} was held back from {whole:?}");
        }
    }
}
