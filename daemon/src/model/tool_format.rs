//! How a chat template asks for tool calls: which markers its calls come
//! in (read from the template's source, as mlx-lm does), and the tools in
//! the shape templates read. Finding calls in a model's output is
//! `crate::decoding::tools`.

use mlxbc_shared::Tool;
use serde_json::{json, Value};

/// How a model's template writes tool calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    /// `<tool_call>{"name": ..., "arguments": ...}</tool_call>` (Qwen2.5,
    /// Qwen3, Hermes).
    Hermes,
    /// A bare `{"name": ..., "parameters": ...}` answer (Llama 3.1 / 3.2).
    Llama3Json,
}

pub const OPEN: &str = "<tool_call>";
pub const CLOSE: &str = "</tool_call>";

impl ToolFormat {
    /// The format a chat template's source uses, if it takes tools at all.
    pub fn of_template(source: &str) -> Option<Self> {
        if !source.contains("tools") {
            return None;
        }
        if source.contains(OPEN) {
            return Some(Self::Hermes);
        }
        // Llama 3.x: "Respond in the format {"name": function name,
        // "parameters": dictionary of argument name and its value}".
        let llama = source.contains("\"parameters\": dictionary") || source.contains("Environment: ipython");
        llama.then_some(Self::Llama3Json)
    }
}

/// The tools as templates expect them (OpenAI's shape, parameters parsed).
pub fn template_tools(tools: &[Tool]) -> Vec<Value> {
    tools
        .iter()
        .map(|t| {
            let parameters: Value = serde_json::from_str(&t.parameters).unwrap_or_else(|_| json!({}));
            json!({"type": "function", "function": {"name": t.name, "description": t.description, "parameters": parameters}})
        })
        .collect()
}
