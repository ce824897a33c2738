//! A whole recording, window by window, as mlx-whisper's `transcribe()`
//! walks it (without word timestamps): each 30-second window from `seek`
//! is decoded with the fallback ladder, skipped when it is silence, split
//! into segments at its timestamp pairs, and `seek` moves to where the
//! last complete segment ended. Written as a state machine the engine
//! advances one window at a time, between its other work, and so that the
//! encoder's output for each window can come from the feature store.

use super::decoding::{decode_window, detect_language, WindowOptions, WindowResult};
use super::Whisper;
use crate::audio::mel;
use crate::model::family::{SpeechResult, SpeechTask, SpeechWindow};
use anyhow::{bail, Result};
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;
use mlxbc_shared::{TranscribeRequest, TranscriptSegment};
use rand::SeedableRng;
use std::rc::Rc;

/// Whisper's thresholds (its `transcribe()` defaults).
const COMPRESSION_RATIO_THRESHOLD: f64 = 2.4;
const LOGPROB_THRESHOLD: f64 = -1.0;
const NO_SPEECH_THRESHOLD: f64 = 0.6;
const FALLBACK_TEMPERATURES: [f32; 6] = [0.0, 0.2, 0.4, 0.6, 0.8, 1.0];
/// Mel frames per encoder position, and seconds per timestamp token.
const INPUT_STRIDE: usize = 2;
const TIME_PRECISION: f64 = 0.02;

/// A recording being transcribed.
pub struct Transcription {
    /// Log-mel of the audio and 30 s of padding `[frames, n_mels]`; `None`
    /// when the samples were not sent (every window from the store).
    mel: Option<Array>,
    content_frames: usize,
    seek: usize,
    language: Option<String>,
    translate: bool,
    timestamps: bool,
    condition_on_previous_text: bool,
    temperatures: Vec<f32>,
    all_tokens: Vec<u32>,
    initial_prompt_len: usize,
    prompt_reset_since: usize,
    segments: Vec<TranscriptSegment>,
    rng: rand::rngs::StdRng,
    /// Windows decoded so far (fallbacks counted).
    pub windows: u32,
    /// The model it runs on.
    model: Rc<Whisper>,
}

impl Transcription {
    /// Starts on a recording of `frames` mel frames: computes the log-mel
    /// of its `samples` (16 kHz mono) when they were sent.
    pub fn new(w: Rc<Whisper>, samples: Option<&[f32]>, frames: usize, r: &TranscribeRequest) -> Result<Self> {
        let mel = match samples {
            Some(samples) => {
                let mel = mel::log_mel(samples, mel::WINDOW_SAMPLES, w.config.n_mels)?;
                mel.eval()?;
                debug_assert_eq!(mel.shape()[0] as usize - mel::WINDOW_FRAMES, frames);
                Some(mel)
            }
            None => None,
        };
        let content_frames = frames;
        if let Some(code) = &r.language {
            if w.tokens.is_multilingual() && w.tokens.language(code).is_none() {
                bail!("language {code:?} is not one this model knows (ISO 639-1 codes such as en, de, ja)");
            }
            if !w.tokens.is_multilingual() && code != "en" {
                bail!("this model is English-only (a .en model): it cannot take language {code:?}");
            }
        }
        if r.translate && !w.tokens.is_multilingual() {
            bail!("this model is English-only: translating needs a multilingual Whisper model");
        }
        let language = if w.tokens.is_multilingual() { r.language.clone() } else { Some("en".into()) };
        let initial: Vec<u32> = match r.prompt.as_deref().map(str::trim).filter(|p| !p.is_empty()) {
            Some(p) => w.encode_text(&format!(" {p}"))?,
            None => vec![],
        };
        let temperatures = match r.temperature {
            Some(t) if t.is_finite() && (0.0..=2.0).contains(&t) => vec![t],
            Some(t) => bail!("temperature {t}: between 0 and 2"),
            None => FALLBACK_TEMPERATURES.to_vec(),
        };
        Ok(Self {
            mel,
            content_frames,
            seek: 0,
            language,
            translate: r.translate,
            timestamps: r.timestamps,
            condition_on_previous_text: r.condition_on_previous_text,
            temperatures,
            initial_prompt_len: initial.len(),
            all_tokens: initial,
            prompt_reset_since: 0,
            segments: vec![],
            rng: rand::rngs::StdRng::seed_from_u64(0),
            windows: 0,
            model: w,
        })
    }

    /// Detects the language from the encoder output of the language window.
    fn detect_language(&mut self, w: &Whisper, features: &Array) -> Result<()> {
        let cross = w.net.decoder.cross_kv(features)?;
        let probs = detect_language(&w.net, &w.tokens, &cross)?;
        self.language = probs.first().map(|(code, _)| code.clone()).or(Some("en".into()));
        Ok(())
    }

    fn segment_size(&self) -> usize {
        mel::WINDOW_FRAMES.min(self.content_frames - self.seek)
    }

    /// Decodes the window at `seek` from its encoder output `features`
    /// `[1, 1500, d]` and moves on.
    fn decode_at_seek(&mut self, w: &Whisper, features: &Array) -> Result<()> {
        let cross = w.net.decoder.cross_kv(features)?;
        let window_seek = self.seek as u32;
        let mut options = WindowOptions {
            language: self.language.as_deref().and_then(|c| w.tokens.language(c)),
            translate: self.translate,
            prompt: self.all_tokens[self.prompt_reset_since..].to_vec(),
            temperature: 0.0,
            timestamps: self.timestamps,
            max_initial_timestamp: 1.0,
        };
        let mut result: Option<WindowResult> = None;
        for &t in &self.temperatures {
            options.temperature = t;
            self.windows += 1;
            let r = decode_window(&w.net, &w.tokens, &w.tokenizer, &cross, &options, &mut self.rng)?;
            let mut fallback = r.compression_ratio > COMPRESSION_RATIO_THRESHOLD || r.avg_logprob < LOGPROB_THRESHOLD;
            if r.no_speech_prob > NO_SPEECH_THRESHOLD {
                fallback = false; // silence: no hotter decode makes speech of it
            }
            result = Some(r);
            if !fallback {
                break;
            }
        }
        let result = result.expect("at least one temperature");
        let segment_size = self.segment_size();
        if result.no_speech_prob > NO_SPEECH_THRESHOLD && result.avg_logprob <= LOGPROB_THRESHOLD {
            self.seek += segment_size;
            return Ok(());
        }
        let time_offset = self.seek as f64 * mel::HOP as f64 / mel::SAMPLE_RATE as f64;
        let segment_duration = segment_size as f64 * mel::HOP as f64 / mel::SAMPLE_RATE as f64;
        let tb = w.tokens.timestamp_begin;
        let tokens = &result.tokens;
        let is_ts: Vec<bool> = tokens.iter().map(|&t| t >= tb).collect();
        let single_timestamp_ending = is_ts.len() >= 2 && !is_ts[is_ts.len() - 2] && is_ts[is_ts.len() - 1];
        let consecutive: Vec<usize> = (1..is_ts.len()).filter(|&i| is_ts[i - 1] && is_ts[i]).collect();
        let mut current: Vec<(f64, f64, Vec<u32>)> = Vec::new();
        if !consecutive.is_empty() {
            let mut slices = consecutive.clone();
            if single_timestamp_ending {
                slices.push(tokens.len());
            }
            let mut last = 0;
            for &cut in &slices {
                let part = &tokens[last..cut];
                let start = time_offset + (part[0] - tb) as f64 * TIME_PRECISION;
                let end = time_offset + (part[part.len() - 1] - tb) as f64 * TIME_PRECISION;
                current.push((start, end, part.to_vec()));
                last = cut;
            }
            if single_timestamp_ending {
                self.seek += segment_size;
            } else {
                self.seek += (tokens[last - 1] - tb) as usize * INPUT_STRIDE;
            }
        } else {
            let mut duration = segment_duration;
            if let Some(&last_ts) = tokens.iter().rev().find(|&&t| t >= tb) {
                if last_ts != tb {
                    duration = (last_ts - tb) as f64 * TIME_PRECISION;
                }
            }
            current.push((time_offset, time_offset + duration, tokens.clone()));
            self.seek += segment_size;
        }
        for (start, end, mut toks) in current {
            let text_ids: Vec<u32> = toks.iter().copied().filter(|&t| t < w.tokens.eot).collect();
            let mut text = w.decode_text(&text_ids)?;
            if start == end || text.trim().is_empty() {
                text.clear();
                toks.clear();
            }
            self.all_tokens.extend_from_slice(&toks);
            self.segments.push(TranscriptSegment {
                id: self.segments.len() as u32,
                seek: window_seek,
                start,
                end,
                text,
                tokens: toks,
                temperature: result.temperature,
                avg_logprob: result.avg_logprob,
                compression_ratio: result.compression_ratio,
                no_speech_prob: result.no_speech_prob,
            });
        }
        if !self.condition_on_previous_text || result.temperature > 0.5 {
            self.prompt_reset_since = self.all_tokens.len();
        }
        Ok(())
    }
}

/// Window ids in the feature store: the first 30 s as language detection
/// reads them (the padding's log-mel included), or a window from a frame.
const LANGUAGE_WINDOW: &str = "language";

impl SpeechTask for Transcription {
    fn next_window(&self) -> Result<Option<SpeechWindow>> {
        if self.language.is_none() {
            let input = self.mel.as_ref().map(|m| m.index(..mel::WINDOW_FRAMES as i32).expand_dims(0)).transpose()?;
            return Ok(Some(SpeechWindow { id: LANGUAGE_WINDOW.into(), input }));
        }
        if self.seek >= self.content_frames {
            return Ok(None);
        }
        // The window from `seek`, zero-padded to 30 s (`pad_or_trim`).
        let size = self.segment_size() as i32;
        let s = self.seek as i32;
        let input = match &self.mel {
            None => None,
            Some(m) => {
                let part = m.index(s..s + size);
                let part = if size < mel::WINDOW_FRAMES as i32 {
                    let zeros = mlx_rs::ops::zeros::<f32>(&[mel::WINDOW_FRAMES as i32 - size, part.shape()[1]])?;
                    mlx_rs::ops::concatenate(&[part, zeros], 0)?
                } else {
                    part
                };
                Some(part.expand_dims(0)?)
            }
        };
        Ok(Some(SpeechWindow { id: format!("frames {}+{size}", self.seek), input }))
    }

    fn step(&mut self, features: &Array) -> Result<()> {
        let w = self.model.clone();
        if self.language.is_none() {
            return self.detect_language(&w, features);
        }
        self.decode_at_seek(&w, features)
    }

    fn windows(&self) -> u32 {
        self.windows
    }

    fn seconds(&self) -> f64 {
        self.content_frames as f64 * mel::HOP as f64 / mel::SAMPLE_RATE as f64
    }

    fn finish(self: Box<Self>) -> Result<SpeechResult> {
        let w = self.model.clone();
        let text_ids: Vec<u32> = self.all_tokens[self.initial_prompt_len..]
            .iter()
            .copied()
            .filter(|&t| t < w.tokens.timestamp_begin)
            .collect();
        Ok(SpeechResult {
            text: w.decode_text(&text_ids)?,
            language: self.language.unwrap_or_else(|| "en".into()),
            segments: self.segments,
        })
    }
}
