//! The tokio side's handle on the engine thread: it queues jobs, and reads
//! status, routes and the prompt cache's report from the last snapshot the
//! engine published, without queueing.

use super::jobs::{Control, Job, PromptRoute};
use super::memory;
use crate::error::EngineError;
use crate::{media, prompt_cache};
use mlxbc_shared::sync::lock;
use mlxbc_shared::{DaemonStatus, LoadedModel, ShedEvent};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Instant;

/// What the engine last published about itself; read without queueing.
#[derive(Debug, Clone, Default)]
pub struct EngineSnapshot {
    pub loaded: Vec<LoadedModel>,
    pub mlx_active_bytes: u64,
    pub mlx_peak_bytes: u64,
    pub memory_budget_bytes: u64,
    /// Memory-pressure sheds (newest last), with when they happened.
    pub sheds: Vec<(Instant, ShedEvent)>,
    /// For each model name a request used (`None`: the default model) that
    /// resolved to a resident model: how to tokenize for it.
    pub routes: HashMap<Option<String>, PromptRoute>,
    /// Generations in flight, and the scheduler's queue and limits.
    pub sequences: Vec<mlxbc_shared::SequenceInfo>,
    pub admission_queue: u32,
    pub reserved_kv_bytes: u64,
    pub max_batch: u32,
    pub max_queue: u32,
    /// The prompt cache's RAM tier.
    pub prompt_ram: PromptRamState,
}

/// The prompt cache's RAM tier as status and `cache stats` see it.
#[derive(Debug, Default, Clone, Copy)]
pub struct PromptRamState {
    pub blocks: u64,
    pub bytes: u64,
    pub budget_bytes: u64,
    pub counters: prompt_cache::PromptCacheCounters,
}

/// The tokio side's handle on the engine thread.
#[derive(Clone)]
pub struct EngineHandle {
    pub(super) jobs: mpsc::Sender<Control>,
    pub(super) stopping: Arc<AtomicBool>,
    pub(super) snapshot: Arc<Mutex<EngineSnapshot>>,
    pub(super) queued: Arc<AtomicU32>,
    pub(super) served: Arc<AtomicU64>,
    pub(super) cancelled: Arc<AtomicU64>,
    /// The compute device, e.g. "cpu" or "gpu".
    pub device: String,
    /// The feature store (`None` when it could not be opened), shared with
    /// the engine; and where it lives.
    pub store: Option<media::SharedStore>,
    pub store_path: std::path::PathBuf,
    /// The prompt cache's disk tier (`None`: off, or it could not be
    /// opened), and the names of its RAM tier's blocks with the measured
    /// costs of disk reads and prefills, for reading a prompt's blocks off
    /// the engine thread.
    pub prompt_disk: Option<Arc<mlxbc_cache::BlockStore>>,
    pub prompt_shared: Arc<Mutex<prompt_cache::SharedIndex>>,
    pub prompt_path: std::path::PathBuf,
    /// The group this daemon leads as rank 0, if any.
    pub cluster: Option<crate::cluster::Coordinator>,
    /// What `/metrics` reports; the engine and the gateway record into it.
    pub metrics: Arc<crate::metrics::Metrics>,
}

impl EngineHandle {
    /// The group as rank 0 sees it now.
    pub fn cluster_status(&self) -> Option<mlxbc_shared::ClusterStatus> {
        let c = self.cluster.as_ref()?;
        let stats = c.stats();
        let per_call = |s: f64| if stats.calls == 0 { 0.0 } else { s * 1000.0 / stats.calls as f64 };
        Some(mlxbc_shared::ClusterStatus {
            backend: c.backend().to_string(),
            state: match c.phase() {
                crate::cluster::Phase::Ready => "formed".into(),
                crate::cluster::Phase::Forming { .. } => format!("forming: waiting for {}", c.workers_named()),
                crate::cluster::Phase::Refused(why) => format!("refused: {why}"),
            },
            ranks: c
                .ranks()
                .into_iter()
                .map(|r| mlxbc_shared::RankStatus {
                    rank: r.rank as u32,
                    host: r.host,
                    rss_bytes: r.rss_bytes,
                    step_ms: r.step_ms.unwrap_or(0.0),
                })
                .collect(),
            calls: stats.calls,
            mean_call_ms: per_call(stats.call_s),
            mean_message_ms: per_call(stats.message_s),
            all_sum_us: stats.all_sum_us,
            models: c.models(),
            last_break: c.last_break(),
        })
    }

    /// The prompt cache's state: its RAM tier as last published, its disk
    /// tier now.
    pub fn prompt_report(&self) -> mlxbc_shared::PromptCacheReport {
        let ram = lock(&self.snapshot).prompt_ram;
        let disk = self.prompt_disk.as_ref().map(|d| d.stats()).unwrap_or_default();
        mlxbc_shared::PromptCacheReport {
            path: self.prompt_path.display().to_string(),
            block_tokens: prompt_cache::BLOCK_TOKENS as u32,
            ram_blocks: ram.blocks,
            ram_bytes: ram.bytes,
            ram_budget_bytes: ram.budget_bytes,
            disk_blocks: disk.blocks,
            disk_bytes: disk.bytes,
            disk_budget_bytes: disk.budget_bytes,
            ram_hit_tokens: ram.counters.ram_hit_tokens,
            disk_hit_tokens: ram.counters.disk_hit_tokens,
            stored_blocks: ram.counters.stored_blocks,
            ram_evictions: ram.counters.ram_evictions,
            disk_evictions: disk.evictions,
            corrupt: disk.corrupt,
            writes_dropped: ram.counters.writes_dropped,
            disk_skipped_tokens: lock(&self.prompt_shared).costs.skipped_tokens,
            disk_skipped_for_space: disk.skipped_for_space,
            disk_room_bytes: disk.room_bytes,
        }
    }

    /// Queues a job. Fails only when the engine thread is gone.
    pub fn submit(&self, job: Job) -> Result<(), EngineError> {
        if self.stopping.load(Ordering::SeqCst) {
            return Err(EngineError::ShuttingDown("mlxbcd is shutting down".to_string()));
        }
        self.queued.fetch_add(1, Ordering::SeqCst);
        self.jobs.send(Control::Job(job)).map_err(|_| {
            self.queued.fetch_sub(1, Ordering::SeqCst);
            EngineError::ShuttingDown("the engine has stopped".to_string())
        })
    }

    /// Status, built from the last snapshot plus live counters.
    pub fn status(&self, started: Instant) -> DaemonStatus {
        let snap = lock(&self.snapshot).clone();
        DaemonStatus {
            daemon_version: env!("CARGO_PKG_VERSION").to_string(),
            protocol: mlxbc_shared::PROTOCOL_VERSION,
            pid: std::process::id(),
            uptime_s: started.elapsed().as_secs(),
            device: self.device.clone(),
            blas: crate::BLAS.to_string(),
            loaded: snap.loaded,
            mlx_active_bytes: snap.mlx_active_bytes,
            mlx_peak_bytes: snap.mlx_peak_bytes,
            rss_bytes: crate::rss_bytes(),
            queued_jobs: self.queued.load(Ordering::SeqCst),
            requests_served: self.served.load(Ordering::SeqCst),
            generations_cancelled: self.cancelled.load(Ordering::SeqCst),
            memory_budget_bytes: snap.memory_budget_bytes,
            available_bytes: memory::available_bytes(),
            memory_sheds: snap
                .sheds
                .iter()
                .map(|(at, e)| ShedEvent { ago_s: at.elapsed().as_secs(), ..e.clone() })
                .collect(),
            // Filled in by the server, which owns the connections.
            connections_open: 0,
            connections_cap: 0,
            connections_evicted: 0,
            connections_refused: 0,
            http_connections_open: 0,
            http_connections_cap: 0,
            http_connections_evicted: 0,
            cluster: self.cluster_status(),
            http_connections_refused: 0,
            sequences: snap.sequences,
            admission_queue: snap.admission_queue,
            reserved_kv_bytes: snap.reserved_kv_bytes,
            max_batch: snap.max_batch,
            max_queue: snap.max_queue,
            counters: Box::new(self.metrics.counters()),
        }
    }

    /// Asks the engine to finish the job in hand and exit; queued jobs are
    /// answered with `ShuttingDown`. Connections may still hold handles, so
    /// dropping them is not enough.
    pub fn stop(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        let _ = self.jobs.send(Control::Stop);
    }

    /// No model resident, no job queued, nothing generating.
    pub fn is_idle(&self) -> bool {
        let snap = lock(&self.snapshot);
        self.queued.load(Ordering::SeqCst) == 0 && snap.loaded.is_empty() && snap.sequences.is_empty()
    }

    /// How to tokenize and prepare media for the model `model` names (`None`:
    /// the default), when that model is resident; `None` otherwise.
    pub fn route(&self, model: &Option<String>) -> Option<PromptRoute> {
        lock(&self.snapshot).routes.get(model).cloned()
    }

    /// Names of resident models.
    pub fn loaded_names(&self) -> Vec<String> {
        lock(&self.snapshot).loaded.iter().map(|m| m.name.clone()).collect()
    }
}
