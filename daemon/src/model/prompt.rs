//! A model's prompt kit: its chat template and tokenizer, with no MLX in
//! them. Shared behind an `Arc`, so that a connection can render and
//! tokenize a text prompt on tokio's blocking pool while the engine thread
//! keeps computing for everyone else (a long prompt used to stall every
//! client for as long as it took to tokenize).

use super::chat_template::ChatTemplate;
use anyhow::Result;
use tokenizers::Tokenizer;

/// Messages to prompt text to token ids.
pub struct Prompter {
    pub tokenizer: Tokenizer,
    pub template: ChatTemplate,
}

impl Prompter {
    /// Token ids of a prompt text (special tokens in the text are honoured,
    /// no BOS added: chat templates write it themselves).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.tokenizer.encode(text, false).map_err(|e| anyhow::anyhow!("tokenizing the prompt: {e}"))?;
        Ok(enc.get_ids().to_vec())
    }
}
