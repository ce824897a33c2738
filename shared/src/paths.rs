//! Where mlxbc keeps things. `MLXBC_HOME` moves everything (config, models,
//! caches, logs, and the socket unless `MLXBC_SOCKET` says otherwise); without
//! it the platform's per-user directories are used.

use std::path::PathBuf;

/// Everything the daemon and clients put on disk.
#[derive(Debug, Clone, PartialEq)]
pub struct Paths {
    /// Root data directory (config, models, caches).
    pub home: PathBuf,
    /// The settings file.
    pub config_file: PathBuf,
    /// Where the daemon writes its own log when started by a client.
    pub log_dir: PathBuf,
    /// Default socket path (the settings file and `MLXBC_SOCKET` can override).
    pub default_socket: PathBuf,
}

impl Paths {
    /// Resolves the paths from the environment.
    pub fn from_env() -> Self {
        match std::env::var_os("MLXBC_HOME") {
            Some(home) if !home.is_empty() => Self::under(PathBuf::from(home)),
            _ => Self::per_user(),
        }
    }

    /// Everything under one directory (used by `MLXBC_HOME` and by tests).
    pub fn under(home: PathBuf) -> Self {
        Self {
            config_file: home.join("config.toml"),
            log_dir: home.join("logs"),
            default_socket: home.join("mlxbcd.sock"),
            home,
        }
    }

    fn per_user() -> Self {
        let home = dirs::data_dir().unwrap_or_else(|| PathBuf::from(".")).join("mlxbc");
        // The socket goes where the OS puts per-user runtime files: a tmpfs
        // cleared at logout on Linux, the per-user cache dir on macOS.
        let runtime = if cfg!(target_os = "macos") {
            dirs::cache_dir().map(|d| d.join("mlxbc"))
        } else {
            dirs::runtime_dir().map(|d| d.join("mlxbc"))
        };
        let default_socket = runtime.unwrap_or_else(|| home.join("run")).join("mlxbcd.sock");
        let log_dir = if cfg!(target_os = "macos") {
            dirs::home_dir().map(|h| h.join("Library/Logs/mlxbc")).unwrap_or_else(|| home.join("logs"))
        } else {
            home.join("logs")
        };
        Self { config_file: home.join("config.toml"), log_dir, default_socket, home }
    }
}

/// Creates `dir` (and parents) readable only by the current user.
pub fn create_private_dir(dir: &std::path::Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    if dir.is_dir() {
        return Ok(());
    }
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)
}
