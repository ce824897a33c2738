//! Structured output by constrained decoding: a request's [`Constraint`]
//! (JSON Schema, any JSON object, a regex or a Lark grammar) is compiled by
//! llguidance (the library llama.cpp and vLLM use) into a matcher over the
//! model's tokenizer; before each token is sampled the matcher's mask of
//! allowed tokens is applied to that row's logits on the device, and the
//! sampled token is fed back to it. The answer therefore always parses.
//!
//! The token trie behind the masks is built once per model (its tokenizer's
//! every token as bytes), on first use; a schema is compiled per request.
//! llguidance's default parser limits bound what a hostile grammar can cost.

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use mlx_rs::Array;
use mlxbc_shared::Constraint;

/// Schemas and grammars longer than this are refused before compiling.
pub const MAX_CONSTRAINT_BYTES: usize = 64 * 1024;

/// Checks what can be checked without a model: size, and that a schema is
/// JSON.
pub fn check(c: &Constraint) -> Result<(), String> {
    let text = match c {
        Constraint::JsonObject => return Ok(()),
        Constraint::JsonSchema(t) | Constraint::Regex(t) | Constraint::Lark(t) => t,
    };
    if text.len() > MAX_CONSTRAINT_BYTES {
        return Err(format!("the schema or grammar is {} bytes; at most {MAX_CONSTRAINT_BYTES}", text.len()));
    }
    if let Constraint::JsonSchema(t) = c {
        serde_json::from_str::<serde_json::Value>(t).map_err(|e| format!("the JSON schema is not JSON: {e}"))?;
    }
    Ok(())
}

fn grammar(c: &Constraint) -> Result<TopLevelGrammar, String> {
    Ok(match c {
        Constraint::JsonObject => TopLevelGrammar::from_json_schema(serde_json::json!({"type": "object"})),
        Constraint::JsonSchema(t) => TopLevelGrammar::from_json_schema(
            serde_json::from_str(t).map_err(|e| format!("the JSON schema is not JSON: {e}"))?,
        ),
        Constraint::Regex(r) => TopLevelGrammar::from_regex(r),
        Constraint::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
    })
}

/// One sequence's constraint.
pub struct Constrained {
    matcher: Matcher,
    /// The model's end-of-sequence ids: all allowed where the grammar may
    /// end (llguidance's mask names only one of them).
    eos_ids: Vec<u32>,
}

impl Constrained {
    /// Compiles `c` for the model `factory` serves; the error is the
    /// client's (`BadRequest`): a schema llguidance cannot compile.
    pub fn new(factory: &ParserFactory, c: &Constraint, eos_ids: Vec<u32>) -> Result<Self, String> {
        let parser = factory.create_parser(grammar(c)?).map_err(|e| format!("the constraint does not compile: {e}"))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(format!("the constraint does not compile: {e}"));
        }
        Ok(Self { matcher, eos_ids })
    }

    /// `logits` (`[1, vocab]` or `[vocab]`) with every token the constraint
    /// forbids next set to minus infinity.
    pub fn mask(&mut self, logits: &Array) -> anyhow::Result<Array> {
        let allowed = self.matcher.compute_mask().map_err(|e| anyhow::anyhow!("constraint: {e}"))?;
        let vocab = logits.shape()[logits.ndim() - 1] as usize;
        // Tokens past the tokenizer's vocabulary (padding rows of the
        // embedding) are never allowed.
        let mut keep: Vec<bool> = (0..vocab).map(|t| t < allowed.len() && allowed.is_allowed(t as u32)).collect();
        if self.matcher.is_accepting().unwrap_or(false) {
            for &e in &self.eos_ids {
                if let Some(k) = keep.get_mut(e as usize) {
                    *k = true;
                }
            }
        }
        let keep = Array::from_slice(&keep, &[vocab as i32]);
        Ok(mlx_rs::ops::select(&keep, logits, Array::from_f32(f32::NEG_INFINITY))?)
    }

    /// Feeds the sampled `token` to the matcher.
    pub fn consume(&mut self, token: u32) -> anyhow::Result<()> {
        self.matcher.consume_token(token).map_err(|e| anyhow::anyhow!("constraint: {e}"))
    }

    /// True when the grammar is complete and admits nothing more.
    pub fn is_done(&self) -> bool {
        self.matcher.is_stopped()
    }
}
