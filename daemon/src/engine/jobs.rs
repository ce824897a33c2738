//! What the tokio side sends the engine thread: jobs (a generation with
//! what was prepared off the thread, a load, a prefetch, a transcription)
//! and the routes connections tokenize by.

use crate::model::prompt::Prompter;
use crate::{media, prompt_cache, sessions};
use mlxbc_shared::{ErrorKind, GenerateRequest, KeepAlive, Response};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::{mpsc as tmpsc, oneshot};

/// Work for the engine thread.
#[expect(
    clippy::large_enum_variant,
    reason = "one value per request or load, moved a few times and matched at once; boxing the large variant buys nothing"
)]
pub enum Job {
    /// Stream a chat completion into `events`.
    Generate {
        request: GenerateRequest,
        events: tmpsc::UnboundedSender<Response>,
        /// Set when the client went away.
        cancel: Arc<AtomicBool>,
        /// When the daemon received the request (time to first token starts here).
        received: Instant,
        /// The prompt's ids, when a connection made them off the engine thread.
        prepared: Option<PreparedPrompt>,
        /// The request's media, looked up and preprocessed off the engine thread.
        media: Option<media::PreparedMedia>,
        /// A named session's turn: `request.messages` already starts with
        /// its history; the new messages and the answer are appended when done.
        turn: Option<SessionTurn>,
        /// Time a load requested while preparing took (ms), counted in the stats.
        load_ms: f64,
    },
    /// Make a model resident (`None`: the default model).
    Load {
        model: Option<String>,
        keep_alive: Option<KeepAlive>,
        /// A request is being prepared for this model and follows at once:
        /// nothing is shed or expired before it arrives.
        for_request: bool,
        /// Split it over the group.
        sharded: bool,
        reply: oneshot::Sender<Response>,
    },
    /// Drop a resident model.
    Unload { model: String, reply: oneshot::Sender<Response> },
    /// Encode media ahead of time (prepared off the engine thread when the model was resident).
    Prefetch {
        model: Option<String>,
        media: Vec<mlxbc_shared::MediaRef>,
        prepared: Option<media::PreparedMedia>,
        reply: oneshot::Sender<Response>,
    },
    /// Drop the prompt cache's RAM tier (`cache clear --prompts`; the disk
    /// tier is cleared off the engine thread); replies with the blocks dropped.
    ClearPromptRam { reply: oneshot::Sender<u64> },
    /// Transcribe a recording (decoded off the engine thread) into `events`.
    /// Texts to embed with an embedding model (`engine::embed`).
    Embed { request: mlxbc_shared::EmbedRequest, received: Instant, reply: oneshot::Sender<Response> },
    /// Documents to order by relevance with a reranker (`engine::embed`).
    Rerank { request: mlxbc_shared::RerankRequest, received: Instant, reply: oneshot::Sender<Response> },
    Transcribe {
        request: mlxbc_shared::TranscribeRequest,
        audio: crate::audio::AudioInput,
        events: tmpsc::UnboundedSender<Response>,
        cancel: Arc<AtomicBool>,
        received: Instant,
    },
}

/// A turn of a named session, begun before its job was queued.
pub struct SessionTurn {
    pub name: String,
    /// This turn's own messages (without the history).
    pub messages: Vec<mlxbc_shared::ChatMessage>,
    pub started: sessions::Turn,
}

/// A text prompt rendered and tokenized before its job reached the engine.
pub struct PreparedPrompt {
    /// The resident model it was made for (its canonical name).
    pub model: String,
    /// That model's prompter: if the model was reloaded meanwhile, the ids
    /// are not trusted and the engine tokenizes again.
    pub prompter: Arc<Prompter>,
    pub ids: Vec<u32>,
    /// The prompt cache's blocks for these ids that were on disk (and not
    /// in RAM), read off the engine thread.
    pub stored: prompt_cache::StoredBlocks,
}

impl PreparedPrompt {
    /// Made by this model's own prompter.
    pub fn is_for(&self, model: &str, prompter: &Arc<Prompter>) -> bool {
        self.model == model && Arc::ptr_eq(&self.prompter, prompter)
    }
}

/// What a connection needs to tokenize for a resident model: its canonical
/// name, its prompter, its context length.
#[derive(Clone)]
pub struct PromptRoute {
    pub model: String,
    pub prompter: Arc<Prompter>,
    pub context: usize,
    /// A vision model's image placeholder: a prompt whose text holds one
    /// (with no image sent) is left to the engine, which refuses it.
    pub placeholder: Option<String>,
    /// A vision model's preprocessing and store-key parts.
    pub media: Option<media::MediaRoute>,
    /// The model's KV identity, where the prompt cache's block names start.
    pub kv_root: Option<[u8; 32]>,
    /// The model keeps recurrent states (its prefixes need them stored).
    pub recurrent: bool,
}

impl std::fmt::Debug for PromptRoute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PromptRoute").field("model", &self.model).field("context", &self.context).finish()
    }
}

/// Control messages, kept apart from jobs so a stop is never stuck behind them.
#[expect(
    clippy::large_enum_variant,
    reason = "one value per request or load, moved a few times and matched at once; boxing the large variant buys nothing"
)]
pub(super) enum Control {
    Job(Job),
    /// Finish the job in hand, refuse the queued ones, exit.
    Stop,
}

/// Answers a job that arrived after the stop.
pub(super) fn refuse(job: Job) {
    let err = || Response::Error { kind: ErrorKind::ShuttingDown, message: "mlxbcd is shutting down".into() };
    match job {
        Job::Generate { events, .. } | Job::Transcribe { events, .. } => {
            let _ = events.send(err());
        }
        Job::Load { reply, .. }
        | Job::Unload { reply, .. }
        | Job::Prefetch { reply, .. }
        | Job::Embed { reply, .. }
        | Job::Rerank { reply, .. } => {
            let _ = reply.send(err());
        }
        Job::ClearPromptRam { .. } => {}
    }
}
