//! The gateway's own accept loop: what the socket has, for a TCP port that
//! every local user can reach.
//!
//! Found before this existed (axum::serve, which has no limits): 20,000 idle
//! TCP connections that never sent a byte took every descriptor, the
//! owner's `mlxbc ask` failed, and none of them was ever closed; slow
//! headers and a `Content-Length` that never arrives were held forever.
//!
//! Now every connection takes a slot in the gateway's own
//! [`ConnectionTable`] (a cap beside the socket's, so the socket's clients
//! keep their descriptors); a connection with no request in flight is
//! closed after the idle timeout (which is also the header timeout: until
//! its headers are in, a request is not in flight); when the table is full
//! the longest-idle connection is closed to make room, and with every one
//! busy the new one gets a 503. Bodies are read under a deadline that grows
//! with the bytes received ([`read_body`]), and a declared length over the
//! cap is refused before a byte of it is read.

use crate::limits::{AcceptBackoff, ConnectionTable, RateLimitedLog, Slot};
use axum::body::Body;
use axum::extract::Request;
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};
use http_body_util::BodyExt;
use hyper_util::rt::{TokioIo, TokioTimer};
use serde_json::json;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::TcpStream;
use tokio::sync::watch;

/// A body must start arriving within this long, and then keep to
/// [`BODY_MIN_BYTES_PER_S`] (Apache's mod_reqtimeout rule: the allowance
/// grows by a second per that many bytes).
const BODY_GRACE: Duration = Duration::from_secs(10);
/// The slowest body the gateway waits for, on average after the grace.
/// Loopback delivers hundreds of MB/s; 64 KiB/s is a client that is stuck
/// or hostile, and a 64 MiB body still gets 17 minutes at that rate.
const BODY_MIN_BYTES_PER_S: u64 = 64 << 10;
/// How long a response may wait on a peer that does not read it: past
/// this the connection is dropped, so an answer nobody reads cannot keep a
/// slot busy forever.
const WRITE_STALL: Duration = Duration::from_secs(60);
/// How long a refusal may take to write.
const REFUSAL_WRITE_TIMEOUT: Duration = Duration::from_secs(1);

/// Accept errors, logged at most once every 10 s.
static ACCEPT_LOG: RateLimitedLog = RateLimitedLog::new(Duration::from_secs(10));
/// Refusals for lack of room, logged at most once every 10 s.
static FULL_LOG: RateLimitedLog = RateLimitedLog::new(Duration::from_secs(10));

/// The gateway's connection bounds.
#[derive(Debug, Clone, Copy)]
pub struct HttpLimits {
    /// A connection with no request in flight (none yet, or between
    /// keep-alive requests, or still sending its headers) is closed after this.
    pub idle_timeout: Duration,
    /// Largest request body, in bytes.
    pub max_body_bytes: usize,
}

/// Accepts connections on `listener` and serves `app` on each until `stop`.
pub async fn accept_loop(
    listener: tokio::net::TcpListener,
    app: Router,
    table: Arc<ConnectionTable>,
    limits: HttpLimits,
    mut stop: watch::Receiver<bool>,
) {
    let mut backoff = AcceptBackoff::default();
    let for_connections = stop.clone();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    backoff.succeeded();
                    let _ = stream.set_nodelay(true);
                    match table.admit() {
                        Some(slot) => {
                            tokio::spawn(serve_connection(stream, Arc::new(slot), app.clone(), limits, for_connections.clone()));
                        }
                        None => {
                            let cap = table.cap();
                            FULL_LOG.log(|suppressed| tracing::warn!(cap, suppressed, "HTTP: refused a connection: every slot has a request in flight"));
                            tokio::spawn(refuse_busy(stream, cap));
                        }
                    }
                }
                Err(e) => {
                    // Out of descriptors: close the longest-idle HTTP
                    // connection so the next accept can succeed; every
                    // failure backs off, so it cannot spin a core.
                    let out_of_fds = matches!(e.raw_os_error(), Some(libc::EMFILE) | Some(libc::ENFILE));
                    let freed = out_of_fds && table.evict_idle();
                    let wait = backoff.failed();
                    ACCEPT_LOG.log(|suppressed| {
                        tracing::warn!(error = %e, freed_an_idle_connection = freed, retry_ms = wait.as_millis() as u64, suppressed, "HTTP accept failed")
                    });
                    tokio::time::sleep(wait).await;
                }
            },
            _ = stopped(&mut stop) => return,
        }
    }
}

/// Serves one TCP connection (HTTP/1.1, keep-alive) until the peer closes
/// it, it idles out, its slot is taken for a newer connection, or the
/// daemon stops (then the request in hand finishes first).
async fn serve_connection(
    stream: TcpStream,
    slot: Arc<Slot>,
    app: Router,
    limits: HttpLimits,
    mut stop: watch::Receiver<bool>,
) {
    let service = {
        let slot = slot.clone();
        hyper::service::service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
            // In flight from the moment its headers are in until its
            // response body (a stream, maybe) is finished or dropped.
            let in_flight = slot.begin_request();
            let app = app.clone();
            async move {
                let response = tower_service::Service::call(&mut app.clone(), request.map(Body::new)).await?;
                Ok::<_, std::convert::Infallible>(response.map(move |body| {
                    Body::new(body.map_frame(move |frame| {
                        let _ = &in_flight;
                        frame
                    }))
                }))
            }
        })
    };
    let connection = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.idle_timeout)
        .serve_connection(TokioIo::new(StallTimeout::new(stream, WRITE_STALL)), service);
    tokio::pin!(connection);
    let mut stopping = false;
    loop {
        // Wake when the connection would have idled out, not on a timer:
        // hundreds of idle connections must not cost the daemon wakeups.
        let left = slot.idle_for().map_or(limits.idle_timeout, |idle| limits.idle_timeout.saturating_sub(idle));
        tokio::select! {
            _ = connection.as_mut() => return,
            // Taken for a newer connection: only ever an idle one.
            _ = slot.close.notified() => return,
            _ = tokio::time::sleep(left) => {
                if slot.idle_for().is_some_and(|idle| idle >= limits.idle_timeout) {
                    return;
                }
            }
            _ = stopped(&mut stop), if !stopping => {
                stopping = true;
                connection.as_mut().graceful_shutdown();
            }
        }
    }
}

/// Resolves when the daemon is stopping (the watch's guard is not held
/// past it, so the futures that select on this stay `Send`).
async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// A 503 for a connection that found every slot busy, written without
/// reading from it.
async fn refuse_busy(mut stream: TcpStream, cap: usize) {
    use tokio::io::AsyncWriteExt;
    let body = json!({"error": {"message": format!("mlxbcd is busy: all {cap} HTTP connections have a request in flight; retry shortly"),
                                "type": "server_error", "code": "busy"}})
    .to_string();
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    let _ = tokio::time::timeout(REFUSAL_WRITE_TIMEOUT, async {
        stream.write_all(head.as_bytes()).await?;
        stream.write_all(body.as_bytes()).await?;
        stream.shutdown().await
    })
    .await;
}

/// Middleware: reads the whole request body before any handler sees it,
/// refusing a declared length over the cap at once (413) and a body that
/// falls behind its deadline (408), so a handler never waits on a peer.
pub async fn read_body(limits: axum::extract::State<HttpLimits>, request: Request, next: Next) -> Response {
    let max = limits.max_body_bytes;
    let declared = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|n| n > max as u64) {
        return refusal(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the request body is {} bytes; the gateway takes at most {max}", declared.unwrap_or(0)),
        );
    }
    let (parts, mut body) = request.into_parts();
    let started = Instant::now();
    let mut received: Vec<u8> = Vec::with_capacity(declared.unwrap_or(0).min(1 << 20) as usize);
    loop {
        let allowance = BODY_GRACE + Duration::from_secs_f64(received.len() as f64 / BODY_MIN_BYTES_PER_S as f64);
        let deadline = tokio::time::Instant::from_std(started + allowance);
        match tokio::time::timeout_at(deadline, body.frame()).await {
            Err(_) => {
                return refusal(
                    StatusCode::REQUEST_TIMEOUT,
                    format!(
                        "the request body arrived too slowly ({} bytes in {:.0} s); send it at once",
                        received.len(),
                        started.elapsed().as_secs_f64()
                    ),
                )
            }
            Ok(None) => break,
            Ok(Some(Err(e))) => {
                return refusal(StatusCode::BAD_REQUEST, format!("reading the request body: {e}"));
            }
            Ok(Some(Ok(frame))) => {
                if let Ok(data) = frame.into_data() {
                    if received.len() + data.len() > max {
                        return refusal(
                            StatusCode::PAYLOAD_TOO_LARGE,
                            format!("the request body is over {max} bytes, the most the gateway takes"),
                        );
                    }
                    received.extend_from_slice(&data);
                }
            }
        }
    }
    next.run(Request::from_parts(parts, Body::from(received))).await
}

/// An error body that also closes the connection (its body, if any, was
/// not read to the end, so the connection cannot be reused).
fn refusal(status: StatusCode, message: String) -> Response {
    let code = if status == StatusCode::PAYLOAD_TOO_LARGE { "body_too_large" } else { "body_timeout" };
    let mut response =
        (status, Json(json!({"error": {"message": message, "type": "invalid_request_error", "code": code}})))
            .into_response();
    response.headers_mut().insert(header::CONNECTION, header::HeaderValue::from_static("close"));
    response
}

/// A stream whose writes fail once they have made no progress for
/// `limit` (the peer stopped reading); reads are untouched (the idle and
/// body deadlines bound those).
struct StallTimeout<S> {
    inner: S,
    limit: Duration,
    stalled: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
}

impl<S> StallTimeout<S> {
    fn new(inner: S, limit: Duration) -> Self {
        Self { inner, limit, stalled: None }
    }

    /// Pending from the inner stream: arm (or check) the stall clock.
    fn pending<T>(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<std::io::Result<T>> {
        let limit = self.limit;
        let sleep = self.stalled.get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match sleep.as_mut().poll(cx) {
            std::task::Poll::Ready(()) => std::task::Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the peer has not read its answer for a minute",
            ))),
            std::task::Poll::Pending => std::task::Poll::Pending,
        }
    }
}

use std::future::Future as _;
use std::pin::Pin;
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

impl<S: AsyncRead + Unpin> AsyncRead for StallTimeout<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for StallTimeout<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        match Pin::new(&mut self.inner).poll_write(cx, buf) {
            Poll::Pending => self.pending(cx),
            done => {
                self.stalled = None;
                done
            }
        }
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match Pin::new(&mut self.inner).poll_flush(cx) {
            Poll::Pending => self.pending(cx),
            done => {
                self.stalled = None;
                done
            }
        }
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match Pin::new(&mut self.inner).poll_shutdown(cx) {
            Poll::Pending => self.pending(cx),
            done => {
                self.stalled = None;
                done
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    /// A peer that never reads: the write fails after the limit instead
    /// of waiting forever; a peer that reads is never cut off.
    #[tokio::test]
    async fn a_write_nobody_reads_times_out() {
        let (a, mut b) = tokio::io::duplex(1024);
        let mut w = StallTimeout::new(a, Duration::from_millis(200));
        let t = std::time::Instant::now();
        let err = w.write_all(&vec![0u8; 1 << 20]).await.unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::TimedOut);
        assert!(t.elapsed() < Duration::from_secs(2));
        let (a, mut b2) = tokio::io::duplex(1024);
        let reader = tokio::spawn(async move {
            use tokio::io::AsyncReadExt;
            let mut sink = Vec::new();
            b2.read_to_end(&mut sink).await.map(|_| sink.len())
        });
        let mut w = StallTimeout::new(a, Duration::from_millis(200));
        w.write_all(&vec![0u8; 1 << 20]).await.unwrap();
        w.shutdown().await.unwrap();
        drop(w);
        assert_eq!(reader.await.unwrap().unwrap(), 1 << 20);
        let _ = &mut b;
    }
}
