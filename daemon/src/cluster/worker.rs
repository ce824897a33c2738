//! A rank above 0: no socket, no gateway, no scheduler. It joins the
//! group, loads the shards rank 0 asks for from its own store, and carries
//! out rank 0's plan call by call. When the group breaks (a rank died or
//! was cut off) it drops what the group held and joins again, for as long
//! as it runs.

use super::coordinator::{own_reply, probe_all_sum};
use super::plan::{self, Op, Reply};
use super::sharded::dtype_of;
use crate::catalog::registry::ModelRegistry;
use crate::distributed::{Group, Link, Shard};
use crate::model::family::LanguageModel;
use crate::model::kv_cache::{CacheOp, KvCache};
use crate::model::options::ModelOptions;
use crate::model::positions::{Deepstack, MediaPositions};
use crate::prompt_cache::{KvLayout, PromptCache, PromptKeys};
use anyhow::{anyhow, Context, Result};
use mlx_rs::Array;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

/// One shard this rank holds.
struct Held {
    lm: Box<dyn LanguageModel>,
    caches: HashMap<u64, KvCache>,
    /// The last forward pass's hidden states (what `Logits` reads).
    last: Option<Array>,
    /// Its KV layout, learnt from its first forward pass (rank 0's warm-up).
    layout: Option<KvLayout>,
}

/// What a worker keeps beside its shards, across the group's lives.
struct Local {
    /// This rank's own prompt cache (its shards' blocks, in its own home).
    prompts: PromptCache,
    /// Mean seconds a forward pass takes here (for the status).
    step_s: Option<f64>,
}

/// The worker daemon's main: serves as the rank `settings.cluster` names
/// until the process is stopped.
pub fn serve_as_worker(
    settings: &mlxbc_shared::settings::Settings,
    options: crate::model::options::EngineOptions,
) -> Result<std::convert::Infallible> {
    let c = &settings.cluster;
    let hostfile = crate::distributed::Hostfile::read(c.hostfile.as_deref().context("no hostfile")?)?;
    let rank = c.rank.context("no rank")?;
    let device = mlx_rs::Device::default();
    let form = ModelOptions {
        form: crate::model::weights::WeightForm::for_device(&device, options.weights),
        fusion: options.fusion,
        // A rank holds its shard without a budget of its own.
        batch: crate::model::layers::BatchWeights::for_device(options.batch).without_copies(),
        shard: None,
    };
    tracing::info!(
        rank,
        ranks = hostfile.size(),
        backend = %c.backend,
        rank0 = %hostfile.host(0),
        "serving as a worker of the group (models from {})",
        settings.models_dir.display()
    );
    let ram = settings.prompt_cache_ram_bytes.unwrap_or(1 << 30);
    let prompts = PromptCache::new(ram, crate::prompt_cache::open_disk(settings), Default::default());
    run(ModelRegistry::new(settings), form, prompts, &c.backend, rank, &hostfile)
}

/// Serves as rank `rank` of the hostfile's group until the process is stopped.
pub fn run(
    registry: ModelRegistry,
    options: ModelOptions,
    prompts: PromptCache,
    backend: &str,
    rank: usize,
    hostfile: &crate::distributed::Hostfile,
) -> ! {
    let size = hostfile.size();
    let own = hostfile.addresses(rank);
    let peers: Vec<_> = (0..size).filter(|&r| r != rank).flat_map(|r| hostfile.addresses(r)).collect();
    let link = Link::default();
    let mut local = Local { prompts, step_s: None };
    let mut attempts = 0u32;
    loop {
        Group::forget_backends();
        let group = match Group::init(backend, true) {
            Ok(g) if g.rank() == rank && g.size() == size => g,
            Ok(g) => {
                tracing::error!(
                    "MLX made this daemon rank {} of {}, but it was started as rank {rank} of {size}",
                    g.rank(),
                    g.size()
                );
                std::thread::sleep(Duration::from_secs(5));
                continue;
            }
            Err(e) => {
                attempts += 1;
                if attempts == 1 || attempts.is_multiple_of(30) {
                    tracing::info!(attempts, "waiting for the group: {e:#}");
                }
                std::thread::sleep(Duration::from_secs(2));
                continue;
            }
        };
        attempts = 0;
        tracing::info!(rank, size, backend, "joined the group");
        let group = Arc::new(group);
        link.set(Some(group.clone()));
        let shard = Shard { rank, size, link: link.clone() };
        let mut held: HashMap<u32, Held> = HashMap::new();
        // The ring's sockets, to sleep on between messages (other
        // backends' waits are their own).
        let sockets = if backend == "ring" { crate::distributed::ring_sockets(&own, &peers) } else { Vec::new() };
        let why = serve(&group, &registry, &options, &shard, &mut held, &mut local, &sockets);
        tracing::warn!("the group broke ({why:#}); joining it again");
        // Shards are loaded again on rank 0's word: a new rank 0 may ask
        // for other models, and the caches are gone with the old group.
        drop(held);
        link.set(None);
        drop(group);
        let _ = mlx_rs::memory::clear_cache();
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// Carries out rank 0's messages until a collective fails.
fn serve(
    group: &Group,
    registry: &ModelRegistry,
    options: &ModelOptions,
    shard: &Shard,
    held: &mut HashMap<u32, Held>,
    local: &mut Local,
    sockets: &[i32],
) -> anyhow::Error {
    loop {
        if !sockets.is_empty() {
            crate::distributed::wait_readable(sockets);
        }
        let ops = match group.broadcast_bytes(None).and_then(|b| plan::decode(&b)) {
            Ok(ops) => ops,
            Err(e) => return e,
        };
        for op in ops {
            if let Err(e) = carry_out(group, registry, options, shard, held, local, op) {
                return e;
            }
        }
    }
}

fn reply(group: &Group, r: &Reply) -> Result<()> {
    group.all_gather(&Array::from_slice(&plan::reply_bytes(r), &[plan::REPLY_BYTES as i32]))?.eval()?;
    Ok(())
}

fn carry_out(
    group: &Group,
    registry: &ModelRegistry,
    options: &ModelOptions,
    shard: &Shard,
    held: &mut HashMap<u32, Held>,
    local: &mut Local,
    op: Op,
) -> Result<()> {
    match op {
        Op::Hello { version } => {
            let mine = env!("CARGO_PKG_VERSION");
            let r = if version == mine {
                own_reply(None)
            } else {
                Reply::Refused(format!("it runs mlxbcd {mine}, rank 0 runs {version}"))
            };
            reply(group, &r)?;
            probe_all_sum(group)?;
        }
        Op::Load { slot, name, fingerprint } => {
            let r = match load(registry, options, shard, &name, &fingerprint) {
                Ok(lm) => {
                    held.insert(slot, Held { lm, caches: HashMap::new(), last: None, layout: None });
                    own_reply(None)
                }
                Err(e) => {
                    tracing::error!(model = %name, "not loaded: {e:#}");
                    Reply::Refused(format!("{e:#}"))
                }
            };
            reply(group, &r)?;
        }
        Op::Unload { slot } => {
            held.remove(&slot);
            let _ = mlx_rs::memory::clear_cache();
        }
        Op::Caches { slot, ops } => {
            let h = model(held, slot)?;
            let layers = h.lm.num_layers();
            for op in ops {
                match op {
                    CacheOp::Store { id, row, keys } => store(h, &mut local.prompts, shard, id, row, &keys),
                    op => KvCache::replay(&mut h.caches, layers, op)?,
                }
            }
        }
        Op::Embed { slot, shape, ids } => {
            let h = model(held, slot)?;
            anyhow::ensure!(elements(&shape)? == ids.len(), "rank 0 sent {} ids for shape {shape:?}", ids.len());
            h.lm.embed(&Array::from_slice(&ids, &shape))?.eval()?;
        }
        Op::Forward { slot, cache, shape, dtype, media } => {
            let h = model(held, slot)?;
            // What follows is a broadcast of this shape: bounded like a message.
            anyhow::ensure!(elements(&shape)? <= MAX_EMBEDDINGS, "rank 0 announced embeddings of shape {shape:?}");
            let embeds = group.broadcast(&mlx_rs::ops::zeros_dtype(&shape, dtype_of(&dtype)?)?)?;
            let deepstack = match &media.deepstack {
                Some(plan::DeepstackPlan { row_of, tables }) => {
                    anyhow::ensure!(
                        tables.len() <= MAX_DEEPSTACK,
                        "rank 0 announced {} deepstack tables",
                        tables.len()
                    );
                    let mut layers = Vec::with_capacity(tables.len());
                    for (shape, dtype) in tables {
                        anyhow::ensure!(elements(shape)? <= MAX_EMBEDDINGS, "a deepstack table of shape {shape:?}");
                        // Rows index the table unchecked by MLX's gather.
                        anyhow::ensure!(
                            row_of.iter().all(|&r| r < shape[0] - 1),
                            "deepstack rows beyond their table of shape {shape:?}"
                        );
                        layers.push(group.broadcast(&mlx_rs::ops::zeros_dtype(shape, dtype_of(dtype)?)?)?);
                    }
                    Some(Deepstack { row_of: row_of.clone(), layers })
                }
                None => None,
            };
            let positions = MediaPositions {
                image_blocks: media.image_blocks.as_deref(),
                mrope: media.mrope.as_ref(),
                deepstack: deepstack.as_ref(),
            };
            let c = h.caches.get_mut(&cache).ok_or_else(|| anyhow!("rank 0 named cache {cache}, unknown here"))?;
            // Image blocks are read by absolute position up to the chunk's end.
            let end = c.offset as usize + shape.get(1).copied().unwrap_or(0).max(0) as usize;
            anyhow::ensure!(
                media.image_blocks.as_ref().is_none_or(|b| b.len() >= end),
                "rank 0 sent image blocks shorter than the positions they cover"
            );
            let started = std::time::Instant::now();
            let hidden = h.lm.forward(&embeds, c, &positions)?;
            hidden.eval()?;
            let took = started.elapsed().as_secs_f64();
            local.step_s = Some(local.step_s.map_or(took, |m| 0.9 * m + 0.1 * took));
            if h.layout.is_none() && c.offset > 0 {
                h.layout = KvLayout::of(c).ok();
            }
            h.last = Some(hidden);
        }
        Op::Logits { slot } => {
            let h = model(held, slot)?;
            let last = h.last.as_ref().ok_or_else(|| anyhow!("logits asked before any forward pass"))?;
            h.lm.logits(last)?.eval()?;
        }
        Op::LogitsAll { slot } => {
            let h = model(held, slot)?;
            let last = h.last.as_ref().ok_or_else(|| anyhow!("logits asked before any forward pass"))?;
            h.lm.logits_all(last)?.eval()?;
        }
        Op::Restore { slot, cache, keys, positions } => {
            let h = model(held, slot)?;
            let r = match restore(h, &mut local.prompts, shard, &keys, positions) {
                Ok(c) => {
                    h.caches.insert(cache, c);
                    own_reply(local.step_s)
                }
                Err(why) => Reply::Refused(why),
            };
            reply(group, &r)?;
        }
        Op::Report => reply(group, &own_reply(local.step_s))?,
    }
    Ok(())
}

/// Stores row `row` of cache `id`'s blocks under this rank's names for
/// rank 0's `keys`. A store that cannot be made is logged and skipped: a
/// later restore of those blocks then misses here, and rank 0 computes the
/// prefix again.
fn store(h: &Held, prompts: &mut PromptCache, shard: &Shard, id: u64, row: u32, keys: &[u8]) {
    let Some(cache) = h.caches.get(&id) else {
        tracing::warn!("rank 0 stored the prompt of cache {id}, unknown here");
        return;
    };
    match PromptKeys::from_bytes(keys) {
        Ok(k) => prompts.store(&k.for_rank(shard.rank, shard.size), cache, row as usize),
        Err(e) => tracing::warn!("rank 0 sent prompt keys that are not: {e:#}"),
    }
}

/// This rank's cache of the `positions`-long prefix rank 0 found for
/// `keys`, from this rank's own prompt cache; why not, when it has not
/// all of it.
fn restore(h: &Held, prompts: &mut PromptCache, shard: &Shard, keys: &[u8], positions: u32) -> Result<KvCache, String> {
    let layout = h.layout.as_ref().ok_or("its shard has not run yet")?;
    let keys = PromptKeys::from_bytes(keys).map_err(|e| format!("{e:#}"))?.for_rank(shard.rank, shard.size);
    let reuse = prompts.restore(&keys, layout).ok_or("none of the prefix is stored here")?;
    let here = reuse.ram_tokens + reuse.disk_tokens;
    if here != positions as usize {
        return Err(format!("{here} of the prefix's {positions} positions are stored here"));
    }
    Ok(reuse.cache)
}

/// The most deepstack tables a forward pass may announce (one per layer of
/// the deepest model).
const MAX_DEEPSTACK: usize = 256;

/// The most embedding values one forward pass may announce (a 2048-position
/// chunk of 64 rows of a 16384-wide model).
const MAX_EMBEDDINGS: usize = 1 << 31;

/// The values an announced shape holds; an error for a shape no array has.
fn elements(shape: &[i32]) -> Result<usize> {
    anyhow::ensure!(!shape.is_empty() && shape.len() <= 4, "an array shape of {} axes", shape.len());
    shape.iter().try_fold(1usize, |n, &d| {
        let d = usize::try_from(d).map_err(|_| anyhow!("a negative axis in {shape:?}"))?;
        n.checked_mul(d).ok_or_else(|| anyhow!("shape {shape:?} overflows"))
    })
}

fn model(held: &mut HashMap<u32, Held>, slot: u32) -> Result<&mut Held> {
    held.get_mut(&slot).ok_or_else(|| anyhow!("rank 0 named model slot {slot}, not loaded here"))
}

/// Resolves `name` in this host's own store and loads this rank's shard,
/// after checking its weights are rank 0's.
fn load(
    registry: &ModelRegistry,
    options: &ModelOptions,
    shard: &Shard,
    name: &str,
    fingerprint: &str,
) -> Result<Box<dyn LanguageModel>> {
    let resolved = registry.resolve(Some(name)).map_err(|e| anyhow!("{e}"))?;
    let mine = super::fingerprint::weights_fingerprint(&resolved.path)
        .with_context(|| format!("reading {}", resolved.path.display()))?;
    if mine != fingerprint {
        anyhow::bail!(
            "its {} holds other weights than rank 0's for {name} (fingerprint {} here, {} on rank 0)",
            resolved.path.display(),
            &mine[..12],
            &fingerprint[..12.min(fingerprint.len())]
        );
    }
    let options = ModelOptions { shard: Some(shard.clone()), ..options.clone() };
    tracing::info!(model = %name, path = %resolved.path.display(), "loading this rank's shard");
    let loaded = crate::families::load_any(&resolved.path, options, None)?;
    // The whole tensors the shard was cut from are free: give them back.
    crate::distributed::release_freed_memory();
    match loaded {
        crate::families::LoadedModel::Chat(m) => Ok(m.lm),
        crate::families::LoadedModel::Speech(_) => anyhow::bail!("{name} is a speech model and is not split"),
        crate::families::LoadedModel::Embed(_) => anyhow::bail!("{name} is an embedding model and is not split"),
    }
}
