//! A Whisper checkpoint's shape, from either layout it comes in: the
//! Hugging Face `config.json` (`openai/whisper-*`, and what
//! scripts/fixtures/whisper/ct2_to_hf.py writes) or mlx-whisper's `ModelDimensions`
//! (`mlx-community/whisper-*`).

use anyhow::{bail, Result};
use serde_json::Value;

/// The dimensions of a Whisper model.
#[derive(Debug, Clone, PartialEq)]
pub struct WhisperConfig {
    pub n_mels: usize,
    /// Encoder positions per 30-second window (1500).
    pub audio_ctx: i32,
    pub audio_state: i32,
    pub audio_heads: i32,
    pub audio_layers: usize,
    pub vocab: i32,
    /// Decoder positions (448).
    pub text_ctx: usize,
    pub text_state: i32,
    pub text_heads: i32,
    pub text_layers: usize,
}

impl WhisperConfig {
    /// Reads either layout.
    pub fn parse(v: &Value) -> Result<Self> {
        let int = |k: &str| v.get(k).and_then(Value::as_i64);
        if let Some(n_mels) = int("n_mels") {
            let get = |k: &str| int(k).ok_or_else(|| anyhow::anyhow!("config.json: missing {k}"));
            return Ok(Self {
                n_mels: n_mels as usize,
                audio_ctx: get("n_audio_ctx")? as i32,
                audio_state: get("n_audio_state")? as i32,
                audio_heads: get("n_audio_head")? as i32,
                audio_layers: get("n_audio_layer")? as usize,
                vocab: get("n_vocab")? as i32,
                text_ctx: get("n_text_ctx")? as usize,
                text_state: get("n_text_state")? as i32,
                text_heads: get("n_text_head")? as i32,
                text_layers: get("n_text_layer")? as usize,
            })
            .and_then(Self::checked);
        }
        let get = |k: &str| int(k).ok_or_else(|| anyhow::anyhow!("config.json: missing {k}"));
        let d = get("d_model")? as i32;
        Self {
            n_mels: get("num_mel_bins")? as usize,
            audio_ctx: get("max_source_positions")? as i32,
            audio_state: d,
            audio_heads: get("encoder_attention_heads")? as i32,
            audio_layers: get("encoder_layers")? as usize,
            vocab: get("vocab_size")? as i32,
            text_ctx: get("max_target_positions")? as usize,
            text_state: d,
            text_heads: get("decoder_attention_heads")? as i32,
            text_layers: get("decoder_layers")? as usize,
        }
        .checked()
    }

    /// Bounds what a config file may claim before anything is allocated.
    fn checked(self) -> Result<Self> {
        let sane = |x: i64, hi: i64| (1..=hi).contains(&x);
        if !(self.n_mels == 80 || self.n_mels == 128) {
            bail!("config.json: {} mel bins (Whisper uses 80 or 128)", self.n_mels);
        }
        if self.audio_ctx != 1500 {
            bail!("config.json: {} encoder positions (Whisper's 30-second window has 1500)", self.audio_ctx);
        }
        let ok = sane(self.audio_state as i64, 8192)
            && sane(self.text_state as i64, 8192)
            && sane(self.audio_heads as i64, 128)
            && sane(self.text_heads as i64, 128)
            && self.audio_state % self.audio_heads == 0
            && self.text_state % self.text_heads == 0
            && sane(self.audio_layers as i64, 128)
            && sane(self.text_layers as i64, 128)
            && sane(self.text_ctx as i64, 4096)
            && (51_800..=52_000).contains(&self.vocab);
        if !ok {
            bail!("config.json does not describe a Whisper model: {self:?}");
        }
        Ok(self)
    }

    /// Multilingual checkpoints have a language token per language (and
    /// 51,865 or more tokens); the `.en` ones 51,864.
    pub fn is_multilingual(&self) -> bool {
        self.vocab >= 51_865
    }

    /// Languages the vocabulary has tokens for (as mlx-whisper counts them).
    pub fn num_languages(&self) -> usize {
        (self.vocab - 51_765 - self.is_multilingual() as i32) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_layouts_give_the_same_shape() {
        let hf = serde_json::json!({"model_type": "whisper", "d_model": 384, "encoder_layers": 4, "decoder_layers": 4,
            "encoder_attention_heads": 6, "decoder_attention_heads": 6, "num_mel_bins": 80, "vocab_size": 51864,
            "max_source_positions": 1500, "max_target_positions": 448});
        let mlx = serde_json::json!({"n_mels": 80, "n_audio_ctx": 1500, "n_audio_state": 384, "n_audio_head": 6,
            "n_audio_layer": 4, "n_vocab": 51864, "n_text_ctx": 448, "n_text_state": 384, "n_text_head": 6,
            "n_text_layer": 4});
        let (a, b) = (WhisperConfig::parse(&hf).unwrap(), WhisperConfig::parse(&mlx).unwrap());
        assert_eq!(a, b);
        assert!(!a.is_multilingual());
        let mut bad = hf.clone();
        bad["encoder_attention_heads"] = 7.into();
        assert!(WhisperConfig::parse(&bad).is_err());
    }
}
