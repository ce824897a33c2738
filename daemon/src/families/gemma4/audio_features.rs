//! Gemma 4's audio frontend (mlx-vlm 0.7.10's `Gemma4AudioFeatureExtractor`,
//! Hugging Face's USM preprocessing), on the CPU with no MLX state: 16 kHz
//! samples padded with zeros to a multiple of 128, half a frame of zeros in
//! front, 20 ms frames every 10 ms (a periodic Hann window of 320, zero-
//! padded to a 512-point FFT), the magnitude spectrum through 128 HTK mel
//! filters (0–8 kHz, unnormalized), `ln(mel + 0.001)`, optional per-bin
//! mean and deviation; frames that reach into the padding are zeroed and
//! marked invalid. One soft token per 40 ms of audio, at most 750 (30 s).

use crate::model::family::PreparedAudio;
use realfft::RealFftPlanner;

/// The feature extractor's parameters (`processor_config.json`'s
/// `feature_extractor`, HF's defaults otherwise).
#[derive(Debug, Clone, PartialEq)]
pub struct Gemma4AudioFrontend {
    pub sampling_rate: u32,
    pub mel_bins: usize,
    pub frame_length: usize,
    pub hop_length: usize,
    pub fft_length: usize,
    pub min_frequency: f64,
    pub max_frequency: f64,
    pub mel_floor: f64,
    pub preemphasis: f64,
    pub per_bin_mean: Option<Vec<f64>>,
    pub per_bin_stddev: Option<Vec<f64>>,
    /// Samples are padded to a multiple of this.
    pub pad_to_multiple_of: usize,
    /// Milliseconds of audio per soft token, and the most soft tokens.
    pub ms_per_token: f64,
    pub max_tokens: usize,
}

impl Gemma4AudioFrontend {
    /// From a `feature_extractor` section (absent fields: HF's defaults) and
    /// the processor's `audio_ms_per_token` / `audio_seq_length`.
    pub fn from_config(fe: &serde_json::Value, ms_per_token: f64, max_tokens: usize) -> Self {
        let f = |k: &str, d: f64| fe.get(k).and_then(|v| v.as_f64()).unwrap_or(d);
        let list =
            |k: &str| fe.get(k).and_then(|v| v.as_array()).map(|a| a.iter().filter_map(|x| x.as_f64()).collect());
        let sampling_rate = f("sampling_rate", 16_000.0) as u32;
        let frame_length = (sampling_rate as f64 * f("frame_length_ms", 20.0) / 1000.0).round() as usize;
        let hop_length = (sampling_rate as f64 * f("hop_length_ms", 10.0) / 1000.0).round() as usize;
        let mut fft_length = frame_length.next_power_of_two();
        if fe.get("fft_overdrive").and_then(|v| v.as_bool()).unwrap_or(false) {
            fft_length *= 2;
        }
        Self {
            sampling_rate,
            mel_bins: f("feature_size", 128.0) as usize,
            frame_length,
            hop_length,
            fft_length,
            min_frequency: f("min_frequency", 0.0),
            max_frequency: f("max_frequency", 8000.0),
            mel_floor: f("mel_floor", 1e-3),
            preemphasis: f("preemphasis", 0.0),
            per_bin_mean: list("per_bin_mean"),
            per_bin_stddev: list("per_bin_stddev"),
            pad_to_multiple_of: 128,
            ms_per_token,
            max_tokens,
        }
    }

    /// Every parameter that changes the tower's input or the token count
    /// (feature-store key part).
    pub fn describe(&self) -> String {
        format!(
            "gemma4-audio;rate={};mel={};frame={};hop={};fft={};f={}..{};floor={};pre={};mean={:?};std={:?};pad={};ms/token={};max={}",
            self.sampling_rate,
            self.mel_bins,
            self.frame_length,
            self.hop_length,
            self.fft_length,
            self.min_frequency,
            self.max_frequency,
            self.mel_floor,
            self.preemphasis,
            self.per_bin_mean,
            self.per_bin_stddev,
            self.pad_to_multiple_of,
            self.ms_per_token,
            self.max_tokens
        )
    }

    /// Longest clip taken, in samples (the processor truncates past it; we
    /// refuse, so nothing a user said is silently dropped).
    pub fn max_samples(&self) -> usize {
        (self.max_tokens as f64 * self.ms_per_token / 1000.0 * self.sampling_rate as f64) as usize
    }

    /// Soft tokens a clip of `samples` takes: `ceil(ms / ms_per_token)`, capped.
    pub fn tokens(&self, samples: usize) -> usize {
        let ms = samples as f64 / self.sampling_rate as f64 * 1000.0;
        ((ms / self.ms_per_token).ceil() as usize).min(self.max_tokens)
    }

    /// HF's `mel_filter_bank(norm=None, mel_scale="htk")`: `[bins, mel]` row-major.
    fn mel_filters(&self) -> Vec<f64> {
        let bins = self.fft_length / 2 + 1;
        let hz_to_mel = |f: f64| 2595.0 * (1.0 + f / 700.0).log10();
        let mel_to_hz = |m: f64| 700.0 * (10f64.powf(m / 2595.0) - 1.0);
        let (lo, hi) = (hz_to_mel(self.min_frequency), hz_to_mel(self.max_frequency));
        let n = self.mel_bins;
        let points: Vec<f64> = (0..n + 2).map(|i| mel_to_hz(lo + (hi - lo) * i as f64 / (n + 1) as f64)).collect();
        let nyquist = (self.sampling_rate / 2) as f64;
        let mut out = vec![0f64; bins * n];
        for k in 0..bins {
            let f = nyquist * k as f64 / (bins - 1) as f64;
            for m in 0..n {
                let down = (f - points[m]) / (points[m + 1] - points[m]);
                let up = (points[m + 2] - f) / (points[m + 2] - points[m + 1]);
                out[k * n + m] = down.min(up).max(0.0);
            }
        }
        out
    }

    /// The log-mel frames of 16 kHz mono `samples`, zeroed where invalid,
    /// with how many are valid and the clip's soft-token count.
    pub fn prepare(&self, samples: &[f32]) -> Result<PreparedAudio, String> {
        if samples.is_empty() {
            return Err("the audio has no samples".into());
        }
        if samples.len() > self.max_samples() {
            return Err(format!(
                "the audio is {:.1} s long; Gemma 4 hears at most {:.0} s per clip: split it",
                samples.len() as f64 / self.sampling_rate as f64,
                self.max_samples() as f64 / self.sampling_rate as f64
            ));
        }
        let m = self.pad_to_multiple_of;
        let padded_len = samples.len().div_ceil(m) * m;
        let left = self.frame_length / 2;
        // The waveform with half a frame of zeros in front and the padding behind.
        let mut wave = vec![0f32; left + padded_len];
        wave[left..left + samples.len()].copy_from_slice(samples);
        let unfold = self.frame_length + 1;
        if wave.len() < unfold {
            return Err("the audio is too short to hear".into());
        }
        let frames = (wave.len() - unfold) / self.hop_length + 1;
        // A frame is valid when its last sample is a real one.
        let valid_frames = (0..frames)
            .filter(|f| {
                let end = f * self.hop_length + unfold - 1;
                end >= left && end < left + samples.len()
            })
            .count();
        let window: Vec<f32> = (0..self.frame_length)
            .map(|n| 0.5 - 0.5 * (2.0 * std::f32::consts::PI * n as f32 / self.frame_length as f32).cos())
            .collect();
        let filters = self.mel_filters();
        let (bins, mel) = (self.fft_length / 2 + 1, self.mel_bins);
        let fft = RealFftPlanner::<f64>::new().plan_fft_forward(self.fft_length);
        let (mut input, mut spectrum) = (fft.make_input_vec(), fft.make_output_vec());
        let mut values = vec![0f32; frames * mel];
        for f in 0..valid_frames {
            let frame = &wave[f * self.hop_length..f * self.hop_length + unfold];
            input.iter_mut().for_each(|x| *x = 0.0);
            for n in 0..self.frame_length {
                let x = if self.preemphasis > 0.0 {
                    // HTK's flavour: the first sample scaled, the rest differenced.
                    if n == 0 {
                        frame[0] as f64 * (1.0 - self.preemphasis)
                    } else {
                        frame[n] as f64 - self.preemphasis * frame[n - 1] as f64
                    }
                } else {
                    frame[n] as f64
                };
                input[n] = (x as f32 * window[n]) as f64;
            }
            fft.process(&mut input, &mut spectrum).map_err(|e| format!("FFT: {e}"))?;
            let magnitude: Vec<f64> = spectrum.iter().map(|c| c.norm()).collect();
            for j in 0..mel {
                let energy: f64 = (0..bins).map(|k| magnitude[k] * filters[k * mel + j]).sum();
                let mut v = (energy + self.mel_floor).ln();
                if let Some(mean) = &self.per_bin_mean {
                    v -= mean.get(j).copied().unwrap_or(0.0);
                }
                if let Some(std) = &self.per_bin_stddev {
                    v /= std.get(j).copied().unwrap_or(1.0);
                }
                values[f * mel + j] = v as f32;
            }
        }
        let tokens = self.tokens(samples.len());
        Ok(PreparedAudio { values, frames, bins: mel, valid_frames, tokens })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frontend() -> Gemma4AudioFrontend {
        Gemma4AudioFrontend::from_config(&serde_json::json!({}), 40.0, 750)
    }

    #[test]
    fn hf_defaults_and_token_counts() {
        let f = frontend();
        assert_eq!((f.frame_length, f.hop_length, f.fft_length, f.mel_bins), (320, 160, 512, 128));
        // One second: 25 tokens; 30 s: 750; a sample more: still 750 but refused.
        assert_eq!(f.tokens(16_000), 25);
        assert_eq!(f.tokens(16_001), 26);
        assert_eq!(f.max_samples(), 480_000);
        assert!(f.prepare(&vec![0.0; 480_001]).is_err());
        let one = f.prepare(&vec![0.1; 16_000]).unwrap();
        // (16000 + 160 - 321) / 160 + 1 frames, all within the clip; 1100 samples pad to
        // 1152, and the last frame reaches into the padding.
        assert_eq!((one.frames, one.valid_frames, one.tokens), (99, 99, 25));
        let odd = f.prepare(&vec![0.1; 1100]).unwrap();
        assert_eq!(odd.frames, (1152 + 160 - 321) / 160 + 1);
        assert!(odd.valid_frames < odd.frames);
        assert!(odd.values[odd.valid_frames * 128..].iter().all(|&v| v == 0.0));
    }
}
