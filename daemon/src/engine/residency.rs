//! Which models are resident, for how long they stay after their last use,
//! and how many fit: at most `max_loaded` models within a memory budget.
//! Loading beyond either unloads the least recently used unpinned model
//! first; a model that cannot fit even then is refused before it is loaded.

use super::keep_alive::{self, Clock, NoRoom};
use crate::catalog::registry::ModelRegistry;
use crate::error::EngineError;
use crate::model::family::{Embedder, SpeechRecognizer};
use crate::model::{weights::WeightForm, Model};
use mlxbc_shared::{KeepAlive, LoadedModel};
use std::collections::HashMap;
use std::path::Path;
use std::rc::Rc;
use std::time::{Duration, Instant};

/// How many draft models a target keeps loaded beside it: enough for the
/// few drafts its clients name in turn (each load costs seconds), few
/// enough that drafts nobody uses any more do not hold memory for long.
pub const MOST_DRAFT_MODELS: usize = 3;

const MIB: u64 = 1 << 20;

/// A resident model of either kind.
#[derive(Clone)]
pub enum Servable {
    Chat(Rc<Model>),
    Speech(Rc<dyn SpeechRecognizer>),
    Embed(Rc<dyn Embedder>),
}

impl Servable {
    fn architecture(&self) -> &'static str {
        match self {
            Servable::Chat(m) => m.lm.architecture(),
            Servable::Speech(s) => s.architecture(),
            Servable::Embed(e) => e.architecture(),
        }
    }
}

struct Resident {
    /// Shared with the generation using it (the engine is one thread).
    model: Servable,
    clock: Clock,
}

/// A model made resident (or found so).
pub struct Ready {
    /// Its canonical name.
    pub name: String,
    pub model: Rc<Model>,
    /// Time spent loading it now (0 when it was resident).
    pub load_ms: f64,
}

/// The resident models and their keep-alive clocks.
pub struct Residency {
    models: HashMap<String, Resident>,
    default_keep_alive: KeepAlive,
    max_loaded: usize,
    budget_bytes: u64,
    /// Models unloaded to make room since the engine last asked.
    evicted: Vec<String>,
    /// The compute device ("cpu", "gpu"): part of a model's KV identity.
    pub device: String,
    /// The group this daemon leads, and which models it splits over it.
    pub cluster: Option<SplitModels>,
    /// How decode steps are built: a compiled step is traced at load.
    pub decode: crate::model::decode_step::DecodeMode,
    /// Batch sizes whose paths a newly loaded model warms while the engine
    /// is idle (`Model::warm_batches`): a GPU's powers of two up to its
    /// `max_batch`; none on a CPU, which compiles nothing for them.
    pub warm_rows: Vec<usize>,
    /// Draft models config.toml names per model (`[models."NAME"] draft`),
    /// by the name written there.
    pub drafts: std::collections::BTreeMap<String, String>,
    /// Configured drafts that failed to load, and why (not tried again
    /// for every request; a request naming one hears why).
    failed_drafts: HashMap<(String, String), String>,
}

/// Which models are split over the group rank 0 leads: those named in
/// `[cluster] sharded` or loaded with `mlxbc load --sharded` (by the name
/// asked or the name it resolved to), and any whose weights would not fit
/// rank 0's memory budget whole.
pub struct SplitModels {
    pub coordinator: crate::cluster::Coordinator,
    pub names: std::collections::BTreeSet<String>,
}

/// Loads a model split over the group: every other rank is told to load
/// its shard (they load while rank 0 loads its own), then every rank's
/// answer is collected, whatever rank 0's own load gave, so the group's
/// collectives stay in step; a rank that refused (other weights, another
/// version, no such model) is named in the error.
fn load_split(
    coordinator: &crate::cluster::Coordinator,
    resolved: &crate::catalog::registry::ResolvedModel,
    form: crate::model::options::ModelOptions,
    fingerprints: Option<&sled::Tree>,
) -> Result<crate::families::LoadedModel, EngineError> {
    let fingerprint = crate::cluster::weights_fingerprint(&resolved.path)
        .map_err(|e| EngineError::ModelLoad(format!("reading {}: {e}", resolved.path.display())))?;
    let slot = coordinator.new_slot();
    coordinator.begin_load(slot, &resolved.name, &fingerprint).map_err(EngineError::inference)?;
    let shard = crate::distributed::Shard { rank: 0, size: coordinator.size(), link: coordinator.link() };
    let mine = crate::families::load_any(
        &resolved.path,
        crate::model::options::ModelOptions { shard: Some(shard), ..form },
        fingerprints,
    );
    let reply = match &mine {
        Ok(_) => crate::cluster::own_reply(None),
        Err(e) => crate::cluster::plan::Reply::Refused(format!("{e:#}")),
    };
    let others = coordinator.finish_load(reply);
    // The whole tensors the shards were cut from are free now: give their
    // buffers back, so the rank holds about its part.
    crate::distributed::release_freed_memory();
    let mine = mine.map_err(|e| {
        EngineError::ModelLoad(format!(
            "loading rank 0's shard of {} from {}: {e:#}",
            resolved.name,
            resolved.path.display()
        ))
    })?;
    others.map_err(|e| match EngineError::inference(e) {
        EngineError::Inference(why) => {
            EngineError::ModelLoad(format!("loading {} over the group: {why}", resolved.name))
        }
        other => other,
    })?;
    Ok(match mine {
        crate::families::LoadedModel::Chat(mut model) => {
            model.lm = Box::new(crate::cluster::ShardedLm::new(
                model.lm,
                slot,
                &resolved.name,
                &fingerprint,
                coordinator.clone(),
            ));
            crate::families::LoadedModel::Chat(model)
        }
        speech => speech,
    })
}

/// Memory a model will take once loaded in `form`, from its files alone
/// (before loading; the measurement after loading is what is accounted).
/// GGUF and quantized weights are expanded when computing in dense f32.
pub fn estimated_bytes(path: &Path, form: WeightForm) -> u64 {
    let dense = matches!(form, WeightForm::DenseF32);
    if path.is_file() {
        let size = std::fs::metadata(path).map_or(0, |m| m.len());
        // GGUF Q4/Q5/Q8 blocks average 5-6 bits a weight; f32 takes 32.
        return if dense { size * 6 } else { size + size / 8 };
    }
    let size: u64 = std::fs::read_dir(path)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
        .filter_map(|e| e.metadata().ok())
        .map(|m| m.len())
        .sum();
    let config = crate::model::read_json(&path.join("config.json")).ok().flatten().unwrap_or_default();
    let bits = config.get("quantization").and_then(|q| q.get("bits")).and_then(|b| b.as_u64());
    let half = matches!(config.get("torch_dtype").and_then(|d| d.as_str()), Some("bfloat16" | "float16"));
    match (dense, bits, half) {
        (true, Some(b), _) => size * 32 / (b + 1).max(1), // scales and biases ride along
        (true, None, true) => size * 2,
        _ => size + size / 8,
    }
}

/// Bytes of f16 copies of a quantized model's matrices, from the packed
/// `estimate`: 16 bits a weight against ~4.5 packed (4-bit with group-64
/// scales and biases; GGUF K-quants average more, so this errs high).
pub fn dense_copy_bytes(path: &Path, estimate: u64) -> u64 {
    let config = crate::model::read_json(&path.join("config.json")).ok().flatten().unwrap_or_default();
    let bits = config.get("quantization").and_then(|q| q.get("bits")).and_then(|b| b.as_u64()).unwrap_or(4);
    estimate * 16 * 2 / (2 * bits + 1).max(1)
}

impl Residency {
    /// No models yet; `default_keep_alive` applies when a request names none.
    pub fn new(default_keep_alive: KeepAlive, max_loaded: usize, budget_bytes: u64) -> Self {
        Self {
            models: HashMap::new(),
            default_keep_alive,
            max_loaded: max_loaded.max(1),
            budget_bytes,
            evicted: vec![],
            device: String::new(),
            cluster: None,
            decode: crate::model::decode_step::DecodeMode::Eager,
            warm_rows: Vec::new(),
            drafts: Default::default(),
            failed_drafts: HashMap::new(),
        }
    }

    /// The memory budget in bytes.
    pub fn budget_bytes(&self) -> u64 {
        self.budget_bytes
    }

    /// What the resident models took at load, together.
    pub fn used_bytes(&self) -> u64 {
        self.models.values().map(|r| r.clock.memory_bytes).sum()
    }

    fn clocks(&self) -> impl Iterator<Item = (&String, &Clock)> {
        self.models.iter().map(|(n, r)| (n, &r.clock))
    }

    /// The least recently used model that may be unloaded.
    fn least_recent_unpinned(&self) -> Option<String> {
        keep_alive::least_recent_unpinned(self.clocks())
    }

    /// Unloads least recently used unpinned models until one more model of
    /// `need` bytes fits both limits.
    fn make_room(&mut self, name: &str, need: u64) -> Result<(), EngineError> {
        let victims = keep_alive::make_room(self.clocks(), need, self.budget_bytes, self.max_loaded).map_err(|e| {
            EngineError::OutOfMemory(match e {
                NoRoom::OverBudget => format!(
                    "model {name} needs about {} MiB, more than the memory budget of {} MiB; \
                     raise memory_budget_mib in config.toml or use a smaller (quantized) model",
                    need / MIB,
                    self.budget_bytes / MIB
                ),
                NoRoom::Pinned { pinned, used } => format!(
                    "model {name} (about {} MiB) does not fit next to the pinned models {} ({} of {} MiB used, \
                     at most {} loaded); unload one with `mlxbc unload NAME`",
                    need / MIB,
                    pinned.join(", "),
                    used / MIB,
                    self.budget_bytes / MIB,
                    self.max_loaded
                ),
            })
        })?;
        for victim in victims {
            tracing::info!(model = %victim, to_load = %name, "unloading the least recently used model to make room");
            self.unload(&victim);
            self.evicted.push(victim);
        }
        Ok(())
    }

    /// Names of models unloaded to make room since the last call.
    pub fn take_evicted(&mut self) -> Vec<String> {
        std::mem::take(&mut self.evicted)
    }

    /// Memory pressure's last tier: unloads the least recently used unpinned
    /// model; returns its name and the bytes it held.
    pub fn shed_one(&mut self) -> Option<(String, u64)> {
        let victim = self.least_recent_unpinned()?;
        let bytes = self.memory_of(&victim);
        self.unload(&victim);
        Some((victim, bytes))
    }

    /// Resolves `name` and loads it unless resident, as a chat model (a
    /// speech model is refused with what to do instead). Returns the
    /// canonical name, the model, and the milliseconds spent loading (0
    /// when already resident).
    pub fn ensure_loaded(
        &mut self,
        registry: &ModelRegistry,
        name: Option<&str>,
        form: crate::model::options::ModelOptions,
        keep_alive: Option<KeepAlive>,
        fingerprints: Option<&sled::Tree>,
    ) -> Result<Ready, EngineError> {
        let (name, model, load_ms) = self.ensure_any(registry, name, form, keep_alive, fingerprints)?;
        match model {
            Servable::Chat(model) => Ok(Ready { name, model, load_ms }),
            Servable::Speech(_) => Err(EngineError::BadRequest(format!(
                "{name} is a speech model: it transcribes audio (`mlxbc transcribe FILE -m {name}`, \
                 /v1/audio/transcriptions) and does not chat"
            ))),
            Servable::Embed(_) => Err(EngineError::BadRequest(format!(
                "{name} is an embedding model: it embeds text (`mlxbc embed -m {name} TEXT`, /v1/embeddings, \
                 /api/embed) and does not chat"
            ))),
        }
    }

    /// The same for a speech model (a chat model is refused).
    pub fn ensure_speech(
        &mut self,
        registry: &ModelRegistry,
        name: &str,
        form: crate::model::options::ModelOptions,
        keep_alive: Option<KeepAlive>,
        fingerprints: Option<&sled::Tree>,
    ) -> Result<(String, Rc<dyn SpeechRecognizer>, f64), EngineError> {
        let (name, model, load_ms) = self.ensure_any(registry, Some(name), form, keep_alive, fingerprints)?;
        match model {
            Servable::Speech(s) => Ok((name, s, load_ms)),
            Servable::Chat(_) | Servable::Embed(_) => Err(EngineError::BadMedia(format!(
                "{name} is a language model and cannot take audio; transcribe with a Whisper model \
                 (`mlxbc models` lists them)"
            ))),
        }
    }

    /// The same for an embedding model (another kind is refused, saying
    /// what it does instead).
    pub fn ensure_embedder(
        &mut self,
        registry: &ModelRegistry,
        name: &str,
        form: crate::model::options::ModelOptions,
        keep_alive: Option<KeepAlive>,
        fingerprints: Option<&sled::Tree>,
    ) -> Result<(String, Rc<dyn Embedder>, f64), EngineError> {
        let (name, model, load_ms) = self.ensure_any(registry, Some(name), form, keep_alive, fingerprints)?;
        match model {
            Servable::Embed(e) => Ok((name, e, load_ms)),
            Servable::Chat(_) | Servable::Speech(_) => Err(EngineError::BadRequest(format!(
                "{name} is not an embedding model or a reranker; embed (or rerank) with one (`mlxbc models` \
                 lists them as embedding and rerank), e.g. all-MiniLM-L6-v2"
            ))),
        }
    }

    /// Resolves `name` and loads it unless resident, whatever its kind.
    fn ensure_any(
        &mut self,
        registry: &ModelRegistry,
        name: Option<&str>,
        form: crate::model::options::ModelOptions,
        keep_alive: Option<KeepAlive>,
        fingerprints: Option<&sled::Tree>,
    ) -> Result<(String, Servable, f64), EngineError> {
        let resolved = registry.resolve(name)?;
        if let Some(r) = self.models.get(&resolved.name) {
            return Ok((resolved.name, r.model.clone(), 0.0));
        }
        let estimate = estimated_bytes(&resolved.path, form.form);
        let split = self.cluster.as_ref().filter(|c| {
            c.names.contains(&resolved.name)
                || name.is_some_and(|n| c.names.contains(n))
                || c.names.iter().any(|n| registry.resolve(Some(n)).is_ok_and(|r| r.name == resolved.name))
                || (estimate > self.budget_bytes && c.coordinator.phase() == crate::cluster::Phase::Ready)
        });
        let split = split.map(|c| c.coordinator.clone());
        let size = split.as_ref().map_or(1, |c| c.size() as u64);
        self.make_room(&resolved.name, estimate / size)?;
        let form = self.choose_batch_weights(&resolved.name, &resolved.path, form, estimate, split.is_some());
        let t = Instant::now();
        tracing::info!(model = %resolved.name, path = %resolved.path.display(), split = split.is_some(), "loading model");
        let before = mlx_rs::memory::active_memory().unwrap_or(0);
        let loaded = match &split {
            Some(c) => load_split(c, &resolved, form.clone(), fingerprints),
            None => crate::families::load_any(&resolved.path, form.clone(), fingerprints).map_err(|e| {
                EngineError::ModelLoad(format!(
                    "loading model {} from {}: {e:#}",
                    resolved.name,
                    resolved.path.display()
                ))
            }),
        }?;
        let model = match loaded {
            crate::families::LoadedModel::Chat(mut model) => {
                model.batch_weights = form.batch;
                *model.warm_pending.borrow_mut() = self.warm_rows.clone();
                model.warm_up().and_then(|()| model.warm_decode(self.decode)).map_err(
                    |e| match EngineError::inference(e) {
                        EngineError::RankStopped(why) => EngineError::RankStopped(why),
                        other => EngineError::ModelLoad(format!(
                            "running model {} for the first time: {other}",
                            resolved.name
                        )),
                    },
                )?;
                // A split model's blocks are rank 0's shard of the KV: named
                // for the group's size and rank 0 (the other ranks rename
                // them for theirs, `PromptKeys::for_rank`).
                let form_name = match &split {
                    Some(c) => format!("{form:?} split over {} ranks, rank 0", c.size()),
                    None => format!("{form:?}"),
                };
                model.kv_root = match crate::prompt_cache::model_root(&resolved.path, &form_name, &self.device) {
                    Ok(root) => Some(root),
                    Err(e) => {
                        tracing::warn!(model = %resolved.name, error = %e, "no KV identity: prompts of this model are not cached");
                        None
                    }
                };
                Servable::Chat(Rc::new(model))
            }
            crate::families::LoadedModel::Speech(s) => Servable::Speech(Rc::from(s)),
            crate::families::LoadedModel::Embed(e) => Servable::Embed(Rc::from(e)),
        };
        let load_ms = t.elapsed().as_secs_f64() * 1000.0;
        let memory_bytes = mlx_rs::memory::active_memory().unwrap_or(0).saturating_sub(before) as u64;
        tracing::info!(model = %resolved.name, load_ms, memory_bytes, "model loaded");
        // The estimate may have been low: measured, others make room if needed.
        while self.used_bytes() + memory_bytes > self.budget_bytes {
            let Some(victim) = self.least_recent_unpinned() else { break };
            tracing::info!(model = %victim, loaded = %resolved.name, "over the memory budget after loading: unloading");
            self.unload(&victim);
            self.evicted.push(victim);
        }
        self.models.insert(
            resolved.name.clone(),
            Resident {
                model: model.clone(),
                clock: Clock {
                    memory_bytes,
                    keep_alive: keep_alive.unwrap_or(self.default_keep_alive),
                    last_used: Instant::now(),
                },
            },
        );
        Ok((resolved.name, model, load_ms))
    }

    /// The draft model for the resident model `name`: `asked` (a request's)
    /// else the one config.toml names for it, loaded beside it unless it
    /// is already (its memory counted with the target's, and unloaded
    /// with it; a target keeps its [`MOST_DRAFT_MODELS`] most recently
    /// used drafts).
    /// `None` when neither names one; with the milliseconds a load took now
    /// (0 when it was resident). A draft that cannot serve its target
    /// (another tokenizer, a family whose cache cannot forget drafts, no
    /// room) is an error with the reason; a configured one that failed is
    /// not tried again until the daemon restarts.
    pub fn draft_for(
        &mut self,
        registry: &ModelRegistry,
        name: &str,
        asked: Option<&str>,
        form: crate::model::options::ModelOptions,
        fingerprints: Option<&sled::Tree>,
    ) -> Result<(Option<Rc<Model>>, f64), EngineError> {
        let Some(target) = self.handle(name) else { return Ok((None, 0.0)) };
        let wanted = match asked {
            Some(a) => a.to_string(),
            None => match self.configured_draft(registry, name) {
                Some(d) => d,
                None => return Ok((None, 0.0)),
            },
        };
        let key = (name.to_string(), wanted.clone());
        if let Some(why) = self.failed_drafts.get(&key) {
            return Err(EngineError::BadRequest(why.clone()));
        }
        let resolved = registry.resolve(Some(&wanted))?;
        {
            let mut drafts = target.draft_models.borrow_mut();
            if let Some(i) = drafts.iter().position(|d| d.name == resolved.name) {
                let used = drafts.remove(i);
                let model = used.model.clone();
                drafts.push(used);
                return Ok((Some(model), 0.0));
            }
        }
        let t = Instant::now();
        let loaded = self.load_draft(name, &target, &resolved, form, fingerprints);
        if let (Err(EngineError::BadRequest(why) | EngineError::ModelLoad(why)), None) = (&loaded, asked) {
            self.failed_drafts.insert(key, why.clone());
        }
        loaded.map(|m| (Some(m), t.elapsed().as_secs_f64() * 1000.0))
    }

    /// The draft config.toml names for `name` (written under that name or
    /// any name that resolves to it).
    fn configured_draft(&self, registry: &ModelRegistry, name: &str) -> Option<String> {
        if let Some(d) = self.drafts.get(name) {
            return Some(d.clone());
        }
        self.drafts
            .iter()
            .find(|(k, _)| registry.resolve(Some(k)).is_ok_and(|r| r.name == name))
            .map(|(_, d)| d.clone())
    }

    fn load_draft(
        &mut self,
        name: &str,
        target: &Rc<Model>,
        resolved: &crate::catalog::registry::ResolvedModel,
        form: crate::model::options::ModelOptions,
        fingerprints: Option<&sled::Tree>,
    ) -> Result<Rc<Model>, EngineError> {
        let draft = &resolved.name;
        if draft == name {
            return Err(EngineError::BadRequest(format!(
                "{draft} cannot draft for itself: a draft model is a smaller model with the same tokenizer"
            )));
        }
        // Room beside the resident models, never by unloading the target:
        // its own least recently used drafts go first.
        while target.draft_models.borrow().len() >= MOST_DRAFT_MODELS {
            self.drop_oldest_draft(name, target);
        }
        let estimate = estimated_bytes(&resolved.path, form.form);
        let drafts: Vec<u64> = target.draft_models.borrow().iter().map(|d| d.bytes).collect();
        let others = self.models.iter().filter(|(n, _)| n.as_str() != name).map(|(n, r)| (n, &r.clock));
        let (given_up, victims) =
            keep_alive::make_room_for_draft(others, estimate, self.memory_of(name), &drafts, self.budget_bytes)
                .map_err(|_| {
                    EngineError::OutOfMemory(format!(
                        "the draft model {draft} (about {} MiB) does not fit beside {name} in the memory budget of \
                         {} MiB",
                        estimate / MIB,
                        self.budget_bytes / MIB
                    ))
                })?;
        for _ in 0..given_up {
            self.drop_oldest_draft(name, target);
        }
        for victim in victims {
            tracing::info!(model = %victim, draft = %draft, "unloading the least recently used model to make room");
            self.unload(&victim);
            self.evicted.push(victim);
        }
        let form = self.choose_batch_weights(draft, &resolved.path, form, estimate, false);
        let before = mlx_rs::memory::active_memory().unwrap_or(0);
        let t = Instant::now();
        let loaded = crate::families::load_any(&resolved.path, form, fingerprints).map_err(|e| {
            EngineError::ModelLoad(format!("loading the draft model {draft} from {}: {e:#}", resolved.path.display()))
        })?;
        let crate::families::LoadedModel::Chat(mut model) = loaded else {
            return Err(EngineError::BadRequest(format!("{draft} is a speech model and cannot draft tokens")));
        };
        if !model.lm.verifies_drafts() {
            return Err(EngineError::BadRequest(format!(
                "{draft} ({}) cannot draft: its cache cannot forget rejected drafts (llama, Qwen2 and Qwen3 \
                 decoders can)",
                model.lm.architecture()
            )));
        }
        if let Some(why) = crate::model::tokenizer::disagreement(&target.prompter.tokenizer, &model.prompter.tokenizer)
        {
            return Err(EngineError::BadRequest(format!(
                "{draft} cannot draft for {name}: {why}; a draft model must have the same tokenizer"
            )));
        }
        model.warm_up().and_then(|()| model.warm_decode(self.decode)).map_err(|e| {
            EngineError::ModelLoad(format!("running the draft model {draft} for the first time: {e:#}"))
        })?;
        let bytes = mlx_rs::memory::active_memory().unwrap_or(0).saturating_sub(before) as u64;
        let model = Rc::new(model);
        target.draft_models.borrow_mut().push(crate::model::AttachedDraft {
            name: draft.clone(),
            model: model.clone(),
            bytes,
        });
        self.add_memory(name, bytes);
        tracing::info!(model = %name, draft = %draft, load_ms = t.elapsed().as_secs_f64() * 1000.0, memory_bytes = bytes, "draft model loaded");
        Ok(model)
    }

    /// Unloads `target`'s least recently used draft model (sequences
    /// drafting with it keep it until they end) and stops counting it in
    /// the memory of `name`, the target.
    fn drop_oldest_draft(&mut self, name: &str, target: &Model) {
        let mut drafts = target.draft_models.borrow_mut();
        if drafts.is_empty() {
            return;
        }
        let old = drafts.remove(0);
        if let Some(r) = self.models.get_mut(name) {
            r.clock.memory_bytes = r.clock.memory_bytes.saturating_sub(old.bytes);
        }
        tracing::info!(model = %name, draft = %old.name, "draft model unloaded to make room for another");
    }

    /// `form` with dense copies only where the budget holds
    /// them beside the model and what is resident (without unloading
    /// anything for them); otherwise expanded per step, as a split model
    /// always is (its ranks have no budget of their own).
    fn choose_batch_weights(
        &self,
        name: &str,
        path: &Path,
        mut form: crate::model::options::ModelOptions,
        estimate: u64,
        split: bool,
    ) -> crate::model::options::ModelOptions {
        use crate::model::layers::BatchWeights;
        if form.batch != BatchWeights::Dense {
            return form;
        }
        let copies = dense_copy_bytes(path, estimate);
        let free = self.budget_bytes.saturating_sub(self.used_bytes() + estimate);
        if split || copies > free {
            // A split model's ranks have no budget of their own.
            tracing::info!(
                model = %name,
                copies_mib = copies / MIB,
                free_mib = free / MIB,
                split,
                "batched steps expand the packed weights per step (no room for dense copies)"
            );
            form.batch = form.batch.without_copies();
        }
        form
    }

    /// Warms one pending batch size of one resident model (the first found);
    /// false when none is pending. A failure is logged and ends that
    /// model's warming: it costs the first burst a stall, nothing more.
    pub fn warm_next(&self) -> bool {
        for (name, r) in &self.models {
            let Servable::Chat(m) = &r.model else { continue };
            let Some(rows) = m.warm_pending.borrow().first().copied() else { continue };
            // Temperature, top-k and top-p: every kernel a sampled row runs.
            let params = mlxbc_shared::SamplingParams { temperature: 0.7, top_k: 40, top_p: 0.9, seed: Some(0) };
            let sampled = |row: &mlx_rs::Array| crate::decoding::sampling::Sampler::new(params.clone())?.pick(row);
            // Guarded like a request's step: a panic stops this model's
            // warming, not the engine.
            let warmed =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| m.warm_batches(rows as i32, &sampled)))
                    .unwrap_or_else(|panic| Err(anyhow::anyhow!("panicked: {}", crate::error::panic_message(&*panic))));
            match warmed {
                Ok(()) => {
                    m.warm_pending.borrow_mut().remove(0);
                    if m.warm_pending.borrow().is_empty() {
                        // The warming's buffers are garbage now: give them
                        // back rather than keep them in MLX's cache, where
                        // other processes on the GPU cannot have them
                        // (suspected in an out-of-memory of three daemons on
                        // one H200: docs/measurements/h200-2026-12-05-speculation.md).
                        let _ = mlx_rs::memory::clear_cache();
                    }
                }
                Err(e) => {
                    tracing::warn!(model = %name, rows, error = %format!("{e:#}"), "warming batched paths failed");
                    m.warm_pending.borrow_mut().clear();
                }
            }
            return true;
        }
        false
    }

    /// True while a resident model has batch sizes left to warm.
    pub fn warming(&self) -> bool {
        self.models.values().any(|r| matches!(&r.model, Servable::Chat(m) if !m.warm_pending.borrow().is_empty()))
    }

    /// The resident chat model of that canonical name, as a handle.
    pub fn handle(&self, name: &str) -> Option<Rc<Model>> {
        match &self.models.get(name)?.model {
            Servable::Chat(m) => Some(m.clone()),
            Servable::Speech(_) | Servable::Embed(_) => None,
        }
    }

    /// The resident chat model of that canonical name.
    pub fn get(&self, name: &str) -> Option<&Model> {
        match &self.models.get(name)?.model {
            Servable::Chat(m) => Some(m),
            Servable::Speech(_) | Servable::Embed(_) => None,
        }
    }

    /// Restarts a model's idle clock, optionally with a new keep-alive.
    pub fn touch(&mut self, name: &str, keep_alive: Option<KeepAlive>) {
        if let Some(r) = self.models.get_mut(name) {
            r.clock.last_used = Instant::now();
            if let Some(ka) = keep_alive {
                r.clock.keep_alive = ka;
            }
        }
    }

    /// MLX memory a resident model took at load.
    pub fn memory_of(&self, name: &str) -> u64 {
        self.models.get(name).map_or(0, |r| r.clock.memory_bytes)
    }

    /// Drops a model; false when it was not resident.
    pub fn unload(&mut self, name: &str) -> bool {
        let was = self.models.remove(name).is_some();
        if was {
            let _ = mlx_rs::memory::clear_cache();
            tracing::info!(model = %name, "unloaded");
        }
        was
    }

    /// How long until the next model's keep-alive runs out.
    pub fn next_expiry(&self) -> Option<Duration> {
        keep_alive::next_expiry(self.clocks(), Instant::now())
    }

    /// Unloads every model whose keep-alive has run out; returns their names.
    pub fn expire(&mut self) -> Vec<String> {
        let gone = keep_alive::expired(self.clocks(), Instant::now());
        for name in &gone {
            self.models.remove(name);
        }
        if !gone.is_empty() {
            let _ = mlx_rs::memory::clear_cache();
        }
        gone
    }

    /// Counts `bytes` more (a LoRA adapter loaded on it) in `name`'s memory.
    pub fn add_memory(&mut self, name: &str, bytes: u64) {
        if let Some(r) = self.models.get_mut(name) {
            r.clock.memory_bytes += bytes;
        }
    }

    /// Wire descriptions of the resident models.
    pub fn describe(&self) -> Vec<LoadedModel> {
        let now = Instant::now();
        let mut out: Vec<LoadedModel> = self
            .models
            .iter()
            .map(|(name, r)| LoadedModel {
                name: name.clone(),
                architecture: r.model.architecture().to_string(),
                memory_bytes: r.clock.memory_bytes,
                keep_alive: r.clock.keep_alive,
                expires_in_s: r.clock.expires_at().map(|t| t.saturating_duration_since(now).as_secs()),
                idle_s: now.duration_since(r.clock.last_used).as_secs(),
                context_length: match &r.model {
                    Servable::Chat(m) => m.lm.context_length(),
                    Servable::Speech(_) | Servable::Embed(_) => 0,
                },
                pinned: r.clock.pinned(),
                batch_weights: match &r.model {
                    Servable::Chat(m) if !m.warm_pending.borrow().is_empty() => {
                        format!("{} (warming batches)", m.batch_weights.describe())
                    }
                    Servable::Chat(m) => m.batch_weights.describe().to_string(),
                    Servable::Speech(_) | Servable::Embed(_) => "-".to_string(),
                },
                speculation: match &r.model {
                    Servable::Chat(m) if m.lm.verifies_drafts() => {
                        let mode = format!("{:?}", crate::decoding::lookup::configured()).to_lowercase();
                        let attached = m.draft_models.borrow();
                        let drafts: Vec<&str> = attached.iter().map(|d| d.name.as_str()).collect();
                        match drafts.len() {
                            0 => mode,
                            1 => format!("{mode}, draft {}", drafts[0]),
                            _ => format!("{mode}, drafts {}", drafts.join(", ")),
                        }
                    }
                    _ => "-".to_string(),
                },
                draft_tokens: match &r.model {
                    Servable::Chat(m) => m.drafts.get().0,
                    Servable::Speech(_) | Servable::Embed(_) => 0,
                },
                accepted_draft_tokens: match &r.model {
                    Servable::Chat(m) => m.drafts.get().1,
                    Servable::Speech(_) | Servable::Embed(_) => 0,
                },
                adapters: match &r.model {
                    Servable::Chat(m) => m
                        .adapters
                        .borrow()
                        .values()
                        .map(|a| mlxbc_shared::protocol::AdapterStatus {
                            name: a.name.clone(),
                            method: if a.dora { "DoRA" } else { "LoRA" }.into(),
                            rank: a.rank as u32,
                            bytes: a.bytes,
                        })
                        .collect(),
                    Servable::Speech(_) | Servable::Embed(_) => Vec::new(),
                },
            })
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        out
    }
}
