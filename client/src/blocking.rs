//! The same client for callers without an async runtime (editor plugins,
//! scripts, FFI): every call blocks the calling thread. It owns a small
//! single-threaded tokio runtime.
//!
//! ```no_run
//! # fn demo() -> Result<(), mlxbc_client::ClientError> {
//! use mlxbc_client::{blocking::Client, GenerateRequest, Settings};
//! let mut client = Client::connect_or_start(&Settings::from_env()?)?;
//! let stats = client.generate(GenerateRequest::ask("Name three colours."), |piece| print!("{piece}"))?;
//! eprintln!("\n{} tokens", stats.generated_tokens);
//! # Ok(()) }
//! ```

use crate::{
    CacheCommand, CacheReport, ClientError, DaemonStatus, GenerateRequest, GenerationStats, KeepAlive, MediaRef,
    ModelInfo, Response, SessionCommand, SessionInfo, Settings,
};
use std::path::Path;

/// A blocking connection to mlxbcd.
pub struct Client {
    runtime: tokio::runtime::Runtime,
    inner: crate::Client,
}

fn runtime() -> Result<tokio::runtime::Runtime, ClientError> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|source| ClientError::Unreachable { socket: Default::default(), source })
}

impl Client {
    /// Connects to a daemon already listening on `socket`.
    pub fn connect(socket: &Path) -> Result<Self, ClientError> {
        let runtime = runtime()?;
        let inner = runtime.block_on(crate::Client::connect(socket))?;
        Ok(Self { runtime, inner })
    }

    /// Connects, starting `mlxbcd` when nothing listens (see [`crate::Client::connect_or_start`]).
    pub fn connect_or_start(settings: &Settings) -> Result<Self, ClientError> {
        let runtime = runtime()?;
        let inner = runtime.block_on(crate::Client::connect_or_start(settings))?;
        Ok(Self { runtime, inner })
    }

    /// Runs a generation, calling `on_text` with each piece of text as it arrives.
    pub fn generate(
        &mut self,
        request: GenerateRequest,
        mut on_text: impl FnMut(&str),
    ) -> Result<GenerationStats, ClientError> {
        let Self { runtime, inner } = self;
        runtime.block_on(async {
            let mut stream = inner.generate(request).await?;
            while let Some(event) = stream.next_event().await? {
                match event {
                    Response::Token { text } => on_text(&text),
                    Response::Done { stats } => return Ok(stats),
                    _ => {}
                }
            }
            Err(ClientError::Disconnected)
        })
    }

    /// Runs a generation to its end: the whole answer and its statistics.
    pub fn ask(&mut self, request: GenerateRequest) -> Result<(String, GenerationStats), ClientError> {
        self.runtime.block_on(self.inner.ask(request))
    }

    /// See [`crate::Client::list_models`].
    pub fn list_models(&mut self) -> Result<Vec<ModelInfo>, ClientError> {
        self.runtime.block_on(self.inner.list_models())
    }

    /// See [`crate::Client::status`].
    pub fn status(&mut self) -> Result<DaemonStatus, ClientError> {
        self.runtime.block_on(self.inner.status())
    }

    /// See [`crate::Client::load`].
    pub fn load(&mut self, model: &str, keep_alive: Option<KeepAlive>) -> Result<(String, u64, u64), ClientError> {
        self.runtime.block_on(self.inner.load(model, keep_alive))
    }

    /// See [`crate::Client::unload`].
    pub fn unload(&mut self, model: &str) -> Result<bool, ClientError> {
        self.runtime.block_on(self.inner.unload(model))
    }

    /// See [`crate::Client::prefetch`].
    pub fn prefetch(&mut self, model: Option<&str>, media: Vec<MediaRef>) -> Result<(u32, u32), ClientError> {
        self.runtime.block_on(self.inner.prefetch(model, media))
    }

    /// See [`crate::Client::cache`].
    pub fn cache(&mut self, command: CacheCommand) -> Result<CacheReport, ClientError> {
        self.runtime.block_on(self.inner.cache(command))
    }

    /// See [`crate::Client::sessions`].
    pub fn sessions(&mut self, command: SessionCommand) -> Result<Vec<SessionInfo>, ClientError> {
        self.runtime.block_on(self.inner.sessions(command))
    }

    /// See [`crate::Client::shutdown`].
    pub fn shutdown(&mut self) -> Result<(), ClientError> {
        self.runtime.block_on(self.inner.shutdown())
    }
}
