//! Renders a model's chat template (Jinja, as shipped in GGUF metadata or
//! tokenizer_config.json) with minijinja, with the Python-isms HF templates use.

use anyhow::{Context, Result};
use minijinja::{context, Environment, Error, ErrorKind};
use mlxbc_shared::ChatMessage;

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    /// Compiles `source`; `bos`/`eos` are the texts of those tokens.
    pub fn new(source: String, bos_token: String, eos_token: String) -> Result<Self> {
        let mut env = Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<String, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_function("strftime_now", |fmt: String| -> String {
            // Only date formats appear in real templates; a fixed date keeps
            // prompts (and therefore prefix caches) stable within a day.
            let _ = fmt;
            String::from("29 Nov 2026")
        });
        env.add_template_owned("chat", source).context("compiling the chat template")?;
        Ok(Self { env, bos_token, eos_token })
    }

    /// The prompt text for `messages`, ending where the assistant's answer starts.
    pub fn render(&self, messages: &[ChatMessage]) -> Result<String> {
        // Messages with images use HF's content-list form, which multimodal
        // templates expect: [{"type": "image"}, ..., {"type": "text", "text": ...}].
        let messages: Vec<_> = messages
            .iter()
            .map(|m| {
                if m.images.is_empty() {
                    return context! { role => m.role.as_str(), content => m.content.clone() };
                }
                let mut parts: Vec<minijinja::Value> = m.images.iter().map(|_| context! { type => "image" }).collect();
                parts.push(context! { type => "text", text => m.content.clone() });
                context! { role => m.role.as_str(), content => parts }
            })
            .collect();
        let tmpl = self.env.get_template("chat")?;
        tmpl.render(context! {
            messages => messages,
            add_generation_prompt => true,
            bos_token => self.bos_token.clone(),
            eos_token => self.eos_token.clone(),
        })
        .context("rendering the chat template")
    }
}

/// ChatML, for models that ship no template.
pub const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
