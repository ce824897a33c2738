//! Hyper-parameters of the decoder-only text models we serve, read either from
//! GGUF metadata or from an HF/MLX `config.json`.

use crate::model::gguf::{gguf_number, gguf_string, Gguf};
use anyhow::{bail, Context, Result};
use serde::Deserialize;

/// Which transformer variant a checkpoint is. They share one implementation
/// (`model.rs`); the differences are small flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    /// Llama 2/3, SmolLM2.
    Llama,
    /// Qwen2 / Qwen2.5: biases on the q/k/v projections.
    Qwen2,
    /// Qwen3: RMS norms on q and k per head, no q/k/v biases.
    Qwen3,
}

impl Architecture {
    /// Parses the name GGUF (`general.architecture`) or config.json (`model_type`) uses.
    pub fn from_name(name: &str) -> Result<Self> {
        Ok(match name {
            "llama" | "mistral" => Architecture::Llama,
            "qwen2" => Architecture::Qwen2,
            "qwen3" => Architecture::Qwen3,
            other => bail!("unsupported architecture {other:?} (supported: llama, qwen2, qwen3)"),
        })
    }

    /// How llama.cpp stored this architecture's q/k rows in GGUF.
    pub fn gguf_qk_rows(self, heads: i32, kv_heads: i32) -> crate::model::weights::GgufQkRows {
        use crate::model::weights::GgufQkRows;
        match self {
            Architecture::Llama => GgufQkRows::Permuted { heads, kv_heads },
            Architecture::Qwen2 | Architecture::Qwen3 => GgufQkRows::AsHf,
        }
    }

    /// The canonical name.
    pub fn name(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Qwen2 => "qwen2",
            Architecture::Qwen3 => "qwen3",
        }
    }
}

/// Llama 3's frequency-dependent rope scaling.
#[derive(Debug, Clone, PartialEq)]
pub struct Llama3RopeScaling {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_max_position_embeddings: f32,
}

/// Everything the transformer needs to know about its shape.
#[derive(Debug, Clone, PartialEq)]
pub struct TextConfig {
    pub architecture: Architecture,
    pub hidden_size: i32,
    pub intermediate_size: i32,
    pub num_layers: i32,
    pub num_heads: i32,
    pub num_kv_heads: i32,
    pub head_dim: i32,
    pub vocab_size: i32,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub rope_scaling: Option<Llama3RopeScaling>,
    /// Qwen2-VL's multimodal rope: how many frequencies follow the time,
    /// height and width positions (sums to head_dim / 2).
    pub mrope_section: Option<Vec<i32>>,
    /// Qwen3-VL's interleaved layout of those frequencies (t, h, w, t, h,
    /// w, ...) instead of Qwen2-VL's consecutive sections.
    pub mrope_interleaved: bool,
    pub context_length: u32,
    pub tie_word_embeddings: bool,
}

/// The subset of HF `config.json` we read.
#[derive(Debug, Deserialize)]
struct HfConfig {
    model_type: String,
    hidden_size: i32,
    intermediate_size: i32,
    num_hidden_layers: i32,
    num_attention_heads: i32,
    num_key_value_heads: Option<i32>,
    head_dim: Option<i32>,
    vocab_size: i32,
    rms_norm_eps: f32,
    #[serde(default = "default_theta")]
    rope_theta: f32,
    rope_scaling: Option<serde_json::Value>,
    max_position_embeddings: Option<u32>,
    #[serde(default)]
    tie_word_embeddings: bool,
}

fn default_theta() -> f32 {
    10000.0
}

impl TextConfig {
    /// Reads `config.json` text.
    pub fn from_hf_json(text: &str) -> Result<Self> {
        let c: HfConfig = serde_json::from_str(text).context("parsing config.json")?;
        let architecture = Architecture::from_name(&c.model_type)?;
        let mrope_section: Option<Vec<i32>> = c
            .rope_scaling
            .as_ref()
            .and_then(|v| v.get("mrope_section"))
            .and_then(|m| serde_json::from_value(m.clone()).ok());
        let rope_scaling = match &c.rope_scaling {
            _ if mrope_section.is_some() => None,
            Some(v) if v.get("rope_type").or(v.get("type")).and_then(|t| t.as_str()) == Some("llama3") => {
                let f = |k: &str, d: f32| v.get(k).and_then(|x| x.as_f64()).map(|x| x as f32).unwrap_or(d);
                Some(Llama3RopeScaling {
                    factor: f("factor", 1.0),
                    low_freq_factor: f("low_freq_factor", 1.0),
                    high_freq_factor: f("high_freq_factor", 4.0),
                    original_max_position_embeddings: f("original_max_position_embeddings", 8192.0),
                })
            }
            Some(v) if !v.is_null() => bail!("unsupported rope_scaling {v}"),
            _ => None,
        };
        Ok(Self {
            architecture,
            hidden_size: c.hidden_size,
            intermediate_size: c.intermediate_size,
            num_layers: c.num_hidden_layers,
            num_heads: c.num_attention_heads,
            num_kv_heads: c.num_key_value_heads.unwrap_or(c.num_attention_heads),
            head_dim: c.head_dim.unwrap_or(c.hidden_size / c.num_attention_heads),
            vocab_size: c.vocab_size,
            rms_norm_eps: c.rms_norm_eps,
            rope_theta: c.rope_theta,
            rope_scaling,
            mrope_section,
            mrope_interleaved: c
                .rope_scaling
                .as_ref()
                .and_then(|v| v.get("mrope_interleaved"))
                .and_then(|v| v.as_bool())
                .unwrap_or(false),
            context_length: c.max_position_embeddings.unwrap_or(4096),
            tie_word_embeddings: c.tie_word_embeddings,
        })
    }

    /// The HF `config.json` that `from_hf_json` reads back as this config
    /// (mlx-lm reads it too).
    pub fn to_hf_json(&self) -> serde_json::Value {
        let mut v = serde_json::json!({
            "model_type": self.architecture.name(),
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.context_length,
            "tie_word_embeddings": self.tie_word_embeddings,
        });
        if let Some(s) = &self.rope_scaling {
            v["rope_scaling"] = serde_json::json!({
                "rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings,
            });
        }
        v
    }

    /// Reads GGUF metadata (`<arch>.block_count`, ...).
    pub fn from_gguf(file: &Gguf, has_output_tensor: bool, vocab_from_tensor: i32) -> Result<Self> {
        let arch_name = gguf_string(file, "general.architecture")?;
        let architecture = Architecture::from_name(&arch_name)?;
        let key = |k: &str| format!("{arch_name}.{k}");
        let hidden_size = gguf_number(file, &key("embedding_length"))? as i32;
        let num_heads = gguf_number(file, &key("attention.head_count"))? as i32;
        let head_dim = gguf_number(file, &key("attention.key_length"))
            .or_else(|_| gguf_number(file, &key("rope.dimension_count")))
            .map(|v| v as i32)
            .unwrap_or(hidden_size / num_heads);
        let rope_scaling = match gguf_string(file, &key("rope.scaling.type")).ok().as_deref() {
            None | Some("none") => None,
            Some(other) => bail!("unsupported GGUF rope scaling {other:?}"),
        };
        Ok(Self {
            architecture,
            hidden_size,
            intermediate_size: gguf_number(file, &key("feed_forward_length"))? as i32,
            num_layers: gguf_number(file, &key("block_count"))? as i32,
            num_heads,
            num_kv_heads: gguf_number(file, &key("attention.head_count_kv")).map(|v| v as i32).unwrap_or(num_heads),
            head_dim,
            vocab_size: gguf_number(file, &key("vocab_size")).map(|v| v as i32).unwrap_or(vocab_from_tensor),
            rms_norm_eps: gguf_number(file, &key("attention.layer_norm_rms_epsilon"))? as f32,
            rope_theta: gguf_number(file, &key("rope.freq_base")).map(|v| v as f32).unwrap_or(10000.0),
            rope_scaling,
            mrope_section: None,
            mrope_interleaved: false,
            context_length: gguf_number(file, &key("context_length")).map(|v| v as u32).unwrap_or(4096),
            tie_word_embeddings: !has_output_tensor,
        })
    }
}
