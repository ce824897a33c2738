//! The application state: what the socket server and the HTTP gateway
//! share — the engine handle, the model registry, the session store, the
//! connection table and the request bounds. Each on-disk store here has one
//! owner (one `SessionStore`, one `ModelRegistry`), built once at start.

use crate::engine::{EngineHandle, Job};
use crate::error::EngineError;
use crate::limits::ConnectionTable;
use crate::requests::prepare::{Preparation, Ready};
use crate::requests::validate;
use mlxbc_shared::{GenerateRequest, Response};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio::sync::watch;

/// Shared by every connection, socket or HTTP.
pub struct AppState {
    pub engine: EngineHandle,
    pub registry: Arc<crate::catalog::registry::ModelRegistry>,
    pub started: Instant,
    /// Set to true to stop the daemon.
    pub shutdown: watch::Sender<bool>,
    /// Open client connections, under a cap.
    pub connections: Arc<ConnectionTable>,
    /// The HTTP gateway's open connections, under a cap of their own.
    pub http_connections: Arc<ConnectionTable>,
    /// Whether the HTTP gateway is serving.
    pub http_on: bool,
    /// A connection with no request in flight is closed after this long.
    pub idle_timeout: Option<Duration>,
    /// Bounds checked before a request is queued.
    pub limits: validate::Limits,
    /// The HTTP gateway's bearer token and allowed cross-site origins.
    pub http_token: Option<String>,
    pub http_allowed_origins: Vec<String>,
    /// The only uid allowed to connect: the daemon's own.
    pub owner_uid: u32,
    /// Named conversations: the one store the engine appends to and connections list and delete.
    pub sessions: Arc<crate::sessions::SessionStore>,
}

impl AppState {
    /// The daemon's state as `mlxbc status` shows it: the engine's, with
    /// the connection tables'.
    pub fn status(&self) -> mlxbc_shared::DaemonStatus {
        let (c, h) = (&self.connections, &self.http_connections);
        mlxbc_shared::DaemonStatus {
            connections_open: c.len() as u32,
            connections_cap: c.cap() as u32,
            connections_evicted: c.evicted_count(),
            connections_refused: c.refused_count(),
            http_connections_open: h.len() as u32,
            http_connections_cap: if self.http_on { h.cap() as u32 } else { 0 },
            http_connections_evicted: h.evicted_count(),
            http_connections_refused: h.refused_count(),
            ..self.engine.status(self.started)
        }
    }

    /// Queues a generation, prepared first as far as it can be off the
    /// engine thread (`requests::prepare`): its events, and the flag that
    /// cancels it. The one place a `Job::Generate` is built, for the socket
    /// and HTTP alike.
    pub async fn start_generation(
        &self,
        request: GenerateRequest,
    ) -> Result<(mpsc::UnboundedReceiver<Response>, Arc<AtomicBool>), EngineError> {
        let received = Instant::now();
        let (events, rx) = mpsc::unbounded_channel();
        let cancel = Arc::new(AtomicBool::new(false));
        match crate::requests::prepare::prepare(&self.engine, &self.sessions, request).await? {
            Preparation::NeedMedia(missing) => {
                let _ = events.send(Response::NeedMedia { missing });
            }
            Preparation::Ready(ready) => {
                let Ready { request, prepared, media, turn, load_ms } = *ready;
                let cancel = cancel.clone();
                self.engine.submit(Job::Generate {
                    request,
                    events,
                    cancel,
                    received,
                    prepared,
                    media,
                    turn,
                    load_ms,
                })?;
            }
        }
        Ok((rx, cancel))
    }

    /// Queues a transcription, its audio decoded first on the blocking pool
    /// (`requests::transcribe`): its events (one `Transcribed`, or
    /// `NeedMedia`, or an error), and the flag that cancels it.
    pub async fn start_transcription(
        &self,
        request: mlxbc_shared::TranscribeRequest,
    ) -> Result<(mpsc::UnboundedReceiver<Response>, Arc<AtomicBool>), EngineError> {
        use crate::requests::transcribe::{prepare, AudioPreparation};
        let received = Instant::now();
        let (events, rx) = mpsc::unbounded_channel();
        let cancel = Arc::new(AtomicBool::new(false));
        match prepare(self.engine.store.clone(), &request).await? {
            AudioPreparation::NeedBytes(sha) => {
                let _ = events.send(Response::NeedMedia { missing: vec![sha] });
            }
            AudioPreparation::Ready(audio) => {
                let cancel = cancel.clone();
                self.engine.submit(Job::Transcribe { request, audio, events, cancel, received })?;
            }
        }
        Ok((rx, cancel))
    }
}
