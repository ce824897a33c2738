//! Prompts sent as text rather than messages: completions, and
//! fill-in-the-middle (the editor's code before and after the cursor, in
//! the model's FIM format, as Continue's autocomplete sends them).

use mlxbc_shared::RawPrompt;

/// FIM token triples (prefix, suffix, middle) of the families that have
/// them: Qwen2.5-Coder / Qwen3-Coder, then StarCoder-style.
const FIM_FORMATS: [(&str, &str, &str); 2] =
    [("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"), ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")];

/// True when the tokenizer has one of the FIM formats as single tokens.
pub fn has_fim(tokenizer: &tokenizers::Tokenizer) -> bool {
    fim_format(tokenizer).is_some()
}

fn fim_format(tokenizer: &tokenizers::Tokenizer) -> Option<(&'static str, &'static str, &'static str)> {
    FIM_FORMATS.into_iter().find(|(p, s, m)| [p, s, m].iter().all(|t| tokenizer.token_to_id(t).is_some()))
}

/// The prompt text of `raw`; a `BadRequest` message for a suffix on a
/// model without FIM tokens.
pub fn text(tokenizer: &tokenizers::Tokenizer, raw: &RawPrompt) -> Result<String, String> {
    let Some(suffix) = &raw.suffix else { return Ok(raw.prefix.clone()) };
    let (p, s, m) = fim_format(tokenizer).ok_or_else(|| {
        "this model has no fill-in-the-middle tokens (a `suffix` needs e.g. Qwen2.5-Coder); send the prompt alone"
            .to_string()
    })?;
    Ok(format!("{p}{}{s}{suffix}{m}", raw.prefix))
}
