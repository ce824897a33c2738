//! Whisper's log-mel frontend, computed as whisper and mlx-whisper do:
//! 16 kHz samples, a 400-point periodic Hann window every 160 samples
//! (reflect padding of 200 on both sides), the power spectrum of each frame
//! (the last frame dropped), Slaney-style mel filters (librosa's
//! `filters.mel(sr=16000, n_fft=400)`, 80 or 128 bins), `log10` clamped at
//! 1e-10, then at 8 below the maximum, scaled as `(x + 4) / 4`.

use mlx_rs::error::Result;
use mlx_rs::Array;

pub const SAMPLE_RATE: usize = 16_000;
pub const N_FFT: usize = 400;
pub const HOP: usize = 160;
/// Samples in one 30-second window, and its frames.
pub const WINDOW_SAMPLES: usize = 30 * SAMPLE_RATE;
pub const WINDOW_FRAMES: usize = WINDOW_SAMPLES / HOP;

/// The periodic Hann window (numpy's `hanning(N + 1)[:-1]`).
fn hann() -> Vec<f32> {
    (0..N_FFT).map(|n| (0.5 - 0.5 * (2.0 * std::f64::consts::PI * n as f64 / N_FFT as f64).cos()) as f32).collect()
}

/// Slaney's mel scale (librosa's default, `htk=False`).
fn hz_to_mel(f: f64) -> f64 {
    let (f_sp, min_log_hz, logstep) = (200.0 / 3.0, 1000.0, (6.4f64).ln() / 27.0);
    if f < min_log_hz {
        f / f_sp
    } else {
        min_log_hz / f_sp + (f / min_log_hz).ln() / logstep
    }
}

fn mel_to_hz(m: f64) -> f64 {
    let (f_sp, min_log_hz, logstep) = (200.0 / 3.0, 1000.0, (6.4f64).ln() / 27.0);
    let min_log_mel = min_log_hz / f_sp;
    if m < min_log_mel {
        m * f_sp
    } else {
        min_log_hz * (logstep * (m - min_log_mel)).exp()
    }
}

/// librosa's `filters.mel(sr=16000, n_fft=400, n_mels)` (Slaney norm):
/// `[n_mels, N_FFT / 2 + 1]`, row-major.
pub fn mel_filters(n_mels: usize) -> Vec<f32> {
    let bins = N_FFT / 2 + 1;
    let fft_freqs: Vec<f64> = (0..bins).map(|i| i as f64 * SAMPLE_RATE as f64 / N_FFT as f64).collect();
    let (lo, hi) = (hz_to_mel(0.0), hz_to_mel(SAMPLE_RATE as f64 / 2.0));
    let mel_f: Vec<f64> = (0..n_mels + 2).map(|i| mel_to_hz(lo + (hi - lo) * i as f64 / (n_mels + 1) as f64)).collect();
    let mut out = vec![0f32; n_mels * bins];
    for m in 0..n_mels {
        let (left, center, right) = (mel_f[m], mel_f[m + 1], mel_f[m + 2]);
        let norm = 2.0 / (right - left);
        for (k, &f) in fft_freqs.iter().enumerate() {
            let lower = (f - left) / (center - left);
            let upper = (right - f) / (right - center);
            out[m * bins + k] = (lower.min(upper).max(0.0) * norm) as f32;
        }
    }
    out
}

/// Frames per chunk of the spectrogram: an hour of audio is 360,000 frames,
/// whose framed samples and spectrum at once would take over 2 GB.
const CHUNK_FRAMES: usize = 30_000;

/// The log-mel spectrogram `[frames, n_mels]` of `samples` (16 kHz mono)
/// followed by `padding` zeros, as `log_mel_spectrogram(audio, n_mels,
/// padding)` computes it; its clamp uses the maximum over all frames.
/// Computed (and evaluated) a chunk of frames at a time.
pub fn log_mel(samples: &[f32], padding: usize, n_mels: usize) -> Result<Array> {
    let mut x = samples.to_vec();
    x.resize(samples.len() + padding, 0.0);
    let half = N_FFT / 2;
    // Reflect padding (too short an input has nothing to reflect: zeros).
    let mut padded = Vec::with_capacity(x.len() + 2 * half);
    padded.extend((1..=half).rev().map(|i| x.get(i).copied().unwrap_or(0.0)));
    padded.extend_from_slice(&x);
    let n = x.len();
    padded.extend((0..half).map(|i| if n >= i + 2 { x[n - 2 - i] } else { 0.0 }));
    drop(x);
    // STFT frames; the last is dropped, as whisper does.
    let frames = (padded.len() - N_FFT + HOP) / HOP - 1;
    let window = hann();
    let filters = Array::from_slice(&mel_filters(n_mels), &[n_mels as i32, (N_FFT / 2 + 1) as i32]);
    let mut chunks = Vec::new();
    for start in (0..frames).step_by(CHUNK_FRAMES) {
        let count = CHUNK_FRAMES.min(frames - start);
        let mut framed = Vec::with_capacity(count * N_FFT);
        for f in start..start + count {
            framed.extend(padded[f * HOP..f * HOP + N_FFT].iter().zip(&window).map(|(s, w)| s * w));
        }
        let framed = Array::from_slice(&framed, &[count as i32, N_FFT as i32]);
        let power = mlx_rs::fft::rfft(&framed, N_FFT as i32, -1)?.abs()?.square()?;
        let mel = mlx_rs::ops::matmul(&power, filters.t())?;
        let log = mlx_rs::ops::maximum(&mel, Array::from_f32(1e-10))?.log10()?;
        log.eval()?;
        chunks.push(log);
    }
    let log = if chunks.len() == 1 { chunks.pop().expect("one chunk") } else { mlx_rs::ops::concatenate(&chunks, 0)? };
    let floor = log.max(None)?.subtract(Array::from_f32(8.0))?;
    mlx_rs::ops::maximum(&log, &floor)?.add(Array::from_f32(4.0))?.divide(Array::from_f32(4.0))
}
