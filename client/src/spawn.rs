//! Starting the daemon on first use: `mlxbcd` next to the running executable,
//! else from `PATH` (or `MLXBC_DAEMON`), detached, logging to the data dir.

use crate::ClientError;
use mlxbc_shared::settings::Settings;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

/// Where a daemon started by a client writes its log.
pub fn log_path(settings: &Settings) -> PathBuf {
    settings.paths.log_dir.join("mlxbcd.log")
}

/// The `mlxbcd` a client starts: `MLXBC_DAEMON`, else the one beside this
/// executable, else `mlxbcd` from `PATH`.
pub fn daemon_program() -> PathBuf {
    if let Some(p) = std::env::var_os("MLXBC_DAEMON") {
        return PathBuf::from(p);
    }
    let beside = std::env::current_exe().ok().and_then(|exe| exe.parent().map(|d| d.join("mlxbcd")));
    match beside {
        Some(p) if p.is_file() => p,
        _ => PathBuf::from("mlxbcd"),
    }
}

/// Spawns `mlxbcd` for `settings.socket` in its own session.
pub fn start_daemon(settings: &Settings) -> Result<Child, ClientError> {
    let program = daemon_program();
    let log = log_path(settings);
    let _ = mlxbc_shared::paths::create_private_dir(&settings.paths.log_dir);
    use std::os::unix::fs::OpenOptionsExt;
    let stderr = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(&log)
        .map(Stdio::from)
        .unwrap_or_else(|_| Stdio::null());
    let mut cmd = Command::new(&program);
    // The daemon rotates its log by size; stderr goes there too until it
    // has parsed its arguments.
    cmd.arg("--socket")
        .arg(&settings.socket)
        .arg("--log-file")
        .arg(&log)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(stderr);
    // A new session: the daemon outlives the terminal and ignores its Ctrl-C.
    // SAFETY: setsid is async-signal-safe and touches no parent state.
    unsafe {
        cmd.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
    cmd.spawn().map_err(|source| ClientError::Spawn { program, source })
}
