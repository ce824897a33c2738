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
    /// A rank of the group a sharded model runs on stopped answering.
    #[error("{0}")]
    RankStopped(String),
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
            EngineError::RankStopped(_) => ErrorKind::RankStopped,
        }
    }

    /// The `Error` event that ends the client's stream.
    pub fn into_response(self) -> Response {
        Response::Error { kind: self.kind(), message: self.to_string() }
    }

    /// A computation that failed inside MLX or the model code (or, for a
    /// model split over a group, because a rank stopped answering).
    pub fn inference(e: impl Into<anyhow::Error>) -> Self {
        let e = e.into();
        if let Some(stopped) = e.chain().find_map(|c| c.downcast_ref::<RankStoppedError>()) {
            return EngineError::RankStopped(stopped.0.clone());
        }
        let message = explained(format!("{e:#}"));
        if let Some(why) = sticky_device_error(&message) {
            tracing::error!(why, "the GPU reported an error that leaves its context unusable");
            DEVICE_LOST.store(true, std::sync::atomic::Ordering::SeqCst);
        }
        EngineError::Inference(message)
    }
}

/// Set once the GPU has reported a sticky error: the engine then exits the
/// process (its service manager starts it again) instead of failing every
/// later request.
pub static DEVICE_LOST: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Set when a service manager handed the socket over
/// (`server::activation`): a daemon that must start afresh then exits and
/// lets its manager start it (the socket listening meanwhile) rather than
/// executing itself again.
pub static SOCKET_INHERITED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The exit status of a daemon whose GPU context was lost (EX_SOFTWARE):
/// not 0, so launchd's KeepAlive and systemd's Restart=on-failure restart it.
pub const DEVICE_LOST_EXIT: i32 = 70;

/// The message with its likely cause where MLX's own says little: an array
/// MLX could not allocate comes back empty (mlx-c logs the allocator's error
/// and returns a null array), and the next operation on it fails with
/// "expected a non-empty mlx_array". Seen on an H100 shared by three
/// daemons of an 8B model: every request of a burst failed so.
pub fn explained(message: String) -> String {
    if message.contains("expected a non-empty mlx_array") {
        return format!(
            "the device could not allocate an array (out of memory? another process may hold it): {message}"
        );
    }
    message
}

/// CUDA errors after which the context can no longer be used: every later
/// call fails the same way until the process exits (CUDA's "sticky"
/// errors). Seen on the H200: an out-of-memory inside a CUDA graph's
/// launch followed by "an illegal memory access was encountered" for every
/// later step. An out-of-memory error itself is not one.
pub fn sticky_device_error(message: &str) -> Option<&'static str> {
    const STICKY: [&str; 6] = [
        "an illegal memory access was encountered",
        "unspecified launch failure",
        "misaligned address",
        "an illegal instruction was encountered",
        "device-side assert triggered",
        "uncorrectable ECC error",
    ];
    STICKY.into_iter().find(|s| message.contains(s))
}

/// A sharded model's call failed because a rank of its group stopped
/// answering: carried inside the model's `anyhow` error so the engine
/// reports [`EngineError::RankStopped`] wherever it maps model errors.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{0}")]
pub struct RankStoppedError(pub String);

/// What a caught panic said (its `String` or `&str` payload), for the log.
pub fn panic_message(panic: &(dyn std::any::Any + Send)) -> &str {
    panic.downcast_ref::<String>().map(String::as_str).or_else(|| panic.downcast_ref::<&str>().copied()).unwrap_or("?")
}

#[cfg(test)]
mod tests {
    use super::{explained, sticky_device_error};

    /// A null array from a failed allocation names its likely cause; other
    /// messages are left as they are.
    #[test]
    fn an_empty_array_is_explained_as_an_allocation_failure() {
        let empty = "expected a non-empty mlx_array at mlx/c/ops.cpp:4089".to_string();
        assert!(explained(empty.clone()).starts_with("the device could not allocate"), "{}", explained(empty));
        assert_eq!(explained("shapes do not match".into()), "shapes do not match");
    }

    /// The messages MLX gave on the H200 (docs/measurements/h200-2026-12-05-sweep.md).
    #[test]
    fn an_illegal_memory_access_is_sticky_and_an_out_of_memory_is_not() {
        let illegal = "cuGraphAddKernelNode(&node, graph_, NULL, 0, &params) failed: an illegal memory access was \
                       encountered at mlx/c/array.cpp:352";
        let oom = "cudaMallocAsync(&data, size, stream) failed: out of memory at mlx/c/transforms.cpp:15";
        assert!(sticky_device_error(illegal).is_some());
        assert_eq!(sticky_device_error(oom), None);
    }
}
