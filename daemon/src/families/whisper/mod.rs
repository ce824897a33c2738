//! Whisper (OpenAI's speech recognizer): the first encoder–decoder family.
//! Its encoder is an audio tower whose output the feature store keeps per
//! 30-second window; its decoder turns that into text with timestamps.
//!
//! - `config`: the shape, from HF's or mlx-whisper's config.json
//! - `model`: encoder and decoder (MLX), op for op as mlx-whisper
//! - `tokens`: special tokens and suppressed sets from tokenizer.json
//! - `decoding`: one window: logit filters, greedy or sampled, no-speech
//! - `transcribe`: a recording window by window (seek, fallback, segments)
//!
//! Loads the Hugging Face layout (`model.safetensors` with HF names, what
//! `openai/whisper-*` and scripts/fixtures/whisper/ct2_to_hf.py give) and
//! mlx-whisper's (`weights.safetensors` with its names, bf16/f16 or
//! quantized, as `mlx-community/whisper-*` holds), given a `tokenizer.json`.

pub mod config;
pub mod decoding;
pub mod model;
pub mod tokens;
pub mod transcribe;

use crate::model::family::SpeechRecognizer;
use crate::model::options::ModelOptions;
use crate::model::weights::TensorMap;
use anyhow::{Context, Result};
use config::WhisperConfig;
use mlx_rs::Array;
use model::WhisperNet;
use std::path::Path;
use tokenizers::Tokenizer;
use tokens::SpecialTokens;

/// A loaded Whisper model.
pub struct Whisper {
    pub config: WhisperConfig,
    pub net: WhisperNet,
    pub tokens: SpecialTokens,
    pub tokenizer: Tokenizer,
    fingerprint: mlxbc_cache::TowerFingerprint,
}

impl Whisper {
    /// Token ids of `text` (no special tokens added).
    pub fn encode_text(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self.tokenizer.encode(text, false).map_err(|e| anyhow::anyhow!("{e}"))?.get_ids().to_vec())
    }

    /// The text of token ids (byte-level BPE: exact bytes, then UTF-8).
    pub fn decode_text(&self, ids: &[u32]) -> Result<String> {
        self.tokenizer.decode(ids, false).map_err(|e| anyhow::anyhow!("{e}"))
    }
}

impl SpeechRecognizer for Whisper {
    fn architecture(&self) -> &'static str {
        "whisper"
    }

    fn frontend_key(&self) -> String {
        format!(
            "whisper-log-mel sr={} n_fft={} hop={} n_mels={} window={}s periodic-hann reflect slaney log10-clamp8",
            crate::audio::mel::SAMPLE_RATE,
            crate::audio::mel::N_FFT,
            crate::audio::mel::HOP,
            self.config.n_mels,
            crate::audio::mel::WINDOW_SAMPLES / crate::audio::mel::SAMPLE_RATE
        )
    }

    fn fingerprint(&self) -> mlxbc_cache::TowerFingerprint {
        self.fingerprint
    }

    fn encode(&self, window: &Array) -> Result<Array> {
        self.net.encoder.forward(window)
    }

    fn begin(
        self: std::rc::Rc<Self>,
        samples: Option<&[f32]>,
        frames: usize,
        request: &mlxbc_shared::TranscribeRequest,
    ) -> Result<Box<dyn crate::model::family::SpeechTask>> {
        Ok(Box::new(transcribe::Transcription::new(self, samples, frames, request)?))
    }
}

/// Loads a Whisper directory (either layout; see the module docs).
pub fn load_dir(
    dir: &Path,
    raw: &serde_json::Value,
    options: ModelOptions,
    memo: Option<&sled::Tree>,
) -> Result<Box<dyn SpeechRecognizer>> {
    let config = WhisperConfig::parse(raw)?;
    let tokenizer_path = dir.join("tokenizer.json");
    if !tokenizer_path.is_file() {
        anyhow::bail!(
            "{} has no tokenizer.json (mlx-whisper directories carry none): copy the one of the same \
             model from openai/whisper-* on the hub beside its weights",
            dir.display()
        );
    }
    let tokenizer = crate::model::tokenizer::from_file(&tokenizer_path)?;
    let tokens = SpecialTokens::find(&tokenizer, &config)?;
    let quantization = raw.get("quantization");
    let mlx_layout = raw.get("n_mels").is_some();
    let mut t = TensorMap::from_safetensors_dir(dir, quantization, options.form)?;
    if mlx_layout {
        t = t.renamed(model::hf_name);
    }
    let net = WhisperNet::load(&config, &mut t).with_context(|| format!("loading Whisper from {}", dir.display()))?;
    net.eval()?;
    // The encoder's identity: its config and weight files (memoized by file identity).
    let fingerprint = crate::model::vlm_dir::weights_fingerprint(
        dir,
        &["model.encoder.", "encoder."],
        &format!("whisper-encoder {config:?}"),
        memo,
    )
    .with_context(|| format!("fingerprinting the encoder in {}", dir.display()))?;
    Ok(Box::new(Whisper { config, net, tokens, tokenizer, fingerprint }))
}
