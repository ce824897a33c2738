//! The listener: accepts connections on the Unix socket, a task each, until
//! SIGTERM/SIGINT, a Shutdown request or (socket-activated) an idle period.

pub mod activation;
pub mod cache_report;
pub mod connection;
mod socket;

use crate::limits;
use crate::requests::validate;
use crate::state::AppState;
use anyhow::{Context, Result};
use mlxbc_shared::settings::Settings;
use mlxbc_shared::KeepAlive;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::watch;

/// Runs the daemon until it is told to stop. `options` are the diagnostic
/// switches read once at start. `inherited` is the socket a
/// service manager passed ([`activation::take_inherited`]); without one the
/// daemon binds `settings.socket` itself.
pub async fn run(
    settings: Settings,
    options: crate::model::options::EngineOptions,
    inherited: Option<activation::Inherited>,
) -> Result<()> {
    private_files(&settings);
    // Handlers first: from the moment the socket listens, a SIGTERM must
    // mean a clean stop, never the default kill.
    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sigint = signal(SignalKind::interrupt())?;
    let manager = inherited.as_ref().map(|i| i.manager);
    let (listener, guard) = match inherited {
        Some(i) => (tokio::net::UnixListener::from_std(i.listener)?, None),
        None => {
            let (listener, guard) = socket::bind(&settings.socket)?;
            (listener, Some(guard))
        }
    };
    let http = match settings.http {
        Some(addr) => Some(crate::http::bind(addr).await?),
        None => None,
    };
    // One session store for the engine (which appends) and the connections
    // (which list and delete): the single writer of those files.
    let sessions = Arc::new(crate::sessions::SessionStore::new(&crate::sessions::sessions_dir(&settings)));
    let registry = Arc::new(crate::catalog::registry::ModelRegistry::new(&settings));
    let (engine, engine_thread) = crate::engine::spawn(&settings, options, sessions.clone(), registry.clone())
        .context("starting the engine thread")?;
    // Only a socket-activated daemon may leave: its manager keeps listening
    // and starts it again on the next connection.
    let idle_exit = match (manager, settings.idle_exit) {
        (Some(_), KeepAlive::Seconds(s)) => Some(Duration::from_secs(s)),
        _ => None,
    };
    tracing::info!(
        socket = %settings.socket.display(),
        activated_by = manager.unwrap_or("none"),
        idle_exit_s = idle_exit.map(|d| d.as_secs()),
        device = %engine.device,
        blas = crate::BLAS,
        blas_kernels = crate::blas_core::describe().unwrap_or_default(),
        models = %settings.models_dir.display(),
        "mlxbcd {} listening",
        env!("CARGO_PKG_VERSION")
    );
    let (shutdown, mut shutdown_rx) = watch::channel(false);
    let fd_limit = limits::raise_fd_limit();
    let (cap, http_cap) = limits::connection_caps(
        settings.max_connections,
        http.is_some().then_some(settings.max_http_connections),
        fd_limit,
    );
    tracing::info!(fd_limit, max_connections = cap, max_http_connections = http_cap, "connection limits");
    let state = Arc::new(AppState {
        engine,
        registry,
        started: Instant::now(),
        shutdown,
        connections: limits::ConnectionTable::new(cap),
        http_connections: limits::ConnectionTable::new(http_cap.max(1)),
        http_on: http.is_some(),
        idle_timeout: settings.connection_idle_timeout,
        limits: validate::Limits {
            max_prompt_bytes: settings.max_prompt_bytes,
            max_prompt_messages: settings.max_prompt_messages,
        },
        http_token: settings.http_token.clone(),
        http_allowed_origins: settings.http_allowed_origins.clone(),
        // SAFETY: geteuid cannot fail.
        owner_uid: unsafe { libc::geteuid() },
        sessions,
    });
    if let Some(listener) = http {
        let (state, stop) = (state.clone(), shutdown_rx.clone());
        let idle_timeout = settings.http_idle_timeout;
        tokio::spawn(async move {
            if let Err(e) = crate::http::serve(listener, state, idle_timeout, stop).await {
                tracing::error!("{e:#}");
            }
        });
    }
    activation::notify_ready(&format!("listening on {}", settings.socket.display()));
    let mut tick =
        tokio::time::interval(idle_exit.map_or(Duration::from_secs(3600), |d| (d / 4).max(Duration::from_millis(100))));
    let mut idle_since: Option<Instant> = None;
    let mut backoff = limits::AcceptBackoff::default();
    let accept_log = limits::RateLimitedLog::new(Duration::from_secs(10));
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    idle_since = None;
                    backoff.succeeded();
                    tokio::spawn(connection::serve(stream, state.clone()));
                }
                Err(e) => {
                    // Out of descriptors: close the longest-idle connection so
                    // the next accept can succeed; every failure backs off, so
                    // a persistent one cannot spin a core or flood the log.
                    let out_of_fds = matches!(e.raw_os_error(), Some(libc::EMFILE) | Some(libc::ENFILE));
                    let freed = out_of_fds && state.connections.evict_idle();
                    let wait = backoff.failed();
                    accept_log.log(|suppressed| {
                        tracing::warn!(error = %e, freed_an_idle_connection = freed, retry_ms = wait.as_millis() as u64, suppressed, "accept failed")
                    });
                    tokio::time::sleep(wait).await;
                }
            },
            _ = tick.tick(), if idle_exit.is_some() => {
                let idle = state.connections.is_empty() && state.engine.is_idle();
                let since = *idle_since.get_or_insert_with(Instant::now);
                if !idle {
                    idle_since = None;
                } else if since.elapsed() >= idle_exit.unwrap_or_default() {
                    tracing::info!(idle_s = since.elapsed().as_secs(), "idle with no model loaded: exiting until the next connection");
                    break;
                }
            }
            _ = sigterm.recv() => { tracing::info!("SIGTERM: stopping"); let _ = state.shutdown.send(true); break; }
            _ = sigint.recv() => { tracing::info!("SIGINT: stopping"); let _ = state.shutdown.send(true); break; }
            _ = shutdown_rx.changed() => break,
        }
    }
    activation::notify_stopping();
    // Stop taking connections, then let the engine finish the job in hand.
    // An inherited socket stays open in the manager, which queues new clients.
    drop(listener);
    drop(guard);
    state.engine.stop();
    drop(state);
    tokio::task::spawn_blocking(move || engine_thread.join()).await.ok();
    tracing::info!("mlxbcd stopped");
    Ok(())
}

/// Everything the daemon writes is the user's alone: files 0600 and
/// directories 0700 from here on (umask), and the data directory and feature
/// store of an older install, once 0755 with 0644 files, tightened now.
fn private_files(settings: &Settings) {
    use std::os::unix::fs::PermissionsExt;
    // SAFETY: umask only changes this process's file creation mask.
    unsafe { libc::umask(0o077) };
    let tighten = |path: &std::path::Path, mode: u32| {
        if let Ok(meta) = std::fs::symlink_metadata(path) {
            if !meta.file_type().is_symlink() && meta.permissions().mode() & 0o077 != 0 {
                let _ = std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode));
            }
        }
    };
    let home = &settings.paths.home;
    for dir in [home.clone(), home.join("sessions"), home.join("cache"), settings.feature_cache_dir.clone()] {
        tighten(&dir, 0o700);
    }
    for dir in [home.join("sessions"), settings.feature_cache_dir.clone(), settings.feature_cache_dir.join("blobs")] {
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let is_dir = entry.file_type().is_ok_and(|t| t.is_dir());
            tighten(&entry.path(), if is_dir { 0o700 } else { 0o600 });
        }
    }
}
