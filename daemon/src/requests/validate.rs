//! Requests are checked here, before they reach the engine's queue, so that
//! nonsense costs nothing and gets a clear `BadRequest`: sampling parameters
//! (NaN, infinite or negative ones used to be accepted; a NaN temperature
//! answered nothing), the prompt's size in bytes (a 60 MB prompt was
//! tokenized in full on the engine thread, 28.7 s for everyone, before it
//! was refused), and the sizes of names, stop strings and media lists.

use mlxbc_shared::{GenerateRequest, Request};

/// Bounds from the settings.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Message text, in bytes, over all messages (each message counted
    /// [`MESSAGE_OVERHEAD_BYTES`] more, for what its template adds).
    pub max_prompt_bytes: usize,
    /// Messages in one request.
    pub max_prompt_messages: usize,
}

/// What a message costs beyond its text, counted against
/// `max_prompt_bytes`: its template's role header and separators are a few
/// tokens each. Found before: 100,000 one-letter messages passed the byte
/// check and tokenized to 600k tokens (2.8 s of CPU, +195 MiB).
pub const MESSAGE_OVERHEAD_BYTES: usize = 32;

/// Longest model name or path accepted (PATH_MAX).
const MAX_NAME_BYTES: usize = 4096;
/// Stop strings per request and bytes per stop string.
const MAX_STOPS: usize = 64;
const MAX_STOP_BYTES: usize = 1024;
/// Images over all messages.
const MAX_MEDIA: usize = 256;
/// Above this temperature every distribution is uniform for practical purposes.
const MAX_TEMPERATURE: f32 = 100.0;

/// Why a request was refused before it was queued.
#[derive(Debug, thiserror::Error, PartialEq)]
#[error("{0}")]
pub struct Invalid(pub String);

fn bad(message: String) -> Result<(), Invalid> {
    Err(Invalid(message))
}

fn check_name(what: &str, name: &str) -> Result<(), Invalid> {
    if name.len() > MAX_NAME_BYTES {
        return bad(format!("{what} is {} bytes long; at most {MAX_NAME_BYTES}", name.len()));
    }
    if name.contains('\0') {
        return bad(format!("{what} contains a NUL byte"));
    }
    Ok(())
}

/// Tools one request may describe, and the bytes of each one's schema or description.
pub const MAX_TOOLS: usize = 128;
pub const MAX_TOOL_BYTES: usize = 32 * 1024;

/// Checks a generation request.
pub fn generate(request: &GenerateRequest, limits: Limits) -> Result<(), Invalid> {
    let s = &request.sampling;
    if !s.temperature.is_finite() || !(0.0..=MAX_TEMPERATURE).contains(&s.temperature) {
        return bad(format!(
            "temperature must be a number from 0 (greedy) to {MAX_TEMPERATURE}, not {}",
            s.temperature
        ));
    }
    if !s.top_p.is_finite() || s.top_p <= 0.0 || s.top_p > 1.0 {
        return bad(format!("top_p must be above 0 and at most 1 (1 disables it), not {}", s.top_p));
    }
    if request.messages.is_empty() && request.raw.is_none() {
        return bad("the request has no messages".into());
    }
    if request.logprobs.is_some_and(|k| k > mlxbc_shared::MAX_TOP_LOGPROBS) {
        return bad(format!("top_logprobs must be from 0 to {}", mlxbc_shared::MAX_TOP_LOGPROBS));
    }
    if let Some(raw) = &request.raw {
        if !request.messages.is_empty() || request.session.is_some() || !request.tools.is_empty() {
            return bad("a raw prompt comes alone: no messages, session or tools with it".into());
        }
        let bytes = raw.prefix.len() + raw.suffix.as_ref().map_or(0, String::len);
        if bytes > limits.max_prompt_bytes {
            return bad(format!(
                "the prompt is {bytes} bytes; this daemon accepts at most {}",
                limits.max_prompt_bytes
            ));
        }
    }
    if request.messages.len() > limits.max_prompt_messages {
        return bad(format!(
            "{} messages in one request; this daemon accepts at most {} (max_prompt_messages in config.toml)",
            request.messages.len(),
            limits.max_prompt_messages
        ));
    }
    let bytes: usize = request.messages.iter().map(|m| m.content.len() + MESSAGE_OVERHEAD_BYTES).sum();
    if bytes > limits.max_prompt_bytes {
        return bad(format!(
            "the prompt is {bytes} bytes; this daemon accepts at most {} (max_prompt_bytes in config.toml)",
            limits.max_prompt_bytes
        ));
    }
    let media = request.messages.iter().map(|m| m.media.len()).sum::<usize>();
    if media > MAX_MEDIA {
        return bad(format!("{media} images in one request; at most {MAX_MEDIA}"));
    }
    if request.stop.len() > MAX_STOPS || request.stop.iter().any(|s| s.len() > MAX_STOP_BYTES || s.is_empty()) {
        return bad(format!("stop strings: at most {MAX_STOPS}, each 1 to {MAX_STOP_BYTES} bytes"));
    }
    if let Some(m) = &request.model {
        check_name("the model name", m)?;
    }
    if let Some(name) = &request.session {
        crate::sessions::check_name(name).map_err(|e| Invalid(e.to_string()))?;
    }
    if request.tools.len() > MAX_TOOLS
        || request.tools.iter().any(|t| t.parameters.len() > MAX_TOOL_BYTES || t.description.len() > MAX_TOOL_BYTES)
    {
        return bad(format!("tools: at most {MAX_TOOLS}, each description and schema at most {MAX_TOOL_BYTES} bytes"));
    }
    crate::decoding::tools::check(&request.tools, &request.tool_choice).map_err(Invalid)?;
    if let Some(c) = &request.constraint {
        crate::decoding::constraint::check(c).map_err(Invalid)?;
    }
    Ok(())
}

/// Checks any request (the parts that are not the engine's to judge).
pub fn request(request: &Request, limits: Limits) -> Result<(), Invalid> {
    match request {
        Request::Generate(g) => generate(g, limits),
        Request::Load { model, .. } | Request::Unload { model } => check_name("the model name", model),
        Request::Prefetch { model, media } => {
            if media.len() > MAX_MEDIA {
                return bad(format!("{} images in one request; at most {MAX_MEDIA}", media.len()));
            }
            model.as_deref().map_or(Ok(()), |m| check_name("the model name", m))
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlxbc_shared::fuzz::{arbitrary_request, Rng};

    const LIMITS: Limits = Limits { max_prompt_bytes: 1 << 20, max_prompt_messages: 4096 };

    #[test]
    fn bad_sampling_is_refused_with_the_value() {
        for (t, p) in [(f32::NAN, 1.0), (-1.0, 1.0), (f32::INFINITY, 1.0), (0.7, f32::NAN), (0.7, 0.0), (0.7, 1.5)] {
            let mut r = GenerateRequest::ask("hi");
            r.sampling.temperature = t;
            r.sampling.top_p = p;
            let err = generate(&r, LIMITS).unwrap_err();
            assert!(err.0.contains("temperature") || err.0.contains("top_p"), "{err}");
        }
        assert!(generate(&GenerateRequest::ask("hi"), LIMITS).is_ok());
    }

    #[test]
    fn oversized_prompts_names_and_stops_are_refused() {
        let big = GenerateRequest::ask("x".repeat((1 << 20) + 1));
        assert!(generate(&big, LIMITS).unwrap_err().0.contains("max_prompt_bytes"));
        let mut r = GenerateRequest::ask("hi");
        r.stop = vec![String::new()];
        assert!(generate(&r, LIMITS).is_err());
        r.stop = vec!["x".repeat(2000)];
        assert!(generate(&r, LIMITS).is_err());
        assert!(request(&Request::Load { model: "m".repeat(5000), keep_alive: None, sharded: false }, LIMITS).is_err());
        assert!(request(&Request::Unload { model: "a\0b".into() }, LIMITS).is_err());
    }

    #[test]
    fn many_tiny_messages_are_refused_before_tokenizing() {
        let mut r = GenerateRequest::ask("x");
        r.messages = vec![r.messages[0].clone(); 100_000];
        assert!(generate(&r, LIMITS).unwrap_err().0.contains("max_prompt_messages"));
        // Under the count, the template's share still counts against the bytes.
        let tight = Limits { max_prompt_bytes: 4000 * MESSAGE_OVERHEAD_BYTES, max_prompt_messages: 4096 };
        r.messages.truncate(4096);
        assert!(generate(&r, tight).unwrap_err().0.contains("max_prompt_bytes"));
        r.messages.truncate(3000);
        assert!(generate(&r, tight).is_ok());
    }

    /// A million arbitrary requests of every variant: the checks never
    /// panic, and whatever they let through is within the bounds.
    #[test]
    fn fuzzed_requests_never_panic_and_what_passes_is_bounded() {
        let mut rng = Rng::new(11);
        let (mut passed, mut refused) = (0u32, 0u32);
        for _ in 0..1_000_000 {
            let r = arbitrary_request(&mut rng, true);
            match request(&r, LIMITS) {
                Ok(()) => {
                    passed += 1;
                    if let Request::Generate(g) = &r {
                        assert!(g.sampling.temperature.is_finite() && g.sampling.temperature >= 0.0);
                        assert!(g.sampling.top_p > 0.0 && g.sampling.top_p <= 1.0);
                        assert!(g.logprobs.is_none_or(|k| k <= mlxbc_shared::MAX_TOP_LOGPROBS));
                        // Messages, or a raw prompt alone within the byte limit.
                        match &g.raw {
                            None => assert!(!g.messages.is_empty()),
                            Some(raw) => {
                                assert!(g.messages.is_empty() && g.session.is_none() && g.tools.is_empty());
                                let bytes = raw.prefix.len() + raw.suffix.as_ref().map_or(0, String::len);
                                assert!(bytes <= LIMITS.max_prompt_bytes);
                            }
                        }
                    }
                }
                Err(_) => refused += 1,
            }
        }
        assert!(passed > 100_000 && refused > 100_000, "{passed} passed, {refused} refused");
    }
}
