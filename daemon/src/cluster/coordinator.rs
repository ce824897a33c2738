//! Rank 0's side of the group: forming it (and forming it again after a
//! rank was lost), sending each call's plan, bounding every collective
//! with a watchdog, and saying which rank stopped answering.

use super::plan::{self, Op, Reply};
use crate::distributed::{cut_ring_sockets, Group, Hostfile, Link};
use crate::error::RankStoppedError;
use anyhow::{anyhow, bail, Result};
use mlxbc_shared::sync::lock;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// How long a rank may take to load its shard (the other calls get the
/// step timeout).
const LOAD_TIMEOUT: Duration = Duration::from_secs(600);
/// How often an idle group is asked for its ranks' memory.
const REPORT_EVERY: Duration = Duration::from_secs(10);
/// Pause between attempts to form the group.
const RETRY: Duration = Duration::from_secs(2);

/// Where the group stands.
#[derive(Debug, Clone, PartialEq)]
pub enum Phase {
    /// Waiting for every rank to join (MLX's init), then the handshake.
    Forming {
        attempts: u32,
        last_error: Option<String>,
    },
    Ready,
    /// A rank runs another daemon version: not retried until
    /// `mlxbc cluster restart`.
    Refused(String),
}

/// One rank as the last handshake or report saw it.
#[derive(Debug, Clone, PartialEq)]
pub struct RankLine {
    pub rank: usize,
    pub host: String,
    pub rss_bytes: u64,
    /// Mean milliseconds of a forward pass on the rank, once it ran one.
    pub step_ms: Option<f64>,
}

/// Rank 0's handle on the group (cheap to clone; shared by the engine
/// thread, the forming thread and the watchdog).
#[derive(Clone)]
pub struct Coordinator(Arc<Inner>);

struct Inner {
    hostfile: Hostfile,
    backend: String,
    timeout: Duration,
    link: Link,
    generation: AtomicU64,
    phase: Mutex<Phase>,
    wake: Condvar,
    /// The deadline of the collective in flight, watched.
    deadline: Mutex<Option<Instant>>,
    /// The watchdog cut this group's sockets.
    cut: AtomicBool,
    next_slot: AtomicU32,
    /// Unloads waiting for the next message.
    outbox: Mutex<Vec<Op>>,
    ranks: Mutex<Vec<RankLine>>,
    stats: Mutex<Stats>,
    /// Why the group last broke, for the status.
    last_break: Mutex<Option<String>>,
    /// The split models and how each is cut.
    models: Mutex<Vec<(String, String)>>,
    last_report: Mutex<Option<Instant>>,
}

/// Time spent per call, and in the messages and broadcasts of it.
#[derive(Debug, Clone, Default)]
pub struct Stats {
    pub calls: u64,
    pub call_s: f64,
    pub message_s: f64,
    /// One all-reduce of a decode row, measured at formation (µs).
    pub all_sum_us: f64,
    /// Seconds a forward pass took per position, lately (moving average).
    pub s_per_position: Option<f64>,
    /// Seconds a forward pass took on rank 0, its collectives included
    /// (moving average).
    pub step_s: Option<f64>,
}

/// Before any forward pass was timed: a guess on the slow side (a CPU
/// prefilling an 8B model).
const FIRST_GUESS_S_PER_POSITION: f64 = 0.05;

impl Coordinator {
    /// Starts forming the group in the background (rank 0 serves its own
    /// models meanwhile) and its watchdog.
    pub fn start(hostfile: Hostfile, backend: String, timeout: Duration) -> Self {
        let c = Coordinator(Arc::new(Inner {
            hostfile,
            backend,
            timeout,
            link: Link::default(),
            generation: AtomicU64::new(0),
            phase: Mutex::new(Phase::Forming { attempts: 0, last_error: None }),
            wake: Condvar::new(),
            deadline: Mutex::new(None),
            cut: AtomicBool::new(false),
            next_slot: AtomicU32::new(0),
            outbox: Mutex::new(Vec::new()),
            ranks: Mutex::new(Vec::new()),
            stats: Mutex::new(Stats::default()),
            last_break: Mutex::new(None),
            models: Mutex::new(Vec::new()),
            last_report: Mutex::new(None),
        }));
        let former = c.clone();
        std::thread::Builder::new()
            .name("mlxbc-group".into())
            .spawn(move || former.keep_formed())
            .expect("spawning the group thread");
        let watch = c.clone();
        std::thread::Builder::new().name("mlxbc-watchdog".into()).spawn(move || watch.watch()).expect("spawning");
        c
    }

    pub fn size(&self) -> usize {
        self.0.hostfile.size()
    }

    pub fn backend(&self) -> &str {
        &self.0.backend
    }

    pub fn link(&self) -> Link {
        self.0.link.clone()
    }

    pub fn phase(&self) -> Phase {
        lock(&self.0.phase).clone()
    }

    /// Bumped every time the group forms.
    pub fn generation(&self) -> u64 {
        self.0.generation.load(Ordering::SeqCst)
    }

    pub fn ranks(&self) -> Vec<RankLine> {
        lock(&self.0.ranks).clone()
    }

    pub fn stats(&self) -> Stats {
        lock(&self.0.stats).clone()
    }

    pub fn last_break(&self) -> Option<String> {
        lock(&self.0.last_break).clone()
    }

    /// The split models and how each is cut.
    pub fn models(&self) -> Vec<(String, String)> {
        lock(&self.0.models).clone()
    }

    /// Notes a split model (`how` it is cut), or forgets it (`None`).
    pub fn note_model(&self, name: &str, how: Option<String>) {
        let mut models = lock(&self.0.models);
        models.retain(|(n, _)| n != name);
        if let Some(how) = how {
            models.push((name.to_string(), how));
        }
    }

    /// A slot number for a model being loaded.
    pub fn new_slot(&self) -> u32 {
        self.0.next_slot.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Sends `op` with the next message (an unload: nothing waits on it).
    pub fn post(&self, op: Op) {
        lock(&self.0.outbox).push(op);
    }

    /// Forms the group again now (`mlxbc cluster restart`), also after a
    /// version refusal.
    pub fn restart(&self) {
        self.break_group("restarted on request".into());
    }

    /// The ranks above 0, named for messages: "rank 1 (10.0.0.2)".
    pub fn workers_named(&self) -> String {
        let h = &self.0.hostfile;
        match h.size() {
            0 | 1 => "no other rank".into(),
            2 => format!("rank 1 ({})", h.host(1)),
            n => format!(
                "a rank of {}",
                (1..n).map(|r| format!("rank {r} ({})", h.host(r))).collect::<Vec<_>>().join(", ")
            ),
        }
    }

    /// [`Self::call`] for a forward pass over `positions` positions (rows
    /// times length): its deadline is the step timeout beyond four times
    /// what that many positions took lately (a long prompt's chunk may take
    /// longer than the timeout on a slow machine; only waiting on a rank
    /// beyond that is a fault).
    pub fn call_sized<T>(&self, positions: usize, f: impl FnOnce(&Group) -> Result<T>) -> Result<T> {
        let per_position = lock(&self.0.stats).s_per_position.unwrap_or(FIRST_GUESS_S_PER_POSITION);
        let expected = Duration::from_secs_f64(per_position * positions as f64 * 4.0);
        let t = Instant::now();
        let result = self.call(Some(self.0.timeout + expected), f);
        if result.is_ok() && positions > 0 {
            let took = t.elapsed().as_secs_f64();
            let measured = took / positions as f64;
            let mut stats = lock(&self.0.stats);
            stats.step_s = Some(stats.step_s.map_or(took, |s| 0.9 * s + 0.1 * took));
            stats.s_per_position = Some(match stats.s_per_position {
                Some(s) => s * 0.8 + measured * 0.2,
                None => measured,
            });
        }
        result
    }

    /// Runs `f` (which issues collectives) on the formed group, bounded by
    /// the step timeout, or `timeout` when given. A failure breaks the
    /// group (it re-forms in the background) and comes back as a
    /// [`RankStoppedError`].
    pub fn call<T>(&self, timeout: Option<Duration>, f: impl FnOnce(&Group) -> Result<T>) -> Result<T> {
        let phase = self.phase();
        if phase != Phase::Ready {
            return Err(anyhow!(RankStoppedError(self.not_ready(&phase))));
        }
        let group = self.0.link.group().map_err(|_| anyhow!(RankStoppedError(self.not_ready(&phase))))?;
        let t = Instant::now();
        *lock(&self.0.deadline) = Some(t + timeout.unwrap_or(self.0.timeout));
        let result = f(&group);
        *lock(&self.0.deadline) = None;
        let mut stats = lock(&self.0.stats);
        stats.calls += 1;
        stats.call_s += t.elapsed().as_secs_f64();
        drop(stats);
        result.map_err(|e| {
            let why = if self.0.cut.load(Ordering::SeqCst) {
                format!(
                    "{} stopped answering (nothing within {:.0} s); the group is forming again",
                    self.workers_named(),
                    timeout.unwrap_or(self.0.timeout).as_secs_f64()
                )
            } else {
                format!("{} stopped answering ({}); the group is forming again", self.workers_named(), reason(&e))
            };
            tracing::warn!("{why}");
            self.break_group(why.clone());
            anyhow!(RankStoppedError(why))
        })
    }

    /// Sends `ops` (after any posted ones) to every rank.
    pub fn send(&self, group: &Group, ops: Vec<Op>) -> Result<()> {
        let mut all = std::mem::take(&mut *lock(&self.0.outbox));
        all.extend(ops);
        let t = Instant::now();
        group.broadcast_bytes(Some(&plan::encode(&all)))?;
        lock(&self.0.stats).message_s += t.elapsed().as_secs_f64();
        Ok(())
    }

    /// Every rank's reply (rank 0's own is `mine`), in rank order.
    pub fn gather(&self, group: &Group, mine: &Reply) -> Result<Vec<Reply>> {
        let all =
            group.all_gather(&mlx_rs::Array::from_slice(&plan::reply_bytes(mine), &[plan::REPLY_BYTES as i32]))?;
        all.eval()?;
        all.as_slice::<u8>().chunks(plan::REPLY_BYTES).map(plan::parse_reply).collect()
    }

    /// Tells every rank to load `name` into `slot` (they load while rank 0
    /// loads its own shard); [`Self::finish_load`] collects their answers.
    pub fn begin_load(&self, slot: u32, name: &str, fingerprint: &str) -> Result<()> {
        self.call(None, |g| {
            self.send(g, vec![Op::Load { slot, name: name.to_string(), fingerprint: fingerprint.to_string() }])
        })
    }

    /// Every rank's answer to the load: an error names the first rank
    /// that refused and why.
    pub fn finish_load(&self, mine: Reply) -> Result<()> {
        let replies = self.call(Some(LOAD_TIMEOUT), |g| self.gather(g, &mine))?;
        for (rank, r) in replies.iter().enumerate() {
            if let Reply::Refused(why) = r {
                bail!("rank {rank} ({}) refused: {why}", self.0.hostfile.host(rank));
            }
        }
        self.note_ranks(&replies);
        Ok(())
    }

    /// [`Self::report`] when the group is formed and the last report is
    /// older than [`REPORT_EVERY`] (its failure breaks the group, logged).
    pub fn report_if_due(&self) {
        if self.phase() != Phase::Ready {
            return;
        }
        {
            let mut last = lock(&self.0.last_report);
            if last.is_some_and(|t| t.elapsed() < REPORT_EVERY) {
                return;
            }
            *last = Some(Instant::now());
        }
        if let Err(e) = self.report() {
            tracing::warn!("{e:#}");
        }
    }

    /// Asks every rank for its memory (for the status).
    pub fn report(&self) -> Result<()> {
        let replies = self.call(None, |g| {
            self.send(g, vec![Op::Report])?;
            self.gather(g, &own_reply(lock(&self.0.stats).step_s))
        })?;
        self.note_ranks(&replies);
        Ok(())
    }

    fn note_ranks(&self, replies: &[Reply]) {
        let lines = replies
            .iter()
            .enumerate()
            .map(|(rank, r)| match r {
                Reply::Ok { rss_bytes, host, step_ms } => {
                    RankLine { rank, host: host.clone(), rss_bytes: *rss_bytes, step_ms: *step_ms }
                }
                Reply::Refused(_) => RankLine { rank, host: self.0.hostfile.host(rank), rss_bytes: 0, step_ms: None },
            })
            .collect();
        *lock(&self.0.ranks) = lines;
    }

    fn not_ready(&self, phase: &Phase) -> String {
        match phase {
            Phase::Ready => "the group is forming again".into(),
            Phase::Refused(why) => format!("the group is refused: {why} (`mlxbc cluster restart` after fixing it)"),
            Phase::Forming { .. } => match self.last_break() {
                Some(why) => format!("{why} (still waiting for it)"),
                None => format!("the group is forming: waiting for {}", self.workers_named()),
            },
        }
    }

    fn break_group(&self, why: String) {
        *lock(&self.0.last_break) = Some(why.clone());
        self.0.link.set(None);
        let mut phase = lock(&self.0.phase);
        *phase = Phase::Forming { attempts: 0, last_error: Some(why) };
        self.0.wake.notify_all();
    }

    /// The forming thread: whenever the group is not formed, forms it.
    fn keep_formed(&self) {
        loop {
            {
                let mut phase = lock(&self.0.phase);
                while !matches!(*phase, Phase::Forming { .. }) {
                    phase = self.0.wake.wait(phase).unwrap_or_else(|p| p.into_inner());
                }
            }
            match self.form() {
                Ok(()) => {
                    self.0.generation.fetch_add(1, Ordering::SeqCst);
                    *lock(&self.0.phase) = Phase::Ready;
                    tracing::info!(ranks = self.size(), backend = %self.0.backend, "the group is formed");
                }
                Err(Formed::Refused(why)) => {
                    tracing::error!("{why}");
                    self.0.link.set(None);
                    *lock(&self.0.phase) = Phase::Refused(why);
                }
                Err(Formed::Failed(e)) => {
                    self.0.link.set(None);
                    if let Phase::Forming { attempts, last_error } = &mut *lock(&self.0.phase) {
                        *attempts += 1;
                        if *attempts == 1 || attempts.is_multiple_of(30) {
                            tracing::info!(attempts, "the group is not formed yet: {e:#}");
                        }
                        if last_error.is_none() {
                            *last_error = Some(format!("{e:#}"));
                        }
                    }
                    std::thread::sleep(RETRY);
                }
            }
        }
    }

    /// Joins MLX's group and checks every rank runs this daemon version.
    fn form(&self) -> Result<(), Formed> {
        self.0.cut.store(false, Ordering::SeqCst);
        Group::forget_backends();
        let group = Group::init(&self.0.backend, true).map_err(Formed::Failed)?;
        if group.size() != self.size() || group.rank() != 0 {
            return Err(Formed::Refused(format!(
                "MLX formed a group of {} with this daemon as rank {}, but the hostfile lists {} ranks and rank 0 serves",
                group.size(),
                group.rank(),
                self.size()
            )));
        }
        let group = Arc::new(group);
        let version = env!("CARGO_PKG_VERSION").to_string();
        *lock(&self.0.deadline) = Some(Instant::now() + self.0.timeout);
        let hello = (|| -> Result<Vec<Reply>> {
            self.send(&group, vec![Op::Hello { version }])?;
            self.gather(&group, &own_reply(None))
        })();
        let probe = probe_all_sum(&group);
        *lock(&self.0.deadline) = None;
        let replies = hello.map_err(Formed::Failed)?;
        for (rank, r) in replies.iter().enumerate() {
            if let Reply::Refused(why) = r {
                return Err(Formed::Refused(format!(
                    "rank {rank} ({}) refused to join: {why}",
                    self.0.hostfile.host(rank)
                )));
            }
        }
        lock(&self.0.stats).all_sum_us = probe.unwrap_or(0.0);
        self.note_ranks(&replies);
        self.0.link.set(Some(group));
        Ok(())
    }

    /// Cuts the ring's sockets when a collective overstays its deadline;
    /// starts the daemon afresh when even that does not end it.
    fn watch(&self) {
        let own = self.0.hostfile.addresses(0);
        let peers: Vec<_> = (1..self.size()).flat_map(|r| self.0.hostfile.addresses(r)).collect();
        // A cut socket fails its collective at once; one still waiting
        // seconds later never returns.
        let grace = Duration::from_secs(5);
        let mut cut_at: Option<Instant> = None;
        loop {
            std::thread::sleep(Duration::from_millis(200));
            let deadline = *lock(&self.0.deadline);
            let late = deadline.is_some_and(|d| Instant::now() > d);
            if late && !self.0.cut.swap(true, Ordering::SeqCst) {
                let n = cut_ring_sockets(&own, &peers);
                tracing::warn!(sockets = n, "a collective overstayed its deadline: the group's connections are cut");
                cut_at = Some(Instant::now());
            }
            if deadline.is_none() {
                cut_at = None;
            }
            if cut_at.is_some_and(|t| t.elapsed() > grace) {
                start_afresh();
            }
        }
    }
}

/// The last resort when a collective never returns, even with its sockets
/// cut: MLX 0.32.2's ring backend can leave it waiting forever on a peer
/// killed while rank 0 was sending (its socket thread fails the tasks it
/// holds and exits; a task queued after that is never run:
/// ml-explore/mlx#3862, #4060), and the engine's thread with it, so every
/// model of this daemon would stop answering. The process starts afresh:
/// clients in flight see their connection close; the group forms again
/// as its workers rejoin. Under a service manager (socket activation) it
/// exits for the manager to start it, the socket listening meanwhile;
/// otherwise it executes itself again with the same arguments.
fn start_afresh() -> ! {
    tracing::error!(
        "a collective did not return after the group's connections were cut (MLX's ring backend can wait \
         forever on a killed peer): starting this daemon afresh so that its models answer again"
    );
    if !crate::error::SOCKET_INHERITED.load(Ordering::SeqCst) {
        // Every descriptor but stdio closes at exec: MLX's ring sockets are
        // not close-on-exec, and a listening one kept would stop the new
        // process binding its hostfile address.
        if let Ok(fds) = std::fs::read_dir("/dev/fd") {
            let fds: Vec<i32> =
                fds.flatten().filter_map(|e| e.file_name().to_str().and_then(|n| n.parse().ok())).collect();
            for fd in fds.into_iter().filter(|&fd| fd > 2) {
                // SAFETY: fcntl on a descriptor number only sets its flag (EBADF if it is gone).
                unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
            }
        }
        if let Ok(exe) = std::env::current_exe() {
            use std::os::unix::process::CommandExt;
            let err = std::process::Command::new(exe).args(std::env::args_os().skip(1)).exec();
            tracing::error!("could not execute the daemon again ({err}): exiting");
        }
    }
    std::process::exit(crate::error::DEVICE_LOST_EXIT)
}

/// MLX's sentence from an error, without the source locations mlx-c and
/// mlx-rs append ("... at /path/array.cpp:352").
fn reason(e: &anyhow::Error) -> String {
    let text = e.root_cause().to_string();
    let text = text.split(" at /").next().unwrap_or(&text);
    text.trim_matches(|c| c == '"' || c == ' ').to_string()
}

/// Why forming failed: worth retrying, or not until someone acts.
enum Formed {
    Failed(anyhow::Error),
    Refused(String),
}

/// This process's answer to a handshake or report.
pub fn own_reply(step_s: Option<f64>) -> Reply {
    Reply::Ok { rss_bytes: crate::rss_bytes(), host: hostname(), step_ms: step_s.map(|s| s * 1000.0) }
}

/// The machine's name.
pub fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most `len` bytes into `buf`.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr() as *mut libc::c_char, buf.len()) };
    if rc != 0 {
        return String::new();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// Microseconds per all-reduce of one 4096-wide f32 row (a decode step's
/// size for an 8B model), median of 21, workers joining in with their own
/// probe (see the worker's handshake).
pub fn probe_all_sum(group: &Group) -> Result<f64> {
    let x = mlx_rs::Array::zeros::<f32>(&[1, 4096])?;
    let mut times = Vec::new();
    for _ in 0..21 {
        let t = Instant::now();
        group.all_sum(&x)?.eval()?;
        times.push(t.elapsed().as_secs_f64() * 1e6);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}
