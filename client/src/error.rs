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
    /// Something accepted the connection but never answered the Hello;
    /// `why` is what could be found out about the process listening there.
    #[error("{socket} accepted the connection but sent no answer within {after:?}: {why}")]
    HandshakeTimeout { socket: PathBuf, after: std::time::Duration, why: String },
    /// The daemon closed the connection before the answer was complete.
    #[error("mlxbcd closed the connection before answering: it stopped or crashed (its log says why)")]
    Disconnected,
    /// The daemon answered with something that does not fit the request.
    #[error("unexpected answer from mlxbcd: {0}")]
    Unexpected(String),
    /// Settings could not be read.
    #[error(transparent)]
    Settings(#[from] mlxbc_shared::settings::SettingsError),
}

/// Why a daemon that accepted a connection may not have answered: when the
/// process holding the socket's lock is found (Linux's /proc), whether it is
/// out of file descriptors; otherwise the likely causes, in order.
pub(crate) fn silent_daemon(socket: &std::path::Path) -> String {
    let pid = std::fs::read_to_string(socket.with_extension("lock")).ok().and_then(|p| p.trim().parse::<u32>().ok());
    if let Some(pid) = pid {
        let open = std::fs::read_dir(format!("/proc/{pid}/fd")).map(|d| d.count() as u64);
        let limit = std::fs::read_to_string(format!("/proc/{pid}/limits")).ok().and_then(|l| {
            l.lines().find(|l| l.starts_with("Max open files"))?.split_whitespace().nth(3)?.parse::<u64>().ok()
        });
        if let (Ok(open), Some(limit)) = (open, limit) {
            if open + 8 >= limit {
                return format!(
                    "mlxbcd (pid {pid}) is out of file descriptors ({open} of {limit} open): too many connections are \
                     held open (`mlxbc status` counts them); it closes idle ones over time, or restart it with `mlxbc stop`"
                );
            }
            return format!(
                "mlxbcd (pid {pid}) is running ({open} of {limit} descriptors open) but did not answer: it may be \
                 stuck; its log (`mlxbc service logs`, or logs/mlxbcd.log in the data directory) may say why; `mlxbc stop` and retry"
            );
        }
    }
    "the process listening there is overloaded, out of file descriptors, or not mlxbcd (a service that failed to \
     start leaves its socket listening): check `mlxbc service status` and `mlxbc service logs`, or `mlxbc stop` and retry"
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The process holding the socket's lock (this test process) near its
    /// descriptor limit: the message says it is out of descriptors, with
    /// the counts; with room, it says the daemon runs but did not answer.
    /// (Linux: the diagnosis reads /proc.)
    #[cfg(target_os = "linux")]
    #[test]
    fn a_silent_daemon_out_of_descriptors_is_named() {
        let dir = std::env::temp_dir().join(format!("mlxbc-silent-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let socket = dir.join("mlxbcd.sock");
        std::fs::write(socket.with_extension("lock"), std::process::id().to_string()).unwrap();
        let roomy = silent_daemon(&socket);
        assert!(roomy.contains("is running") && roomy.contains("did not answer"), "{roomy}");
        let open = std::fs::read_dir("/proc/self/fd").unwrap().count() as u64;
        let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: get/setrlimit with valid pointers; the old limit is restored.
        unsafe {
            libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
            let tight = libc::rlimit { rlim_cur: open + 4, rlim_max: lim.rlim_max };
            libc::setrlimit(libc::RLIMIT_NOFILE, &tight);
        }
        let full = silent_daemon(&socket);
        unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) };
        assert!(full.contains("out of file descriptors"), "{full}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
