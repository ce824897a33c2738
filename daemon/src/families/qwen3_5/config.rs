//! Qwen3.5's text hyper-parameters (`text_config` of its config.json), as
//! mlx-vlm 0.7.10's `qwen3_5/config.py` reads them.

use anyhow::{ensure, Context, Result};
use serde::Deserialize;

/// The hybrid decoder's shape: every `full_attention_interval`-th layer is
/// gated attention, the others Gated DeltaNet.
#[derive(Debug, Clone, Deserialize)]
pub struct Qwen35TextConfig {
    pub hidden_size: i32,
    pub intermediate_size: i32,
    pub num_hidden_layers: usize,
    pub num_attention_heads: i32,
    pub num_key_value_heads: i32,
    pub head_dim: Option<i32>,
    pub rms_norm_eps: f32,
    pub vocab_size: i32,
    pub max_position_embeddings: u32,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default = "default_interval")]
    pub full_attention_interval: usize,
    /// Gated DeltaNet: value heads, key heads and their widths.
    pub linear_num_value_heads: i32,
    pub linear_num_key_heads: i32,
    pub linear_key_head_dim: i32,
    pub linear_value_head_dim: i32,
    /// Width of the depthwise causal convolution over q, k and v.
    pub linear_conv_kernel_dim: i32,
    #[serde(default)]
    pub rope_parameters: Option<RopeParameters>,
}

fn default_interval() -> usize {
    4
}

/// Rope of the attention layers: partial rotary, interleaved multimodal.
#[derive(Debug, Clone, Deserialize)]
pub struct RopeParameters {
    pub rope_theta: f32,
    pub partial_rotary_factor: f32,
    pub mrope_section: Vec<i32>,
}

impl Qwen35TextConfig {
    /// Parses `text_config`, with mlx-vlm's defaults for what it leaves out.
    pub fn from_json(v: &serde_json::Value) -> Result<Self> {
        let mut c: Self = serde_json::from_value(v.clone()).context("config.json text_config (qwen3_5)")?;
        if c.rope_parameters.is_none() {
            c.rope_parameters = Some(RopeParameters {
                rope_theta: 100_000.0,
                partial_rotary_factor: 0.25,
                mrope_section: vec![11, 11, 10],
            });
        }
        ensure!(
            c.linear_num_value_heads % c.linear_num_key_heads == 0,
            "linear value heads must be a multiple of key heads"
        );
        ensure!(c.full_attention_interval > 0, "full_attention_interval is 0");
        Ok(c)
    }

    /// Width of one attention head.
    pub fn head_dim(&self) -> i32 {
        self.head_dim.unwrap_or(self.hidden_size / self.num_attention_heads)
    }

    /// The rope parameters (always set after parsing).
    pub fn rope(&self) -> &RopeParameters {
        self.rope_parameters.as_ref().expect("set by from_json")
    }

    /// Dimensions of each head the rope turns (the rest pass through).
    pub fn rotary_dim(&self) -> i32 {
        (self.head_dim() as f32 * self.rope().partial_rotary_factor) as i32
    }

    /// True for the gated-attention layers (the others are Gated DeltaNet).
    pub fn is_attention(&self, layer: usize) -> bool {
        (layer + 1).is_multiple_of(self.full_attention_interval)
    }
}
