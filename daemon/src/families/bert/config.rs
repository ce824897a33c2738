//! BERT's shape, from Hugging Face's `config.json` (`BertModel`).

use anyhow::{bail, Result};
use serde::Deserialize;

/// What the encoder is made of.
#[derive(Debug, Clone, Deserialize)]
pub struct BertConfig {
    pub hidden_size: i32,
    pub num_hidden_layers: usize,
    pub num_attention_heads: i32,
    pub max_position_embeddings: i32,
    #[serde(default = "default_eps")]
    pub layer_norm_eps: f32,
    #[serde(default = "default_act")]
    pub hidden_act: String,
    #[serde(default = "default_position")]
    pub position_embedding_type: String,
    /// `bert`, or `xlm-roberta` (multilingual-e5, bge-m3, paraphrase-multilingual:
    /// BERT's layers, positions counted after the padding id).
    #[serde(default = "default_model_type")]
    pub model_type: String,
    #[serde(default)]
    pub pad_token_id: Option<i32>,
}

fn default_model_type() -> String {
    "bert".into()
}

fn default_eps() -> f32 {
    1e-12
}

fn default_act() -> String {
    "gelu".into()
}

fn default_position() -> String {
    "absolute".into()
}

impl BertConfig {
    /// The first position row a text's first token takes: 0 for BERT;
    /// for XLM-RoBERTa the padding id + 1 (Hugging Face's
    /// `create_position_ids_from_input_ids`: rows up to the padding id are
    /// never a real token's).
    pub fn first_position(&self) -> i32 {
        match self.model_type.as_str() {
            "xlm-roberta" => self.pad_token_id.unwrap_or(1).saturating_add(1),
            _ => 0,
        }
    }

    /// Parses and checks what this encoder supports.
    pub fn from_json(raw: &serde_json::Value) -> Result<Self> {
        let c: Self = serde_json::from_value(raw.clone())?;
        if c.position_embedding_type != "absolute" {
            bail!("BERT with {:?} position embeddings is not supported (absolute is)", c.position_embedding_type);
        }
        if !matches!(c.hidden_act.as_str(), "gelu" | "gelu_new" | "gelu_pytorch_tanh") {
            bail!("BERT with activation {:?} is not supported (gelu is)", c.hidden_act);
        }
        if c.num_attention_heads <= 0 || c.hidden_size % c.num_attention_heads != 0 {
            bail!("hidden_size {} does not split into {} heads", c.hidden_size, c.num_attention_heads);
        }
        if !(0..c.max_position_embeddings).contains(&c.first_position()) {
            bail!(
                "pad_token_id {:?} leaves none of the {} position rows for a text",
                c.pad_token_id,
                c.max_position_embeddings
            );
        }
        Ok(c)
    }

    pub fn head_dim(&self) -> i32 {
        self.hidden_size / self.num_attention_heads
    }
}
