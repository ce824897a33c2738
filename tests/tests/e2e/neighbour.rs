//! Issue "A neighbour, a photo folder and a full disk cannot hurt it": the
//! gateway under a flood of idle and slow TCP connections from another
//! local user, a log that peers cannot fill, a prompt cache that leaves the
//! disk room, a photo folder prefetched, and the rough edges a new user hit.

use crate::helper::*;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Raises this test process's descriptor limit to `n` (the flood needs
/// thousands of sockets of its own).
fn raise_own_fd_limit(n: u64) {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: get/setrlimit with a valid pointer.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
        let want = libc::rlimit { rlim_cur: n.min(lim.rlim_max), rlim_max: lim.rlim_max };
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &want), 0);
    }
    assert!(lim.rlim_max >= n, "this test needs {n} descriptors; the hard limit is {}", lim.rlim_max);
}

/// True once the peer has closed `s` (a read returns 0 or an error), within `wait`.
fn closed_within(s: &TcpStream, wait: Duration) -> bool {
    s.set_read_timeout(Some(wait.max(Duration::from_millis(1)))).unwrap();
    let mut s = s;
    let mut buf = [0u8; 512];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue, // a 408/413 answer, then the close
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                return false
            }
            Err(_) => return true,
        }
    }
}

/// 2,000 idle TCP connections and 200 slow ones (100 trickling their
/// headers, 100 their bodies) against a daemon whose descriptor limit is
/// 1,024: the owner's `mlxbc ask` and an HTTP request both answer within
/// 2 s, the idle and slow ones are all closed within their timeouts, a
/// `Content-Length` lie is refused at once, and `mlxbc status` counts the
/// HTTP connections.
#[test]
fn a_flood_of_idle_and_slow_connections_cannot_lock_the_owner_out() {
    raise_own_fd_limit(8192);
    let port = free_port();
    let opts = DaemonOptions { args: vec!["--http".into(), format!("127.0.0.1:{port}")], ..Default::default() };
    let mut d = Daemon::prepare(&opts);
    std::fs::write(d.home.path().join("config.toml"), "max_http_connections = 100000\nhttp_idle_timeout = \"4s\"\n")
        .unwrap();
    d.spawn_limited(&opts.args, 1024);
    let addr = format!("127.0.0.1:{port}");
    let host = format!("Host: {addr}\r\n");
    // Warm: the model is loaded before the flood, so 2 s measures serving.
    let warm = d.cli().args(["ask", "-n", "1", "Hi"]).output().unwrap();
    assert!(warm.status.success(), "{}", String::from_utf8_lossy(&warm.stderr));
    // What an ask costs on this machine now, unflooded (the slowest of
    // three: CI runs two tests at once on two cores).
    let warm_s = (0..3)
        .map(|_| {
            let t = Instant::now();
            assert!(d.cli().args(["ask", "-n", "1", "Hi"]).output().unwrap().status.success());
            t.elapsed()
        })
        .max()
        .unwrap();

    let mut idle = Vec::new();
    for _ in 0..2000 {
        idle.push(TcpStream::connect(&addr).expect("the listener accepts (its backlog, then the loop)"));
    }
    let mut slow_headers = Vec::new();
    let mut slow_bodies = Vec::new();
    for i in 0..200 {
        let mut s = TcpStream::connect(&addr).unwrap();
        if i % 2 == 0 {
            s.write_all(format!("POST /v1/chat/completions HTTP/1.1\r\n{host}").as_bytes()).unwrap();
            slow_headers.push(s);
        } else {
            s.write_all(
                format!("POST /v1/chat/completions HTTP/1.1\r\n{host}Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{{")
                    .as_bytes(),
            )
            .unwrap();
            slow_bodies.push(s);
        }
    }
    let slow_opened = Instant::now();
    // The trickle: a byte each to every slow connection, every second.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let trickle = {
        let stop = stop.clone();
        let mut all: Vec<TcpStream> = slow_headers.iter().chain(&slow_bodies).map(|s| s.try_clone().unwrap()).collect();
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                for s in &mut all {
                    let _ = s.write_all(b"x");
                }
                std::thread::sleep(Duration::from_secs(1));
            }
        })
    };

    // The owner, meanwhile: the socket and the gateway both answer in 2 s.
    let t = Instant::now();
    let out = d.cli().args(["ask", "-n", "1", "Hi"]).output().unwrap();
    let ask_s = t.elapsed();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    eprintln!("mlxbc ask: {warm_s:?} before the flood, {ask_s:?} during it");
    // Within 2 s; on a machine so loaded that an unflooded ask takes over
    // half a second, within four times that.
    let bound = Duration::from_secs(2).max(warm_s * 4);
    assert!(ask_s < bound, "mlxbc ask took {ask_s:?} during the flood (before it: {warm_s:?})");
    let t = Instant::now();
    let mut s = TcpStream::connect(&addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    s.write_all(format!("GET /api/version HTTP/1.1\r\n{host}Connection: close\r\n\r\n").as_bytes()).unwrap();
    let mut answer = String::new();
    let _ = s.read_to_string(&mut answer);
    assert!(answer.starts_with("HTTP/1.1 200"), "GET /api/version during the flood: {answer:?}");
    eprintln!("GET /api/version during the flood: {:?}", t.elapsed());
    assert!(t.elapsed() < bound, "HTTP took {:?}", t.elapsed());

    // A declared body over the cap: refused before a byte of it is read.
    let t = Instant::now();
    let mut lie = TcpStream::connect(&addr).unwrap();
    lie.write_all(
        format!("POST /v1/chat/completions HTTP/1.1\r\n{host}Content-Type: application/json\r\nContent-Length: 99999999999999\r\n\r\n")
            .as_bytes(),
    )
    .unwrap();
    lie.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let mut head = [0u8; 64];
    let n = lie.read(&mut head).unwrap_or(0);
    assert!(
        String::from_utf8_lossy(&head[..n]).starts_with("HTTP/1.1 413"),
        "{:?}",
        String::from_utf8_lossy(&head[..n])
    );
    assert!(t.elapsed() < Duration::from_secs(1), "the lie took {:?}", t.elapsed());

    let status = d.cli().arg("status").output().unwrap();
    let status = String::from_utf8_lossy(&status.stdout).to_string();
    assert!(status.contains("HTTP connections open"), "{status}");

    // Idle and slow-header connections close at the idle timeout (4 s);
    // slow bodies at their deadline (10 s grace at 64 KiB/s).
    let deadline = Instant::now() + Duration::from_secs(8);
    let still_open_idle =
        idle.iter().filter(|s| !closed_within(s, deadline.saturating_duration_since(Instant::now()))).count();
    assert_eq!(still_open_idle, 0, "idle connections left open past the timeout");
    let deadline = slow_opened + Duration::from_secs(4 + 4);
    let still_slow_headers =
        slow_headers.iter().filter(|s| !closed_within(s, deadline.saturating_duration_since(Instant::now()))).count();
    assert_eq!(still_slow_headers, 0, "slow-header connections left open past the timeout");
    let deadline = slow_opened + Duration::from_secs(10 + 6);
    let still_slow_bodies =
        slow_bodies.iter().filter(|s| !closed_within(s, deadline.saturating_duration_since(Instant::now()))).count();
    assert_eq!(still_slow_bodies, 0, "slow-body connections left open past their deadline");
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    trickle.join().unwrap();
    let log = d.log_text();
    assert!(!log.contains("Too many open files"), "the daemon ran out of descriptors:\n{}", tail(&log));
    assert!(std::fs::metadata(&d.log).unwrap().len() < 100 << 10, "the log stayed small:\n{}", tail(&log));
    d.terminate();
}

fn tail(text: &str) -> &str {
    &text[text.len().saturating_sub(4000)..]
}

/// 3,000 requests for an unknown model with a 4,096-byte name, and 500 bad
/// socket frames, add less than 100 KB to the log.
#[tokio::test(flavor = "multi_thread")]
async fn unknown_models_and_bad_frames_cannot_flood_the_log() {
    let port = free_port();
    let d = Daemon::start_with(DaemonOptions {
        args: vec!["--http".into(), format!("127.0.0.1:{port}")],
        ..Default::default()
    });
    let before = std::fs::metadata(&d.log).unwrap().len();
    let http = reqwest::Client::new();
    let url = format!("http://127.0.0.1:{port}/v1/chat/completions");
    let name = "x".repeat(4096);
    let body = serde_json::json!({"model": name, "messages": [{"role": "user", "content": "hi"}]});
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let (http, url, body) = (http.clone(), url.clone(), body.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..3000 / 16 + 1 {
                let r = http.post(&url).json(&body).send().await.unwrap();
                assert_eq!(r.status(), 404);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    for _ in 0..500 {
        use tokio::io::AsyncWriteExt;
        let mut s = tokio::net::UnixStream::connect(&d.socket).await.unwrap();
        let _ = s.write_all(&[0, 0, 0, 11, 0x00, 0x02, 0xfd, 0, 0, 0, 0, 0, 0, 0, 0x40]).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let grown = std::fs::metadata(&d.log).unwrap().len() - before;
    assert!(grown < 100 << 10, "the log grew {grown} bytes:\n{}", tail(&d.log_text()));
    // Still served, and the throttle says what it dropped.
    let (text, _) = ask(&d.socket, greedy(None, "What is the capital of France?", 8)).await.unwrap();
    assert!(text.contains("Paris"), "{text}");
    let log = d.log_text();
    assert!(!log.contains(&"x".repeat(200)), "a peer's 4 KB name was logged whole");
}

/// The prompt cache on a small filesystem (a 64 MiB tmpfs holding the
/// sessions too) never takes it below its reserve (25% here); session
/// turns keep saving; and when something else fills the disk, a turn
/// takes its room back from the cache.
#[test]
fn a_prompt_cache_on_a_small_disk_leaves_the_reserve_and_sessions_save() {
    let d = Daemon::prepare(&DaemonOptions::default());
    let small = d.home.path().join("small");
    let _m = Mount::tmpfs(&small, "size=64m,mode=0700");
    std::fs::create_dir_all(small.join("sessions")).unwrap();
    std::os::unix::fs::symlink(small.join("sessions"), d.home.path().join("sessions")).unwrap();
    std::fs::write(
        d.home.path().join("config.toml"),
        format!(
            "prompt_cache_dir = \"{}\"\ndisk_reserve_percent = 25\ndisk_reserve_mib = 0\n",
            small.join("prompts").display()
        ),
    )
    .unwrap();
    let mut d = d;
    d.spawn(&[]);
    let space = || mlxbc_cache::disk_space(&small).unwrap();
    let reserve = space().total / 4;
    let mut lowest = u64::MAX;
    for turn in 0..6 {
        // ~700 new tokens a turn, ten KV blocks of SmolLM2 (~3 MB each):
        // the 48 MiB above the reserve fill by the fourth turn.
        let text: String = (0..140).map(|i| format!("w{turn}x{i} ")).collect();
        let session = format!("small{turn}");
        let out =
            d.cli().args(["ask", "-n", "2", "--session", &session, &format!("Remember: {text}")]).output().unwrap();
        assert!(out.status.success(), "turn {turn}: {}", String::from_utf8_lossy(&out.stderr));
        std::thread::sleep(Duration::from_millis(300)); // the block writer
        lowest = lowest.min(space().available);
        assert!(space().available >= reserve, "turn {turn}: {} free of a {} reserve", space().available, reserve);
    }
    let stats = String::from_utf8_lossy(&d.cli().args(["cache", "stats"]).output().unwrap().stdout).to_string();
    assert!(stats.contains("reserve"), "cache stats say the reserve held writes back: {stats}");
    assert!(lowest < reserve + (16 << 20), "the cache did fill up to near the reserve (lowest free {lowest})");
    // Something else fills the disk: the next turn still saves, from the cache's room.
    let mut f = std::fs::File::create(small.join("filler")).unwrap();
    for size in [1 << 16, 4096, 1] {
        while f.write_all(&vec![0u8; size]).is_ok() {}
    }
    drop(f);
    let out = d.cli().args(["ask", "-n", "2", "--session", "small5", "And one more?"]).output().unwrap();
    assert!(out.status.success(), "a full disk: {}", String::from_utf8_lossy(&out.stderr));
    let shown =
        String::from_utf8_lossy(&d.cli().args(["sessions", "show", "small5"]).output().unwrap().stdout).to_string();
    assert!(shown.contains("And one more?") && shown.contains("w5x1 "), "every turn saved: {}", tail(&shown));
    // The cache gave blocks back until the reserve was free again, rather
    // than keep the disk full.
    std::thread::sleep(Duration::from_millis(500));
    assert!(space().available >= reserve, "{} free of a {} reserve after the disk filled", space().available, reserve);
    let stats = String::from_utf8_lossy(&d.cli().args(["cache", "stats"]).output().unwrap().stdout).to_string();
    assert!(stats.contains("disk room:"), "{stats}");
    assert!(small.join("filler").exists(), "the user's file is untouched");
}

const VLM: &str = "tiny-gemma3-vlm";

fn vlm_daemon() -> Daemon {
    Daemon::start_with(DaemonOptions {
        models: vec![(VLM, fixture("mlx/tiny-gemma3-vlm")), (SMOLLM2, fixture(&format!("models/{SMOLLM2}")))],
        args: vec![],
    })
}

/// A photo folder: 500 small images in one command (twice the daemon's
/// per-request limit), and twelve 17 MB ones (three times a frame), with
/// progress per batch; a broken file among them is named and the rest kept.
#[test]
fn prefetch_takes_a_photo_folder() {
    let d = vlm_daemon();
    let dir = tempfile::tempdir().unwrap();
    let mut files = Vec::new();
    for i in 0..500u32 {
        let p = dir.path().join(format!("small-{i}.png"));
        // Distinct bytes for every file (the pattern repeats every 256 seeds).
        std::fs::write(&p, crate::vision::png(16 + i / 256, 16, i % 256 + 1)).unwrap();
        files.push(p);
    }
    let out = d.cli().arg("prefetch").args(["-m", VLM]).args(&files).env("MLXBC_PROGRESS", "1").output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "500 encoded, 0 already stored");
    assert!(stderr.contains("[32/500]") && stderr.contains("[500/500]"), "progress per batch: {stderr}");

    let big = tempfile::tempdir().unwrap();
    let mut photos = Vec::new();
    for i in 0..12u32 {
        // Noise does not compress: 2400x2400 RGB is a ~17 MB PNG.
        let mut x = 0x9e37_79b9u32.wrapping_mul(i + 1);
        let img = image::RgbImage::from_fn(2400, 2400, |_, _| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            image::Rgb([x as u8, (x >> 8) as u8, (x >> 16) as u8])
        });
        let p = big.path().join(format!("photo-{i}.png"));
        img.save(&p).unwrap();
        assert!(std::fs::metadata(&p).unwrap().len() > 16 << 20);
        photos.push(p);
    }
    let broken = big.path().join("broken.png");
    std::fs::write(&broken, b"\x89PNG\r\n\x1a\n not really").unwrap();
    photos.insert(5, broken);
    let out = d.cli().arg("prefetch").args(["-m", VLM]).args(&photos).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(4), "one file refused: exit 4\n{stderr}");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "12 encoded, 0 already stored, 1 failed");
    assert!(stderr.contains("broken.png") && !stderr.contains("frame"), "the bad file named, no wire jargon: {stderr}");
    let again = d.cli().arg("prefetch").args(["-m", VLM]).args(&photos[6..]).output().unwrap();
    assert_eq!(String::from_utf8_lossy(&again.stdout).trim(), "0 encoded, 7 already stored");
}

/// The rough edges: `chat` exits 5 when a turn is not saved and keeps its
/// commands to itself; tiny temperatures are greedy; a flood of tiny
/// messages is refused before tokenizing; status before any load shows
/// the real limits; `ask -v` on one token; `ps` says forever; `sessions
/// show` of nothing says so; a daemon killed mid-answer points at its log.
#[test]
fn the_rough_edges_a_new_user_hit() {
    let mut d = Daemon::start();
    // Status before the first load: the limits in force, not zeros.
    let status = String::from_utf8_lossy(&d.cli().arg("status").output().unwrap().stdout).to_string();
    assert!(!status.contains("max_batch 0") && !status.contains("0.0 MiB budget"), "{status}");
    let s = tokio_block(async { d.client().await.status().await.unwrap() });
    assert!(s.memory_budget_bytes > 0 && s.max_batch > 0 && s.max_queue > 0, "{s:?}");

    // chat: /help and unknown commands are not sent; a turn not saved: exit 5.
    let sessions = d.home.path().join("sessions");
    let _m = Mount::tmpfs(&sessions, "size=64k,mode=0700");
    let chat = |input: &str| {
        let mut c = d
            .cli()
            .args(["chat", "--session", "edge"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        c.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
        c.wait_with_output().unwrap()
    };
    let out = chat("/help\n/bogus\n");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stderr.contains("/image PATH") && stderr.contains("unknown command /bogus"),
        "{stderr}"
    );
    assert!(out.stdout.is_empty(), "nothing was sent to the model: {:?}", String::from_utf8_lossy(&out.stdout));
    let shown = d.cli().args(["sessions", "show", "edge"]).output().unwrap();
    assert_eq!(shown.status.code(), Some(1), "no turn was taken");
    assert!(String::from_utf8_lossy(&shown.stderr).contains("no session edge"));
    let out = chat("What is the capital of France?\n");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // A full disk: the turn is answered, not saved, and chat exits 5.
    let mut f = std::fs::File::create(sessions.join("filler")).unwrap();
    while f.write_all(&[0u8; 4096]).is_ok() {}
    drop(f);
    let out = chat("And of Italy?\n");
    assert_eq!(out.status.code(), Some(5), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not saved"));
    assert!(!out.stdout.is_empty(), "the answer was printed");
    std::fs::remove_file(sessions.join("filler")).unwrap();

    // Temperatures below 1e-4 are greedy.
    let ask_t = |t: &str| {
        let o = d.cli().args(["ask", "-n", "12", "-t", t, "What is the capital of France?"]).output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout).to_string()
    };
    let greedy_text = ask_t("0");
    assert_eq!(ask_t("1e-45"), greedy_text);
    assert_eq!(ask_t("0.00001"), greedy_text);

    // 100,000 one-letter messages: refused before anything is tokenized.
    let mut r = greedy(None, "x", 1);
    r.messages = vec![r.messages[0].clone(); 100_000];
    let t = Instant::now();
    let err = tokio_block(async { ask(&d.socket, r).await.unwrap_err() });
    assert!(err.to_string().contains("max_prompt_messages"), "{err}");
    assert!(t.elapsed() < Duration::from_secs(2), "refused in {:?}", t.elapsed());

    // ask -v on one token: no decode step, said so, not "0.0 tok/s".
    let o = d.cli().args(["ask", "-v", "-n", "1", "Hi"]).output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(stderr.contains("no decode step") && !stderr.contains("decode 0.0"), "{stderr}");

    // ps: a keep-alive of forever reads "forever".
    let load = d.cli().args(["load", SMOLLM2, "--keep-alive", "forever"]).output().unwrap();
    assert!(load.status.success(), "{}", String::from_utf8_lossy(&load.stderr));
    let ps = String::from_utf8_lossy(&d.cli().arg("ps").output().unwrap().stdout).to_string();
    assert!(ps.contains("forever") && !ps.contains("9223372036854775807"), "{ps}");

    // A daemon killed mid-answer: exit 3 and where its log is.
    let mut long = d
        .cli()
        .args(["ask", "-n", "2000", "--ignore-eos", "Count to a thousand."])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = [0u8; 1];
    long.stdout.as_mut().unwrap().read_exact(&mut first).unwrap();
    let pid = d.child.as_ref().unwrap().id();
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    let out = long.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(stderr.contains("stopped or crashed") && stderr.contains("mlxbcd.log"), "{stderr}");
    let _ = d.wait_exit(Duration::from_secs(5));
}

fn tokio_block<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(f)
}
