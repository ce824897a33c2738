//! Audio files → 16 kHz mono f32 samples, for the speech families.
//!
//! Containers and codecs are symphonia's (WAV, FLAC, MP3, OGG/Vorbis); the
//! resampler is rubato's FFT resampler, run chunk by chunk so a long file
//! at 48 kHz stereo never sits in memory at its own rate. Everything a
//! peer controls is bounded before it is trusted: the sample rate and the
//! channel count from the header, the duration from the header where it
//! states one and again while decoding (a stream may not state it), so a
//! header that claims three hours, or a 1 kHz file, is refused before any
//! sample is decoded.

use rubato::{FftFixedIn, Resampler};
use symphonia::core::audio::SampleBuffer;
use symphonia::core::codecs::{DecoderOptions, CODEC_TYPE_NULL};
use symphonia::core::errors::Error as SymphoniaError;
use symphonia::core::formats::FormatOptions;
use symphonia::core::io::MediaSourceStream;
use symphonia::core::meta::MetadataOptions;
use symphonia::core::probe::Hint;

/// The rate every speech model here reads.
pub const TARGET_RATE: u32 = 16_000;
/// Rates accepted in a file: telephone speech up to studio masters.
pub const MIN_RATE: u32 = 8_000;
pub const MAX_RATE: u32 = 384_000;
pub const MAX_CHANNELS: usize = 16;
/// The longest audio taken in one request (its 16 kHz samples and log-mel
/// take about 350 MB); longer recordings are split by the client.
pub const MAX_SECONDS: f64 = 3600.0;

/// Why a file was refused.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum AudioError {
    #[error("not an audio file this daemon decodes (WAV, FLAC, MP3, OGG/Vorbis): {0}")]
    Unrecognized(String),
    #[error("the audio is damaged or truncated: {0}")]
    Damaged(String),
    #[error("a sample rate of {0} Hz is outside what speech models take ({MIN_RATE} to {MAX_RATE} Hz)")]
    SampleRate(u32),
    #[error("{0} channels: at most {MAX_CHANNELS}")]
    Channels(usize),
    #[error("the audio is {0:.0} s long, over the {MAX_SECONDS:.0} s limit: split it")]
    TooLong(f64),
    #[error("the audio holds no samples (0 seconds)")]
    Empty,
}

/// Decoded audio at [`TARGET_RATE`], mono.
#[derive(Debug, Clone)]
pub struct Audio {
    pub samples: Vec<f32>,
    /// The file's own rate and channel count (for logs and stats).
    pub source_rate: u32,
    pub source_channels: usize,
}

impl Audio {
    pub fn seconds(&self) -> f64 {
        self.samples.len() as f64 / TARGET_RATE as f64
    }
}

/// Decodes a whole file (`bytes`) to 16 kHz mono.
pub fn decode(bytes: &[u8]) -> Result<Audio, AudioError> {
    let stream = MediaSourceStream::new(Box::new(std::io::Cursor::new(bytes.to_vec())), Default::default());
    let probed = symphonia::default::get_probe()
        .format(&Hint::new(), stream, &FormatOptions::default(), &MetadataOptions::default())
        .map_err(|e| AudioError::Unrecognized(e.to_string()))?;
    let mut format = probed.format;
    let track = format
        .tracks()
        .iter()
        .find(|t| t.codec_params.codec != CODEC_TYPE_NULL)
        .ok_or_else(|| AudioError::Unrecognized("no audio track".into()))?;
    let params = track.codec_params.clone();
    let track_id = track.id;
    let rate = params.sample_rate.ok_or_else(|| AudioError::Unrecognized("no sample rate".into()))?;
    if !(MIN_RATE..=MAX_RATE).contains(&rate) {
        return Err(AudioError::SampleRate(rate));
    }
    if let Some(ch) = params.channels {
        if ch.count() == 0 || ch.count() > MAX_CHANNELS {
            return Err(AudioError::Channels(ch.count()));
        }
    }
    if let Some(frames) = params.n_frames {
        let seconds = frames as f64 / rate as f64;
        if seconds > MAX_SECONDS {
            return Err(AudioError::TooLong(seconds));
        }
    }
    let mut decoder = symphonia::default::get_codecs()
        .make(&params, &DecoderOptions::default())
        .map_err(|e| AudioError::Unrecognized(e.to_string()))?;
    let max_frames = (MAX_SECONDS * rate as f64) as u64;
    let mut to_16k = MonoResampler::new(rate)?;
    let mut frames_in = 0u64;
    let mut channels = params.channels.map_or(0, |c| c.count());
    loop {
        let packet = match format.next_packet() {
            Ok(p) => p,
            Err(SymphoniaError::IoError(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => break,
            Err(SymphoniaError::ResetRequired) => break,
            Err(e) => return Err(AudioError::Damaged(e.to_string())),
        };
        if packet.track_id() != track_id {
            continue;
        }
        let decoded = match decoder.decode(&packet) {
            Ok(d) => d,
            // One bad packet in a long file costs that packet (as ffmpeg does).
            Err(SymphoniaError::DecodeError(e)) => {
                tracing::debug!(error = %e, "skipping an undecodable audio packet");
                continue;
            }
            Err(e) => return Err(AudioError::Damaged(e.to_string())),
        };
        let spec = *decoded.spec();
        channels = spec.channels.count();
        if channels == 0 || channels > MAX_CHANNELS {
            return Err(AudioError::Channels(channels));
        }
        if spec.rate != rate {
            return Err(AudioError::Damaged(format!(
                "the sample rate changes mid-stream ({rate} to {} Hz)",
                spec.rate
            )));
        }
        let mut buffer = SampleBuffer::<f32>::new(decoded.capacity() as u64, spec);
        buffer.copy_interleaved_ref(decoded);
        let interleaved = buffer.samples();
        frames_in += (interleaved.len() / channels) as u64;
        if frames_in > max_frames {
            return Err(AudioError::TooLong(frames_in as f64 / rate as f64));
        }
        let mono = interleaved.chunks_exact(channels).map(|f| f.iter().sum::<f32>() / channels as f32);
        to_16k.push(mono)?;
    }
    if frames_in == 0 {
        return Err(AudioError::Empty);
    }
    let samples = to_16k.finish(frames_in)?;
    Ok(Audio { samples, source_rate: rate, source_channels: channels })
}

/// Mono samples at the source rate in, 16 kHz out, in fixed chunks.
struct MonoResampler {
    resampler: Option<FftFixedIn<f32>>,
    pending: Vec<f32>,
    out: Vec<f32>,
    source_rate: u32,
}

/// Input frames per resampler call.
const CHUNK: usize = 4096;

impl MonoResampler {
    fn new(source_rate: u32) -> Result<Self, AudioError> {
        let resampler = if source_rate == TARGET_RATE {
            None
        } else {
            Some(
                FftFixedIn::<f32>::new(source_rate as usize, TARGET_RATE as usize, CHUNK, 2, 1)
                    .map_err(|e| AudioError::Damaged(format!("resampling from {source_rate} Hz: {e}")))?,
            )
        };
        Ok(Self { resampler, pending: Vec::new(), out: Vec::new(), source_rate })
    }

    fn push(&mut self, mono: impl Iterator<Item = f32>) -> Result<(), AudioError> {
        let Some(r) = self.resampler.as_mut() else {
            self.out.extend(mono);
            return Ok(());
        };
        self.pending.extend(mono);
        let mut at = 0;
        while self.pending.len() - at >= r.input_frames_next() {
            let n = r.input_frames_next();
            let y = r.process(&[&self.pending[at..at + n]], None).map_err(|e| AudioError::Damaged(e.to_string()))?;
            self.out.extend_from_slice(&y[0]);
            at += n;
        }
        self.pending.drain(..at);
        Ok(())
    }

    /// The resampled signal: the resampler's delay trimmed, the length
    /// that of the input at the new rate.
    fn finish(mut self, frames_in: u64) -> Result<Vec<f32>, AudioError> {
        let Some(mut r) = self.resampler.take() else { return Ok(self.out) };
        let want = (frames_in as f64 * TARGET_RATE as f64 / self.source_rate as f64).round() as usize;
        let delay = r.output_delay();
        // Flush: the rest, then silence until the delayed tail is out.
        let rest = std::mem::take(&mut self.pending);
        let y = r.process_partial(Some(&[rest.as_slice()]), None).map_err(|e| AudioError::Damaged(e.to_string()))?;
        self.out.extend_from_slice(&y[0]);
        while self.out.len() < delay + want {
            let y = r.process_partial::<&[f32]>(None, None).map_err(|e| AudioError::Damaged(e.to_string()))?;
            if y[0].is_empty() {
                break;
            }
            self.out.extend_from_slice(&y[0]);
        }
        let mut samples = self.out.split_off(delay.min(self.out.len()));
        samples.truncate(want);
        Ok(samples)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 16-bit PCM WAV of `samples` at `rate`, `channels` interleaved.
    pub fn wav(rate: u32, channels: u16, samples: &[i16]) -> Vec<u8> {
        let data = (samples.len() * 2) as u32;
        let mut b = Vec::new();
        b.extend_from_slice(b"RIFF");
        b.extend_from_slice(&(36 + data).to_le_bytes());
        b.extend_from_slice(b"WAVEfmt ");
        b.extend_from_slice(&16u32.to_le_bytes());
        b.extend_from_slice(&1u16.to_le_bytes());
        b.extend_from_slice(&channels.to_le_bytes());
        b.extend_from_slice(&rate.to_le_bytes());
        b.extend_from_slice(&(rate * channels as u32 * 2).to_le_bytes());
        b.extend_from_slice(&(channels * 2).to_le_bytes());
        b.extend_from_slice(&16u16.to_le_bytes());
        b.extend_from_slice(b"data");
        b.extend_from_slice(&data.to_le_bytes());
        for s in samples {
            b.extend_from_slice(&s.to_le_bytes());
        }
        b
    }

    fn tone(rate: u32, seconds: f64, hz: f64) -> Vec<i16> {
        (0..(rate as f64 * seconds) as usize)
            .map(|i| ((2.0 * std::f64::consts::PI * hz * i as f64 / rate as f64).sin() * 8000.0) as i16)
            .collect()
    }

    #[test]
    fn a_16k_wav_is_taken_as_it_is() {
        let pcm = tone(16_000, 1.0, 440.0);
        let a = decode(&wav(16_000, 1, &pcm)).unwrap();
        assert_eq!(a.samples.len(), 16_000);
        assert!((a.samples[100] - pcm[100] as f32 / 32768.0).abs() < 1e-6);
    }

    #[test]
    fn a_44k_stereo_wav_is_mixed_down_and_resampled_keeping_its_length_and_pitch() {
        let mono = tone(44_100, 2.0, 440.0);
        let stereo: Vec<i16> = mono.iter().flat_map(|&s| [s, s]).collect();
        let a = decode(&wav(44_100, 2, &stereo)).unwrap();
        assert_eq!((a.samples.len(), a.source_rate, a.source_channels), (32_000, 44_100, 2));
        // Still a 440 Hz tone: compare with one made at 16 kHz, away from the edges.
        let want = tone(16_000, 2.0, 440.0);
        let err = (1000..31_000).map(|i| (a.samples[i] - want[i] as f32 / 32768.0).abs()).fold(0f32, f32::max);
        assert!(err < 0.01, "max error {err}");
    }

    #[test]
    fn what_is_not_audio_or_out_of_bounds_is_refused_before_decoding() {
        assert!(matches!(decode(b"hello, this is not audio"), Err(AudioError::Unrecognized(_))));
        assert_eq!(decode(&wav(1_000, 1, &tone(1_000, 1.0, 100.0))).unwrap_err(), AudioError::SampleRate(1_000));
        assert_eq!(decode(&wav(16_000, 1, &[])).unwrap_err(), AudioError::Empty);
        // A header claiming three hours, with one second of data behind it.
        let mut long = wav(16_000, 1, &tone(16_000, 1.0, 440.0));
        let claimed = 3 * 3600 * 16_000 * 2u32;
        long[4..8].copy_from_slice(&(36 + claimed).to_le_bytes());
        long[40..44].copy_from_slice(&claimed.to_le_bytes());
        assert!(matches!(decode(&long), Err(AudioError::TooLong(s)) if s > 10_000.0), "{:?}", decode(&long));
    }

    #[test]
    fn a_truncated_file_decodes_what_it_holds_or_says_it_is_damaged() {
        let full = wav(16_000, 1, &tone(16_000, 1.0, 440.0));
        match decode(&full[..full.len() / 2]) {
            Ok(a) => assert!(a.samples.len() < 16_000 && !a.samples.is_empty()),
            Err(e) => assert!(matches!(e, AudioError::Damaged(_)), "{e}"),
        }
        assert!(decode(&full[..30]).is_err());
    }
}
