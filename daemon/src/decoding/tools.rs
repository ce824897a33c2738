//! Tool calls: how a model's chat template asks for them, how they are
//! found in its output, and the grammar that makes a required call parse.
//!
//! Tools reach the model through its own chat template (the `tools`
//! variable HF templates read). Which markers its calls come in is read
//! from the template, as mlx-lm does: Qwen2.5 / Qwen3 (Hermes style) write
//! `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one block
//! per call; Llama 3.1 / 3.2 answer with one bare JSON object
//! `{"name": ..., "parameters": {...}}` (their template says so and renders
//! results as `ipython` turns). A model whose template has no tool support
//! gets a clear `BadRequest` rather than tools it would ignore.

pub use crate::model::tool_format::ToolFormat;
use crate::model::tool_format::{CLOSE, OPEN};
use mlxbc_shared::{Constraint, Tool, ToolCall, ToolChoice};
use serde_json::{json, Value};

/// The tools a request's prompt describes to the model (none when it
/// sends none or chose `ToolChoice::None`); a `BadRequest` message when the
/// model's template takes no tools.
pub fn for_prompt<'a>(
    template: &crate::model::chat_template::ChatTemplate,
    request: &'a mlxbc_shared::GenerateRequest,
) -> Result<&'a [Tool], String> {
    if request.tools.is_empty() || request.tool_choice == ToolChoice::None {
        return Ok(&[]);
    }
    if template.tool_format.is_none() {
        return Err("this model's chat template has no tool support (GET /api/show lists `tools` among a model's \
                    capabilities when it has); use a model whose template takes tools, e.g. Qwen2.5 or Qwen3"
            .into());
    }
    Ok(&request.tools)
}

/// Checks tools before anything is rendered: names, schemas as JSON, a
/// named choice that exists.
pub fn check(tools: &[Tool], choice: &ToolChoice) -> Result<(), String> {
    for t in tools {
        if t.name.is_empty()
            || t.name.len() > 64
            || !t.name.chars().all(|c| c.is_ascii_alphanumeric() || "_-.".contains(c))
        {
            return Err(format!("tool name {:?}: 1 to 64 letters, digits, '_', '-' or '.'", t.name));
        }
        let schema: Value = serde_json::from_str(&t.parameters)
            .map_err(|e| format!("tool {}: parameters are not JSON: {e}", t.name))?;
        if !schema.is_object() {
            return Err(format!("tool {}: parameters must be a JSON Schema object", t.name));
        }
    }
    match choice {
        ToolChoice::Function(name) if !tools.iter().any(|t| &t.name == name) => {
            Err(format!("tool_choice names {name:?}, which is not among the tools"))
        }
        ToolChoice::Required | ToolChoice::Function(_) if tools.is_empty() => {
            Err("tool_choice requires a call but no tools were given".into())
        }
        _ => Ok(()),
    }
}

/// The grammar a required (or named) call is generated under: one or more
/// call blocks whose JSON names a tool and holds arguments valid under its
/// schema. `open`/`close` are the marker tokens' ids when the tokenizer has
/// them as single (special) tokens, which the model emits rather than text.
pub fn required_call_grammar(
    format: ToolFormat,
    tools: &[Tool],
    choice: &ToolChoice,
    open: Option<u32>,
    close: Option<u32>,
) -> Option<Constraint> {
    let chosen: Vec<&Tool> = match choice {
        ToolChoice::Required => tools.iter().collect(),
        ToolChoice::Function(name) => tools.iter().filter(|t| &t.name == name).collect(),
        ToolChoice::Auto | ToolChoice::None => return None,
    };
    let key = match format {
        ToolFormat::Hermes => "arguments",
        ToolFormat::Llama3Json => "parameters",
    };
    let calls: Vec<Value> = chosen
        .iter()
        .map(|t| {
            let parameters: Value = serde_json::from_str(&t.parameters).unwrap_or_else(|_| json!({}));
            json!({"type": "object", "properties": {"name": {"const": t.name}, key: parameters},
                   "required": ["name", key], "additionalProperties": false})
        })
        .collect();
    let schema = json!({"anyOf": calls});
    if format == ToolFormat::Llama3Json {
        // The call is the whole answer, a bare object.
        return Some(Constraint::JsonSchema(schema.to_string()));
    }
    let marker = |id: Option<u32>, text: &str| match id {
        Some(id) => format!("<[{id}]>"),
        None => serde_json::to_string(text).expect("a string"),
    };
    let (open, close) = (marker(open, OPEN), marker(close, CLOSE));
    // One call: small models asked for "one or more" repeat the call
    // until their token limit (measured on Qwen2.5-Coder-0.5B); several
    // calls come in `auto` mode, parsed from the answer.
    Some(Constraint::Lark(format!("start: {open} \"\\n\" body \"\\n\" {close}\nbody: %json {schema}\n")))
}

/// Splits a streamed answer into text and tool calls: text inside call
/// markers is held back and parsed when its block closes.
#[derive(Debug, Default)]
pub struct ToolCallFilter {
    /// The markers' ids where the tokenizer has them as single special
    /// tokens (which the stream's decoder does not print).
    pub marker_ids: Option<(u32, u32)>,
    /// Text not yet known to be outside a call (it may start a marker).
    pending: String,
    /// Inside a call block: its text so far.
    inside: Option<String>,
    pub calls: Vec<ToolCall>,
    /// Blocks that did not parse (kept as text, with a warning).
    pub warnings: Vec<String>,
    /// The tools' names: an answer that is a bare JSON call of one of them
    /// (small models often drop the markers) is a call too.
    names: Vec<String>,
    /// Nothing streamed yet, and the answer so far could be a bare call.
    bare: Option<String>,
    started: bool,
}

impl ToolCallFilter {
    /// A filter for a model with this tokenizer.
    pub fn new(tokenizer: &tokenizers::Tokenizer, tools: &[Tool]) -> Self {
        let marker_ids = tokenizer.token_to_id(OPEN).zip(tokenizer.token_to_id(CLOSE));
        Self { marker_ids, names: tools.iter().map(|t| t.name.clone()).collect(), ..Self::default() }
    }

    /// The marker text a token id stands for, if it is one.
    pub fn marker(&self, token: u32) -> Option<&'static str> {
        match self.marker_ids {
            Some((open, _)) if open == token => Some(OPEN),
            Some((_, close)) if close == token => Some(CLOSE),
            _ => None,
        }
    }

    /// Takes the next piece of output; returns the text to stream now.
    pub fn push(&mut self, piece: &str) -> String {
        // An answer that starts with '{' may be a bare call: held whole.
        if !self.started {
            let mut held = self.bare.take().unwrap_or_default();
            held.push_str(piece);
            match held.trim_start().chars().next() {
                None => {
                    self.bare = Some(held);
                    return String::new();
                }
                Some('{') if !self.names.is_empty() => {
                    self.bare = Some(held);
                    return String::new();
                }
                Some(_) => {
                    self.started = true;
                    return self.push_marked(&held);
                }
            }
        }
        self.push_marked(piece)
    }

    fn push_marked(&mut self, piece: &str) -> String {
        self.pending.push_str(piece);
        let mut out = String::new();
        loop {
            match &mut self.inside {
                None => match self.pending.find(OPEN) {
                    Some(at) => {
                        out.push_str(&self.pending[..at]);
                        self.pending.drain(..at + OPEN.len());
                        self.inside = Some(String::new());
                    }
                    None => {
                        // Keep a tail that could be the start of a marker.
                        let keep = longest_marker_prefix(&self.pending, OPEN);
                        let cut = self.pending.len() - keep;
                        out.push_str(&self.pending[..cut]);
                        self.pending.drain(..cut);
                        return out;
                    }
                },
                Some(body) => match self.pending.find(CLOSE) {
                    Some(at) => {
                        body.push_str(&self.pending[..at]);
                        let body = std::mem::take(body);
                        self.pending.drain(..at + CLOSE.len());
                        self.inside = None;
                        if let Err(raw) = self.parse(&body) {
                            out.push_str(&raw);
                        }
                    }
                    None => return out,
                },
            }
        }
    }

    /// The end of the answer: text still held back (a call never closed is
    /// returned as text, with a warning).
    pub fn finish(&mut self) -> String {
        if let Some(held) = self.bare.take() {
            if self.bare_call(held.trim()) {
                return String::new();
            }
            // Not a bare call: it may still hold marked ones.
            self.started = true;
            let mut out = self.push_marked(&held);
            out.push_str(&self.finish());
            return out;
        }
        let mut out = std::mem::take(&mut self.pending);
        if let Some(body) = self.inside.take() {
            self.warnings.push("the model began a tool call and never closed it; its text is in the answer".into());
            out = format!("{OPEN}{body}{out}");
        }
        out
    }

    /// True when `text` is one JSON call of a known tool (taken as a call).
    fn bare_call(&mut self, text: &str) -> bool {
        let Ok(v) = serde_json::from_str::<Value>(text) else { return false };
        let known = v["name"].as_str().is_some_and(|n| self.names.iter().any(|t| t == n));
        let has_arguments = v.get("arguments").or_else(|| v.get("parameters")).is_some_and(Value::is_object);
        known && has_arguments && self.parse(text).is_ok()
    }

    /// A call block's JSON as a call; `Err(raw text)` when it is not one.
    fn parse(&mut self, body: &str) -> Result<(), String> {
        let raw = || format!("{OPEN}{body}{CLOSE}");
        let Ok(v) = serde_json::from_str::<Value>(body.trim()) else {
            self.warnings.push("a tool call's text was not JSON; it is in the answer".into());
            return Err(raw());
        };
        let (Some(name), Some(arguments)) = (v["name"].as_str(), v.get("arguments").or_else(|| v.get("parameters")))
        else {
            self.warnings.push("a tool call had no name or arguments; it is in the answer".into());
            return Err(raw());
        };
        let arguments = match arguments {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        let id = format!("call_{:016x}", rand::random::<u64>());
        self.calls.push(ToolCall { id, name: name.to_string(), arguments });
        Ok(())
    }
}

/// The length of the longest suffix of `text` that is a proper prefix of `marker`.
fn longest_marker_prefix(text: &str, marker: &str) -> usize {
    (1..marker.len().min(text.len() + 1))
        .rev()
        .find(|&n| text.is_char_boundary(text.len() - n) && marker.starts_with(&text[text.len() - n..]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_are_taken_out_of_the_stream_in_any_split() {
        let answer = "Let me check.<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"t\", \"arguments\": {}}\n</tool_call>";
        for step in [1, 2, 3, 7, 100] {
            let mut f = ToolCallFilter { names: vec!["get_weather".into()], ..Default::default() };
            let mut text = String::new();
            let chars: Vec<char> = answer.chars().collect();
            for piece in chars.chunks(step) {
                text.push_str(&f.push(&piece.iter().collect::<String>()));
            }
            text.push_str(&f.finish());
            assert_eq!(text.trim(), "Let me check.", "step {step}");
            assert_eq!(f.calls.len(), 2);
            assert_eq!(
                (f.calls[0].name.as_str(), f.calls[0].arguments.as_str()),
                ("get_weather", r#"{"city":"Paris"}"#)
            );
            assert!(f.warnings.is_empty());
        }
    }

    #[test]
    fn a_bare_json_call_of_a_known_tool_is_a_call_and_other_json_is_text() {
        let call = r#" {"name": "get_weather", "arguments": {"city": "Paris"}}"#;
        let mut f = ToolCallFilter { names: vec!["get_weather".into()], ..Default::default() };
        let text = f.push(&call[..10]) + &f.push(&call[10..]) + &f.finish();
        assert_eq!((text.as_str(), f.calls.len()), ("", 1));
        let other = r#"{"city": "Paris"}"#;
        let mut f = ToolCallFilter { names: vec!["get_weather".into()], ..Default::default() };
        let text = f.push(other) + &f.finish();
        assert_eq!((text.as_str(), f.calls.len()), (other, 0));
    }

    #[test]
    fn templates_say_which_format_their_calls_take() {
        let qwen = "{% if tools %}{{ tools | tojson }} <tool_call>{% endif %}";
        assert_eq!(ToolFormat::of_template(qwen), Some(ToolFormat::Hermes));
        let llama = r#"{% if tools is not none %}Environment: ipython
Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.{% endif %}"#;
        assert_eq!(ToolFormat::of_template(llama), Some(ToolFormat::Llama3Json));
        assert_eq!(ToolFormat::of_template("{{ messages[0].content }}"), None);
        // A Llama 3 call is a bare object with "parameters".
        let mut f = ToolCallFilter { names: vec!["get_weather".into()], ..Default::default() };
        let text = f.push(r#"{"name": "get_weather", "parameters": {"city": "Paris"}}"#) + &f.finish();
        assert_eq!((text.as_str(), f.calls[0].arguments.as_str()), ("", r#"{"city":"Paris"}"#));
    }

    #[test]
    fn broken_or_unclosed_calls_stay_text_with_a_warning() {
        let mut f = ToolCallFilter::default();
        let mut text = f.push("a <tool_call>not json</tool_call> b <tool_call>{\"name\"");
        text.push_str(&f.finish());
        assert_eq!(text, "a <tool_call>not json</tool_call> b <tool_call>{\"name\"");
        assert!(f.calls.is_empty());
        assert_eq!(f.warnings.len(), 2);
    }

    #[test]
    fn a_required_call_grammar_names_the_tools() {
        let tools =
            [Tool { name: "get_weather".into(), description: "".into(), parameters: r#"{"type":"object"}"#.into() }];
        let hermes = required_call_grammar(ToolFormat::Hermes, &tools, &ToolChoice::Required, Some(7), Some(8));
        let Some(Constraint::Lark(g)) = hermes else { panic!() };
        assert!(g.contains("<[7]>") && g.contains("<[8]>") && g.contains("get_weather"), "{g}");
        assert!(required_call_grammar(ToolFormat::Hermes, &tools, &ToolChoice::Auto, None, None).is_none());
        let llama = required_call_grammar(ToolFormat::Llama3Json, &tools, &ToolChoice::Required, None, None);
        let Some(Constraint::JsonSchema(schema)) = llama else { panic!() };
        assert!(schema.contains(r#""required":["name","parameters"]"#), "{schema}");
        assert!(check(&tools, &ToolChoice::Function("nope".into())).is_err());
    }
}
