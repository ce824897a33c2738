//! `mlxbcd`: the daemon binary.

use anyhow::Result;
use clap::Parser;
use mlxbc_shared::settings::Settings;
use std::path::PathBuf;

/// Keeps MLX language models resident and serves them over a Unix socket.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// Socket to listen on (default: from the settings, or the per-user runtime dir).
    #[arg(long, env = "MLXBC_SOCKET")]
    socket: Option<PathBuf>,
    /// Idle time before a model is unloaded: 30m, 90s, 0, forever.
    #[arg(long)]
    keep_alive: Option<String>,
    /// Directory of models (default: <data dir>/models).
    #[arg(long)]
    models_dir: Option<PathBuf>,
    /// Also serve the OpenAI-compatible HTTP API here (loopback only), e.g. 127.0.0.1:11435.
    #[arg(long)]
    http: Option<std::net::SocketAddr>,
    /// When socket-activated: exit after this long idle with no model loaded (10m, 0, forever).
    #[arg(long)]
    idle_exit: Option<String>,
    /// Log to this file (and make it stderr), rotated past `log_max_mib`.
    #[arg(long)]
    log_file: Option<PathBuf>,
    /// Join a group that splits models between daemons: MLX's hostfile
    /// (JSON, one entry per rank; default: `[cluster] hostfile`, or
    /// MLX_HOSTFILE as `mlx.launch` sets it). docs/distributed.md.
    #[arg(long)]
    hostfile: Option<PathBuf>,
    /// This daemon's rank in the hostfile: 0 serves clients, the others
    /// are workers (default: `[cluster] rank`, or MLX_RANK).
    #[arg(long)]
    rank: Option<usize>,
    /// MLX's backend: ring (TCP), jaccl (Thunderbolt 5 RDMA), nccl, mpi, any
    /// (default: `[cluster] backend`, or ring).
    #[arg(long)]
    backend: Option<String>,
    /// Print the OpenBLAS kernels this daemon runs MLX's matmuls on and
    /// exit (scripts give a reference the same: `OPENBLAS_CORETYPE`).
    #[arg(long, hide = true)]
    openblas_core: bool,
}

/// Where this daemon stands in a group: flags, else config.toml's
/// `[cluster]`, else MLX's launch environment (`MLX_HOSTFILE`, `MLX_RANK`,
/// as `mlx.launch` sets them); the result is written back to that
/// environment, which is where MLX's backends read it. Runs before any
/// thread exists (it sets environment variables).
fn join_group_settings(
    settings: &mut Settings,
    hostfile: Option<PathBuf>,
    rank: Option<usize>,
    backend: Option<String>,
) -> Result<()> {
    let c = &mut settings.cluster;
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    c.hostfile = hostfile.or(c.hostfile.take()).or_else(|| env("MLX_HOSTFILE").map(PathBuf::from));
    c.rank = match (rank, c.rank, env("MLX_RANK")) {
        (Some(r), _, _) | (None, Some(r), _) => Some(r),
        (None, None, Some(r)) => Some(r.parse().map_err(|_| anyhow::anyhow!("MLX_RANK={r} is not a rank"))?),
        _ => None,
    };
    if let Some(b) = backend {
        c.backend = b;
    }
    const BACKENDS: [&str; 5] = ["ring", "jaccl", "nccl", "mpi", "any"];
    if !BACKENDS.contains(&c.backend.as_str()) {
        anyhow::bail!("unknown backend {:?}: one of {}", c.backend, BACKENDS.join(", "));
    }
    match (&c.hostfile, c.rank) {
        (Some(h), Some(r)) => {
            let hosts = mlxbc_daemon::distributed::Hostfile::read(h)?;
            if r >= hosts.size() {
                anyhow::bail!("rank {r} is not in the hostfile {} ({} ranks)", h.display(), hosts.size());
            }
            std::env::set_var("MLX_HOSTFILE", h);
            std::env::set_var("MLX_RANK", r.to_string());
            // NCCL meets at rank 0 and takes one GPU per rank: what
            // `mlx.launch --backend nccl` sets, from this hostfile; what the
            // user set is kept.
            if c.backend == "nccl" {
                for (key, value) in hosts.nccl_environment(r) {
                    if env(key).is_none() {
                        std::env::set_var(key, value);
                    }
                }
            }
        }
        (Some(h), None) => anyhow::bail!("a hostfile ({}) but no rank: give --rank N", h.display()),
        (None, Some(_)) if rank.is_some() => {
            anyhow::bail!("a rank but no hostfile: give --hostfile FILE (MLX's JSON list of ranks)")
        }
        _ => {}
    }
    Ok(())
}

/// MLX's CUDA settings a long-lived server wants, each through its
/// environment variable, set before MLX reads it; a value the user set is
/// kept, and the CPU build ignores them all. MLX keeps the PTX of the
/// kernels it compiles (for each new batch shape: tens of seconds at real
/// sizes) where `MLX_PTX_CACHE_DIR` says; under the daemon's home they
/// outlive a reboot's temp cleanup, so a restarted daemon does not compile
/// them again.
fn cuda_server_defaults(settings: &Settings) {
    // MLX's CUDA caches (graphs, attention plans) count every miss over
    // the process's life and throw once a count passes twice the cache's
    // size, and the throw leaves the command encoder unusable: every later
    // request failed. An 8B model's steps at varying batch sizes and
    // lengths reached it within minutes on an H200 (issue "The GPU step at
    // real sizes"). A long-lived server must not carry such a fuse: the
    // caches still evict, they no longer throw.
    if std::env::var_os("MLX_ENABLE_CACHE_THRASHING_CHECK").is_none() {
        std::env::set_var("MLX_ENABLE_CACHE_THRASHING_CHECK", "0");
    }
    // MLX's cuDNN attention builds a plan for every new (rows, length)
    // shape a prefill brings: 45-85 ms each on an H200, now and then over a
    // second, and a chat's every turn is a new length. MLX's own kernels
    // compile once and cost up to ~1 ms more per 2,048-token chunk and
    // layer (docs/measurements/gpu-2026-12-04-batch-attention.md). MLX
    // 0.32 reads `SPDA`, later releases `SDPA`: the user's value of either,
    // else off, is given to both.
    const CUDNN_ATTENTION: [&str; 2] = ["MLX_CUDA_USE_CUDNN_SPDA", "MLX_CUDA_USE_CUDNN_SDPA"];
    let cudnn = CUDNN_ATTENTION.iter().find_map(|n| std::env::var(n).ok()).unwrap_or_else(|| "0".into());
    for name in CUDNN_ATTENTION {
        std::env::set_var(name, &cudnn);
    }
    if std::env::var_os("MLX_PTX_CACHE_DIR").is_some() {
        return;
    }
    let dir = settings.paths.home.join("cache/kernels");
    if std::fs::create_dir_all(&dir).is_ok() {
        std::env::set_var("MLX_PTX_CACHE_DIR", dir);
    }
}

fn main() -> Result<()> {
    // First of all: it may execute this program again (blas_core.rs).
    mlxbc_daemon::blas_core::restart_with_wider_kernels();
    let args = Args::parse();
    if args.openblas_core {
        println!("{}", mlxbc_daemon::blas_core::openblas_core().unwrap_or_default());
        return Ok(());
    }
    // Before any thread exists: it clears LISTEN_* from the environment.
    let inherited = mlxbc_daemon::server::activation::take_inherited()?;
    let mut settings = Settings::from_env()?;
    cuda_server_defaults(&settings);
    if let Err(e) = mlxbc_daemon::logging::init(args.log_file.as_deref(), settings.log_max_bytes) {
        anyhow::bail!("opening the log file {}: {e}", args.log_file.unwrap_or_default().display());
    }
    if let Some(s) = args.socket {
        settings.socket = s;
    }
    if let Some(k) = args.keep_alive {
        settings.keep_alive = mlxbc_shared::KeepAlive::parse(&k).map_err(anyhow::Error::msg)?;
    }
    if let Some(d) = args.models_dir {
        settings.models_dir = d;
    }
    if args.http.is_some() {
        settings.http = args.http;
    }
    if let Some(i) = args.idle_exit {
        settings.idle_exit = mlxbc_shared::KeepAlive::parse(&i).map_err(anyhow::Error::msg)?;
    }
    join_group_settings(&mut settings, args.hostfile, args.rank, args.backend)?;
    let options =
        mlxbc_daemon::model::options::EngineOptions::from_settings_and_env(&settings).map_err(anyhow::Error::msg)?;
    mlxbc_daemon::model::batch_attention::configure(options.attention);
    mlxbc_daemon::model::layers::configure(options.split_parts);
    mlxbc_daemon::model::w4a16::configure(options.w4a16_rows.unwrap_or(mlxbc_daemon::model::w4a16::DEFAULT_ROWS));
    mlxbc_daemon::decoding::lookup::configure(options.speculate);
    if let Some(n) = options.lookup_shortest {
        mlxbc_daemon::decoding::lookup::configure_shortest(n);
    }
    mlxbc_daemon::engine::draft_batch::configure(options.draft_rows);
    if let (Some(_), Some(rank)) = (&settings.cluster.hostfile, settings.cluster.rank) {
        if rank > 0 {
            // A worker: no socket, no gateway; it serves the group until stopped.
            mlxbc_daemon::cluster::worker::serve_as_worker(&settings, options)?;
        }
    }
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let result = runtime.block_on(mlxbc_daemon::run(settings, options, inherited));
    if let Err(e) = &result {
        tracing::error!("{e:#}");
    }
    // Everything is stopped and flushed (the engine thread, and with it the
    // feature store, was joined in `run`). Leave without running static
    // destructors: MLX's can block process exit now and then (seen here: a
    // daemon that logged "stopped" and never exited).
    runtime.shutdown_timeout(std::time::Duration::from_secs(2));
    use std::io::Write;
    let _ = std::io::stderr().flush();
    // SAFETY: _exit ends the process immediately; nothing is left to clean up.
    unsafe { libc::_exit(if result.is_ok() { 0 } else { 1 }) }
}
