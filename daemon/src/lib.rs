//! mlxbcd: keeps MLX language models resident and serves them to local
//! clients over a Unix socket. The binary in `bin/` is a thin shell around
//! [`run`], so tests can also boot the daemon in-process.

pub mod audio;
pub mod blas_core;
pub mod catalog;
pub mod cluster;
pub mod decoding;
pub mod distributed;
pub mod engine;
pub mod error;
pub mod families;
pub mod http;
#[cfg(test)]
mod layering;
pub mod limits;
pub mod logging;
pub mod media;
pub mod metrics;
pub mod model;
pub mod prompt_cache;
pub mod requests;
pub mod server;
pub mod sessions;
pub mod state;

pub use server::run;

/// Which BLAS MLX's f32 matmuls land in, decided at build time (build.rs).
pub const BLAS: &str = env!("MLXBC_BLAS_IN_USE");

/// Resident set size of this process, in bytes (0 where unknown).
pub fn rss_bytes() -> u64 {
    let Ok(statm) = std::fs::read_to_string("/proc/self/statm") else {
        return 0;
    };
    let pages: u64 = statm.split_whitespace().nth(1).and_then(|p| p.parse().ok()).unwrap_or(0);
    // SAFETY: sysconf has no preconditions.
    pages * unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64
}
