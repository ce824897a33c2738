//! `mlxbc transcribe FILE...`: speech to text with a Whisper model on the
//! daemon, as text, JSON (segments and statistics), SubRip or WebVTT
//! subtitles. A file the daemon has transcribed before goes by hash only:
//! its encoder output is in the feature store.

use anyhow::{bail, Context, Result};
use mlxbc_client::{Client, MediaRef, TranscribeRequest, Transcript};
use std::io::{Read, Write};

/// How a transcript is printed.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Text,
    Json,
    Srt,
    Vtt,
}

#[derive(clap::Args, Debug)]
pub struct TranscribeArgs {
    /// Audio files (WAV, FLAC, MP3, OGG/Vorbis); `-` reads stdin.
    #[arg(required = true)]
    files: Vec<std::path::PathBuf>,
    /// Speech model (default: the first Whisper model installed).
    #[arg(long, short, value_parser = crate::model_arg)]
    model: Option<String>,
    /// The spoken language (ISO 639-1, e.g. en); detected when not given.
    #[arg(long, short)]
    language: Option<String>,
    /// Translate into English (multilingual models).
    #[arg(long)]
    translate: bool,
    /// Text that came before: names and spellings to prefer.
    #[arg(long)]
    prompt: Option<String>,
    /// Decode at this temperature only (default: Whisper's fallback ladder from 0).
    #[arg(long, short)]
    temperature: Option<f32>,
    /// Decode each 30-second window on its own, not fed the text before it
    /// (Whisper's `condition_on_previous_text=False`: steadier on repetitive audio).
    #[arg(long)]
    no_previous_text: bool,
    #[arg(long, short, value_enum, default_value_t = Format::Text)]
    format: Format,
    /// With `--format text`: each segment on its own line with its times.
    #[arg(long)]
    timestamps: bool,
    /// How long the model stays loaded afterwards: 30m, 0, forever.
    #[arg(long)]
    keep_alive: Option<String>,
    /// Print statistics (encoder hits, real-time factor) to stderr.
    #[arg(long, short)]
    verbose: bool,
}

/// Transcribes each file in turn.
pub async fn run(client: &mut Client, args: &TranscribeArgs) -> Result<()> {
    let keep_alive = crate::keep_alive(&args.keep_alive)?;
    let mut out = std::io::stdout().lock();
    for path in &args.files {
        let bytes = if path.as_os_str() == "-" {
            let mut b = Vec::new();
            std::io::stdin().read_to_end(&mut b).context("reading audio from stdin")?;
            b
        } else {
            std::fs::read(path).with_context(|| format!("reading {}", path.display()))?
        };
        if bytes.is_empty() {
            bail!("{}: empty file", path.display());
        }
        let mut request = TranscribeRequest::new(MediaRef::from_bytes(bytes));
        request.model = args.model.clone();
        request.language = args.language.clone();
        request.translate = args.translate;
        request.prompt = args.prompt.clone();
        request.temperature = args.temperature;
        request.condition_on_previous_text = !args.no_previous_text;
        request.keep_alive = keep_alive;
        let t = client.transcribe(request).await.with_context(|| format!("transcribing {}", path.display()))?;
        if args.files.len() > 1 && args.format == Format::Text {
            writeln!(out, "==> {} <==", path.display())?;
        }
        write!(out, "{}", render(&t, args.format, args.timestamps))?;
        if args.verbose {
            let s = &t.stats;
            eprintln!(
                "{}: {:.1} s of audio ({}) in {:.0} ms, real-time factor {:.3}; {} windows, encoder {} hit{} {} miss{} \
                 ({:.0} ms encoding, {:.0} ms decoding, {:.0} ms preparing, {:.0} ms loading)",
                s.model,
                s.audio_seconds,
                t.language,
                s.total_ms,
                s.total_ms / 1000.0 / s.audio_seconds.max(1e-9),
                s.windows,
                s.encoder_hits,
                if s.encoder_hits == 1 { "" } else { "s" },
                s.encoder_misses,
                if s.encoder_misses == 1 { "" } else { "es" },
                s.encode_ms,
                s.decode_ms,
                s.preprocess_ms,
                s.load_ms
            );
        }
    }
    Ok(())
}

/// The transcript in `format`.
pub fn render(t: &Transcript, format: Format, timestamps: bool) -> String {
    use mlxbc_client::subtitles;
    match format {
        Format::Text if timestamps => subtitles::timed_lines(t),
        Format::Text => format!("{}\n", t.text.trim()),
        Format::Json => serde_json::to_string_pretty(t).unwrap_or_default() + "\n",
        Format::Srt => subtitles::srt(t),
        Format::Vtt => subtitles::vtt(t),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlxbc_client::{TranscribeStats, TranscriptSegment};

    fn segment(id: u32, start: f64, end: f64, text: &str) -> TranscriptSegment {
        TranscriptSegment {
            id,
            seek: 0,
            start,
            end,
            text: text.into(),
            tokens: vec![],
            temperature: 0.0,
            avg_logprob: -0.2,
            compression_ratio: 1.0,
            no_speech_prob: 0.01,
        }
    }

    #[test]
    fn subtitles_number_cues_and_format_times() {
        let t = Transcript {
            text: " Hello there. General Kenobi.".into(),
            language: "en".into(),
            segments: vec![segment(0, 0.0, 1.5, " Hello there."), segment(1, 1.5, 3723.25, " General Kenobi.")],
            stats: TranscribeStats::default(),
        };
        assert_eq!(render(&t, Format::Text, false), "Hello there. General Kenobi.\n");
        assert_eq!(
            render(&t, Format::Srt, false),
            "1\n00:00:00,000 --> 00:00:01,500\nHello there.\n\n2\n00:00:01,500 --> 01:02:03,250\nGeneral Kenobi.\n\n"
        );
        assert!(render(&t, Format::Vtt, false).starts_with("WEBVTT\n\n00:00:00.000 --> 00:00:01.500\nHello there."));
        assert!(render(&t, Format::Text, true).contains("[00:00:01.500 --> 01:02:03.250] General Kenobi."));
        let json: serde_json::Value = serde_json::from_str(&render(&t, Format::Json, false)).unwrap();
        assert_eq!(json["segments"][1]["end"], 3723.25);
    }
}
