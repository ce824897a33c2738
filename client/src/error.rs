//! Errors a caller can match on.

use mlxbc_shared::{ErrorKind, FrameError};
use std::path::PathBuf;

/// Why a client call failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Nothing listens on the socket (and it could not be started).
    #[error("cannot reach mlxbcd at {socket}: {source}")]
    Unreachable { socket: PathBuf, source: std::io::Error },
    /// `mlxbcd` could not be started.
    #[error("starting mlxbcd ({program}): {source}")]
    Spawn { program: PathBuf, source: std::io::Error },
    /// The daemon that was started exited before listening.
    #[error("mlxbcd exited ({status}) before listening; see its log at {log}")]
    DaemonExited { status: String, log: PathBuf },
    /// Client and daemon speak different protocol versions.
    #[error("{0}")]
    ProtocolMismatch(String),
    /// The daemon answered with an error.
    #[error("{message}")]
    Daemon { kind: ErrorKind, message: String },
    /// A frame could not be read or written.
    #[error(transparent)]
    Frame(#[from] FrameError),
    /// Something accepted the connection but never answered the Hello.
    #[error(
        "{socket} accepted the connection but sent no answer within {after:?}: is the process listening there mlxbcd? \
         A service that failed to start leaves its socket listening: check `mlxbc service status` and `mlxbc service logs`, \
         or `mlxbc stop` and retry"
    )]
    HandshakeTimeout { socket: PathBuf, after: std::time::Duration },
    /// The daemon closed the connection.
    #[error("mlxbcd closed the connection")]
    Disconnected,
    /// The daemon answered with something that does not fit the request.
    #[error("unexpected answer from mlxbcd: {0}")]
    Unexpected(String),
    /// Settings could not be read.
    #[error(transparent)]
    Settings(#[from] mlxbc_shared::settings::SettingsError),
}
