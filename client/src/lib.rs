//! The client library for mlxbcd: what `mlxbc`, editors and shell
//! integrations embed. It speaks the wire protocol of `mlxbc-shared` over the
//! daemon's Unix socket and starts the daemon when nothing is listening.
//! It never links MLX.
//!
//! ```no_run
//! # async fn demo() -> Result<(), mlxbc_client::ClientError> {
//! use mlxbc_client::{Client, GenerateRequest, Response};
//! let mut client = Client::connect_or_start(&mlxbc_client::Settings::from_env()?).await?;
//! let mut stream = client.generate(GenerateRequest::ask("What is the capital of France?")).await?;
//! while let Some(event) = stream.next_event().await? {
//!     if let Response::Token { text } = event { print!("{text}"); }
//! }
//! # Ok(()) }
//! ```

pub mod blocking;
mod error;
mod spawn;
pub use spawn::{daemon_program, log_path};

pub use error::ClientError;
/// The wire types a caller builds requests from and reads events as.
pub use mlxbc_shared::protocol::{
    CacheCommand, CacheEntry, CacheReport, ChatMessage, Constraint, Counters, DaemonStatus, EmbedRequest, Embeddings,
    ErrorKind, GenerateRequest, GenerationStats, KeepAlive, KvCacheSpec, LoadedModel, MediaKind, MediaRef, ModelInfo,
    PromptCacheReport, Request, RerankRequest, RerankResult, Reranking, Response, Role, SamplingParams, SessionCommand,
    SessionInfo, ShedEvent, Speculation, StopReason, TranscribeRequest, TranscribeStats, Transcript, TranscriptSegment,
    PROTOCOL_VERSION,
};
pub use mlxbc_shared::settings::Settings;
/// Transcripts as SubRip and WebVTT subtitles.
pub use mlxbc_shared::subtitles;
/// Framing errors a [`ClientError::Frame`] carries.
pub use mlxbc_shared::FrameError;
/// The largest frame either side sends: a request's media bytes must fit.
pub use mlxbc_shared::MAX_FRAME_BYTES;

use futures::{SinkExt, StreamExt};
use mlxbc_shared::codec::ClientCodec;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::net::UnixStream;

/// How long [`Client::connect`] waits for the daemon's Hello.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
use tokio_util::codec::Framed;

/// A connection to mlxbcd, past the Hello handshake.
pub struct Client {
    conn: Framed<UnixStream, ClientCodec>,
    /// The daemon's version, as it said in its Hello.
    pub daemon_version: String,
    /// Which BLAS the daemon's MLX uses on CPU.
    pub daemon_blas: String,
    socket: PathBuf,
    /// A generation's events are still due (its stream was dropped early):
    /// the connection is out of step and is replaced before the next call.
    mid_stream: bool,
}

impl Client {
    /// Connects to a daemon already listening on `socket`. The handshake
    /// times out after [`HANDSHAKE_TIMEOUT`]: something that accepts
    /// connections there but never answers is an error, not a hang.
    pub async fn connect(socket: &Path) -> Result<Self, ClientError> {
        let timeout = || ClientError::HandshakeTimeout {
            socket: socket.to_owned(),
            after: HANDSHAKE_TIMEOUT,
            why: error::silent_daemon(socket),
        };
        tokio::time::timeout(HANDSHAKE_TIMEOUT, Self::handshake(socket)).await.map_err(|_| timeout())?
    }

    async fn handshake(socket: &Path) -> Result<Self, ClientError> {
        let stream = UnixStream::connect(socket)
            .await
            .map_err(|source| ClientError::Unreachable { socket: socket.to_owned(), source })?;
        let mut conn = Framed::new(stream, ClientCodec::default());
        let hello = Request::Hello { protocol: PROTOCOL_VERSION, client_version: env!("CARGO_PKG_VERSION").into() };
        // A daemon that refuses us (another user's, or one with no room)
        // answers without reading: its answer is still there to read when
        // our Hello could not be written.
        let sent = conn.send(hello).await;
        let answer = conn.next().await.transpose();
        if answer.as_ref().is_ok_and(|a| a.is_none()) {
            sent?;
        }
        match answer? {
            Some(Response::Hello { daemon_version, blas, .. }) => {
                Ok(Self { conn, daemon_version, daemon_blas: blas, socket: socket.to_owned(), mid_stream: false })
            }
            Some(Response::Error { kind: ErrorKind::ProtocolMismatch, message }) => {
                Err(ClientError::ProtocolMismatch(message))
            }
            Some(Response::Error { kind, message }) => Err(ClientError::Daemon { kind, message }),
            Some(other) => Err(ClientError::Unexpected(format!("{other:?}"))),
            None => Err(ClientError::Disconnected),
        }
    }

    /// Connects to the daemon of `settings`, starting `mlxbcd` when nothing
    /// listens there, and waits (up to 60 s) for it to come up.
    pub async fn connect_or_start(settings: &Settings) -> Result<Self, ClientError> {
        match Self::connect(&settings.socket).await {
            Err(ClientError::Unreachable { .. }) => {}
            other => return other,
        }
        let mut child = spawn::start_daemon(settings)?;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            match Self::connect(&settings.socket).await {
                Err(ClientError::Unreachable { source, .. }) => {
                    // Another client may have won the race to start it: the
                    // loser exits at once, and we keep waiting for the winner.
                    if let Ok(Some(status)) = child.try_wait() {
                        if !status.success() && !settings.socket.exists() {
                            return Err(ClientError::DaemonExited {
                                status: status.to_string(),
                                log: spawn::log_path(settings),
                            });
                        }
                    }
                    if std::time::Instant::now() > deadline {
                        return Err(ClientError::Unreachable { socket: settings.socket.clone(), source });
                    }
                }
                other => return other,
            }
        }
    }

    /// The socket this client is connected to.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Before a request: if the daemon closed this connection while it idled
    /// (it does after `connection_idle_timeout`, or to make room), connect
    /// again, so callers never see it. The daemon sends nothing unasked, so
    /// a readable socket between requests means it was closed.
    async fn reconnect_if_closed(&mut self) -> Result<(), ClientError> {
        use std::os::unix::io::AsRawFd;
        let mut fds = libc::pollfd { fd: self.conn.get_ref().as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: poll on one valid descriptor with a zero timeout.
        let closed = unsafe { libc::poll(&mut fds, 1, 0) } > 0;
        if closed || self.mid_stream || !self.conn.read_buffer().is_empty() {
            let fresh = Self::connect(&self.socket).await?;
            *self = fresh;
        }
        Ok(())
    }

    /// Starts a generation; read its events from the returned stream.
    ///
    /// Images go by content hash first; their bytes are sent only when the
    /// daemon answers that it has no features for them.
    pub async fn generate(&mut self, request: GenerateRequest) -> Result<GenerationStream<'_>, ClientError> {
        let mut first_try = request.clone();
        first_try.messages.iter_mut().flat_map(|m| m.media.iter_mut()).for_each(|m| m.bytes = None);
        self.reconnect_if_closed().await?;
        self.conn.send(Request::Generate(first_try)).await?;
        let first = self.conn.next().await.transpose()?;
        let pending = match first {
            Some(Response::NeedMedia { missing }) => {
                let mut with_bytes = request;
                with_bytes
                    .messages
                    .iter_mut()
                    .flat_map(|m| m.media.iter_mut())
                    .filter(|m| !missing.contains(&m.sha256))
                    .for_each(|m| m.bytes = None);
                self.conn.send(Request::Generate(with_bytes)).await?;
                self.conn.next().await.transpose()?
            }
            other => other,
        };
        self.mid_stream = true;
        Ok(GenerationStream { client: self, finished: false, pending })
    }

    /// Runs a generation to its end: the whole answer and its statistics.
    pub async fn ask(&mut self, request: GenerateRequest) -> Result<(String, GenerationStats), ClientError> {
        self.generate(request).await?.collect_text().await
    }

    /// Lists, shows or deletes the daemon's named conversations.
    pub async fn sessions(&mut self, command: SessionCommand) -> Result<Vec<SessionInfo>, ClientError> {
        match self.call(Request::Sessions(command)).await? {
            Response::Sessions(list) => Ok(list),
            other => Err(unexpected(other)),
        }
    }

    /// Encodes images ahead of time; returns (encoded now, already stored).
    pub async fn prefetch(&mut self, model: Option<&str>, media: Vec<MediaRef>) -> Result<(u32, u32), ClientError> {
        let hashes_only: Vec<MediaRef> =
            media.iter().map(|m| MediaRef { sha256: m.sha256, bytes: None, kind: m.kind }).collect();
        let mut answer = self.call(Request::Prefetch { model: model.map(String::from), media: hashes_only }).await?;
        if let Response::NeedMedia { missing } = &answer {
            let needed = media
                .into_iter()
                .map(|m| if missing.contains(&m.sha256) { m } else { MediaRef { bytes: None, ..m } })
                .collect();
            answer = self.call(Request::Prefetch { model: model.map(String::from), media: needed }).await?;
        }
        match answer {
            Response::Prefetched { encoded, cached } => Ok((encoded, cached)),
            other => Err(unexpected(other)),
        }
    }

    /// Transcribes an audio file with a speech model: the audio goes by
    /// hash first, its bytes only when the daemon asks for them (a
    /// recording it has transcribed before needs none, even after a
    /// restart: the encoder's output is in the feature store).
    pub async fn transcribe(&mut self, request: TranscribeRequest) -> Result<Transcript, ClientError> {
        let mut first_try = request.clone();
        first_try.audio.bytes = None;
        let mut answer = self.call(Request::Transcribe(first_try)).await?;
        if let Response::NeedMedia { .. } = &answer {
            answer = self.call(Request::Transcribe(request)).await?;
        }
        match answer {
            Response::Transcribed(t) => Ok(t),
            other => Err(unexpected(other)),
        }
    }

    /// Runs a feature-store command.
    pub async fn cache(&mut self, command: CacheCommand) -> Result<CacheReport, ClientError> {
        match self.call(Request::Cache(command)).await? {
            Response::Cache(r) => Ok(r),
            other => Err(unexpected(other)),
        }
    }

    /// Every model the daemon knows.
    pub async fn list_models(&mut self) -> Result<Vec<ModelInfo>, ClientError> {
        match self.call(Request::ListModels).await? {
            Response::Models { models } => Ok(models),
            other => Err(unexpected(other)),
        }
    }

    /// Loaded models, memory and queue.
    pub async fn status(&mut self) -> Result<DaemonStatus, ClientError> {
        match self.call(Request::Status).await? {
            Response::Status(s) => Ok(s),
            other => Err(unexpected(other)),
        }
    }

    /// Embeds `request.inputs` with an embedding model: one vector per
    /// input, in order (vectors the daemon has stored come back without
    /// being computed again).
    pub async fn embed(&mut self, request: EmbedRequest) -> Result<Embeddings, ClientError> {
        match self.call(Request::Embed(request)).await? {
            Response::Embedded(e) => Ok(e),
            other => Err(unexpected(other)),
        }
    }

    /// Orders documents by relevance to a query with a reranker (a pair
    /// the daemon scored before comes from its store).
    pub async fn rerank(&mut self, request: RerankRequest) -> Result<Reranking, ClientError> {
        match self.call(Request::Rerank(request)).await? {
            Response::Reranked(r) => Ok(r),
            other => Err(unexpected(other)),
        }
    }

    /// Loads a model now; returns its canonical name, load time and size.
    pub async fn load(
        &mut self,
        model: &str,
        keep_alive: Option<KeepAlive>,
    ) -> Result<(String, u64, u64), ClientError> {
        self.load_with(model, keep_alive, false).await
    }

    /// Loads a model, split over the daemon's group when `sharded`
    /// (`mlxbc load --sharded`); returns the same as [`Self::load`].
    pub async fn load_with(
        &mut self,
        model: &str,
        keep_alive: Option<KeepAlive>,
        sharded: bool,
    ) -> Result<(String, u64, u64), ClientError> {
        match self.call(Request::Load { model: model.into(), keep_alive, sharded }).await? {
            Response::Loaded { model, load_ms, memory_bytes } => Ok((model, load_ms, memory_bytes)),
            other => Err(unexpected(other)),
        }
    }

    /// Forms the daemon's group again now; returns the status after.
    pub async fn cluster_restart(&mut self) -> Result<DaemonStatus, ClientError> {
        match self.call(Request::ClusterRestart).await? {
            Response::Status(s) => Ok(s),
            other => Err(unexpected(other)),
        }
    }

    /// Unloads a model; returns whether it was resident.
    pub async fn unload(&mut self, model: &str) -> Result<bool, ClientError> {
        match self.call(Request::Unload { model: model.into() }).await? {
            Response::Unloaded { was_loaded, .. } => Ok(was_loaded),
            other => Err(unexpected(other)),
        }
    }

    /// Asks the daemon to stop.
    pub async fn shutdown(&mut self) -> Result<(), ClientError> {
        match self.call(Request::Shutdown).await? {
            Response::ShuttingDown => Ok(()),
            other => Err(unexpected(other)),
        }
    }

    async fn call(&mut self, request: Request) -> Result<Response, ClientError> {
        self.reconnect_if_closed().await?;
        self.conn.send(request).await?;
        match self.conn.next().await.transpose()? {
            Some(Response::Error { kind, message }) => Err(ClientError::Daemon { kind, message }),
            Some(r) => Ok(r),
            None => Err(ClientError::Disconnected),
        }
    }
}

fn unexpected(r: Response) -> ClientError {
    ClientError::Unexpected(format!("{r:?}"))
}

/// The events of one generation. Dropping it before `Done` cancels the
/// generation (the connection is shut, which the daemon sees at once) and
/// the [`Client`]'s next call connects afresh, so it stays usable.
pub struct GenerationStream<'a> {
    client: &'a mut Client,
    finished: bool,
    /// The first event, read while settling which media to send.
    pending: Option<Response>,
}

impl Drop for GenerationStream<'_> {
    fn drop(&mut self) {
        if !self.finished {
            use std::os::unix::io::AsRawFd;
            // SAFETY: shutdown on the connection's own open descriptor.
            unsafe { libc::shutdown(self.client.conn.get_ref().as_raw_fd(), libc::SHUT_RDWR) };
        }
    }
}

impl GenerationStream<'_> {
    /// The next event; `Ok(None)` after `Done`. An `Error` event becomes
    /// `Err(ClientError::Daemon)`.
    pub async fn next_event(&mut self) -> Result<Option<Response>, ClientError> {
        if self.finished {
            return Ok(None);
        }
        let event = match self.pending.take() {
            Some(e) => Some(e),
            None => self.client.conn.next().await.transpose()?,
        };
        match event {
            Some(Response::Error { kind, message }) => {
                self.finished = true;
                self.client.mid_stream = false;
                Err(ClientError::Daemon { kind, message })
            }
            Some(event) => {
                self.finished = matches!(event, Response::Done { .. });
                self.client.mid_stream = !self.finished;
                Ok(Some(event))
            }
            None => Err(ClientError::Disconnected),
        }
    }

    /// Collects the whole answer: its text and statistics.
    pub async fn collect_text(mut self) -> Result<(String, GenerationStats), ClientError> {
        let mut text = String::new();
        while let Some(event) = self.next_event().await? {
            match event {
                Response::Token { text: t } => text.push_str(&t),
                Response::Done { stats } => return Ok((text, stats)),
                _ => {}
            }
        }
        Err(ClientError::Disconnected)
    }
}
