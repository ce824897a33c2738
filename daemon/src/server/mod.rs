//! The listener: accepts connections on the Unix socket, a task each, until
//! SIGTERM/SIGINT or a Shutdown request.

pub mod connection;
mod socket;

use anyhow::{Context, Result};
use connection::ServerState;
use mlxbc_shared::settings::Settings;
use std::sync::Arc;
use std::time::Instant;
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::watch;

/// Runs the daemon until it is told to stop.
pub async fn run(settings: Settings) -> Result<()> {
    let (listener, guard) = socket::bind(&settings.socket)?;
    let (engine, engine_thread) = crate::engine::spawn(&settings).context("starting the engine thread")?;
    tracing::info!(
        socket = %settings.socket.display(),
        device = %engine.device,
        blas = crate::BLAS,
        models = %settings.models_dir.display(),
        "mlxbcd {} listening",
        env!("CARGO_PKG_VERSION")
    );
    let (shutdown, mut shutdown_rx) = watch::channel(false);
    let state = Arc::new(ServerState {
        engine,
        registry: crate::engine::registry::ModelRegistry::new(&settings),
        started: Instant::now(),
        shutdown,
    });
    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sigint = signal(SignalKind::interrupt())?;
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => { tokio::spawn(connection::serve(stream, state.clone())); }
                Err(e) => tracing::warn!(error = %e, "accept failed"),
            },
            _ = sigterm.recv() => { tracing::info!("SIGTERM: stopping"); break; }
            _ = sigint.recv() => { tracing::info!("SIGINT: stopping"); break; }
            _ = shutdown_rx.changed() => break,
        }
    }
    // Stop taking connections, then let the engine finish the job in hand.
    drop(listener);
    drop(guard);
    state.engine.stop();
    drop(state);
    tokio::task::spawn_blocking(move || engine_thread.join()).await.ok();
    tracing::info!("mlxbcd stopped");
    Ok(())
}
