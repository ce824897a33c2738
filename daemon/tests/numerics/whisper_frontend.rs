//! Whisper's log-mel frontend against mlx-whisper 0.4.3's
//! `log_mel_spectrogram` on the same clip (an espeak-ng sentence, 16 kHz
//! mono): the first 30-second window `[3000, 80]`, as transcription feeds
//! the encoder (tests/fixtures/reference/whisper, made by
//! scripts/fixtures/whisper_reference.py).

use crate::common::*;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;
use mlxbc_daemon::audio::mel;

/// The samples of a 16-bit PCM mono WAV, in [-1, 1).
fn wav_samples(path: &std::path::Path) -> Vec<f32> {
    let bytes = std::fs::read(path).unwrap();
    assert_eq!(&bytes[..4], b"RIFF");
    let mut at = 12;
    while &bytes[at..at + 4] != b"data" {
        at += 8 + u32::from_le_bytes(bytes[at + 4..at + 8].try_into().unwrap()) as usize;
    }
    let len = u32::from_le_bytes(bytes[at + 4..at + 8].try_into().unwrap()) as usize;
    bytes[at + 8..at + 8 + len].chunks_exact(2).map(|c| i16::from_le_bytes([c[0], c[1]]) as f32 / 32768.0).collect()
}

#[test]
fn log_mel_matches_mlx_whisper_within_1e_4() {
    let samples = wav_samples(&reference_path("whisper/clip1.wav"));
    assert_eq!(samples.len(), 130_017, "the committed clip");
    let want = Array::load_safetensors(reference_path("whisper/clip1-mel.safetensors")).unwrap().remove("mel").unwrap();
    let got = mel::log_mel(&samples, mel::WINDOW_SAMPLES, 80).unwrap();
    let got = got.index((..mel::WINDOW_FRAMES as i32, ..));
    assert_eq!(got.shape(), want.shape());
    let (got, want) = (got.as_slice::<f32>().to_vec(), want.as_slice::<f32>());
    // Relative to each value; values under 0.01 (the log-mel is about -0.7 to 1.5,
    // so only those crossing zero) against 0.01, where f32 rounding of the
    // matrix products alone moves the relative difference past 1e-4.
    let worst = got.iter().zip(want).map(|(g, w)| (g - w).abs() / w.abs().max(1e-2)).fold(0f32, f32::max);
    let max_abs = got.iter().zip(want).map(|(g, w)| (g - w).abs()).fold(0f32, f32::max);
    assert!(worst < 1e-4, "worst relative difference {worst}");
    eprintln!("log-mel [3000, 80]: worst relative difference {worst:e}, largest absolute {max_abs:e}");
}
