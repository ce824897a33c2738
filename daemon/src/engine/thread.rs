//! The engine thread's loop: jobs are taken between the scheduler's ticks
//! (blocking for one only when nothing is generating), a generation's job
//! is set up (`generate::begin`) and handed to the scheduler, transcriptions
//! advance one window per pass, and housekeeping runs every
//! `PRESSURE_POLL`. Status is published to the handle's snapshot.

use super::housekeeping::PRESSURE_POLL;
use super::jobs::{refuse, Control, Job, PromptRoute};
use super::residency::{self, Residency};
use super::{generate, scheduler, speech, EngineSnapshot, PromptRamState};
use crate::catalog::registry::ModelRegistry;
use crate::error::{self, EngineError};
use crate::{media, prompt_cache, sessions};
use mlxbc_shared::sync::lock;
use mlxbc_shared::{KeepAlive, Response};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

/// Requested model names remembered for tokenizing off the engine thread.
const MAX_ROUTES: usize = 64;

/// Jobs (new requests' setup, loads, prefetches) taken between two ticks
/// while generations run.
const JOBS_PER_TICK: usize = 16;

/// How often status is republished while generations run.
const PUBLISH_EVERY: Duration = Duration::from_millis(200);

pub(super) struct Engine {
    pub(super) store: Option<media::SharedStore>,
    /// Counters `/metrics` reports.
    pub(super) metrics: std::sync::Arc<crate::metrics::Metrics>,
    pub(super) prompts: prompt_cache::PromptCache,
    pub(super) registry: Arc<ModelRegistry>,
    pub(super) residency: Residency,
    /// Below this much available memory, shed.
    pub(super) low_memory_bytes: u64,
    pub(super) sessions: Arc<sessions::SessionStore>,
    pub(super) form: crate::model::options::ModelOptions,
    /// How decode steps are built.
    pub(super) decode: crate::model::decode_step::DecodeMode,
    pub(super) prefill_chunk: usize,
    pub(super) scheduler: scheduler::Scheduler,
    /// Transcriptions in flight, advanced one window at a time in turn.
    pub(super) transcriptions: speech::Transcriptions,
    /// Embedding requests in progress, a batch per pass.
    pub(super) embeddings: super::embed::EmbedJobs,
    pub(super) last_publish: Instant,
    pub(super) last_housekeeping: Instant,
    pub(super) max_tokens_limit: Option<u32>,
    /// Each model's KV cache setting (`[models."NAME"]`), by name.
    pub(super) kv_settings: std::collections::BTreeMap<String, mlxbc_shared::KvCacheSpec>,
    /// Requested model names (None: the default) and what they resolved to.
    pub(super) routes: HashMap<Option<String>, String>,
    pub(super) snapshot: Arc<Mutex<EngineSnapshot>>,
    pub(super) queued: Arc<AtomicU32>,
    pub(super) served: Arc<AtomicU64>,
    pub(super) cancelled: Arc<AtomicU64>,
    pub(super) stopping: Arc<AtomicBool>,
}

impl Engine {
    pub(super) fn run(&mut self, rx: mpsc::Receiver<Control>) {
        let mut stopped = false;
        // The last pass found a request on its way (see `pending` below).
        let mut awaiting = false;
        loop {
            if crate::error::DEVICE_LOST.load(Ordering::SeqCst) {
                // Every later step would fail the same way: exit so the
                // service manager (or the next client) starts a fresh daemon.
                tracing::error!(
                    status = crate::error::DEVICE_LOST_EXIT,
                    "the GPU's context is lost: mlxbcd exits to be started again"
                );
                std::process::exit(crate::error::DEVICE_LOST_EXIT);
            }
            // Jobs are taken between ticks; the engine blocks for one only
            // when nothing is generating (waking at least every
            // PRESSURE_POLL to look at the machine's memory).
            let mut pending = false;
            // While a model warms its batch paths the engine does not block:
            // a piece of warming runs between looks at the jobs (unless a
            // request is on its way: then it waits for it, as when idle).
            let warming = !awaiting && self.residency.warming();
            let busy = !self.scheduler.is_empty() || !self.transcriptions.is_empty() || !self.embeddings.is_empty();
            let mut first = if !busy && !stopped && !warming {
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
                        self.embeddings.clear(|| EngineError::ShuttingDown("mlxbcd is shutting down".into()));
                        for ended in self.scheduler.refuse_waiting() {
                            self.answer(ended);
                        }
                    }
                }
            }
            // One window of one transcription per pass, taking turns.
            if let Some((model, keep_alive)) = self.transcriptions.step(self.store.as_ref(), &self.metrics) {
                self.residency.touch(&model, keep_alive);
                self.publish();
            }
            // One batch of one embedding request per pass, likewise.
            if let Some((job, _)) = self.embeddings.step(self.store.as_ref(), &self.metrics) {
                let (model, keep_alive) = job.model();
                self.residency.touch(model, keep_alive);
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
            let side_work = !self.transcriptions.is_empty() || !self.embeddings.is_empty();
            if side_work && self.last_housekeeping.elapsed() < PRESSURE_POLL {
                continue;
            }
            if stopped && self.scheduler.is_empty() && !side_work {
                break;
            }
            awaiting = pending;
            if pending {
                // Its request is coming (image bytes being resent, or being prepared): keep its model.
                self.publish();
                continue;
            }
            // Idle: warm one batch size of a newly loaded model (never ahead of a request).
            if warming && self.scheduler.is_empty() && !side_work && !stopped {
                self.residency.warm_next();
                self.publish();
                if self.residency.warming() {
                    continue;
                }
            }
            self.housekeeping();
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
                    Ok(residency::Ready { name, model, load_ms }) => {
                        let draft = self.draft_for(&name, &request);
                        self.publish();
                        let (draft, draft_ms) = match draft {
                            Ok(d) => d,
                            Err(e) => {
                                self.finish(Err(e), &events, &request.stop, turn);
                                return false;
                            }
                        };
                        let adapter_bytes = model.adapter_bytes();
                        let adapter = match request.adapter.as_deref() {
                            None => None,
                            Some(a) => match self.registry.resolve_adapter(a).and_then(|dir| {
                                model.adapter(a, &dir).map_err(|e| EngineError::BadRequest(format!("{e:#}")))
                            }) {
                                Ok(adapter) => Some(adapter),
                                Err(e) => {
                                    self.finish(Err(e), &events, &request.stop, turn);
                                    return false;
                                }
                            },
                        };
                        // A newly loaded adapter counts in its base's memory.
                        self.residency.add_memory(&name, model.adapter_bytes() - adapter_bytes);
                        let mut ctx = generate::GenerationContext {
                            model_name: &name,
                            load_ms: load_ms.max(loaded_ms) + draft_ms,
                            prefill_chunk: self.prefill_chunk,
                            decode: self.decode,
                            received,
                            store: self.store.as_ref(),
                            prompts: &mut self.prompts,
                            max_tokens_limit: self.max_tokens_limit,
                            prepared,
                            media,
                            draft,
                            kv_default: self.kv_settings.get(&name).copied().unwrap_or_default(),
                            adapter,
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
                    self.residency.ensure_speech(
                        &self.registry,
                        &m,
                        self.form.clone(),
                        request.keep_alive,
                        memo.as_ref(),
                    )
                });
                match loaded {
                    Err(e) => {
                        let _ = events.send(e.into_response());
                    }
                    Ok((name, model, load_ms)) => {
                        self.publish();
                        let begun = speech::ActiveTranscription::begin(
                            name.clone(),
                            model,
                            &request,
                            audio,
                            events,
                            cancel,
                            received,
                            load_ms,
                        );
                        match begun {
                            Ok(t) => self.transcriptions.add(t),
                            Err((e, events)) => {
                                self.metrics.transcription(&name, &format!("{:?}", e.kind()), None);
                                let _ = events.send(e.into_response());
                            }
                        }
                    }
                }
            }
            Job::Embed { request, received, reply } => {
                let (model, keep_alive) = (request.model.clone(), request.keep_alive);
                self.begin_embedding(&model, keep_alive, received, reply, "embed", |name, m, store, arrival| {
                    super::embed::EmbedJob::begin(name, m, store, request, arrival)
                });
            }
            Job::Rerank { request, received, reply } => {
                let (model, keep_alive) = (request.model.clone(), request.keep_alive);
                self.begin_embedding(&model, keep_alive, received, reply, "rerank", |name, m, store, arrival| {
                    super::embed::EmbedJob::begin_rerank(name, m, store, request, arrival)
                });
            }
            Job::ClearPromptRam { reply } => {
                let dropped = self.prompts.clear_ram() as u64;
                self.publish();
                let _ = reply.send(dropped);
            }
            Job::Prefetch { model, media, prepared, reply } => {
                let response = match self.load(model.as_deref(), None) {
                    Err(e) => e.into_response(),
                    Ok(residency::Ready { name, model: m, .. }) => {
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
            Job::Load { model, keep_alive, for_request, sharded, reply } => {
                let t = Instant::now();
                if sharded {
                    if let Err(e) = self.split_next(model.as_deref()) {
                        let _ = reply.send(e.into_response());
                        return for_request;
                    }
                }
                let response = match self.load(model.as_deref(), keep_alive) {
                    Ok(residency::Ready { name, .. }) => {
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

    /// Loads the embedder (or reranker) `model` and begins the job `begin`
    /// makes of it; a refusal is answered at once.
    fn begin_embedding(
        &mut self,
        model: &str,
        keep_alive: Option<KeepAlive>,
        received: std::time::Instant,
        reply: tokio::sync::oneshot::Sender<mlxbc_shared::Response>,
        api: &'static str,
        begin: impl FnOnce(
            &str,
            std::rc::Rc<dyn crate::model::family::Embedder>,
            Option<&crate::media::SharedStore>,
            super::embed::Arrival,
        ) -> Result<
            super::embed::EmbedJob,
            (EngineError, tokio::sync::oneshot::Sender<mlxbc_shared::Response>),
        >,
    ) {
        let memo = self.store.as_ref().and_then(|s| s.lock().tree("tower-fingerprints").ok());
        let loaded =
            self.residency.ensure_embedder(&self.registry, model, self.form.clone(), keep_alive, memo.as_ref());
        match loaded {
            Ok((name, m, load_ms)) => {
                self.publish();
                if load_ms > 0.0 {
                    self.metrics.load(&name, load_ms);
                }
                self.residency.touch(&name, keep_alive);
                match begin(&name, m, self.store.as_ref(), super::embed::Arrival { load_ms, received, reply }) {
                    Ok(job) => self.embeddings.add(job),
                    Err((e, reply)) => {
                        self.metrics.embedding(api, &name, &format!("{:?}", e.kind()), None);
                        let _ = reply.send(e.into_response());
                    }
                }
            }
            Err(e) => {
                let _ = reply.send(e.into_response());
            }
        }
    }

    /// Marks `model` to be split over the group when it loads (`mlxbc load
    /// --sharded`); refused where there is no group.
    fn split_next(&mut self, model: Option<&str>) -> Result<(), EngineError> {
        if self.residency.cluster.is_none() {
            return Err(EngineError::BadRequest(
                "this daemon is not rank 0 of a group: start it with --hostfile FILE --rank 0 (docs/distributed.md)"
                    .into(),
            ));
        }
        let name = self.registry.resolve(model)?.name;
        let whole = self.residency.get(&name).is_some();
        let split = self.residency.cluster.as_mut().expect("checked above");
        if whole && !split.names.contains(&name) {
            return Err(EngineError::BadRequest(format!(
                "{name} is loaded whole on rank 0: `mlxbc unload {name}` first, then load it --sharded"
            )));
        }
        split.names.insert(name);
        if let Some(m) = model {
            split.names.insert(m.to_string());
        }
        Ok(())
    }

    /// Makes a model resident (fingerprinting its tower through the store's
    /// memo) and remembers which model the requested name led to.
    fn load(&mut self, model: Option<&str>, keep_alive: Option<KeepAlive>) -> Result<residency::Ready, EngineError> {
        // A name that already led to a resident model needs no resolving
        // (which may scan other tools' stores).
        let asked = model.map(String::from);
        if let Some((name, model)) = self.routes.get(&asked).and_then(|n| Some((n, self.residency.handle(n)?))) {
            return Ok(residency::Ready { name: name.clone(), model, load_ms: 0.0 });
        }
        let memo = self.store.as_ref().and_then(|s| s.lock().tree("tower-fingerprints").ok());
        let loaded =
            self.residency.ensure_loaded(&self.registry, model, self.form.clone(), keep_alive, memo.as_ref())?;
        if loaded.load_ms > 0.0 {
            self.metrics.load(&loaded.name, loaded.load_ms);
        }
        if self.routes.len() >= MAX_ROUTES {
            // Many spellings of paths can name one model: keep the table small.
            self.routes.clear();
        }
        self.routes.insert(asked, loaded.name.clone());
        Ok(loaded)
    }

    /// The draft model a generation on `name` drafts with, loaded beside
    /// it if needed (and the milliseconds that took): the request's, else
    /// the one config.toml names, where its speculation may use one. A
    /// configured draft that cannot load is logged and left out unless the
    /// request insists on drafting with one.
    fn draft_for(
        &mut self,
        name: &str,
        request: &mlxbc_shared::GenerateRequest,
    ) -> Result<(Option<std::rc::Rc<crate::model::Model>>, f64), EngineError> {
        use mlxbc_shared::Speculation;
        if matches!(request.speculate, Speculation::Off | Speculation::Ngram) {
            return Ok((None, 0.0));
        }
        let memo = self.store.as_ref().and_then(|s| s.lock().tree("tower-fingerprints").ok());
        let found =
            self.residency.draft_for(&self.registry, name, request.draft.as_deref(), self.form.clone(), memo.as_ref());
        let insists = request.draft.is_some() || request.speculate == Speculation::Draft;
        match found {
            Ok(found) => Ok(found),
            Err(e) if insists => Err(e),
            Err(e) => {
                tracing::warn!(model = %name, error = %e, "its configured draft model is left out");
                Ok((None, 0.0))
            }
        }
    }

    pub(super) fn publish(&mut self) {
        self.last_publish = Instant::now();
        let mut snap = lock(&self.snapshot);
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
                    placeholder: m.media_tower.as_ref().map(|v| v.placeholder.clone()),
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
