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

/// The tokens a grammar allows at one position (`Constrained::mask`'s
/// rule): its own mask, and the model's end-of-sequence ids where it may end.
pub struct Allowed {
    /// `None`: anything (past the end of the grammar, where the sequence
    /// ends and its pick is thrown away).
    tokens: Option<llguidance::toktrie::SimpleVob>,
    ends: Vec<u32>,
}

impl Allowed {
    fn anything() -> Self {
        Self { tokens: None, ends: Vec::new() }
    }

    /// True when `token` may come here.
    pub fn allows(&self, token: u32) -> bool {
        match &self.tokens {
            None => true,
            Some(t) => ((token as usize) < t.len() && t.is_allowed(token)) || self.ends.contains(&token),
        }
    }

    /// Per token of a `vocab`-wide logits row, whether it may come here
    /// (tokens past the tokenizer's vocabulary, padding rows of the
    /// embedding, never).
    pub fn keep(&self, vocab: usize) -> Vec<bool> {
        (0..vocab as u32).map(|t| self.allows(t)).collect()
    }
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
        let next = self.next_allowed()?;
        let vocab = logits.shape()[logits.ndim() - 1] as usize;
        let keep = Array::from_slice(&next.keep(vocab), &[vocab as i32]);
        Ok(mlx_rs::ops::select(&keep, logits, Array::from_f32(f32::NEG_INFINITY))?)
    }

    /// What the grammar allows next, in its current state.
    fn next_allowed(&mut self) -> anyhow::Result<Allowed> {
        let tokens = self.matcher.compute_mask().map_err(|e| anyhow::anyhow!("constraint: {e}"))?;
        let ends = if self.matcher.is_accepting().unwrap_or(false) { self.eos_ids.clone() } else { Vec::new() };
        Ok(Allowed { tokens: Some(tokens), ends })
    }

    /// For a verify pass over `drafts`: what the grammar allows after each
    /// of them in turn (position i: after `drafts[..i]`), up to the first
    /// draft it forbids, which ends the run. Returns the allowed sets
    /// (drafts that stand + 1 of them); the matcher ends where it began.
    pub fn allowed_along(&mut self, drafts: &[u32]) -> anyhow::Result<Vec<Allowed>> {
        let mut along = vec![self.next_allowed()?];
        let mut consumed = 0;
        for &d in drafts {
            let here = along.last().expect("one per position");
            // An end-of-sequence draft ends the answer: nothing after it.
            if !here.allows(d) || self.eos_ids.contains(&d) {
                if here.allows(d) {
                    along.push(Allowed::anything());
                }
                break;
            }
            self.consume(d)?;
            consumed += 1;
            along.push(if self.is_done() { Allowed::anything() } else { self.next_allowed()? });
            if self.is_done() {
                break;
            }
        }
        self.matcher.rollback(consumed).map_err(|e| anyhow::anyhow!("constraint: {e}"))?;
        Ok(along)
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
