//! ModernBERT's shape, from Hugging Face's `config.json` (`ModernBertModel`).

use anyhow::{bail, Result};
use serde::Deserialize;

/// What the encoder is made of.
#[derive(Debug, Clone, Deserialize)]
pub struct ModernBertConfig {
    pub hidden_size: i32,
    pub num_hidden_layers: usize,
    pub num_attention_heads: i32,
    pub intermediate_size: i32,
    #[serde(default = "default_positions")]
    pub max_position_embeddings: i32,
    #[serde(default = "default_eps")]
    pub norm_eps: f32,
    /// Whether the layer norms have a bias (none in the released models).
    #[serde(default)]
    pub norm_bias: bool,
    #[serde(default = "default_global_theta")]
    pub global_rope_theta: f32,
    /// The rope base of the sliding-window layers (the global one's when absent).
    #[serde(default)]
    pub local_rope_theta: Option<f32>,
    /// Every this many layers (the first included) attends to the whole
    /// text; the others within a window of `local_attention` positions.
    #[serde(default = "default_every")]
    pub global_attn_every_n_layers: usize,
    #[serde(default = "default_window")]
    pub local_attention: i32,
    #[serde(default = "default_act")]
    pub hidden_activation: String,
}

fn default_positions() -> i32 {
    8192
}

fn default_eps() -> f32 {
    1e-5
}

fn default_global_theta() -> f32 {
    160_000.0
}

fn default_every() -> usize {
    3
}

fn default_window() -> i32 {
    128
}

fn default_act() -> String {
    "gelu".into()
}

impl ModernBertConfig {
    /// Parses and checks what this encoder supports.
    pub fn from_json(raw: &serde_json::Value) -> Result<Self> {
        let c: Self = serde_json::from_value(raw.clone())?;
        if c.hidden_activation != "gelu" {
            bail!("ModernBERT with activation {:?} is not supported (gelu is)", c.hidden_activation);
        }
        if c.num_attention_heads <= 0 || c.hidden_size % c.num_attention_heads != 0 {
            bail!("hidden_size {} does not split into {} heads", c.hidden_size, c.num_attention_heads);
        }
        if c.global_attn_every_n_layers == 0 {
            bail!("global_attn_every_n_layers must be at least 1");
        }
        Ok(c)
    }

    pub fn head_dim(&self) -> i32 {
        self.hidden_size / self.num_attention_heads
    }

    /// Whether layer `i` attends to the whole text (else within the window).
    pub fn is_global(&self, i: usize) -> bool {
        i.is_multiple_of(self.global_attn_every_n_layers)
    }
}
