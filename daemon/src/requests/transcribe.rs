//! A transcription made ready off the engine thread: its fields bounded,
//! its audio decoded and resampled on the blocking pool (`audio::decode`),
//! or — sent by hash only — its length looked up in the feature store. A
//! recording the daemon has never seen is answered `NeedMedia` here; one
//! it has seen is transcribed from the store's encoder outputs, and only a
//! window missing there asks for the bytes (the engine's `NeedMedia`).

use crate::audio::decode::{self, AudioError};
use crate::audio::AudioInput;
use crate::error::EngineError;
use crate::media::SharedStore;
use mlxbc_cache::{FeatureKey, Features, Modality};
use mlxbc_shared::TranscribeRequest;
use std::sync::Arc;

/// The longest `prompt` (bytes): Whisper reads at most 223 of its tokens.
pub const MAX_PROMPT_BYTES: usize = 4096;

/// The store entry that remembers a recording's length (in 10 ms mel
/// frames: exact in f32 up to 46 hours), whatever model transcribes it.
pub fn length_key(sha256: &[u8; 32]) -> FeatureKey {
    FeatureKey {
        modality: Modality::Audio,
        tower: [0; 32],
        preprocess: FeatureKey::preprocess_hash("audio length: mel frames of 160 samples at 16 kHz mono"),
        content: *sha256,
    }
}

/// Checks what a peer sent before anything is decoded.
pub fn validate(r: &TranscribeRequest) -> Result<(), EngineError> {
    let bad = |m: String| Err(EngineError::BadRequest(m));
    if let Some(l) = &r.language {
        if l.is_empty() || l.len() > 8 || !l.chars().all(|c| c.is_ascii_alphabetic()) {
            return bad(format!("language {l:?}: an ISO 639-1 code such as en, de or ja"));
        }
    }
    if r.prompt.as_ref().is_some_and(|p| p.len() > MAX_PROMPT_BYTES) {
        return bad(format!("prompt: at most {MAX_PROMPT_BYTES} bytes"));
    }
    if let Some(t) = r.temperature {
        if !t.is_finite() || !(0.0..=2.0).contains(&t) {
            return bad(format!("temperature {t}: between 0 and 2"));
        }
    }
    if r.model.as_ref().is_some_and(|m| m.len() > 1024) {
        return bad("model: at most 1024 bytes".into());
    }
    Ok(())
}

/// What preparing came to: the audio, or the hash the daemon lacks.
pub enum AudioPreparation {
    Ready(AudioInput),
    NeedBytes([u8; 32]),
}

/// Decodes the audio (or finds its length in the store) on the blocking pool.
pub async fn prepare(store: Option<SharedStore>, r: &TranscribeRequest) -> Result<AudioPreparation, EngineError> {
    validate(r)?;
    let sha = r.audio.sha256;
    let Some(bytes) = r.audio.bytes.clone() else {
        let key = length_key(&sha);
        let stored = tokio::task::spawn_blocking(move || store.and_then(|s| s.lock().get(&key)).map(|(f, _)| f))
            .await
            .map_err(|e| EngineError::Internal(e.to_string()))?;
        return Ok(match stored.and_then(|f| f.to_f32().first().copied()) {
            Some(frames) => AudioPreparation::Ready(AudioInput { samples: None, frames: frames as usize }),
            None => AudioPreparation::NeedBytes(sha),
        });
    };
    let decoded = tokio::task::spawn_blocking(move || {
        if mlxbc_cache::content_hash(&bytes) != sha {
            return Err(EngineError::BadMedia("the audio does not match its sha256".into()));
        }
        let audio = decode::decode(&bytes).map_err(|e: AudioError| EngineError::BadMedia(format!("audio: {e}")))?;
        if let Some(s) = &store {
            let frames = (audio.samples.len() / crate::audio::mel::HOP) as f32;
            let len = Features::from_f32(vec![1], &[frames]);
            if let Err(e) = s.lock().put(&length_key(&sha), &len) {
                tracing::warn!(error = %e, "could not store the audio's length");
            }
        }
        Ok(audio)
    })
    .await
    .map_err(|e| EngineError::Internal(e.to_string()))??;
    tracing::debug!(seconds = decoded.seconds(), rate = decoded.source_rate, "audio decoded");
    let frames = decoded.samples.len() / crate::audio::mel::HOP;
    Ok(AudioPreparation::Ready(AudioInput { samples: Some(Arc::new(decoded.samples)), frames }))
}
