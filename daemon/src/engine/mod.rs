//! The engine: one OS thread that owns every MLX array. It takes jobs from
//! a queue between scheduler ticks (`scheduler`): every generation in flight
//! is a sequence, prefilled in chunks and decoded in one batch with the
//! others on its model (`batch`). Tokio tasks talk to it through channels
//! and never touch MLX state (mlx-rs arrays are `Send`, not `Sync`).

mod answer;
mod batch;
pub mod draft_batch;
mod draft_costs;
mod draft_model;
mod embed;
pub mod generate;
mod handle;
mod housekeeping;
mod jobs;
mod keep_alive;
pub mod memory;
mod residency;
mod scheduler;
pub(crate) mod sequence;
mod speech;
mod thread;

pub use handle::{EngineHandle, EngineSnapshot, PromptRamState};
pub use jobs::{Job, PreparedPrompt, PromptRoute, SessionTurn};

use crate::catalog::registry::ModelRegistry;
use crate::model::weights::WeightForm;
use crate::{media, prompt_cache, sessions};
use mlxbc_shared::settings::Settings;
use mlxbc_shared::sync::lock;
use residency::Residency;
use std::collections::HashMap;
use std::sync::{mpsc, Arc};
use std::time::Instant;

/// Starts the engine thread. It exits when every handle is dropped, after
/// finishing the job in hand.
pub fn spawn(
    settings: &Settings,
    options: crate::model::options::EngineOptions,
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
        Err(e) if e.is_held_elsewhere() => {
            // Another daemon serves this data directory (through another
            // socket): running beside it without the store would encode
            // every image again and say so only in a log nobody reads.
            return Err(std::io::Error::other(format!(
                "another mlxbcd is using the data directory {} (its feature store is locked); stop it with \
                 `mlxbc stop`, or give this daemon its own directory with MLXBC_HOME",
                settings.paths.home.display()
            )));
        }
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
    let cluster = lead_group(settings)?;
    let handle = EngineHandle {
        cluster: cluster.clone(),
        jobs: tx,
        stopping: Arc::default(),
        snapshot: Arc::default(),
        queued: Arc::default(),
        served: Arc::default(),
        cancelled: Arc::default(),
        device: device_name.to_string(),
        store: store.clone(),
        store_path: settings.feature_cache_dir.clone(),
        prompt_disk: prompt_cache::open_disk(settings),
        prompt_shared: Arc::default(),
        prompt_path: settings.prompt_cache_dir.clone(),
        metrics: Arc::default(),
    };
    let metrics = handle.metrics.clone();
    let form = crate::model::options::ModelOptions {
        form: WeightForm::for_device(&device, options.weights),
        fusion: options.fusion,
        batch: crate::model::layers::BatchWeights::for_device(options.batch),
        shard: None,
    };
    let decode = crate::model::decode_step::DecodeMode::for_device(device_name == "gpu", options.decode);
    let on_gpu = device_name == "gpu";
    let memory_budget = settings.memory_budget_bytes.unwrap_or_else(|| memory::default_budget_bytes(on_gpu));
    tracing::info!(device = device_name, budget_mib = memory_budget >> 20, "memory budget");
    if on_gpu && memory::discrete_gpu_bytes().is_some() {
        // MLX's CUDA allocator would otherwise hold up to 80% of the card
        // in use and cached, whatever else runs on it: bound both by the
        // budget, and what an idle daemon keeps cached to a quarter of it.
        let _ = mlx_rs::memory::set_memory_limit(memory_budget as usize);
        let _ = mlx_rs::memory::set_cache_limit((memory_budget / 4) as usize);
    }
    let max_batch = settings.max_batch.unwrap_or_else(|| max_batch_for(on_gpu));
    {
        // The limits are known now: status before the first model load
        // must not show a zero budget or "max_batch 0".
        let mut snap = lock(&handle.snapshot);
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
    let warm_rows = warm_rows_for(on_gpu, max_batch);
    let prompt_ram_bytes =
        settings.prompt_cache_ram_bytes.unwrap_or_else(|| (1u64 << 30).min(memory::total_bytes() / 8));
    let (prompt_disk, prompt_shared) = (handle.prompt_disk.clone(), handle.prompt_shared.clone());
    let device_for_keys = device_name.to_string();
    // The engine is built on its own thread: models hold compiled MLX
    // functions, which must stay on the thread that made them.
    let thread = std::thread::Builder::new().name("mlx-engine".into()).spawn(move || {
        let mut engine = thread::Engine {
            store,
            prompts: prompt_cache::PromptCache::new(prompt_ram_bytes, prompt_disk, prompt_shared),
            metrics,
            registry,
            residency: {
                let mut r = Residency::new(settings.keep_alive, settings.max_loaded_models, memory_budget);
                r.device = device_for_keys;
                r.decode = decode;
                r.warm_rows = warm_rows;
                r.drafts = settings.models.iter().filter_map(|(m, s)| Some((m.clone(), s.draft.clone()?))).collect();
                r.cluster = cluster.map(|coordinator| residency::SplitModels {
                    coordinator,
                    names: settings.cluster.sharded.iter().cloned().collect(),
                });
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
            embeddings: Default::default(),
            last_publish: Instant::now(),
            last_housekeeping: Instant::now(),
            max_tokens_limit: settings.max_tokens_limit,
            kv_settings: settings
                .models
                .iter()
                .map(|(m, s)| {
                    let spec = mlxbc_shared::KvCacheSpec {
                        bits: s.kv_bits,
                        group_size: s.kv_group_size,
                        start: s.quantized_kv_start,
                        rotate: s.kv_rotate,
                        key_bits: s.kv_key_bits,
                    };
                    (m.clone(), spec)
                })
                .collect(),
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

/// Starts forming the group when this daemon is rank 0 of one (its
/// hostfile read and checked now: a bad one stops the daemon with the
/// reason).
fn lead_group(settings: &Settings) -> std::io::Result<Option<crate::cluster::Coordinator>> {
    let c = &settings.cluster;
    let (Some(path), Some(0)) = (&c.hostfile, c.rank) else { return Ok(None) };
    let hostfile = crate::distributed::Hostfile::read(path).map_err(|e| std::io::Error::other(format!("{e:#}")))?;
    if hostfile.size() < 2 {
        return Ok(None);
    }
    tracing::info!(ranks = hostfile.size(), backend = %c.backend, "leading a group as rank 0");
    Ok(Some(crate::cluster::Coordinator::start(hostfile, c.backend.clone(), c.step_timeout)))
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

/// Batch sizes a newly loaded model warms while the engine is idle: on a
/// GPU the powers of two from 2 up to `max_batch` (MLX compiles a GPU's
/// kernels at first use); none on a CPU. `MLXBC_WARM_BATCHES=2,4` (a
/// diagnostic, and how the tests run the warming on a CPU) names them.
pub fn warm_rows_for(on_gpu: bool, max_batch: usize) -> Vec<usize> {
    if let Ok(list) = std::env::var("MLXBC_WARM_BATCHES") {
        return list
            .split(',')
            .filter_map(|n| n.trim().parse().ok())
            .filter(|&n| (2..=max_batch).contains(&n))
            .collect();
    }
    if !on_gpu {
        return Vec::new();
    }
    std::iter::successors(Some(2usize), |n| Some(n * 2)).take_while(|&n| n <= max_batch.max(2)).collect()
}

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
