//! Hostile input cannot hurt it: frames that used to kill the daemon, other
//! users, too many connections, idle and half-closed clients, and bounds on
//! what a request may ask for. Every test ends with an ordinary client being
//! served, because "the daemon keeps serving others" is the point.

use crate::helper::*;
use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use mlxbc_client::{Client, ClientError, ErrorKind, GenerateRequest, Request, Response, StopReason};
use mlxbc_shared::codec;
use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;
use tokio::net::UnixStream;
use tokio_util::codec::{Framed, LengthDelimitedCodec};

/// A daemon with `config` in its config.toml.
pub fn daemon_with_config(config: &str) -> Daemon {
    let opts = DaemonOptions::default();
    let mut d = Daemon::prepare(&opts);
    std::fs::write(d.home.path().join("config.toml"), config).unwrap();
    d.spawn(&opts.args);
    d
}

async fn served(d: &Daemon) {
    let (text, _) = ask(&d.socket, greedy(None, "What is the capital of France?", 24)).await.unwrap();
    assert!(text.contains("Paris"), "{text:?}");
}

pub(crate) type Raw = Framed<UnixStream, LengthDelimitedCodec>;

pub(crate) async fn raw(d: &Daemon) -> Raw {
    Framed::new(UnixStream::connect(&d.socket).await.unwrap(), LengthDelimitedCodec::new())
}

pub(crate) async fn send(conn: &mut Raw, r: &Request) {
    conn.send(Bytes::from(codec::to_payload(r).unwrap())).await.unwrap();
}

pub(crate) async fn recv(conn: &mut Raw) -> Option<Response> {
    let frame = tokio::time::timeout(Duration::from_secs(60), conn.next()).await.expect("an answer in time")?;
    Some(codec::from_payload(&frame.ok()?).unwrap())
}

pub(crate) async fn hello(conn: &mut Raw) {
    send(conn, &Request::Hello { protocol: mlxbc_client::PROTOCOL_VERSION, client_version: "t".into() }).await;
    assert!(matches!(recv(conn).await, Some(Response::Hello { .. })));
}

/// The frame that aborted mlxbcd (SIGABRT, 4 EiB allocation) at 63e7c13.
const CRASH_FRAME: [u8; 15] = [0, 0, 0, 11, 0x00, 0x02, 0xfd, 0, 0, 0, 0, 0, 0, 0, 0x40];

#[tokio::test(flavor = "multi_thread")]
async fn the_15_byte_frame_gets_bad_frame_and_the_daemon_lives() {
    let mut d = Daemon::start();
    for _ in 0..3 {
        let mut s = UnixStream::connect(&d.socket).await.unwrap();
        s.write_all(&CRASH_FRAME).await.unwrap();
        let mut conn = Framed::new(s, LengthDelimitedCodec::new());
        match recv(&mut conn).await {
            Some(Response::Error { kind: ErrorKind::BadFrame, message }) => {
                assert!(message.contains("Limit"), "{message}")
            }
            other => panic!("expected BadFrame, got {other:?}"),
        }
    }
    // After Hello too: a huge message text inside a Generate.
    let mut conn = raw(&d).await;
    hello(&mut conn).await;
    let mut payload = codec::to_payload(&Request::Generate(GenerateRequest::ask("ZZZZZZZZ"))).unwrap();
    let at = payload.windows(9).position(|w| w == b"\x08ZZZZZZZZ").unwrap();
    payload.splice(at..at + 9, [0xfd, 0, 0, 0, 0, 0, 0, 0, 0x40]);
    conn.send(Bytes::from(payload)).await.unwrap();
    assert!(matches!(recv(&mut conn).await, Some(Response::Error { kind: ErrorKind::BadFrame, .. })));
    assert!(d.child.as_mut().unwrap().try_wait().unwrap().is_none(), "mlxbcd is still running");
    served(&d).await;
}

/// Before Hello, a connection may send at most 4 KiB: ten connections
/// declaring 64 MiB frames cannot make the daemon buffer 640 MiB.
#[tokio::test(flavor = "multi_thread")]
async fn before_hello_a_frame_is_capped_at_4_kib() {
    let d = Daemon::start();
    let mut s = UnixStream::connect(&d.socket).await.unwrap();
    // The length alone is refused: no byte of the body is waited for.
    s.write_all(&(60u32 << 20).to_be_bytes()).await.unwrap();
    let mut conn = Framed::new(s, LengthDelimitedCodec::new());
    match recv(&mut conn).await {
        Some(Response::Error { kind: ErrorKind::BadFrame, message }) => assert!(message.contains("4096"), "{message}"),
        other => panic!("{other:?}"),
    }
    served(&d).await;
}

/// Another user's connection is answered and closed before a byte of it is
/// read, so even with the socket opened to everyone (`chmod 777`) their
/// crash frame never reaches the decoder.
#[tokio::test(flavor = "multi_thread")]
async fn another_users_frames_are_never_read() {
    let mut d = Daemon::start();
    std::fs::set_permissions(d.home.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    std::fs::set_permissions(&d.socket, std::fs::Permissions::from_mode(0o777)).unwrap();
    let script = r#"
import socket, struct, sys
s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])
try: s.sendall(bytes([0,0,0,11,0,2,0xfd,0,0,0,0,0,0,0,0x40]))
except OSError: pass
data = b""
while True:
    try: chunk = s.recv(4096)
    except OSError: break
    if not chunk: break
    data += chunk
sys.stdout.buffer.write(data)
"#;
    use std::os::unix::process::CommandExt;
    let out = std::process::Command::new("python3")
        .args(["-c", script])
        .arg(&d.socket)
        .uid(65534)
        .gid(65534)
        .output()
        .expect("python3 runs as uid 65534 (nobody)");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let len = u32::from_be_bytes(out.stdout[..4].try_into().unwrap()) as usize;
    let r: Response = codec::from_payload(&out.stdout[4..4 + len]).unwrap();
    match r {
        Response::Error { kind: ErrorKind::PermissionDenied, message } => {
            assert!(message.contains("uid 65534"), "{message}")
        }
        other => panic!("{other:?}"),
    }
    assert!(d.child.as_mut().unwrap().try_wait().unwrap().is_none(), "mlxbcd is still running");
    assert!(!d.log_text().contains("bad frame"), "the foreign frame was never decoded");
    served(&d).await;
}

/// 500 idle connections that said Hello, and an ordinary client is served.
#[tokio::test(flavor = "multi_thread")]
async fn five_hundred_idle_connections_and_a_client_is_served() {
    let d = Daemon::start();
    let mut idle = Vec::new();
    for _ in 0..500 {
        let mut c = raw(&d).await;
        hello(&mut c).await;
        idle.push(c);
    }
    served(&d).await;
    let mut c = d.client().await;
    let s = c.status().await.unwrap();
    assert_eq!(s.generations_cancelled, 0);
}

/// With the descriptor limit at 256 (macOS's default) and more idle
/// connections than it allows, the daemon keeps serving, closes the
/// longest-idle ones to make room, and its log stays small.
#[tokio::test(flavor = "multi_thread")]
async fn out_of_descriptors_the_daemon_serves_and_the_log_stays_bounded() {
    let opts = DaemonOptions::default();
    let mut d = Daemon::prepare(&opts);
    std::fs::write(d.home.path().join("config.toml"), "max_connections = 100000\n").unwrap();
    d.spawn_limited(&opts.args, 256);
    let mut idle = Vec::new();
    let mut closed = 0;
    for _ in 0..300 {
        match UnixStream::connect(&d.socket).await {
            Ok(s) => {
                let mut c = Framed::new(s, LengthDelimitedCodec::new());
                send(&mut c, &Request::Hello { protocol: mlxbc_client::PROTOCOL_VERSION, client_version: "t".into() })
                    .await;
                match recv(&mut c).await {
                    Some(Response::Hello { .. }) => idle.push(c),
                    _ => closed += 1,
                }
            }
            Err(_) => closed += 1,
        }
    }
    let t = Instant::now();
    served(&d).await;
    assert!(t.elapsed() < Duration::from_secs(60));
    // The longest-idle connections were closed to make room.
    let mut evicted = 0;
    for c in idle.iter_mut().take(150) {
        if tokio::time::timeout(Duration::from_millis(20), c.next()).await.is_ok_and(|n| n.is_none()) {
            evicted += 1;
        }
    }
    assert!(evicted > 0 || closed > 0, "the cap took effect");
    let s = d.client().await.status().await.unwrap();
    assert_eq!(s.connections_cap, 192, "the cap fitted to 256 descriptors");
    assert!(s.connections_evicted >= 100 && s.connections_open <= 192, "status: {s:?}");
    let log = std::fs::metadata(&d.log).unwrap().len();
    assert!(log < 256 << 10, "log is {log} bytes");
    assert!(d.log_text().contains("max_connections=192"), "cap fitted to 256 descriptors:\n{}", d.log_text());
}

/// An idle connection is closed by the daemon after the timeout; the client
/// library reconnects without its caller noticing.
#[tokio::test(flavor = "multi_thread")]
async fn idle_connections_time_out_and_clients_reconnect_transparently() {
    let d = daemon_with_config("connection_idle_timeout = \"1s\"\n");
    let mut conn = raw(&d).await;
    hello(&mut conn).await;
    let mut client = d.client().await;
    tokio::time::sleep(Duration::from_millis(1600)).await;
    assert!(recv(&mut conn).await.is_none(), "the daemon closed the idle raw connection");
    let s = client.status().await.expect("the client reconnected by itself");
    assert!(s.uptime_s >= 1);
    let (text, _) = client.ask(greedy(None, "What is the capital of France?", 24)).await.unwrap();
    assert!(text.contains("Paris"));
}

/// A client that shuts its writing half after the request still gets the
/// whole answer; one that closes the socket cancels the generation.
#[tokio::test(flavor = "multi_thread")]
async fn a_half_closed_client_gets_its_answer_and_a_closed_one_cancels() {
    let d = Daemon::start();
    let mut conn = raw(&d).await;
    hello(&mut conn).await;
    send(&mut conn, &Request::Generate(greedy(None, "What is the capital of France?", 24))).await;
    conn.get_mut().shutdown().await.unwrap();
    let mut text = String::new();
    loop {
        match recv(&mut conn).await {
            Some(Response::Token { text: t }) => text.push_str(&t),
            Some(Response::Done { .. }) => break,
            Some(Response::Started { .. }) => {}
            other => panic!("{other:?}"),
        }
    }
    assert!(text.contains("Paris"), "{text:?}");

    let mut conn = raw(&d).await;
    hello(&mut conn).await;
    let mut long = greedy(None, "Write a long story about a dragon.", 400);
    long.ignore_eos = true;
    send(&mut conn, &Request::Generate(long)).await;
    assert!(matches!(recv(&mut conn).await, Some(Response::Started { .. })));
    drop(conn);
    let mut client = d.client().await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while client.status().await.unwrap().generations_cancelled == 0 {
        assert!(Instant::now() < deadline, "the closed client's generation was not cancelled");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let out = d.cli().arg("status").output().unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains("1 generations cancelled"), "mlxbc status shows it");
}

/// Something that accepts connections and never answers: the client gives
/// up after its handshake timeout with a message naming the socket.
#[tokio::test(flavor = "multi_thread")]
async fn a_socket_that_never_answers_times_out_with_a_message() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("silent.sock");
    let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
    let t = Instant::now();
    let err = Client::connect(&path).await.err().expect("a timeout");
    assert!(matches!(err, ClientError::HandshakeTimeout { .. }), "{err:?}");
    assert!(
        err.to_string().contains(&path.display().to_string()) && err.to_string().contains("mlxbc service"),
        "{err}"
    );
    assert!(t.elapsed() < Duration::from_secs(15));
    drop(listener);
}

async fn expect_error(d: &Daemon, r: GenerateRequest, kind: ErrorKind, needle: &str) {
    match ask(&d.socket, r).await {
        Err(ClientError::Daemon { kind: k, message }) => {
            assert_eq!(k, kind, "{message}");
            assert!(message.contains(needle), "{message:?} should mention {needle:?}");
        }
        other => panic!("expected {kind:?}, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn bounds_on_sampling_prompts_and_max_tokens() {
    let d = daemon_with_config("max_tokens_limit = 6\n");
    let q = "What is the capital of France?";
    for (t, p, needle) in [
        (f32::NAN, 1.0, "temperature"),
        (-1.0, 1.0, "temperature"),
        (f32::INFINITY, 1.0, "temperature"),
        (0.5, f32::NAN, "top_p"),
        (0.5, 0.0, "top_p"),
    ] {
        let mut r = greedy(None, q, 8);
        r.sampling.temperature = t;
        r.sampling.top_p = p;
        expect_error(&d, r, ErrorKind::BadRequest, needle).await;
    }
    // 60 MB: refused by size before anything is tokenized.
    let t = Instant::now();
    expect_error(&d, greedy(None, &"word ".repeat(12 << 20), 8), ErrorKind::BadRequest, "max_prompt_bytes").await;
    // 1 MB: under the byte cap but more than SmolLM2's 8192-token context can hold.
    expect_error(&d, greedy(None, &"word ".repeat(200_000), 8), ErrorKind::ContextOverflow, "context").await;
    eprintln!("two oversized prompts refused in {:.2} s", t.elapsed().as_secs_f64());
    // max_tokens 0: no tokens at all.
    let (text, stats) = ask(&d.socket, greedy(None, q, 0)).await.unwrap();
    assert_eq!((text.as_str(), stats.generated_tokens), ("", 0));
    // u32::MAX is capped by the ceiling.
    let mut r = greedy(None, "Count from one to one hundred.", u32::MAX);
    r.ignore_eos = true;
    let (_, stats) = ask(&d.socket, r).await.unwrap();
    assert_eq!((stats.generated_tokens, stats.stop_reason), (6, StopReason::MaxTokens));
    served(&d).await;
}

/// Everything the daemon writes is the user's alone.
#[tokio::test(flavor = "multi_thread")]
async fn the_data_dir_and_every_file_written_are_private() {
    let opts = DaemonOptions::default();
    let mut d = Daemon::prepare(&opts);
    // An older install: a world-readable data dir.
    std::fs::set_permissions(d.home.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    d.spawn(&opts.args);
    let mut r = greedy(None, "hi", 4);
    r.session = Some("private".into());
    ask(&d.socket, r).await.unwrap();
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(d.home.path()), 0o700);
    let sessions = d.home.path().join("sessions");
    assert_eq!(mode(&sessions), 0o700);
    assert_eq!(mode(&sessions.join("private.json")), 0o600);
    let features = d.home.path().join("cache/features");
    assert_eq!(mode(&features), 0o700);
    for e in std::fs::read_dir(&features).unwrap().flatten() {
        let m = mode(&e.path());
        assert_eq!(m & 0o077, 0, "{} is {m:o}", e.path().display());
    }
}

fn tail(text: &str, n: usize) -> &str {
    &text[text.len().saturating_sub(n)..]
}

/// The dispatcher under fuzzing: requests of every variant (but Shutdown)
/// with arbitrary field values, from 8 connections at once, through the real
/// daemon. Each gets exactly one well-formed answer (a generation: a stream
/// ending in Done or Error), and ordinary clients are served afterwards.
/// `MLXBC_DISPATCH_FUZZ` sets the count (default 20,000; scripts/fuzz: 200,000).
#[tokio::test(flavor = "multi_thread")]
async fn fuzzed_requests_through_the_real_dispatcher() {
    use mlxbc_shared::fuzz::{arbitrary_request, Rng};
    let total: u64 = std::env::var("MLXBC_DISPATCH_FUZZ").ok().and_then(|s| s.parse().ok()).unwrap_or(20_000);
    let opts = DaemonOptions {
        models: vec![("tiny-qwen3", fixture("mlx/tiny-qwen3")), (SMOLLM2, fixture(&format!("models/{SMOLLM2}")))],
        args: vec![],
    };
    let mut d = Daemon::prepare(&opts);
    std::fs::write(d.home.path().join("config.toml"), "default_model = \"tiny-qwen3\"\nmax_tokens_limit = 4\n")
        .unwrap();
    d.spawn(&opts.args);
    let t = Instant::now();
    let mut tasks = Vec::new();
    for worker in 0..8u64 {
        let socket = d.socket.clone();
        tasks.push(tokio::spawn(async move {
            let mut rng = Rng::new(0xd15 + worker);
            let mut conn = Framed::new(UnixStream::connect(&socket).await.unwrap(), LengthDelimitedCodec::new());
            hello(&mut conn).await;
            let mut answered = std::collections::BTreeMap::<String, u64>::new();
            for _ in 0..total / 8 {
                let mut request = arbitrary_request(&mut rng, false);
                // Half the generations get sane sampling, so they reach the model.
                if let (Request::Generate(g), true) = (&mut request, rng.one_in(2)) {
                    g.sampling = mlxbc_client::SamplingParams { temperature: 0.0, top_p: 1.0, ..g.sampling.clone() };
                }
                let generation = matches!(request, Request::Generate(_));
                let hello_again = matches!(request, Request::Hello { .. });
                send(&mut conn, &request).await;
                let last = loop {
                    let r = recv(&mut conn).await.expect("an answer, not a closed connection");
                    let end = !generation
                        || matches!(r, Response::Done { .. } | Response::Error { .. } | Response::NeedMedia { .. });
                    if end {
                        break r;
                    }
                };
                let name = match &last {
                    Response::Error { kind, .. } => format!("{kind:?}"),
                    other => format!("{other:?}").split([' ', '(', '{']).next().unwrap().to_string(),
                };
                *answered.entry(name).or_default() += 1;
                assert!(!hello_again || matches!(last, Response::Error { kind: ErrorKind::BadRequest, .. }));
            }
            answered
        }));
    }
    let mut seen = std::collections::BTreeMap::<String, u64>::new();
    for task in tasks {
        let answered = task.await;
        if answered.is_err() {
            std::fs::write("/tmp/fuzzlog.txt", d.log_text()).unwrap();
        }
        assert!(answered.is_ok(), "a connection failed; the daemon's log ends:\n{}", tail(&d.log_text(), 3000));
        for (k, v) in answered.unwrap() {
            *seen.entry(k).or_default() += v;
        }
    }
    println!("dispatcher fuzz: {} requests in {:.1} s: {seen:?}", total / 8 * 8, t.elapsed().as_secs_f64());
    assert!(d.child.as_mut().unwrap().try_wait().unwrap().is_none(), "mlxbcd is still running");
    assert!(seen.get("Done").copied().unwrap_or(0) > 0 && seen.get("BadRequest").copied().unwrap_or(0) > 0, "{seen:?}");
    // max_tokens_limit = 4: the start of the usual answer.
    let (text, _) = ask(&d.socket, greedy(Some(SMOLLM2), "What is the capital of France?", 24)).await.unwrap();
    assert!(text.starts_with("The capital of France"), "{text:?}");
}

/// 64 socket clients at once: every one gets the whole greedy answer, the
/// same as a lone client's.
#[tokio::test(flavor = "multi_thread")]
async fn sixty_four_concurrent_socket_clients_all_complete_and_agree() {
    let d = Daemon::start();
    let q = "What is the capital of France?";
    let (want, _) = ask(&d.socket, greedy(None, q, 6)).await.unwrap();
    let tasks: Vec<_> = (0..64).map(|_| tokio::spawn(ask(d.socket.clone(), greedy(None, q, 6)))).collect();
    for t in tasks {
        assert_eq!(t.await.unwrap().unwrap().0, want);
    }
}

/// A long prompt is tokenized off the engine thread, so it does not hold up
/// the requests queued behind it. Prints a short request's time to first
/// token when it arrives just after the long prompt, tokenized by its
/// connection (resident model) and by the engine (a session turn, whose
/// history the engine owns) — docs/reliability.md's figures.
#[tokio::test(flavor = "multi_thread")]
async fn a_long_prompt_is_tokenized_off_the_engine_thread() {
    let d = Daemon::start();
    served(&d).await; // resident, so prompts are tokenized by their connections
                      // ~250 KB: under the byte bound (8192 tokens x 32), over the context once tokenized.
    let long = "lorem ipsum dolor sit amet ".repeat(9_500);
    async fn first_token_behind(d: &Daemon, long: GenerateRequest) -> (Duration, Duration) {
        let socket = d.socket.clone();
        let t = Instant::now();
        let refused = tokio::spawn(async move {
            let r = ask(&socket, long).await;
            assert!(matches!(r, Err(ClientError::Daemon { kind: ErrorKind::ContextOverflow, .. })), "{r:?}");
            t.elapsed()
        });
        tokio::time::sleep(Duration::from_millis(10)).await;
        let mut c = d.client().await;
        let t = Instant::now();
        let mut s = c.generate(greedy(None, "What is the capital of France?", 4)).await.unwrap();
        until_first_token(&mut s).await;
        let ttft = t.elapsed();
        s.collect_text().await.unwrap();
        (refused.await.unwrap(), ttft)
    }
    let (mut off, mut on) = (vec![], vec![]);
    for round in 0..3 {
        // Interleaved rounds; medians.
        off.push(first_token_behind(&d, greedy(None, &long, 8)).await);
        let mut session_turn = greedy(None, &long, 8);
        session_turn.session = Some(format!("long{round}"));
        on.push(first_token_behind(&d, session_turn).await);
    }
    let median = |v: &mut Vec<(Duration, Duration)>, i: usize| {
        let mut xs: Vec<f64> = v.iter().map(|p| if i == 0 { p.0 } else { p.1 }.as_secs_f64() * 1e3).collect();
        xs.sort_by(f64::total_cmp);
        xs[xs.len() / 2]
    };
    eprintln!(
        "long prompt ({} bytes) refused after {:.0} ms (connection) / {:.0} ms (engine); a short request sent 10 ms after it: \
         first token in {:.0} ms (connection tokenized it) vs {:.0} ms (engine thread did); medians of 3",
        long.len(),
        median(&mut off, 0),
        median(&mut on, 0),
        median(&mut off, 1),
        median(&mut on, 1)
    );
}
