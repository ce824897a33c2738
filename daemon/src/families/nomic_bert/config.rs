//! nomic-bert's shape, from its `config.json` (`NomicBertModel`: GPT-2's
//! key names, `n_embd`, `n_layer`, ...).

use anyhow::{bail, Result};
use serde::Deserialize;

/// What the encoder is made of.
#[derive(Debug, Clone, Deserialize)]
pub struct NomicBertConfig {
    pub n_embd: i32,
    pub n_head: i32,
    pub n_layer: usize,
    /// The MLP's width (4 × n_embd when absent).
    #[serde(default)]
    pub n_inner: Option<i32>,
    #[serde(default = "default_positions")]
    pub n_positions: i32,
    /// Positions it was trained on (nomic-embed-text v1/v1.5: 2048 of 8192).
    #[serde(default)]
    pub max_trained_positions: Option<i32>,
    #[serde(default = "default_eps")]
    pub layer_norm_epsilon: f32,
    #[serde(default = "default_base")]
    pub rotary_emb_base: f32,
    #[serde(default = "default_fraction")]
    pub rotary_emb_fraction: f32,
    /// Rope on interleaved pairs (GPT-J's) rather than on halves.
    #[serde(default)]
    pub rotary_emb_interleaved: bool,
    #[serde(default)]
    pub rotary_scaling_factor: Option<f32>,
    #[serde(default)]
    pub prenorm: bool,
    #[serde(default = "default_activation")]
    pub activation_function: String,
    #[serde(default)]
    pub moe_every_n_layers: Option<usize>,
    #[serde(default)]
    pub use_rms_norm: bool,
}

fn default_positions() -> i32 {
    2048
}

fn default_eps() -> f32 {
    1e-12
}

fn default_base() -> f32 {
    10_000.0
}

fn default_fraction() -> f32 {
    1.0
}

fn default_activation() -> String {
    "swiglu".into()
}

impl NomicBertConfig {
    /// Parses and checks what this encoder supports: nomic-embed-text v1
    /// and v1.5's architecture (what llama.cpp's converter accepts too).
    pub fn from_json(raw: &serde_json::Value) -> Result<Self> {
        let c: Self = serde_json::from_value(raw.clone())?;
        if c.moe_every_n_layers.is_some_and(|n| n > 0) {
            bail!("nomic-bert with mixture-of-experts layers (nomic-embed-text-v2-moe) is not supported yet; v1 and v1.5 are");
        }
        if c.activation_function != "swiglu" {
            bail!("nomic-bert with activation {:?} is not supported (swiglu is)", c.activation_function);
        }
        if c.prenorm || c.use_rms_norm {
            bail!("nomic-bert with pre-norm or RMS-norm layers is not supported (post-norm LayerNorm is)");
        }
        if c.rotary_emb_fraction != 1.0 || c.rotary_scaling_factor.is_some() {
            bail!("nomic-bert with partial or scaled rotary positions is not supported (the full, unscaled rope is)");
        }
        if c.n_head <= 0 || c.n_embd % c.n_head != 0 {
            bail!("n_embd {} does not split into {} heads", c.n_embd, c.n_head);
        }
        Ok(c)
    }

    pub fn head_dim(&self) -> i32 {
        self.n_embd / self.n_head
    }

    pub fn inner(&self) -> i32 {
        self.n_inner.unwrap_or(4 * self.n_embd)
    }

    /// Positions a text may have: those it was trained on (llama.cpp's
    /// converter writes the same for v1 and v1.5: 2048).
    pub fn positions(&self) -> i32 {
        self.max_trained_positions.map_or(self.n_positions, |t| t.min(self.n_positions))
    }
}
