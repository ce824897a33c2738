//! One client connection: the Hello handshake, then requests until the client
//! hangs up. A client that disconnects during a generation cancels it.

use crate::engine::{EngineHandle, Job};
use futures::{SinkExt, StreamExt};
use mlxbc_shared::codec::DaemonCodec;
use mlxbc_shared::{ErrorKind, FrameError, Request, Response, PROTOCOL_VERSION};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::UnixStream;
use tokio::sync::{mpsc, oneshot, watch};
use tokio_util::codec::Framed;

type Conn = Framed<UnixStream, DaemonCodec>;

/// Shared state every connection sees.
pub struct ServerState {
    pub engine: EngineHandle,
    pub registry: crate::engine::registry::ModelRegistry,
    pub started: Instant,
    /// Set to true to stop the daemon.
    pub shutdown: watch::Sender<bool>,
    /// Open client connections.
    pub connections: AtomicUsize,
    /// The only uid allowed to connect: the daemon's own.
    pub owner_uid: u32,
    /// Named conversations (read here; the engine appends to them).
    pub sessions: crate::engine::sessions::SessionStore,
}

/// Counts a connection for as long as it lives.
struct Counted<'a>(&'a AtomicUsize);

impl<'a> Counted<'a> {
    fn new(n: &'a AtomicUsize) -> Self {
        n.fetch_add(1, Ordering::SeqCst);
        Self(n)
    }
}

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// How long a client may take to say Hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves one connection to its end.
pub async fn serve(stream: UnixStream, state: Arc<ServerState>) {
    let _counted = Counted::new(&state.connections);
    let peer = stream.peer_cred();
    let mut conn = Framed::new(stream, DaemonCodec::default());
    // The socket's file modes already keep others out; the peer's uid is
    // checked as well, for sockets a service manager created or a user relaxed.
    // The refusal answers the client's first frame, so that it is read and
    // not lost to a client still writing its Hello.
    let refused = match peer {
        Ok(cred) if cred.uid() == state.owner_uid => None,
        Ok(cred) => {
            tracing::warn!(uid = cred.uid(), pid = cred.pid(), "refused a connection from another user");
            Some(format!(
                "permission denied: this mlxbcd serves uid {} only, and you are uid {}; run your own daemon",
                state.owner_uid,
                cred.uid()
            ))
        }
        Err(e) => {
            tracing::warn!(error = %e, "could not read the peer's credentials; closing");
            return;
        }
    };
    if let Some(msg) = refused {
        let _ = tokio::time::timeout(HELLO_TIMEOUT, conn.next()).await;
        let _ = conn.send(error(ErrorKind::PermissionDenied, msg)).await;
        return;
    }
    if !handshake(&mut conn).await {
        return;
    }
    while let Some(frame) = conn.next().await {
        let request = match frame {
            Ok(r) => r,
            Err(e) => {
                reject_frame(&mut conn, e).await;
                return;
            }
        };
        let keep_going = match request {
            Request::Generate(req) => stream_generation(&mut conn, &state, req).await,
            other => {
                let reply = answer(&state, other).await;
                conn.send(reply).await.is_ok()
            }
        };
        if !keep_going {
            return;
        }
    }
}

async fn handshake(conn: &mut Conn) -> bool {
    let first = match tokio::time::timeout(HELLO_TIMEOUT, conn.next()).await {
        Ok(Some(f)) => f,
        Ok(None) => return false,
        Err(_) => {
            let _ = conn.send(error(ErrorKind::BadRequest, "no Hello within 10 s; closing")).await;
            return false;
        }
    };
    match first {
        Ok(Request::Hello { protocol, client_version }) if protocol == PROTOCOL_VERSION => {
            tracing::debug!(%client_version, "client connected");
            let hello = Response::Hello {
                protocol: PROTOCOL_VERSION,
                daemon_version: env!("CARGO_PKG_VERSION").into(),
                device: String::new(),
                blas: crate::BLAS.into(),
            };
            conn.send(hello).await.is_ok()
        }
        Ok(Request::Hello { protocol, client_version }) => {
            tracing::warn!(protocol, %client_version, "refused client with another protocol version");
            let msg = format!(
                "protocol mismatch: client {client_version} speaks protocol {protocol}, this daemon (mlxbcd {}) speaks {PROTOCOL_VERSION}; \
                 run `mlxbc stop` and retry so the matching daemon starts",
                env!("CARGO_PKG_VERSION")
            );
            let _ = conn.send(error(ErrorKind::ProtocolMismatch, msg)).await;
            false
        }
        Ok(_) => {
            let _ = conn.send(error(ErrorKind::BadRequest, "the first frame must be Hello")).await;
            false
        }
        Err(e) => {
            reject_frame(conn, e).await;
            false
        }
    }
}

async fn reject_frame(conn: &mut Conn, e: FrameError) {
    if e.is_disconnect() {
        return;
    }
    tracing::warn!(error = %e, "bad frame from client; closing its connection");
    let _ = conn.send(error(ErrorKind::BadFrame, e.to_string())).await;
}

fn error(kind: ErrorKind, message: impl Into<String>) -> Response {
    Response::Error { kind, message: message.into() }
}

/// Streams a generation; returns false when the connection is finished.
async fn stream_generation(conn: &mut Conn, state: &ServerState, request: mlxbc_shared::GenerateRequest) -> bool {
    let (tx, mut rx) = mpsc::unbounded_channel();
    let cancel = Arc::new(AtomicBool::new(false));
    let job = Job::Generate { request, events: tx, cancel: cancel.clone(), received: Instant::now() };
    if let Err((kind, msg)) = state.engine.submit(job) {
        return conn.send(error(kind, msg)).await.is_ok();
    }
    loop {
        tokio::select! {
            event = rx.recv() => {
                let Some(event) = event else {
                    return conn.send(error(ErrorKind::Internal, "the engine dropped the request")).await.is_ok();
                };
                let last = matches!(event, Response::Done { .. } | Response::Error { .. } | Response::NeedMedia { .. });
                if conn.send(event).await.is_err() {
                    cancel.store(true, Ordering::Relaxed);
                    return false;
                }
                if last {
                    return true;
                }
            }
            incoming = conn.next() => {
                // Clients send nothing mid-stream; EOF or an error means they left.
                match incoming {
                    None | Some(Err(_)) => {
                        cancel.store(true, Ordering::Relaxed);
                        return false;
                    }
                    Some(Ok(_)) => {
                        cancel.store(true, Ordering::Relaxed);
                        let _ = conn.send(error(ErrorKind::BadRequest, "a request arrived while a generation was streaming; one at a time per connection")).await;
                        return false;
                    }
                }
            }
        }
    }
}

async fn answer(state: &ServerState, request: Request) -> Response {
    match request {
        Request::Hello { .. } => error(ErrorKind::BadRequest, "Hello was already received"),
        Request::Generate(_) => unreachable!("handled by stream_generation"),
        Request::ListModels => {
            let loaded = state.engine.loaded_names();
            let mut models = state.registry.list();
            for m in &mut models {
                m.loaded = loaded.contains(&m.name);
            }
            Response::Models { models }
        }
        Request::Status => Response::Status(state.engine.status(state.started)),
        Request::Load { model, keep_alive } => round_trip(state, |reply| Job::Load { model, keep_alive, reply }).await,
        Request::Unload { model } => round_trip(state, |reply| Job::Unload { model, reply }).await,
        Request::Prefetch { model, media } => round_trip(state, |reply| Job::Prefetch { model, media, reply }).await,
        Request::Cache(command) => round_trip(state, |reply| Job::Cache { command, reply }).await,
        Request::Sessions(command) => {
            use mlxbc_shared::SessionCommand;
            let result = match command {
                SessionCommand::List => Ok(state.sessions.list()),
                SessionCommand::Show { name } => {
                    state.sessions.load(&name).map(|messages| vec![mlxbc_shared::SessionInfo { name, messages }])
                }
                SessionCommand::Delete { name } => state.sessions.delete(&name).map(|s| s.into_iter().collect()),
            };
            match result {
                Ok(list) => Response::Sessions(list),
                Err(message) => error(ErrorKind::BadRequest, message),
            }
        }
        Request::Shutdown => {
            tracing::info!("shutdown requested by a client");
            let _ = state.shutdown.send(true);
            Response::ShuttingDown
        }
    }
}

async fn round_trip(state: &ServerState, job: impl FnOnce(oneshot::Sender<Response>) -> Job) -> Response {
    let (tx, rx) = oneshot::channel();
    if let Err((kind, msg)) = state.engine.submit(job(tx)) {
        return error(kind, msg);
    }
    rx.await.unwrap_or_else(|_| error(ErrorKind::Internal, "the engine dropped the request"))
}
