//! Service definitions for mlxbcd and the commands that install and drive
//! them: a launchd LaunchAgent on macOS ([`launch_agent`]), systemd user
//! units on Linux ([`systemd`]), both socket-activated. Everything here is
//! pure: it renders files and command lines; `mlxbc service` writes and runs
//! them ([`Plan`]), so what cannot run on a given machine stays small and
//! its command lines are unit-tested.

pub mod launch_agent;
pub mod plan;
pub mod systemd;

pub use plan::{Plan, Platform, Verb};

use std::path::PathBuf;

/// What a service definition needs to know.
#[derive(Debug, Clone, PartialEq)]
pub struct ServiceSpec {
    /// The `mlxbcd` binary to run.
    pub daemon: PathBuf,
    /// The socket the service manager listens on and hands to the daemon.
    pub socket: PathBuf,
    /// Where the daemon's log goes (launchd; systemd uses the journal).
    pub log_file: PathBuf,
    /// Environment for the daemon (e.g. `MLXBC_HOME`, `MLXBC_LOG`).
    pub env: Vec<(String, String)>,
}

/// The LaunchAgent label (and the systemd unit base name is `mlxbc`).
pub const LABEL: &str = "dev.mlxbc.daemon";
