//! Owning the socket path: a lock file so that exactly one daemon serves a
//! path, stale socket files replaced, the socket created 0600 in a 0700 dir.

use anyhow::{bail, Context, Result};
use std::fs::File;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

/// Held for the daemon's lifetime; removes the socket file on drop.
pub struct SocketGuard {
    path: PathBuf,
    _lock: File,
}

impl Drop for SocketGuard {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Takes `<socket>.lock` (flock) and binds the socket. A second daemon on the
/// same path fails here with a message that says so.
pub fn bind(path: &Path) -> Result<(tokio::net::UnixListener, SocketGuard)> {
    let dir = path.parent().context("socket path has no parent directory")?;
    mlxbc_shared::paths::create_private_dir(dir)
        .with_context(|| format!("creating socket directory {}", dir.display()))?;
    let lock_path = path.with_extension("lock");
    let lock = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .with_context(|| format!("opening lock file {}", lock_path.display()))?;
    // SAFETY: flock on a valid descriptor we own.
    if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let pid = std::fs::read_to_string(&lock_path).unwrap_or_default();
        bail!(
            "another mlxbcd (pid {}) is already serving {}; stop it with `mlxbc stop` first",
            pid.trim(),
            path.display()
        );
    }
    std::fs::write(&lock_path, std::process::id().to_string()).ok();
    if path.exists() {
        // We hold the lock, so whatever is there was left by a daemon that died.
        tracing::info!(path = %path.display(), "replacing stale socket file");
        std::fs::remove_file(path).with_context(|| format!("removing stale socket {}", path.display()))?;
    }
    // Create the socket with no group/other bits from the start (umask), so
    // there is no window in which another user could connect.
    // SAFETY: umask only changes this process's file creation mask.
    let old = unsafe { libc::umask(0o177) };
    let bound = std::os::unix::net::UnixListener::bind(path);
    unsafe { libc::umask(old) };
    let std_listener = bound.with_context(|| format!("binding socket {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    std_listener.set_nonblocking(true)?;
    let listener = tokio::net::UnixListener::from_std(std_listener)?;
    Ok((listener, SocketGuard { path: path.to_owned(), _lock: lock }))
}
