//! The engine: one OS thread that owns every MLX array. It takes jobs from
//! a queue between scheduler ticks (`scheduler`): every generation in flight
//! is a sequence, prefilled in chunks and decoded in one batch with the
//! others on its model (`batch`). Tokio tasks talk to it through channels
//! and never touch MLX state (mlx-rs arrays are `Send`, not `Sync`).

mod batch;
pub mod cache_report;
pub mod constraint;
pub mod discovery;
pub mod error;
pub mod generate;
mod logprobs;
pub mod media;
pub mod memory;
pub mod prompt_cache;
pub mod prompt_costs;
pub mod raw_prompt;
pub mod registry;
mod residency;
pub mod sampling;
mod scheduler;
mod sequence;
pub mod sessions;
mod speech;
mod stop;
pub mod tools;

use crate::model::prompt::Prompter;
use crate::model::weights::WeightForm;
pub use error::EngineError;
use mlxbc_shared::{
    settings::Settings, DaemonStatus, ErrorKind, GenerateRequest, KeepAlive, LoadedModel, Response, ShedEvent,
};
use registry::ModelRegistry;
use residency::Residency;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc as tmpsc, oneshot};

/// Work for the engine thread.
pub enum Job {
    /// Stream a chat completion into `events`.
    Generate {
        request: GenerateRequest,
        events: tmpsc::UnboundedSender<Response>,
        /// Set when the client went away.
        cancel: Arc<AtomicBool>,
        /// When the daemon received the request (time to first token starts here).
        received: Instant,
        /// The prompt's ids, when a connection made them off the engine thread.
        prepared: Option<PreparedPrompt>,
        /// The request's media, looked up and preprocessed off the engine thread.
        media: Option<media::PreparedMedia>,
        /// A named session's turn: `request.messages` already starts with
        /// its history; the new messages and the answer are appended when done.
        turn: Option<SessionTurn>,
        /// Time a load requested while preparing took (ms), counted in the stats.
        load_ms: f64,
    },
    /// Make a model resident (`None`: the default model).
    Load {
        model: Option<String>,
        keep_alive: Option<KeepAlive>,
        /// A request is being prepared for this model and follows at once:
        /// nothing is shed or expired before it arrives.
        for_request: bool,
        reply: oneshot::Sender<Response>,
    },
    /// Drop a resident model.
    Unload { model: String, reply: oneshot::Sender<Response> },
    /// Encode media ahead of time (prepared off the engine thread when the model was resident).
    Prefetch {
        model: Option<String>,
        media: Vec<mlxbc_shared::MediaRef>,
        prepared: Option<media::PreparedMedia>,
        reply: oneshot::Sender<Response>,
    },
    /// Drop the prompt cache's RAM tier (`cache clear --prompts`; the disk
    /// tier is cleared off the engine thread); replies with the blocks dropped.
    ClearPromptRam { reply: oneshot::Sender<u64> },
    /// Transcribe a recording (decoded off the engine thread) into `events`.
    Transcribe {
        request: mlxbc_shared::TranscribeRequest,
        audio: crate::requests::transcribe::AudioInput,
        events: tmpsc::UnboundedSender<Response>,
        cancel: Arc<AtomicBool>,
        received: Instant,
    },
}

/// A turn of a named session, begun before its job was queued.
pub struct SessionTurn {
    pub name: String,
    /// This turn's own messages (without the history).
    pub messages: Vec<mlxbc_shared::ChatMessage>,
    pub started: sessions::Turn,
}

/// A text prompt rendered and tokenized before its job reached the engine.
pub struct PreparedPrompt {
    /// The resident model it was made for (its canonical name).
    pub model: String,
    /// That model's prompter: if the model was reloaded meanwhile, the ids
    /// are not trusted and the engine tokenizes again.
    pub prompter: Arc<Prompter>,
    pub ids: Vec<u32>,
    /// The prompt cache's blocks for these ids that were on disk (and not
    /// in RAM), read off the engine thread.
    pub stored: prompt_cache::StoredBlocks,
}

impl PreparedPrompt {
    /// Made by this model's own prompter.
    pub fn is_for(&self, model: &str, prompter: &Arc<Prompter>) -> bool {
        self.model == model && Arc::ptr_eq(&self.prompter, prompter)
    }
}

/// What a connection needs to tokenize for a resident model: its canonical
/// name, its prompter, its context length.
#[derive(Clone)]
pub struct PromptRoute {
    pub model: String,
    pub prompter: Arc<Prompter>,
    pub context: usize,
    /// A vision model's image placeholder: a prompt whose text holds one
    /// (with no image sent) is left to the engine, which refuses it.
    pub placeholder: Option<String>,
    /// A vision model's preprocessing and store-key parts.
    pub media: Option<media::MediaRoute>,
    /// The model's KV identity, where the prompt cache's block names start.
    pub kv_root: Option<[u8; 32]>,
    /// The model keeps recurrent states (its prefixes need them stored).
    pub recurrent: bool,
}

impl std::fmt::Debug for PromptRoute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PromptRoute").field("model", &self.model).field("context", &self.context).finish()
    }
}

/// Control messages, kept apart from jobs so a stop is never stuck behind them.
enum Control {
    Job(Job),
    /// Finish the job in hand, refuse the queued ones, exit.
    Stop,
}

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

/// Opens the prompt cache's disk tier, or says in the log why not.
fn open_prompt_disk(settings: &Settings) -> Option<Arc<mlxbc_cache::BlockStore>> {
    if settings.prompt_cache_disk_bytes == 0 {
        return None;
    }
    match mlxbc_cache::BlockStore::open(
        &settings.prompt_cache_dir,
        settings.prompt_cache_disk_bytes,
        settings.disk_reserve,
    ) {
        Ok(s) => Some(Arc::new(s)),
        Err(e) => {
            tracing::warn!(path = %settings.prompt_cache_dir.display(), error = %e, "the prompt cache's disk tier could not be opened: RAM only");
            None
        }
    }
}

/// Requested model names remembered for tokenizing off the engine thread.
const MAX_ROUTES: usize = 64;

/// How many shed events status keeps.
const SHED_HISTORY: usize = 32;

/// The tokio side's handle on the engine thread.
#[derive(Clone)]
pub struct EngineHandle {
    jobs: mpsc::Sender<Control>,
    stopping: Arc<AtomicBool>,
    snapshot: Arc<Mutex<EngineSnapshot>>,
    queued: Arc<AtomicU32>,
    served: Arc<AtomicU64>,
    cancelled: Arc<AtomicU64>,
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
}

impl EngineHandle {
    /// The prompt cache's state: its RAM tier as last published, its disk
    /// tier now.
    pub fn prompt_report(&self) -> mlxbc_shared::PromptCacheReport {
        let ram = self.snapshot.lock().unwrap_or_else(PoisonError::into_inner).prompt_ram;
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
            disk_skipped_tokens: self.prompt_shared.lock().unwrap_or_else(PoisonError::into_inner).costs.skipped_tokens,
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
        let snap = self.snapshot.lock().unwrap_or_else(PoisonError::into_inner).clone();
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
            http_connections_refused: 0,
            sequences: snap.sequences,
            admission_queue: snap.admission_queue,
            reserved_kv_bytes: snap.reserved_kv_bytes,
            max_batch: snap.max_batch,
            max_queue: snap.max_queue,
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
        let snap = self.snapshot.lock().unwrap_or_else(PoisonError::into_inner);
        self.queued.load(Ordering::SeqCst) == 0 && snap.loaded.is_empty() && snap.sequences.is_empty()
    }

    /// How to tokenize and prepare media for the model `model` names (`None`:
    /// the default), when that model is resident; `None` otherwise.
    pub fn route(&self, model: &Option<String>) -> Option<PromptRoute> {
        self.snapshot.lock().unwrap_or_else(PoisonError::into_inner).routes.get(model).cloned()
    }

    /// Names of resident models.
    pub fn loaded_names(&self) -> Vec<String> {
        self.snapshot.lock().unwrap_or_else(PoisonError::into_inner).loaded.iter().map(|m| m.name.clone()).collect()
    }
}

/// Starts the engine thread. It exits when every handle is dropped, after
/// finishing the job in hand.
pub fn spawn(
    settings: &Settings,
    options: crate::options::EngineOptions,
    sessions: Arc<sessions::SessionStore>,
    registry: Arc<ModelRegistry>,
) -> std::io::Result<(EngineHandle, std::thread::JoinHandle<()>)> {
    let (tx, rx) = mpsc::channel();
    let store = match mlxbc_cache::FeatureStore::open(
        &settings.feature_cache_dir,
        mlxbc_cache::StoreConfig {
            ram_bytes: settings.feature_ram_bytes as usize,
            disk_bytes: settings.feature_cache_bytes,
            reserve: settings.disk_reserve,
        },
    ) {
        Ok(s) => Some(media::SharedStore::new(s)),
        Err(e) => {
            // Serving without the store only costs re-encoding.
            tracing::warn!("{e}; images will be encoded every time");
            None
        }
    };
    let device = mlx_rs::Device::default();
    let device_name = match device.get_type() {
        Ok(mlx_rs::DeviceType::Gpu) => "gpu",
        _ => "cpu",
    };
    let handle = EngineHandle {
        jobs: tx,
        stopping: Arc::default(),
        snapshot: Arc::default(),
        queued: Arc::default(),
        served: Arc::default(),
        cancelled: Arc::default(),
        device: device_name.to_string(),
        store: store.clone(),
        store_path: settings.feature_cache_dir.clone(),
        prompt_disk: open_prompt_disk(settings),
        prompt_shared: Arc::default(),
        prompt_path: settings.prompt_cache_dir.clone(),
    };
    let form =
        crate::options::ModelOptions { form: WeightForm::for_device(&device, options.weights), fusion: options.fusion };
    let decode = crate::model::decode_step::DecodeMode::for_device(device_name == "gpu", options.decode);
    let on_gpu = device_name == "gpu";
    let memory_budget = settings.memory_budget_bytes.unwrap_or(memory::total_bytes() / 4 * 3);
    let max_batch = settings.max_batch.unwrap_or_else(|| max_batch_for(on_gpu));
    {
        // The limits are known now: status before the first model load
        // must not show a zero budget or "max_batch 0".
        let mut snap = handle.snapshot.lock().unwrap_or_else(PoisonError::into_inner);
        snap.memory_budget_bytes = memory_budget;
        snap.max_batch = max_batch as u32;
        snap.max_queue = settings.max_queue as u32;
    }
    let (snapshot, queued, served, cancelled, stopping) = (
        handle.snapshot.clone(),
        handle.queued.clone(),
        handle.served.clone(),
        handle.cancelled.clone(),
        handle.stopping.clone(),
    );
    let settings = settings.clone();
    let prefill_chunk = settings.prefill_chunk.unwrap_or_else(|| prefill_chunk_for(on_gpu));
    let prompt_ram_bytes =
        settings.prompt_cache_ram_bytes.unwrap_or_else(|| (1u64 << 30).min(memory::total_bytes() / 8));
    let (prompt_disk, prompt_shared) = (handle.prompt_disk.clone(), handle.prompt_shared.clone());
    let device_for_keys = device_name.to_string();
    // The engine is built on its own thread: models hold compiled MLX
    // functions, which must stay on the thread that made them.
    let thread = std::thread::Builder::new().name("mlx-engine".into()).spawn(move || {
        let mut engine = Engine {
            store,
            prompts: prompt_cache::PromptCache::new(prompt_ram_bytes, prompt_disk, prompt_shared),
            registry,
            residency: {
                let mut r = Residency::new(settings.keep_alive, settings.max_loaded_models, memory_budget);
                r.device = device_for_keys;
                r
            },
            low_memory_bytes: settings.low_memory_bytes.unwrap_or(memory::total_bytes() / 20),
            sessions,
            form,
            decode,
            prefill_chunk,
            scheduler: scheduler::Scheduler::new(scheduler::SchedulerLimits {
                max_batch,
                max_queue: settings.max_queue,
                prefill_budget: prefill_chunk,
            }),
            transcriptions: Default::default(),
            last_publish: Instant::now(),
            last_housekeeping: Instant::now(),
            max_tokens_limit: settings.max_tokens_limit,
            routes: HashMap::new(),
            snapshot,
            queued,
            served,
            cancelled,
            stopping,
        };
        engine.run(rx)
    })?;
    Ok((handle, thread))
}

/// Where named conversations are kept.
pub fn sessions_dir(settings: &Settings) -> std::path::PathBuf {
    settings.paths.home.join("sessions")
}

/// What a session turn that found the disk full frees from the prompt
/// cache's disk tier before trying again (a session file is kilobytes; the
/// margin is for whatever else filled the disk meanwhile).
const SESSION_ROOM_BYTES: u64 = 64 << 20;

/// True when both paths are on one filesystem (so freeing one frees room
/// for the other).
fn same_filesystem(a: &std::path::Path, b: &std::path::Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    matches!((std::fs::metadata(a), std::fs::metadata(b)), (Ok(x), Ok(y)) if x.dev() == y.dev())
}

/// How often the engine looks at available memory when idle.
const PRESSURE_POLL: Duration = Duration::from_secs(2);

/// Answers a job that arrived after the stop.
fn refuse(job: Job) {
    let err = || Response::Error { kind: ErrorKind::ShuttingDown, message: "mlxbcd is shutting down".into() };
    match job {
        Job::Generate { events, .. } | Job::Transcribe { events, .. } => {
            let _ = events.send(err());
        }
        Job::Load { reply, .. } | Job::Unload { reply, .. } | Job::Prefetch { reply, .. } => {
            let _ = reply.send(err());
        }
        Job::ClearPromptRam { .. } => {}
    }
}

/// Prompt tokens per forward pass when the settings name none, by device,
/// as measured by `scripts/bench chunks` (docs/measurements/*-prefill-chunks.md).
/// On an H200 a 4096-token prompt prefills 2.4x (SmolLM2) and 1.8x
/// (Qwen2.5-0.5B) faster in 2048-token chunks than in 512-token ones, and
/// 4096 gains nothing more for twice the memory (mlx-lm's default is 2048
/// too); on CPU the matrix products reach BLAS speed at a few hundred rows.
pub fn prefill_chunk_for(on_gpu: bool) -> usize {
    if on_gpu {
        PREFILL_CHUNK_GPU
    } else {
        PREFILL_CHUNK_CPU
    }
}
const PREFILL_CHUNK_CPU: usize = 512;
const PREFILL_CHUNK_GPU: usize = 2048;

/// Sequences of one model admitted at once when the settings name no
/// `max_batch`. A GPU's decode step costs about the same for 1 or 128 rows
/// of a small model (host-bound); a CPU's grows with the rows, so a smaller
/// batch keeps each stream moving.
pub fn max_batch_for(on_gpu: bool) -> usize {
    if on_gpu {
        128
    } else {
        32
    }
}

/// Jobs (new requests' setup, loads, prefetches) taken between two ticks
/// while generations run.
const JOBS_PER_TICK: usize = 16;

/// How often status is republished while generations run.
const PUBLISH_EVERY: Duration = Duration::from_millis(200);

struct Engine {
    store: Option<media::SharedStore>,
    prompts: prompt_cache::PromptCache,
    registry: Arc<ModelRegistry>,
    residency: Residency,
    /// Below this much available memory, shed.
    low_memory_bytes: u64,
    sessions: Arc<sessions::SessionStore>,
    form: crate::options::ModelOptions,
    /// How decode steps are built.
    decode: crate::model::decode_step::DecodeMode,
    prefill_chunk: usize,
    scheduler: scheduler::Scheduler,
    /// Transcriptions in flight, advanced one window at a time in turn.
    transcriptions: std::collections::VecDeque<speech::ActiveTranscription>,
    last_publish: Instant,
    last_housekeeping: Instant,
    max_tokens_limit: Option<u32>,
    /// Requested model names (None: the default) and what they resolved to.
    routes: HashMap<Option<String>, String>,
    snapshot: Arc<Mutex<EngineSnapshot>>,
    queued: Arc<AtomicU32>,
    served: Arc<AtomicU64>,
    cancelled: Arc<AtomicU64>,
    stopping: Arc<AtomicBool>,
}

impl Engine {
    fn run(&mut self, rx: mpsc::Receiver<Control>) {
        let mut stopped = false;
        loop {
            // Jobs are taken between ticks; the engine blocks for one only
            // when nothing is generating (waking at least every
            // PRESSURE_POLL to look at the machine's memory).
            let mut pending = false;
            let mut first = if self.scheduler.is_empty() && self.transcriptions.is_empty() && !stopped {
                let wait = self.residency.next_expiry().map_or(PRESSURE_POLL, |d| d.min(PRESSURE_POLL));
                match rx.recv_timeout(wait) {
                    Ok(c) => Some(c),
                    Err(mpsc::RecvTimeoutError::Timeout) => None,
                    Err(mpsc::RecvTimeoutError::Disconnected) => break,
                }
            } else {
                None
            };
            // While generating, at most JOBS_PER_TICK jobs are taken before
            // the next step, so a flood of requests cannot stall the streams.
            let mut taken = 0;
            loop {
                if taken >= JOBS_PER_TICK && !self.scheduler.is_empty() {
                    break;
                }
                taken += 1;
                let control = match first.take() {
                    Some(c) => c,
                    None => match rx.try_recv() {
                        Ok(c) => c,
                        Err(_) => break,
                    },
                };
                match control {
                    Control::Job(job) => {
                        self.queued.fetch_sub(1, Ordering::SeqCst);
                        if self.stopping.load(Ordering::SeqCst) {
                            refuse(job);
                            continue;
                        }
                        pending |= self.handle_guarded(job);
                        self.served.fetch_add(1, Ordering::SeqCst);
                    }
                    Control::Stop => {
                        stopped = true;
                        while let Ok(Control::Job(job)) = rx.try_recv() {
                            refuse(job);
                        }
                        self.transcriptions.clear();
                        for ended in self.scheduler.refuse_waiting() {
                            self.answer(ended);
                        }
                    }
                }
            }
            // One window of one transcription per pass, taking turns.
            if let Some(t) = self.transcriptions.pop_front() {
                match t.step(self.store.as_ref()) {
                    speech::Progress::Going(t) => self.transcriptions.push_back(t),
                    speech::Progress::Ended { model, keep_alive } => {
                        self.residency.touch(&model, keep_alive);
                        self.publish();
                    }
                }
            }
            if !self.scheduler.is_empty() {
                // The prompt cache's RAM tier counts in the budget.
                let used = self.residency.used_bytes() + self.prompts.ram_usage().1;
                let free = self.residency.budget_bytes().saturating_sub(used);
                let ended = self.scheduler.tick(&mut self.prompts, free);
                // Status follows arrivals, admissions and ends at once (before
                // a client hears its answer is done), token counts every PUBLISH_EVERY.
                if self.scheduler.take_changed() || self.last_publish.elapsed() >= PUBLISH_EVERY {
                    self.publish();
                }
                for ended in ended {
                    self.answer(ended);
                }
                // While generating, keep-alive and memory pressure are looked at every PRESSURE_POLL.
                if !self.scheduler.is_empty() && self.last_housekeeping.elapsed() < PRESSURE_POLL {
                    continue;
                }
            }
            if !self.transcriptions.is_empty() && self.last_housekeeping.elapsed() < PRESSURE_POLL {
                continue;
            }
            if stopped && self.scheduler.is_empty() && self.transcriptions.is_empty() {
                break;
            }
            if pending {
                // Its request is coming (image bytes being resent, or being prepared): keep its model.
                self.publish();
                continue;
            }
            self.last_housekeeping = Instant::now();
            // Models generating are in use: their idle clocks restart.
            for name in self.scheduler.models_in_use() {
                self.residency.touch(&name, None);
            }
            for t in &self.transcriptions {
                self.residency.touch(t.model_name(), None);
            }
            for name in self.residency.expire() {
                self.prompts.clear_ram();
                tracing::info!(model = %name, "keep-alive expired: unloaded");
            }
            if !self.residency.take_evicted().is_empty() {
                self.prompts.clear_ram();
            }
            self.relieve_memory_pressure();
            self.publish();
        }
        tracing::info!("engine stopped");
    }

    /// Runs a job; a bug that panics in it (a hostile model file the checks
    /// missed) fails that job, not the engine: its reply channels drop, so
    /// its client hears "dropped the request".
    fn handle_guarded(&mut self, job: Job) -> bool {
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.handle(job))) {
            Ok(pending) => pending,
            Err(panic) => {
                let what = error::panic_message(&*panic);
                tracing::error!("a job panicked ({what}); its client was answered with an error");
                false
            }
        }
    }

    /// Answers a generation that ended: `Done` (saving a session's turn
    /// first), nothing for a client that left, or its error.
    fn answer(&mut self, (active, outcome): scheduler::Ended) {
        let scheduler::Active { seq, stop, turn, keep_alive, .. } = active;
        self.residency.touch(seq.model_name(), keep_alive);
        self.finish(outcome, seq.events(), &stop, turn);
    }

    fn finish(
        &mut self,
        outcome: Result<generate::Finished, EngineError>,
        events: &tmpsc::UnboundedSender<Response>,
        stop: &[String],
        turn: Option<SessionTurn>,
    ) {
        match outcome {
            Ok(generate::Finished::Done(mut stats)) => {
                if let Some(SessionTurn { name, mut messages, started }) = turn {
                    messages.push(mlxbc_shared::ChatMessage::assistant(self.answer_text(&stats, stop)));
                    let mut saved = self.sessions.finish(&name, &started, &messages);
                    if let (Err(sessions::SessionError::Io { source, .. }), Some(disk)) = (&saved, self.prompts.disk())
                    {
                        // Sessions get the disk before the cache: a full
                        // disk gives up cached KV blocks for the turn.
                        if source.kind() == std::io::ErrorKind::StorageFull
                            && same_filesystem(disk.dir(), self.sessions.dir())
                        {
                            let freed = disk.free_for_others(SESSION_ROOM_BYTES);
                            tracing::warn!(
                                freed_bytes = freed,
                                "the disk is full: prompt cache blocks removed so a session turn can be saved"
                            );
                            if freed > 0 {
                                saved = self.sessions.finish(&name, &started, &messages);
                            }
                        }
                    }
                    if let Err(e) = saved {
                        // The answer stands, but the client must know the turn is lost.
                        tracing::warn!(session = %crate::logging::peer(&name), "{}", crate::logging::peer(&e.to_string()));
                        stats.warnings.push(format!("this turn was answered but not saved to session {name}: {e}"));
                    }
                }
                let _ = events.send(Response::Done { stats });
            }
            Ok(generate::Finished::AskedForMedia) => {}
            Ok(generate::Finished::Abandoned) => {
                self.cancelled.fetch_add(1, Ordering::SeqCst);
                tracing::info!("generation cancelled: the client went away");
            }
            Err(e) => {
                tracing::warn!(kind = ?e.kind(), message = %crate::logging::peer(&e.to_string()), "generation failed");
                let _ = events.send(e.into_response());
            }
        }
    }

    /// Runs a job; true when its request is still in flight (the daemon
    /// asked the client for media bytes, or loaded a model for a request
    /// being prepared) and the model is about to be needed. A generation
    /// is set up here and handed to the scheduler.
    fn handle(&mut self, job: Job) -> bool {
        match job {
            Job::Generate { request, events, cancel, received, prepared, media, turn, load_ms: loaded_ms } => {
                let keep_alive = request.keep_alive;
                let begun = match self.load(request.model.as_deref(), keep_alive) {
                    Err(e) => Err(e),
                    Ok(residency::Loaded { name, model, load_ms }) => {
                        self.publish();
                        let mut ctx = generate::GenerationContext {
                            model_name: &name,
                            load_ms: load_ms.max(loaded_ms),
                            prefill_chunk: self.prefill_chunk,
                            decode: self.decode,
                            received,
                            store: self.store.as_ref(),
                            prompts: &mut self.prompts,
                            max_tokens_limit: self.max_tokens_limit,
                            prepared,
                            media,
                        };
                        let begun = generate::begin(model, &mut ctx, &request, events.clone(), cancel);
                        self.residency.touch(&name, keep_alive);
                        begun
                    }
                };
                match begun {
                    Ok(generate::Begun::Sequence(seq)) => {
                        let own = self.residency.memory_of(seq.model_name());
                        let beside = self.residency.budget_bytes().saturating_sub(own);
                        let active = scheduler::Active::new(*seq, request.stop, turn, keep_alive);
                        if let Err((active, e)) = self.scheduler.add(active, beside) {
                            self.answer((active, Err(e)));
                        }
                    }
                    Ok(generate::Begun::Finished(generate::Finished::AskedForMedia)) => return true,
                    Ok(generate::Begun::Finished(f)) => self.finish(Ok(f), &events, &request.stop, turn),
                    Err(e) => self.finish(Err(e), &events, &request.stop, turn),
                }
            }
            Job::Transcribe { request, audio, events, cancel, received } => {
                let loaded = match &request.model {
                    Some(m) => Ok(m.clone()),
                    None => self.registry.default_speech(),
                }
                .and_then(|m| {
                    let memo = self.store.as_ref().and_then(|s| s.lock().tree("tower-fingerprints").ok());
                    self.residency.ensure_speech(&self.registry, &m, self.form, request.keep_alive, memo.as_ref())
                });
                match loaded {
                    Err(e) => {
                        let _ = events.send(e.into_response());
                    }
                    Ok((name, model, load_ms)) => {
                        self.publish();
                        let begun = speech::ActiveTranscription::begin(
                            name, model, &request, audio, events, cancel, received, load_ms,
                        );
                        match begun {
                            Ok(t) => self.transcriptions.push_back(t),
                            Err((e, events)) => {
                                let _ = events.send(e.into_response());
                            }
                        }
                    }
                }
            }
            Job::ClearPromptRam { reply } => {
                let dropped = self.prompts.clear_ram() as u64;
                self.publish();
                let _ = reply.send(dropped);
            }
            Job::Prefetch { model, media, prepared, reply } => {
                let response = match self.load(model.as_deref(), None) {
                    Err(e) => e.into_response(),
                    Ok(residency::Loaded { name, model: m, .. }) => {
                        let refs: Vec<&mlxbc_shared::MediaRef> = media.iter().collect();
                        let resolved = match prepared {
                            Some(p) => media::finish(&m, &name, self.store.as_ref(), p, &refs),
                            None => media::resolve(&m, &name, self.store.as_ref(), &refs),
                        };
                        match resolved {
                            Ok(media::Resolved::Missing(missing)) => {
                                let _ = reply.send(Response::NeedMedia { missing });
                                return true;
                            }
                            Ok(media::Resolved::Ready(e)) => {
                                Response::Prefetched { encoded: e.stats.misses, cached: e.stats.hits }
                            }
                            Err(e) => e.into_response(),
                        }
                    }
                };
                let _ = reply.send(response);
            }
            Job::Load { model, keep_alive, for_request, reply } => {
                let t = Instant::now();
                let response = match self.load(model.as_deref(), keep_alive) {
                    Ok(residency::Loaded { name, .. }) => {
                        if let Some(ka) = keep_alive {
                            self.residency.touch(&name, Some(ka));
                        }
                        let memory_bytes = self.residency.memory_of(&name);
                        Response::Loaded { model: name, load_ms: t.elapsed().as_millis() as u64, memory_bytes }
                    }
                    Err(e) => e.into_response(),
                };
                // Status read right after the reply must already see this load.
                self.publish();
                let _ = reply.send(response);
                return for_request;
            }
            Job::Unload { model, reply } => {
                self.prompts.clear_ram();
                let response = match self.registry.resolve(Some(&model)) {
                    Ok(resolved) => {
                        Response::Unloaded { was_loaded: self.residency.unload(&resolved.name), model: resolved.name }
                    }
                    Err(_) => Response::Unloaded { was_loaded: self.residency.unload(&model), model },
                };
                self.publish();
                let _ = reply.send(response);
            }
        }
        false
    }

    /// Makes a model resident (fingerprinting its tower through the store's
    /// memo) and remembers which model the requested name led to.
    fn load(&mut self, model: Option<&str>, keep_alive: Option<KeepAlive>) -> Result<residency::Loaded, EngineError> {
        // A name that already led to a resident model needs no resolving
        // (which may scan other tools' stores).
        let asked = model.map(String::from);
        if let Some((name, model)) = self.routes.get(&asked).and_then(|n| Some((n, self.residency.handle(n)?))) {
            return Ok(residency::Loaded { name: name.clone(), model, load_ms: 0.0 });
        }
        let memo = self.store.as_ref().and_then(|s| s.lock().tree("tower-fingerprints").ok());
        let loaded = self.residency.ensure_loaded(&self.registry, model, self.form, keep_alive, memo.as_ref())?;
        if self.routes.len() >= MAX_ROUTES {
            // Many spellings of paths can name one model: keep the table small.
            self.routes.clear();
        }
        self.routes.insert(asked, loaded.name.clone());
        Ok(loaded)
    }

    /// The text a finished generation streamed: its tokens decoded, cut
    /// before the first stop string (the stream held those back).
    fn answer_text(&self, stats: &mlxbc_shared::GenerationStats, stop: &[String]) -> String {
        let Some(model) = self.residency.get(&stats.model) else { return String::new() };
        let mut text = model.prompter.tokenizer.decode(&stats.token_ids, true).unwrap_or_default();
        if let Some(cut) = stop.iter().filter_map(|s| text.find(s.as_str())).min() {
            text.truncate(cut);
        }
        text
    }

    /// Under memory pressure, lets go of one tier at a time — the encoder RAM
    /// tier, then the prompt cache's RAM tier, then the least recently used unpinned
    /// model — re-reading available memory after each, until it recovers.
    fn relieve_memory_pressure(&mut self) {
        loop {
            let Some(available) = memory::available_bytes() else { return };
            if available >= self.low_memory_bytes {
                return;
            }
            let shed = if let Some(n) = self.store.as_ref().map(|s| s.lock().shed_ram()).filter(|&n| n > 0) {
                ("encoder RAM tier", "cached image features".to_string(), n as u64)
            } else if !self.prompts.is_empty() {
                let bytes = self.prompts.ram_usage().1;
                ("prompt cache RAM tier", format!("{} prompt KV blocks", self.prompts.clear_ram()), bytes)
            } else if let Some((name, bytes)) = self.residency.shed_one() {
                self.prompts.clear_ram();
                ("model", name, bytes)
            } else {
                return; // nothing left that may go: pinned models stay
            };
            let _ = mlx_rs::memory::clear_cache();
            let (tier, what, freed_bytes) = shed;
            tracing::warn!(tier, %what, freed_bytes, available, threshold = self.low_memory_bytes, "memory pressure: shed");
            let mut snap = self.snapshot.lock().unwrap_or_else(PoisonError::into_inner);
            snap.sheds.push((
                Instant::now(),
                ShedEvent { ago_s: 0, tier: tier.into(), what, freed_bytes, available_bytes: available },
            ));
            let excess = snap.sheds.len().saturating_sub(SHED_HISTORY);
            snap.sheds.drain(..excess);
        }
    }

    fn publish(&mut self) {
        self.last_publish = Instant::now();
        let mut snap = self.snapshot.lock().unwrap_or_else(PoisonError::into_inner);
        snap.sequences = self.scheduler.describe();
        snap.admission_queue = self.scheduler.queue_length() as u32;
        snap.reserved_kv_bytes = self.scheduler.reserved_bytes();
        let limits = self.scheduler.limits();
        snap.max_batch = limits.max_batch as u32;
        snap.max_queue = limits.max_queue as u32;
        snap.memory_budget_bytes = self.residency.budget_bytes();
        snap.loaded = self.residency.describe();
        snap.routes = self
            .routes
            .iter()
            .filter_map(|(asked, name)| {
                let m = self.residency.get(name)?;
                let route = PromptRoute {
                    model: name.clone(),
                    prompter: m.prompter.clone(),
                    context: m.lm.context_length() as usize,
                    placeholder: m.vision.as_ref().map(|v| v.placeholder.clone()),
                    media: media::MediaRoute::of(m),
                    kv_root: m.kv_root,
                    recurrent: m.lm.recurrent(),
                };
                Some((asked.clone(), route))
            })
            .collect();
        let (blocks, bytes) = self.prompts.ram_usage();
        snap.prompt_ram =
            PromptRamState { blocks, bytes, budget_bytes: self.prompts.ram_budget(), counters: self.prompts.counters };
        snap.mlx_active_bytes = mlx_rs::memory::active_memory().unwrap_or(0) as u64;
        snap.mlx_peak_bytes = mlx_rs::memory::peak_memory().unwrap_or(0) as u64;
    }
}
