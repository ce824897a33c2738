//! Renders a model's chat template (Jinja, as shipped in GGUF metadata or
//! tokenizer_config.json) with minijinja, with the Python-isms HF templates use.

use anyhow::{Context, Result};
use minijinja::{context, Environment, Error, ErrorKind};
use mlxbc_shared::{ChatMessage, Tool};

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    /// How this template writes tool calls (`None`: it takes no tools).
    pub tool_format: Option<super::tool_format::ToolFormat>,
}

impl ChatTemplate {
    /// Compiles `source`; `bos`/`eos` are the texts of those tokens.
    pub fn new(source: String, bos_token: String, eos_token: String) -> Result<Self> {
        let mut env = Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<String, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_function("strftime_now", |fmt: String| -> String { strftime_today(&fmt) });
        let tool_format = super::tool_format::ToolFormat::of_template(&source);
        env.add_template_owned("chat", source).context("compiling the chat template")?;
        Ok(Self { env, bos_token, eos_token, tool_format })
    }

    /// The prompt text for `messages`, ending where the assistant's answer starts.
    pub fn render(&self, messages: &[ChatMessage]) -> Result<String> {
        self.render_with_tools(messages, &[])
    }

    /// [`Self::render`] with `tools` the model may call (the template's
    /// `tools` variable, absent when there are none).
    pub fn render_with_tools(&self, messages: &[ChatMessage], tools: &[Tool]) -> Result<String> {
        // Messages with media use HF's content-list form, which multimodal
        // templates expect: [{"type": "image"}, {"type": "video"}, ..., {"type": "text", "text": ...}].
        let messages: Vec<_> = messages
            .iter()
            .map(|m| {
                let content = if m.media.is_empty() {
                    minijinja::Value::from(m.content.clone())
                } else {
                    let kind = |m: &mlxbc_shared::MediaRef| match m.kind {
                        mlxbc_shared::MediaKind::Image => "image",
                        mlxbc_shared::MediaKind::Video => "video",
                        mlxbc_shared::MediaKind::Audio => "audio",
                    };
                    let mut parts: Vec<minijinja::Value> =
                        m.media.iter().map(|m| context! { type => kind(m) }).collect();
                    parts.push(context! { type => "text", text => m.content.clone() });
                    minijinja::Value::from(parts)
                };
                // Arguments as objects, as HF passes them (templates `tojson` them).
                let calls: Vec<serde_json::Value> = m
                    .tool_calls
                    .iter()
                    .map(|c| {
                        let arguments: serde_json::Value =
                            serde_json::from_str(&c.arguments).unwrap_or(serde_json::Value::String(c.arguments.clone()));
                        serde_json::json!({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": arguments}})
                    })
                    .collect();
                let mut v = serde_json::json!({"role": m.role.as_str()});
                if !calls.is_empty() {
                    v["tool_calls"] = serde_json::Value::Array(calls);
                }
                if let Some(id) = &m.tool_call_id {
                    v["tool_call_id"] = serde_json::Value::String(id.clone());
                }
                let base = minijinja::Value::from_serialize(&v);
                context! { content => content, ..base }
            })
            .collect();
        let tools =
            (!tools.is_empty()).then(|| minijinja::Value::from_serialize(super::tool_format::template_tools(tools)));
        let tmpl = self.env.get_template("chat")?;
        tmpl.render(context! {
            messages => messages,
            tools => tools,
            add_generation_prompt => true,
            bos_token => self.bos_token.clone(),
            eos_token => self.eos_token.clone(),
        })
        .context("rendering the chat template")
    }
}

/// The (year, month, day) of `days` since 1970-01-01 (Howard Hinnant's
/// civil-from-days algorithm).
pub fn civil_date(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(month <= 2), month, day)
}

/// Today's date (UTC) for the date formats chat templates use (`%d`, `%b`,
/// `%B`, `%Y`, `%m`); other directives are left as written. Only the date,
/// so prompts (and prefix caches) stay stable within a day.
fn strftime_today(fmt: &str) -> String {
    let days =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs() / 86_400) as i64;
    let (year, month, day) = civil_date(days);
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let name = MONTHS[(month - 1) as usize];
    fmt.replace("%d", &format!("{day:02}"))
        .replace("%m", &format!("{month:02}"))
        .replace("%Y", &year.to_string())
        .replace("%B", name)
        .replace("%b", &name[..3])
}

/// ChatML, for models that ship no template.
pub const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

#[cfg(test)]
mod tests {
    #[test]
    fn strftime_today_formats_a_plausible_date() {
        let d = super::strftime_today("%d %b %Y");
        let parts: Vec<&str> = d.split(' ').collect();
        assert_eq!(parts.len(), 3, "{d}");
        assert!(parts[0].len() == 2 && parts[1].len() == 3 && parts[2].parse::<i32>().unwrap() >= 2024, "{d}");
    }
}
