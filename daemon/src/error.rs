//! Why a job failed, typed: what the engine and the request checks return
//! across modules, mapped to the wire's `ErrorKind` in one place
//! ([`EngineError::kind`]).

use mlxbc_shared::{ErrorKind, Response};

/// A failure the client hears about; the text says what to do.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EngineError {
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    UnknownModel(String),
    #[error("{0}")]
    ModelLoad(String),
    #[error("{0}")]
    ContextOverflow(String),
    #[error("{0}")]
    Inference(String),
    #[error("{0}")]
    BadMedia(String),
    #[error("{0}")]
    OutOfMemory(String),
    #[error("{0}")]
    ShuttingDown(String),
    #[error("{0}")]
    Internal(String),
    /// Too much is waiting already; retry shortly.
    #[error("{0}")]
    Busy(String),
}

impl EngineError {
    /// The wire's name for it.
    pub fn kind(&self) -> ErrorKind {
        match self {
            EngineError::BadRequest(_) => ErrorKind::BadRequest,
            EngineError::UnknownModel(_) => ErrorKind::UnknownModel,
            EngineError::ModelLoad(_) => ErrorKind::ModelLoad,
            EngineError::ContextOverflow(_) => ErrorKind::ContextOverflow,
            EngineError::Inference(_) => ErrorKind::Inference,
            EngineError::BadMedia(_) => ErrorKind::BadMedia,
            EngineError::OutOfMemory(_) => ErrorKind::OutOfMemory,
            EngineError::ShuttingDown(_) => ErrorKind::ShuttingDown,
            EngineError::Internal(_) => ErrorKind::Internal,
            EngineError::Busy(_) => ErrorKind::Busy,
        }
    }

    /// The `Error` event that ends the client's stream.
    pub fn into_response(self) -> Response {
        Response::Error { kind: self.kind(), message: self.to_string() }
    }

    /// A computation that failed inside MLX or the model code.
    pub fn inference(e: impl std::fmt::Display) -> Self {
        EngineError::Inference(format!("{e:#}"))
    }
}

/// What a caught panic said (its `String` or `&str` payload), for the log.
pub fn panic_message(panic: &(dyn std::any::Any + Send)) -> &str {
    panic.downcast_ref::<String>().map(String::as_str).or_else(|| panic.downcast_ref::<&str>().copied()).unwrap_or("?")
}
