//! OpenAI's speech-to-text API on the gateway: `POST /v1/audio/transcriptions`
//! and `/v1/audio/translations` (multipart: `file`, `model`, `language`,
//! `prompt`, `response_format` json|text|srt|verbose_json|vtt,
//! `temperature`, `timestamp_granularities[]`), answered by the daemon's
//! Whisper models through the same feature store as `mlxbc transcribe`.
//! `model` may be `whisper-1` (what clients send by default): the first
//! speech model installed.

use super::{error_response, CancelOnDrop};
use crate::state::AppState;
use axum::extract::{Multipart, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::Json;
use mlxbc_shared::{ErrorKind, MediaRef, Response as Wire, TranscribeRequest, Transcript};
use serde_json::json;
use std::sync::Arc;

/// What the form asked for.
struct Form {
    file: Option<Vec<u8>>,
    model: Option<String>,
    language: Option<String>,
    prompt: Option<String>,
    format: String,
    temperature: Option<f32>,
}

fn bad(message: impl Into<String>) -> Response {
    error_response(ErrorKind::BadRequest, message.into())
}

async fn read_form(mut multipart: Multipart) -> Result<Form, Response> {
    let mut f =
        Form { file: None, model: None, language: None, prompt: None, format: "json".into(), temperature: None };
    while let Some(field) = multipart.next_field().await.map_err(|e| bad(format!("multipart body: {e}")))? {
        let name = field.name().unwrap_or_default().to_string();
        if name == "file" {
            f.file = Some(field.bytes().await.map_err(|e| bad(format!("file: {e}")))?.to_vec());
            continue;
        }
        let text = field.text().await.map_err(|e| bad(format!("{name}: {e}")))?;
        if text.len() > crate::requests::transcribe::MAX_PROMPT_BYTES {
            return Err(bad(format!("{name}: too long")));
        }
        match name.as_str() {
            "model" => f.model = Some(text),
            "language" if !text.is_empty() => f.language = Some(text),
            "prompt" if !text.is_empty() => f.prompt = Some(text),
            "response_format" => f.format = text,
            "temperature" => {
                f.temperature = Some(text.trim().parse().map_err(|_| bad(format!("temperature {text:?}: a number")))?)
            }
            "timestamp_granularities[]" | "timestamp_granularities" if text != "segment" => {
                return Err(bad(format!(
                    "timestamp granularity {text:?}: only \"segment\" (word timestamps are not supported)"
                )))
            }
            _ => {} // `stream`, `chunking_strategy`, granularity "segment": nothing to change
        }
    }
    Ok(f)
}

/// `POST /v1/audio/transcriptions`.
pub async fn transcriptions(State(state): State<Arc<AppState>>, form: Multipart) -> Response {
    run(state, form, false).await
}

/// `POST /v1/audio/translations`: into English, with a multilingual model.
pub async fn translations(State(state): State<Arc<AppState>>, form: Multipart) -> Response {
    run(state, form, true).await
}

async fn run(state: Arc<AppState>, form: Multipart, translate: bool) -> Response {
    let f = match read_form(form).await {
        Ok(f) => f,
        Err(r) => return r,
    };
    if !["json", "text", "srt", "verbose_json", "vtt"].contains(&f.format.as_str()) {
        return bad(format!("response_format {:?}: json, text, srt, verbose_json or vtt", f.format));
    }
    let Some(file) = f.file.filter(|b| !b.is_empty()) else { return bad("file is required: the audio to transcribe") };
    let model = f.model.filter(|m| !m.is_empty() && m != "whisper-1");
    if let Some(m) = &model {
        if !crate::catalog::registry::is_plain_name(m) {
            return error_response(ErrorKind::UnknownModel, format!("model {m:?}: name a model the model list shows"));
        }
    }
    let mut request = TranscribeRequest::new(MediaRef::from_bytes(file));
    request.model = model;
    request.language = f.language;
    request.prompt = f.prompt;
    request.translate = translate;
    // OpenAI's temperature 0 (its default) means "choose": Whisper's ladder.
    request.temperature = f.temperature.filter(|t| *t > 0.0);
    let (mut rx, cancel) = match state.start_transcription(request).await {
        Ok(started) => started,
        Err(e) => return error_response(e.kind(), e.to_string()),
    };
    let _guard = CancelOnDrop(cancel);
    let t = match rx.recv().await {
        Some(Wire::Transcribed(t)) => t,
        Some(Wire::Error { kind, message }) => return error_response(kind, message),
        other => return error_response(ErrorKind::Internal, format!("unexpected answer {other:?}")),
    };
    render(&t, &f.format, if translate { "translate" } else { "transcribe" })
}

fn plain(text: String) -> Response {
    ([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], text).into_response()
}

/// The transcript in OpenAI's `response_format`.
fn render(t: &Transcript, format: &str, task: &str) -> Response {
    use mlxbc_shared::subtitles;
    let text = t.text.trim().to_string();
    match format {
        "text" => plain(format!("{text}\n")),
        "srt" => plain(subtitles::srt(t)),
        "vtt" => plain(subtitles::vtt(t)),
        "verbose_json" => {
            let segments: Vec<_> = t
                .segments
                .iter()
                .map(|s| {
                    json!({"id": s.id, "seek": s.seek, "start": s.start, "end": s.end, "text": s.text,
                           "tokens": s.tokens, "temperature": s.temperature, "avg_logprob": s.avg_logprob,
                           "compression_ratio": s.compression_ratio, "no_speech_prob": s.no_speech_prob})
                })
                .collect();
            Json(json!({"task": task, "language": language_name(&t.language), "duration": t.stats.audio_seconds,
                        "text": text, "segments": segments,
                        "usage": {"type": "duration", "seconds": t.stats.audio_seconds.ceil() as u64}}))
            .into_response()
        }
        _ => Json(json!({"text": text, "usage": {"type": "duration", "seconds": t.stats.audio_seconds.ceil() as u64}}))
            .into_response(),
    }
}

/// OpenAI's verbose_json names the language in English words.
fn language_name(code: &str) -> String {
    const NAMES: &[(&str, &str)] = &[
        ("en", "english"),
        ("de", "german"),
        ("fr", "french"),
        ("es", "spanish"),
        ("it", "italian"),
        ("pt", "portuguese"),
        ("nl", "dutch"),
        ("ja", "japanese"),
        ("zh", "chinese"),
        ("ko", "korean"),
        ("ru", "russian"),
        ("pl", "polish"),
        ("tr", "turkish"),
        ("ar", "arabic"),
        ("hi", "hindi"),
        ("sv", "swedish"),
        ("uk", "ukrainian"),
    ];
    NAMES.iter().find(|(c, _)| *c == code).map_or_else(|| code.to_string(), |(_, n)| n.to_string())
}
