//! What keeps many (or hostile) connections from starving the daemon: a cap
//! on open connections below the descriptor limit, the longest-idle one
//! closed to make room, idle connections timed out, and accept errors
//! backed off with their logging rate-limited.
//!
//! Found before this existed: with `ulimit -n 256` and 244 idle connections,
//! `accept` failed with EMFILE in a tight loop, one core at 100% and the log
//! growing 7.8 GB in 40 s, while `mlxbc ask` timed out.

use mlxbc_shared::sync::lock;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::Notify;

/// Descriptors kept free for model files, the feature store and logs,
/// whatever the connections take.
const RESERVED_FDS: u64 = 64;

/// Raises the soft descriptor limit to the hard one (as most servers do:
/// macOS's default soft limit is 256) and returns the soft limit now in force.
pub fn raise_fd_limit() -> u64 {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit with a valid pointer.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return 1024;
        }
        // macOS refuses more than OPEN_MAX for the soft limit.
        let target = if cfg!(target_os = "macos") { lim.rlim_max.min(10240) } else { lim.rlim_max };
        if target > lim.rlim_cur {
            let raised = libc::rlimit { rlim_cur: target, rlim_max: lim.rlim_max };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                lim.rlim_cur = target;
            }
        }
    }
    lim.rlim_cur
}

/// The connection cap in force: the configured one, lowered to fit the
/// descriptor limit with [`RESERVED_FDS`] to spare.
pub fn connection_cap(configured: usize, fd_limit: u64) -> usize {
    let fits = fd_limit.saturating_sub(RESERVED_FDS).max(8);
    configured.min(fits as usize).max(1)
}

/// The caps of the socket and of the HTTP gateway (0 when it is off): the
/// gateway's is at most half of the descriptors left after
/// [`RESERVED_FDS`], and the socket's fits in the rest, so however many
/// TCP connections a neighbour opens, the owner's socket clients always
/// find descriptors.
pub fn connection_caps(socket: usize, http: Option<usize>, fd_limit: u64) -> (usize, usize) {
    let Some(http) = http else { return (connection_cap(socket, fd_limit), 0) };
    let budget = fd_limit.saturating_sub(RESERVED_FDS).max(16) as usize;
    let http = http.min(budget / 2).max(1);
    (socket.min(budget - http).max(1), http)
}

struct Entry {
    /// Since when it has had no request in flight (None: busy).
    idle_since: Option<Instant>,
    /// Notified to make the connection close itself.
    close: Arc<Notify>,
}

/// The open connections, for the cap and for closing idle ones.
pub struct ConnectionTable {
    cap: usize,
    next_id: AtomicU64,
    open: Mutex<HashMap<u64, Entry>>,
    /// Connections closed to make room for new ones.
    evicted: AtomicU64,
    /// Connections refused because every slot was busy.
    refused: AtomicU64,
}

/// A connection's place in the table; leaves it on drop.
pub struct Slot {
    table: Arc<ConnectionTable>,
    id: u64,
    /// Notified when the daemon wants this connection closed.
    pub close: Arc<Notify>,
    /// Requests in flight on it (HTTP counts them; the socket has one at most).
    in_flight: AtomicUsize,
}

/// A request in flight on a [`Slot`]; the slot idles when the last one drops.
pub struct InFlight(Arc<Slot>);

impl Drop for InFlight {
    fn drop(&mut self) {
        if self.0.in_flight.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.idle();
        }
    }
}

impl ConnectionTable {
    pub fn new(cap: usize) -> Arc<Self> {
        Arc::new(Self {
            cap,
            next_id: AtomicU64::new(0),
            open: Mutex::new(HashMap::new()),
            evicted: AtomicU64::new(0),
            refused: AtomicU64::new(0),
        })
    }

    /// The cap in force.
    pub fn cap(&self) -> usize {
        self.cap
    }

    /// Connections open now.
    pub fn len(&self) -> usize {
        lock(&self.open).len()
    }

    /// True when no connection is open.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Takes a slot for a new connection. When the table is full,
    /// the longest-idle connection is told to close and the new one takes its
    /// place; when every connection is busy, `None`.
    pub fn admit(self: &Arc<Self>) -> Option<Slot> {
        let mut open = lock(&self.open);
        if open.len() >= self.cap && !Self::evict_one(&mut open) {
            self.refused.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let close = Arc::new(Notify::new());
        open.insert(id, Entry { idle_since: Some(Instant::now()), close: close.clone() });
        Some(Slot { table: self.clone(), id, close, in_flight: AtomicUsize::new(0) })
    }

    /// Closes the longest-idle connection (to free a descriptor after EMFILE).
    pub fn evict_idle(&self) -> bool {
        Self::evict_one(&mut lock(&self.open))
    }

    fn evict_one(open: &mut HashMap<u64, Entry>) -> bool {
        let oldest = open.iter().filter_map(|(id, e)| e.idle_since.map(|t| (t, *id))).min();
        match oldest {
            Some((_, id)) => {
                let e = open.remove(&id).expect("just found");
                tracing::debug!("closing the longest-idle connection to make room");
                e.close.notify_one();
                true
            }
            None => false,
        }
    }

    /// Idle connections closed to make room so far.
    pub fn evicted_count(&self) -> u64 {
        self.evicted.load(Ordering::Relaxed)
    }

    /// Connections refused (every slot busy) so far.
    pub fn refused_count(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }
}

impl Slot {
    /// A request is in flight (the connection may not be closed for room).
    pub fn busy(&self) {
        if let Some(e) = lock(&self.table.open).get_mut(&self.id) {
            e.idle_since = None;
        }
    }

    /// The request is answered; the connection idles.
    pub fn idle(&self) {
        if let Some(e) = lock(&self.table.open).get_mut(&self.id) {
            e.idle_since = Some(Instant::now());
        }
    }

    /// Counts a request in flight until the guard drops (the connection is
    /// busy while any is).
    pub fn begin_request(self: &Arc<Self>) -> InFlight {
        if self.in_flight.fetch_add(1, Ordering::AcqRel) == 0 {
            self.busy();
        }
        InFlight(self.clone())
    }

    /// How long it has had no request in flight (None: busy, or already
    /// closed for room).
    pub fn idle_for(&self) -> Option<Duration> {
        lock(&self.table.open).get(&self.id).and_then(|e| e.idle_since).map(|t| t.elapsed())
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if lock(&self.table.open).remove(&self.id).is_none() {
            // It was evicted, and already left the table then.
            self.table.evicted.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Logs a recurring warning at most once per interval, with how many were
/// suppressed in between, so a hostile or broken peer cannot fill the disk.
pub struct RateLimitedLog {
    interval: Duration,
    state: Mutex<(Option<Instant>, u64)>,
}

impl RateLimitedLog {
    pub const fn new(interval: Duration) -> Self {
        Self { interval, state: Mutex::new((None, 0)) }
    }

    /// Calls `log(suppressed)` if the interval has passed since the last call that logged.
    pub fn log(&self, log: impl FnOnce(u64)) {
        let mut s = lock(&self.state);
        let due = s.0.is_none_or(|t| t.elapsed() >= self.interval);
        if due {
            let suppressed = s.1;
            *s = (Some(Instant::now()), 0);
            drop(s);
            log(suppressed);
        } else {
            s.1 += 1;
        }
    }
}

/// Exponential backoff for a failing `accept`: 5 ms doubling to 1 s, reset
/// by a success.
pub struct AcceptBackoff(Duration);

impl Default for AcceptBackoff {
    fn default() -> Self {
        Self(Duration::ZERO)
    }
}

impl AcceptBackoff {
    pub fn succeeded(&mut self) {
        self.0 = Duration::ZERO;
    }
    /// How long to wait after this failure.
    pub fn failed(&mut self) -> Duration {
        self.0 = (self.0 * 2).clamp(Duration::from_millis(5), Duration::from_secs(1));
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_table_evicts_the_longest_idle_and_refuses_when_all_are_busy() {
        let t = ConnectionTable::new(2);
        let a = t.admit().unwrap();
        std::thread::sleep(Duration::from_millis(2));
        let b = t.admit().unwrap();
        b.busy();
        let c = t.admit().expect("room made by closing `a`, the idle one");
        assert_eq!(t.len(), 2);
        drop(a);
        assert_eq!(t.evicted_count(), 1);
        c.busy();
        assert!(t.admit().is_none(), "everyone busy: refused");
        c.idle();
        assert!(t.admit().is_some());
    }

    #[test]
    fn the_gateway_never_takes_the_sockets_descriptors() {
        assert_eq!(connection_caps(512, None, 1 << 20), (512, 0));
        assert_eq!(connection_caps(512, Some(256), 1 << 20), (512, 256));
        // 1024 descriptors: 960 for connections, at most half to HTTP.
        assert_eq!(connection_caps(2048, Some(4096), 1024), (480, 480));
        assert_eq!(connection_caps(512, Some(256), 256), (96, 96));
    }

    #[test]
    fn a_slot_is_busy_while_any_request_is_in_flight() {
        let t = ConnectionTable::new(4);
        let slot = Arc::new(t.admit().unwrap());
        assert!(slot.idle_for().is_some());
        let a = slot.begin_request();
        let b = slot.begin_request();
        assert!(slot.idle_for().is_none());
        drop(a);
        assert!(slot.idle_for().is_none(), "one still in flight");
        drop(b);
        assert!(slot.idle_for().is_some());
    }

    #[test]
    fn the_cap_leaves_descriptors_free() {
        assert_eq!(connection_cap(512, 256), 192);
        assert_eq!(connection_cap(512, 1 << 20), 512);
        assert_eq!(connection_cap(512, 10), 8);
    }

    #[test]
    fn rate_limited_log_suppresses_and_counts() {
        let log = RateLimitedLog::new(Duration::from_secs(3600));
        let mut lines = vec![];
        for _ in 0..1000 {
            log.log(|s| lines.push(s));
        }
        assert_eq!(lines, vec![0]);
    }

    #[test]
    fn backoff_doubles_to_a_second_and_resets() {
        let mut b = AcceptBackoff::default();
        let waits: Vec<_> = (0..10).map(|_| b.failed().as_millis()).collect();
        assert_eq!(waits, [5, 10, 20, 40, 80, 160, 320, 640, 1000, 1000]);
        b.succeeded();
        assert_eq!(b.failed().as_millis(), 5);
    }
}
