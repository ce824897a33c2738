//! Listening sockets handed over by a service manager — systemd's
//! `LISTEN_FDS`/`LISTEN_PID` protocol, launchd's `launch_activate_socket` —
//! and readiness notification (`sd_notify`).
//!
//! With socket activation the manager owns the socket file and keeps
//! listening while the daemon is not running: a connection that arrives then
//! starts the daemon, which finds it waiting in the backlog.

use anyhow::{bail, Context, Result};
use std::os::unix::io::{FromRawFd, RawFd};
use std::os::unix::net::UnixListener;

/// A listening socket the daemon did not bind itself.
pub struct Inherited {
    pub listener: UnixListener,
    /// "systemd" or "launchd", for logs and status.
    pub manager: &'static str,
}

/// Takes the socket a service manager passed, if any. Call before any
/// thread is started: it clears the `LISTEN_*` variables so that children
/// do not see them.
pub fn take_inherited() -> Result<Option<Inherited>> {
    let taken = take()?;
    crate::error::SOCKET_INHERITED.store(taken.is_some(), std::sync::atomic::Ordering::SeqCst);
    Ok(taken)
}

fn take() -> Result<Option<Inherited>> {
    #[cfg(target_os = "macos")]
    if let Some(fd) = launchd::activate_socket("Listeners")? {
        return Ok(Some(Inherited { listener: listener_from(fd)?, manager: "launchd" }));
    }
    let fds: Vec<RawFd> = sd_notify::listen_fds().context("reading LISTEN_FDS")?.collect();
    for var in ["LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES"] {
        std::env::remove_var(var);
    }
    match fds.as_slice() {
        [] => Ok(None),
        [fd] => Ok(Some(Inherited { listener: listener_from(*fd)?, manager: "systemd" })),
        more => bail!("systemd passed {} sockets; mlxbc.socket should list exactly one ListenStream", more.len()),
    }
}

/// Wraps a passed descriptor, checking it is a listening Unix socket.
fn listener_from(fd: RawFd) -> Result<UnixListener> {
    #[cfg(target_os = "linux")]
    {
        let mut accepting: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: getsockopt writes at most `len` bytes into `accepting`.
        let rc = unsafe {
            libc::getsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_ACCEPTCONN,
                (&mut accepting as *mut libc::c_int).cast(),
                &mut len,
            )
        };
        if rc != 0 || accepting == 0 {
            bail!("descriptor {fd} passed by the service manager is not a listening socket");
        }
    }
    // SAFETY: the manager handed this descriptor to us alone; from here on it is owned.
    let listener = unsafe { UnixListener::from_raw_fd(fd) };
    listener.local_addr().context("the passed socket is not a Unix socket")?;
    listener.set_nonblocking(true)?;
    Ok(listener)
}

/// Tells systemd the daemon is ready (no-op without `NOTIFY_SOCKET`).
pub fn notify_ready(status: &str) {
    if let Err(e) = sd_notify::notify(true, &[sd_notify::NotifyState::Ready, sd_notify::NotifyState::Status(status)]) {
        tracing::warn!(error = %e, "sd_notify READY failed");
    }
}

/// Tells systemd the daemon is stopping.
pub fn notify_stopping() {
    let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Stopping]);
}

#[cfg(target_os = "macos")]
mod launchd {
    use anyhow::Result;
    use std::ffi::CString;
    use std::os::unix::io::RawFd;

    extern "C" {
        fn launch_activate_socket(
            name: *const libc::c_char,
            fds: *mut *mut libc::c_int,
            cnt: *mut libc::size_t,
        ) -> libc::c_int;
    }

    /// The socket launchd holds for the plist's `Sockets` entry `name`;
    /// None when the daemon was not started by launchd with that entry.
    pub fn activate_socket(name: &str) -> Result<Option<RawFd>> {
        let name = CString::new(name)?;
        let mut fds: *mut libc::c_int = std::ptr::null_mut();
        let mut count: libc::size_t = 0;
        // SAFETY: launchd allocates `fds` with malloc; we free it below.
        let rc = unsafe { launch_activate_socket(name.as_ptr(), &mut fds, &mut count) };
        if rc != 0 || fds.is_null() {
            return Ok(None); // ESRCH: not managed by launchd; ENOENT: no such socket entry
        }
        // SAFETY: launchd returned `count` descriptors at `fds`.
        let all = unsafe { std::slice::from_raw_parts(fds, count) }.to_vec();
        unsafe { libc::free(fds.cast()) };
        Ok(all.first().copied())
    }
}
