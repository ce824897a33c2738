//! The daemon's log cannot fill the disk: every line's call site may log
//! [`BURST`] lines per [`WINDOW`], then its lines are counted and dropped
//! until the next window, which starts with one line saying how many were;
//! the log file is rotated past its size (`log_max_mib`, two old files
//! kept); strings a peer chose are cut to [`PEER_STRING_BYTES`] ([`peer`]).
//!
//! Found before this existed: each HTTP request for an unknown model logged
//! 4.25 KB (its 4,096-byte name and the whole model list), unthrottled;
//! 3,000 of them added 12.8 MB to the log in 2.5 s.

use mlxbc_shared::sync::lock;
use std::borrow::Cow;
use std::collections::HashMap;
use std::io::Write;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tracing::callsite::Identifier;
use tracing::subscriber::Interest;
use tracing::{Event, Metadata};
use tracing_subscriber::layer::{Context, Filter};

/// Lines one call site may log per window.
pub const BURST: u32 = 20;
/// The throttle's window.
pub const WINDOW: Duration = Duration::from_secs(10);
/// The longest peer-chosen string a log line carries.
pub const PEER_STRING_BYTES: usize = 128;

/// `s` as a log line may carry it: at most [`PEER_STRING_BYTES`] bytes (cut
/// at a character boundary), with how long it really was.
pub fn peer(s: &str) -> Cow<'_, str> {
    if s.len() <= PEER_STRING_BYTES {
        return Cow::Borrowed(s);
    }
    let mut end = PEER_STRING_BYTES;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    Cow::Owned(format!("{}… ({} bytes)", &s[..end], s.len()))
}

struct Window {
    started: Instant,
    logged: u32,
    suppressed: u64,
}

/// A per-call-site rate limit on events (spans pass untouched).
#[derive(Default)]
pub struct Throttle {
    sites: Mutex<HashMap<Identifier, Window>>,
}

impl Throttle {
    /// Whether an event of `meta` may be logged now; writes the count of
    /// the ones dropped in the window that just ended, if any.
    fn admit(&self, meta: &Metadata<'_>) -> bool {
        let mut sites = lock(&self.sites);
        let w = sites.entry(meta.callsite()).or_insert_with(|| Window {
            started: Instant::now(),
            logged: 0,
            suppressed: 0,
        });
        if w.started.elapsed() >= WINDOW {
            if w.suppressed > 0 {
                let line = format!(
                    "{} {:>5} {}: {} more lines from {}:{} were dropped in {} s (at most {BURST} per {} s)\n",
                    humantime_now(),
                    meta.level(),
                    meta.target(),
                    w.suppressed,
                    meta.file().unwrap_or("?"),
                    meta.line().unwrap_or(0),
                    w.started.elapsed().as_secs(),
                    WINDOW.as_secs()
                );
                let _ = std::io::stderr().write_all(line.as_bytes());
            }
            *w = Window { started: Instant::now(), logged: 0, suppressed: 0 };
        }
        if w.logged < BURST {
            w.logged += 1;
            true
        } else {
            w.suppressed += 1;
            false
        }
    }
}

/// The time as the fmt layer writes it (RFC 3339, UTC, microseconds).
fn humantime_now() -> String {
    use tracing_subscriber::fmt::time::FormatTime;
    let mut s = String::new();
    let _ = tracing_subscriber::fmt::time::SystemTime
        .format_time(&mut tracing_subscriber::fmt::format::Writer::new(&mut s));
    s
}

impl<S> Filter<S> for Throttle {
    fn enabled(&self, _: &Metadata<'_>, _: &Context<'_, S>) -> bool {
        true
    }

    fn callsite_enabled(&self, meta: &'static Metadata<'static>) -> Interest {
        // Events are decided one by one; spans always pass.
        if meta.is_event() {
            Interest::sometimes()
        } else {
            Interest::always()
        }
    }

    fn event_enabled(&self, event: &Event<'_>, _: &Context<'_, S>) -> bool {
        self.admit(event.metadata())
    }

    /// No level is hidden by the throttle itself. Said, not left unsaid: a
    /// combined filter's hint is the most restrictive of its parts only when
    /// each part gives one; with none it is TRACE, and the `log` crate's
    /// records (sled and tokenizers write `log::trace!` per call) were then
    /// all built and dispatched to be filtered out: 60% of the engine's time
    /// answering 200 embeddings from the store.
    fn max_level_hint(&self) -> Option<tracing::level_filters::LevelFilter> {
        Some(tracing::level_filters::LevelFilter::TRACE)
    }
}

/// The log file the daemon writes through its stderr, rotated by size:
/// past `max_bytes` it becomes `<name>.1` (and `.1` becomes `.2`), and a
/// new file takes descriptor 2, so lines that MLX or a panic write to
/// stderr land in the current file too.
pub struct LogFile {
    path: PathBuf,
    max_bytes: u64,
    written: AtomicU64,
    rotating: Mutex<()>,
}

impl LogFile {
    /// Opens `path` for appending and makes it the process's stderr.
    pub fn open(path: &Path, max_bytes: u64) -> std::io::Result<Arc<Self>> {
        if let Some(dir) = path.parent() {
            let _ = mlxbc_shared::paths::create_private_dir(dir);
        }
        let file = open_append(path)?;
        let written = file.metadata()?.len();
        redirect_stderr(&file)?;
        let log = Arc::new(Self {
            path: path.to_owned(),
            max_bytes,
            written: AtomicU64::new(written),
            rotating: Mutex::new(()),
        });
        log.rotate_if_over();
        Ok(log)
    }

    fn rotate_if_over(&self) {
        if self.written.load(Ordering::Relaxed) < self.max_bytes {
            return;
        }
        let Ok(_held) = self.rotating.try_lock() else { return };
        if self.written.load(Ordering::Relaxed) < self.max_bytes {
            return;
        }
        let old = |n: u32| PathBuf::from(format!("{}.{n}", self.path.display()));
        let _ = std::fs::rename(old(1), old(2));
        let _ = std::fs::rename(&self.path, old(1));
        match open_append(&self.path).and_then(|f| redirect_stderr(&f)) {
            Ok(()) => self.written.store(0, Ordering::Relaxed),
            // Could not open a new file (a full disk): keep writing to the
            // renamed one, and try again after as many bytes again.
            Err(_) => self.written.store(0, Ordering::Relaxed),
        }
    }
}

fn open_append(path: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new().create(true).append(true).mode(0o600).open(path)
}

fn redirect_stderr(file: &std::fs::File) -> std::io::Result<()> {
    // SAFETY: dup2 onto descriptor 2 with a descriptor we own.
    if unsafe { libc::dup2(file.as_raw_fd(), 2) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Writes to stderr (the log file when there is one) and counts the bytes
/// toward rotation.
pub struct LogWriter(Option<Arc<LogFile>>);

impl Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = std::io::stderr().write(buf)?;
        if let Some(log) = &self.0 {
            log.written.fetch_add(n as u64, Ordering::Relaxed);
            log.rotate_if_over();
        }
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

/// What the fmt layer writes through: stderr, rotated when it is our file.
#[derive(Clone)]
pub struct MakeLogWriter(pub Option<Arc<LogFile>>);

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for MakeLogWriter {
    type Writer = LogWriter;
    fn make_writer(&'a self) -> LogWriter {
        LogWriter(self.0.clone())
    }
}

/// Sets up the daemon's logging: `MLXBC_LOG` (default `info`) filters,
/// the [`Throttle`] bounds each call site, and with `log_file` the log is
/// that file, rotated past `max_bytes`.
pub fn init(log_file: Option<&Path>, max_bytes: u64) -> std::io::Result<()> {
    use tracing_subscriber::prelude::*;
    let file = log_file.map(|p| LogFile::open(p, max_bytes)).transpose()?;
    let ansi = file.is_none() && std::io::IsTerminal::is_terminal(&std::io::stderr());
    let directives = std::env::var("MLXBC_LOG").unwrap_or_else(|_| "info".into());
    // The level filter first: the throttle counts only lines that would be written.
    let layer = tracing_subscriber::fmt::layer()
        .with_writer(MakeLogWriter(file))
        .with_ansi(ansi)
        .with_filter(daemon_filter(&directives));
    tracing_subscriber::registry().with(layer).init();
    Ok(())
}

/// The daemon's filter: `MLXBC_LOG`'s level filter (default `info`), then the throttle.
fn daemon_filter<S>(directives: &str) -> impl Filter<S> {
    // Directives that do not parse leave the default, as before.
    let level = tracing_subscriber::EnvFilter::try_new(directives)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::filter::FilterExt::and(level, Throttle::default())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The combined filter tells its level, so the `log` crate's records
    /// below it are never built (see [`Throttle`]'s `max_level_hint`).
    #[test]
    fn the_daemon_filter_tells_its_level() {
        use tracing::level_filters::LevelFilter;
        type R = tracing_subscriber::Registry;
        assert_eq!(Filter::<R>::max_level_hint(&daemon_filter::<R>("info")), Some(LevelFilter::INFO));
        assert_eq!(
            Filter::<R>::max_level_hint(&daemon_filter::<R>("warn,mlxbc_daemon=debug")),
            Some(LevelFilter::DEBUG)
        );
    }

    #[test]
    fn peer_strings_are_cut_at_a_character_boundary() {
        assert_eq!(peer("short"), "short");
        let long = "é".repeat(100);
        let cut = peer(&long);
        assert!(cut.len() < PEER_STRING_BYTES + 20, "{cut}");
        assert!(cut.ends_with("(200 bytes)"), "{cut}");
    }

    #[test]
    fn the_log_rotates_past_its_size_keeping_two_old_files_and_stderr_follows() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.log");
        // SAFETY: dup of stderr, restored below.
        let saved = unsafe { libc::dup(2) };
        let log = LogFile::open(&path, 100).unwrap();
        let mut w = MakeLogWriter(Some(log));
        for round in 0..4 {
            use tracing_subscriber::fmt::MakeWriter;
            w.make_writer().write_all(format!("round {round} {}\n", "x".repeat(120)).as_bytes()).unwrap();
        }
        // What is written to descriptor 2 now lands in the current file.
        std::io::stderr().write_all(b"after\n").unwrap();
        unsafe { libc::dup2(saved, 2) };
        w.0 = None;
        let read = |name: &str| std::fs::read_to_string(dir.path().join(name)).unwrap_or_default();
        assert_eq!(read("d.log"), "after\n");
        assert!(read("d.log.1").starts_with("round 3"), "{}", read("d.log.1"));
        assert!(read("d.log.2").starts_with("round 2"));
        assert!(!dir.path().join("d.log.3").exists());
    }
}
