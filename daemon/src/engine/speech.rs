//! Transcriptions on the engine thread, one window at a time between the
//! scheduler's ticks (so chat streams keep flowing while a long recording
//! is transcribed). Each window's encoder output is looked up in the
//! feature store first — keyed by the recording's sha256, the tower's
//! fingerprint, the frontend's parameters and the window — and stored
//! when it had to be computed: transcribing a recording again, even after
//! a restart, skips the encoder.

use crate::audio::AudioInput;
use crate::error::EngineError;
use crate::media::SharedStore;
use crate::metrics::Metrics;
use crate::model::family::{SpeechRecognizer, SpeechTask};
use mlx_rs::{Array, Dtype};
use mlxbc_cache::{FeatureKey, Features, Modality};
use mlxbc_shared::{Response, TranscribeRequest, TranscribeStats, Transcript};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc::UnboundedSender;

/// A transcription in progress.
pub struct ActiveTranscription {
    model: Rc<dyn SpeechRecognizer>,
    task: Box<dyn SpeechTask>,
    sha256: [u8; 32],
    events: UnboundedSender<Response>,
    cancel: Arc<AtomicBool>,
    received: Instant,
    stats: TranscribeStats,
    pub keep_alive: Option<mlxbc_shared::KeepAlive>,
}

/// Where a transcription stands after a step.
pub enum Progress {
    /// More windows to go.
    Going(ActiveTranscription),
    /// Answered (or its client left); `model` was in use until now.
    Ended { model: String, keep_alive: Option<mlxbc_shared::KeepAlive> },
}

impl ActiveTranscription {
    /// Begins a transcription with a resident speech model (its log-mel is
    /// computed here).
    #[allow(clippy::too_many_arguments)]
    pub fn begin(
        name: String,
        model: Rc<dyn SpeechRecognizer>,
        request: &TranscribeRequest,
        audio: AudioInput,
        events: UnboundedSender<Response>,
        cancel: Arc<AtomicBool>,
        received: Instant,
        load_ms: f64,
    ) -> Result<Self, (EngineError, UnboundedSender<Response>)> {
        let t = Instant::now();
        let task = match model.clone().begin(audio.samples.as_deref().map(|s| s.as_slice()), audio.frames, request) {
            Ok(task) => task,
            Err(e) => return Err((EngineError::BadRequest(format!("{e:#}")), events)),
        };
        let stats = TranscribeStats {
            model: name,
            audio_seconds: task.seconds(),
            load_ms,
            preprocess_ms: t.elapsed().as_secs_f64() * 1000.0,
            ..Default::default()
        };
        Ok(Self {
            model,
            task,
            sha256: request.audio.sha256,
            events,
            cancel,
            received,
            stats,
            keep_alive: request.keep_alive,
        })
    }

    /// The model's name.
    pub fn model_name(&self) -> &str {
        &self.stats.model
    }

    fn key(&self, window: &str) -> FeatureKey {
        FeatureKey {
            modality: Modality::Audio,
            tower: self.model.fingerprint().0,
            preprocess: FeatureKey::preprocess_hash(&format!("{} | window {window}", self.model.frontend_key())),
            content: self.sha256,
        }
    }

    /// Encodes (or finds) and decodes the next window; answers when done.
    /// The request is counted in `metrics` before its client hears the
    /// end, so a scrape right after the answer finds it.
    pub fn step(mut self, store: Option<&SharedStore>, metrics: &Metrics) -> Progress {
        if self.cancel.load(Ordering::Relaxed) || self.events.is_closed() {
            tracing::info!("transcription cancelled: the client went away");
            metrics.transcription(&self.stats.model, "cancelled", None);
            return self.ended();
        }
        match self.advance(store) {
            Ok(true) => Progress::Going(self),
            Ok(false) => self.answer(metrics),
            // The client sends the audio in a new request: this one is not an outcome.
            Err(Stop::NeedBytes) => {
                let _ = self.events.send(Response::NeedMedia { missing: vec![self.sha256] });
                self.ended()
            }
            Err(Stop::Failed(e)) => {
                tracing::warn!(message = %e, "transcription failed");
                metrics.transcription(&self.stats.model, &format!("{:?}", e.kind()), None);
                let _ = self.events.send(e.into_response());
                self.ended()
            }
        }
    }

    fn ended(self) -> Progress {
        Progress::Ended { model: self.stats.model, keep_alive: self.keep_alive }
    }

    /// One window; false when there are no more.
    fn advance(&mut self, store: Option<&SharedStore>) -> Result<bool, Stop> {
        let failed = |e: anyhow::Error| Stop::Failed(EngineError::inference(e));
        let Some(window) = self.task.next_window().map_err(failed)? else { return Ok(false) };
        let key = self.key(&window.id);
        let t = Instant::now();
        let stored = store.and_then(|s| s.lock().get(&key)).map(|(f, _)| f);
        let features = match stored.as_ref().and_then(to_array) {
            Some(f) => {
                self.stats.encoder_hits += 1;
                f
            }
            None => {
                let Some(input) = &window.input else { return Err(Stop::NeedBytes) };
                let f = self.model.encode(input).and_then(|f| Ok(f.as_dtype(Dtype::Float32)?)).map_err(failed)?;
                f.eval().map_err(|e| failed(e.into()))?;
                self.stats.encoder_misses += 1;
                if let Some(s) = store {
                    let shape = f.shape().iter().map(|&d| d as u32).collect();
                    if let Err(e) = s.lock().put(&key, &Features::from_f32(shape, f.as_slice::<f32>())) {
                        tracing::warn!(error = %e, "could not store audio features");
                    }
                }
                f
            }
        };
        self.stats.encode_ms += t.elapsed().as_secs_f64() * 1000.0;
        let t = Instant::now();
        self.task.step(&features).map_err(failed)?;
        self.stats.decode_ms += t.elapsed().as_secs_f64() * 1000.0;
        Ok(true)
    }

    fn answer(mut self, metrics: &Metrics) -> Progress {
        self.stats.windows = self.task.windows();
        self.stats.total_ms = self.received.elapsed().as_secs_f64() * 1000.0;
        let Self { task, events, stats, keep_alive, .. } = self;
        let name = stats.model.clone();
        match task.finish() {
            Ok(r) => {
                metrics.transcription(&name, "done", Some(stats.audio_seconds));
                let _ = events.send(Response::Transcribed(Transcript {
                    text: r.text,
                    language: r.language,
                    segments: r.segments,
                    stats,
                }));
            }
            Err(e) => {
                let e = EngineError::inference(e);
                metrics.transcription(&name, &format!("{:?}", e.kind()), None);
                let _ = events.send(e.into_response());
            }
        }
        Progress::Ended { model: name, keep_alive }
    }
}

enum Stop {
    /// A window is not in the store and the samples were not sent.
    NeedBytes,
    Failed(EngineError),
}

fn to_array(f: &Features) -> Option<Array> {
    let values = f.to_f32();
    if values.is_empty() {
        return None;
    }
    let shape: Vec<i32> = f.shape.iter().map(|&d| d as i32).collect();
    Some(Array::from_slice(&values, &shape))
}

/// Transcriptions in flight, advanced one window at a time in turn (round
/// robin) between the scheduler's ticks.
#[derive(Default)]
pub struct Transcriptions {
    queue: std::collections::VecDeque<ActiveTranscription>,
}

impl Transcriptions {
    pub fn add(&mut self, t: ActiveTranscription) {
        self.queue.push_back(t);
    }

    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// Drops them all (shutting down: their clients hear the channel close).
    pub fn clear(&mut self) {
        self.queue.clear();
    }

    /// The models transcriptions are running on.
    pub fn models(&self) -> impl Iterator<Item = &str> {
        self.queue.iter().map(|t| t.model_name())
    }

    /// Runs one window of the transcription whose turn it is; when it
    /// ended, the model it was using and its keep-alive.
    pub fn step(
        &mut self,
        store: Option<&SharedStore>,
        metrics: &Metrics,
    ) -> Option<(String, Option<mlxbc_shared::KeepAlive>)> {
        let t = self.queue.pop_front()?;
        match t.step(store, metrics) {
            Progress::Going(t) => {
                self.queue.push_back(t);
                None
            }
            Progress::Ended { model, keep_alive } => Some((model, keep_alive)),
        }
    }
}
