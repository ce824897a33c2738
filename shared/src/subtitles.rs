//! Transcripts as subtitles (SubRip, WebVTT) and timed text: what
//! `mlxbc transcribe --format` and the gateway's `response_format` print.

use crate::protocol::Transcript;

/// `HH:MM:SS,mmm` (SubRip) or `HH:MM:SS.mmm` (WebVTT).
pub fn clock(seconds: f64, separator: char) -> String {
    let ms = (seconds.max(0.0) * 1000.0).round() as u64;
    format!("{:02}:{:02}:{:02}{separator}{:03}", ms / 3_600_000, ms / 60_000 % 60, ms / 1000 % 60, ms % 1000)
}

fn spoken(t: &Transcript) -> impl Iterator<Item = &crate::protocol::TranscriptSegment> {
    t.segments.iter().filter(|s| !s.text.trim().is_empty())
}

/// SubRip: numbered cues.
pub fn srt(t: &Transcript) -> String {
    spoken(t)
        .enumerate()
        .map(|(i, s)| format!("{}\n{} --> {}\n{}\n\n", i + 1, clock(s.start, ','), clock(s.end, ','), s.text.trim()))
        .collect()
}

/// WebVTT.
pub fn vtt(t: &Transcript) -> String {
    let cues: String = spoken(t)
        .map(|s| format!("{} --> {}\n{}\n\n", clock(s.start, '.'), clock(s.end, '.'), s.text.trim()))
        .collect();
    format!("WEBVTT\n\n{cues}")
}

/// One line per segment: `[start --> end] text`.
pub fn timed_lines(t: &Transcript) -> String {
    spoken(t).map(|s| format!("[{} --> {}] {}\n", clock(s.start, '.'), clock(s.end, '.'), s.text.trim())).collect()
}
