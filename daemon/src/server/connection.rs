//! One client connection: the peer check before anything is read, the Hello
//! handshake, then requests until the client hangs up or idles out. A client
//! that closes its socket during a generation cancels it; one that only
//! closes its writing half still gets its answer.

use crate::engine::Job;
use crate::limits::RateLimitedLog;
use crate::requests::validate;
use crate::state::AppState;
use futures::{SinkExt, StreamExt};
use mlxbc_shared::codec::DaemonCodec;
use mlxbc_shared::{ErrorKind, FrameError, Request, Response, PROTOCOL_VERSION};
use std::os::unix::io::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::UnixStream;
use tokio::sync::oneshot;
use tokio_util::codec::Framed;

type Conn = Framed<UnixStream, DaemonCodec>;

/// How long a client may take to say Hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// The largest first frame: a Hello is a few dozen bytes.
const HELLO_MAX_BYTES: usize = 4096;
/// How long a refusal may take to write before the connection is dropped.
const REFUSAL_WRITE_TIMEOUT: Duration = Duration::from_secs(1);
/// How often a generation whose client half-closed its socket checks that
/// the client is still there to read the answer.
const HANGUP_POLL: Duration = Duration::from_millis(50);

/// Refusals of other users, logged at most once a minute.
static FOREIGN_LOG: RateLimitedLog = RateLimitedLog::new(Duration::from_secs(60));
/// Refusals for lack of room, logged at most once every 10 s.
static FULL_LOG: RateLimitedLog = RateLimitedLog::new(Duration::from_secs(10));

/// Writes one response frame straight to a stream that has not been read
/// from, with a timeout, then closes it.
async fn refuse(mut stream: UnixStream, response: Response) {
    use tokio::io::AsyncWriteExt;
    let Ok(payload) = mlxbc_shared::codec::to_payload(&response) else { return };
    let mut frame = (payload.len() as u32).to_be_bytes().to_vec();
    frame.extend_from_slice(&payload);
    let _ = tokio::time::timeout(REFUSAL_WRITE_TIMEOUT, async {
        stream.write_all(&frame).await?;
        stream.shutdown().await
    })
    .await;
}

/// Serves one connection to its end. The peer's uid is checked before a
/// single byte is read from it: the socket's file modes already keep others
/// out, but a service manager's socket or a user's `chmod` may not, and a
/// frame from another user must never reach the decoder.
pub async fn serve(stream: UnixStream, state: Arc<AppState>) {
    match stream.peer_cred() {
        Ok(cred) if cred.uid() == state.owner_uid => {}
        Ok(cred) => {
            FOREIGN_LOG.log(|suppressed| {
                tracing::warn!(uid = cred.uid(), pid = cred.pid(), suppressed, "refused a connection from another user")
            });
            let msg = format!(
                "permission denied: this mlxbcd serves uid {} only, and you are uid {}; run your own daemon",
                state.owner_uid,
                cred.uid()
            );
            return refuse(stream, error(ErrorKind::PermissionDenied, msg)).await;
        }
        Err(e) => {
            tracing::warn!(error = %e, "could not read the peer's credentials; closing");
            return;
        }
    }
    let Some(slot) = state.connections.admit() else {
        let cap = state.connections.cap();
        FULL_LOG.log(|suppressed| tracing::warn!(cap, suppressed, "refused a connection: every slot is busy"));
        let msg = format!(
            "mlxbcd is busy: all {cap} connections have a request in flight (max_connections in config.toml); retry shortly"
        );
        return refuse(stream, error(ErrorKind::Busy, msg)).await;
    };
    let mut conn = Framed::new(stream, DaemonCodec::default());
    conn.codec_mut().set_max_frame_bytes(HELLO_MAX_BYTES);
    let handshook = tokio::select! {
        ok = handshake(&mut conn) => ok,
        _ = slot.close.notified() => false,
    };
    if !handshook {
        return;
    }
    conn.codec_mut().set_max_frame_bytes(mlxbc_shared::MAX_FRAME_BYTES);
    loop {
        slot.idle();
        // An idle connection is closed after the timeout (clients reconnect
        // transparently), or at once when its slot is needed for a new one.
        let next = tokio::select! {
            next = next_or_idle(&mut conn, state.idle_timeout) => next,
            _ = slot.close.notified() => return,
        };
        let Some(frame) = next else { return };
        slot.busy();
        let request = match frame {
            Ok(r) => r,
            Err(e) => {
                reject_frame(&mut conn, e).await;
                return;
            }
        };
        if let Err(e) = validate::request(&request, state.limits) {
            if conn.send(error(ErrorKind::BadRequest, e.0)).await.is_err() {
                return;
            }
            continue;
        }
        let keep_going = match request {
            Request::Generate(req) => stream_generation(&mut conn, &state, req).await,
            Request::Transcribe(req) => match state.start_transcription(req).await {
                Ok((rx, cancel)) => stream_events(&mut conn, rx, cancel).await,
                Err(e) => conn.send(e.into_response()).await.is_ok(),
            },
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

/// The next frame; `None` at end of stream or after `idle` without one.
async fn next_or_idle(conn: &mut Conn, idle: Option<Duration>) -> Option<Result<Request, FrameError>> {
    match idle {
        None => conn.next().await,
        Some(idle) => tokio::time::timeout(idle, conn.next()).await.ok().flatten(),
    }
}

/// True once the client has closed its socket entirely (not just its
/// writing half): POLLHUP is set on a Unix stream socket only when both
/// directions are shut.
fn client_hung_up(conn: &Conn) -> bool {
    let mut fds = libc::pollfd { fd: conn.get_ref().as_raw_fd(), events: libc::POLLOUT, revents: 0 };
    // SAFETY: poll on one valid descriptor with a zero timeout.
    let n = unsafe { libc::poll(&mut fds, 1, 0) };
    n > 0 && fds.revents & (libc::POLLHUP | libc::POLLERR) != 0
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
            tracing::warn!(protocol, client_version = %crate::logging::peer(&client_version), "refused client with another protocol version");
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
    tracing::warn!(error = %crate::logging::peer(&e.to_string()), "bad frame from client; closing its connection");
    let _ = conn.send(error(ErrorKind::BadFrame, e.to_string())).await;
}

fn error(kind: ErrorKind, message: impl Into<String>) -> Response {
    Response::Error { kind, message: message.into() }
}

/// Streams a generation; returns false when the connection is finished.
async fn stream_generation(conn: &mut Conn, state: &AppState, request: mlxbc_shared::GenerateRequest) -> bool {
    let (rx, cancel) = match state.start_generation(request).await {
        Ok(started) => started,
        Err(e) => return conn.send(e.into_response()).await.is_ok(),
    };
    stream_events(conn, rx, cancel).await
}

/// Sends a job's events until its last; a client that hangs up cancels it.
/// Returns false when the connection is finished.
async fn stream_events(
    conn: &mut Conn,
    mut rx: tokio::sync::mpsc::UnboundedReceiver<Response>,
    cancel: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> bool {
    // After the client shuts its writing half (EOF on read), it may still be
    // reading: keep streaming, and watch for a full hang-up instead.
    let mut read_closed = false;
    let mut hangup = tokio::time::interval(HANGUP_POLL);
    loop {
        tokio::select! {
            event = rx.recv() => {
                let Some(event) = event else {
                    return conn.send(error(ErrorKind::Internal, "the engine dropped the request")).await.is_ok();
                };
                let last = matches!(
                    event,
                    Response::Done { .. } | Response::Error { .. } | Response::NeedMedia { .. } | Response::Transcribed(_)
                );
                if conn.send(event).await.is_err() {
                    cancel.store(true, Ordering::Relaxed);
                    return false;
                }
                if last {
                    return !read_closed;
                }
            }
            incoming = conn.next(), if !read_closed => {
                match incoming {
                    None => read_closed = true,
                    Some(Err(_)) => {
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
            _ = hangup.tick(), if read_closed => {
                if client_hung_up(conn) {
                    cancel.store(true, Ordering::Relaxed);
                    return false;
                }
            }
        }
    }
}

async fn answer(state: &AppState, request: Request) -> Response {
    match request {
        Request::Hello { .. } => error(ErrorKind::BadRequest, "Hello was already received"),
        Request::Generate(_) | Request::Transcribe(_) => unreachable!("streamed by stream_events"),
        Request::ListModels => {
            let loaded = state.engine.loaded_names();
            let mut models = state.registry.list();
            for m in &mut models {
                m.loaded = loaded.contains(&m.name);
            }
            Response::Models { models }
        }
        Request::Status => status(state),
        Request::ClusterRestart => match &state.engine.cluster {
            Some(c) => {
                tracing::info!("the group is formed again on a client's request");
                c.restart();
                status(state)
            }
            None => crate::error::EngineError::BadRequest(
                "this daemon is not rank 0 of a group: start it with --hostfile FILE --rank 0 (docs/distributed.md)"
                    .into(),
            )
            .into_response(),
        },
        Request::Load { model, keep_alive, sharded } => {
            round_trip(state, |reply| Job::Load { model: Some(model), keep_alive, for_request: false, sharded, reply })
                .await
        }
        Request::Unload { model } => round_trip(state, |reply| Job::Unload { model, reply }).await,
        Request::Embed(request) => {
            round_trip(state, |reply| Job::Embed { request, received: std::time::Instant::now(), reply }).await
        }
        Request::Rerank(request) => {
            round_trip(state, |reply| Job::Rerank { request, received: std::time::Instant::now(), reply }).await
        }
        Request::Prefetch { model, media } => match crate::requests::prepare::prefetch(&state.engine, &model, media)
            .await
        {
            Ok((media, prepared)) => round_trip(state, |reply| Job::Prefetch { model, media, prepared, reply }).await,
            Err(answer) => answer,
        },
        Request::Cache(command) => {
            // Store maintenance runs beside the engine, not on it; only the
            // prompt cache's RAM tier is the engine's to drop.
            let mut removed_prompts = 0;
            if command == mlxbc_shared::CacheCommand::ClearPrompts {
                let disk = state.engine.prompt_disk.clone();
                removed_prompts = tokio::task::spawn_blocking(move || disk.map_or(0, |d| d.clear())).await.unwrap_or(0);
                let (reply, answer) = oneshot::channel();
                if state.engine.submit(Job::ClearPromptRam { reply }).is_ok() {
                    let _ = tokio::time::timeout(Duration::from_secs(30), answer).await;
                }
            }
            let prompts = state.engine.prompt_report();
            let (store, path) = (state.engine.store.clone(), state.engine.store_path.clone());
            tokio::task::spawn_blocking(move || {
                crate::server::cache_report::run(store.as_ref(), &path, command, prompts, removed_prompts)
            })
            .await
            .unwrap_or_else(|e| error(ErrorKind::Internal, format!("cache command failed: {e}")))
        }
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
                Err(e) => crate::error::EngineError::from(e).into_response(),
            }
        }
        Request::Shutdown => {
            tracing::info!("shutdown requested by a client");
            let _ = state.shutdown.send(true);
            Response::ShuttingDown
        }
    }
}

fn status(state: &AppState) -> Response {
    Response::Status(state.status())
}

async fn round_trip(state: &AppState, job: impl FnOnce(oneshot::Sender<Response>) -> Job) -> Response {
    let (tx, rx) = oneshot::channel();
    if let Err(e) = state.engine.submit(job(tx)) {
        return e.into_response();
    }
    rx.await.unwrap_or_else(|_| error(ErrorKind::Internal, "the engine dropped the request"))
}
