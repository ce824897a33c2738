//! The prompt cache: no prompt prefix is prefilled twice, in RAM and on
//! disk, across requests, sessions and restarts (vLLM's automatic prefix
//! caching, llama-server's cache reuse).
//!
//! A prompt is cut into blocks of [`BLOCK_TOKENS`] positions. Each block is
//! named by a chained hash: the model's identity ([`model_root`]: weights,
//! how they were loaded, the device, the KV layout), the previous block's
//! hash, the block's token ids and the content hashes of the images whose
//! placeholders it holds. So a block's name covers everything before its
//! end, and equal names mean equal KV. A request reuses the longest run of
//! cached blocks from its start and prefills only the rest; the prefix that
//! ends right after its last image is kept too (a *tail* block shorter than
//! [`BLOCK_TOKENS`]), so a second question about the same images skips both
//! the tower and the image's prefill.
//!
//! Blocks are stored after a prompt's prefill: in RAM (this module, a byte
//! budget, least recently used out, shed first under memory pressure) and,
//! written behind the request by a thread of their own, on disk
//! ([`mlxbc_cache::BlockStore`]), where they outlive the daemon. A request's
//! blocks on disk are read off the engine thread, while its prompt is
//! tokenized (`requests::prepare`); the engine only joins arrays.
//!
//! Only positions computed inside prefill chunks are stored, never the
//! prompt's last (computed alone, as mlx-lm's `generate_step` does): a later
//! prompt computes that position inside a chunk, and the cache must give
//! the very KV it would have computed, so greedy ids with the cache equal
//! ids without it.

pub mod costs;

use crate::model::kv_cache::{quantized_block_shape, KvCache, KvQuantization};
use lru::LruCache;
use mlx_rs::{Array, Dtype};
use mlxbc_cache::{BlockHash, BlockStore, FeatureDtype, Features, WeightFileIdentity};
use mlxbc_shared::sync::lock;
use sha2::{Digest, Sha256};
use std::collections::{HashMap, HashSet};

use costs::PromptCosts;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;
use std::sync::{Arc, Mutex};

/// Positions per block: small enough that a turn appended to a chat
/// reuses all but its last partial block, big enough that a 4,000-token
/// prefix is 63 reads.
pub const BLOCK_TOKENS: usize = 64;

/// The identity of a model's KV: its weight files (identity and sampled
/// bytes), `form` (how the weights were loaded, which changes the
/// numbers), the device and MLX's version. The chain of every block starts
/// from it, so a model whose weights change gets new keys.
///
/// Sampled, not a hash of every byte: hashing a 4 GB model at each load
/// would cost seconds; a changed file has a new size, mtime or inode, and
/// 16 slices of 64 KiB across each file catch a rewrite that keeps those.
pub fn model_root(path: &Path, form: &str, device: &str) -> std::io::Result<[u8; 32]> {
    let files = weight_files(path)?;
    let mut h = Sha256::new();
    h.update(b"mlxbc-kv-v1\0");
    h.update(form.as_bytes());
    h.update(device.as_bytes());
    h.update(mlx_version().as_bytes());
    for f in &files {
        let id = WeightFileIdentity::of(f)?;
        h.update(f.file_name().map(|n| n.as_encoded_bytes()).unwrap_or_default());
        h.update(format!("{}:{}:{}", id.ino, id.size, id.mtime_ns).as_bytes());
        hash_samples(&mut h, f, id.size)?;
    }
    Ok(h.finalize().into())
}

/// The files a model's identity is made of: the one file, or a
/// directory's weights, configs and tokenizer models, sorted.
pub fn weight_files(path: &Path) -> std::io::Result<Vec<std::path::PathBuf>> {
    let mut files: Vec<std::path::PathBuf> = if path.is_dir() {
        std::fs::read_dir(path)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors" || x == "json" || x == "gguf" || x == "model"))
            .collect()
    } else {
        vec![path.to_path_buf()]
    };
    files.sort();
    Ok(files)
}

/// Feeds 16 slices of 64 KiB spread across `file` (of `size` bytes) to `h`.
pub fn hash_samples(h: &mut Sha256, file: &Path, size: u64) -> std::io::Result<()> {
    let mut buf = vec![0u8; 64 << 10];
    let mut file = std::fs::File::open(file)?;
    for i in 0..16u64 {
        file.seek(SeekFrom::Start(size / 16 * i))?;
        let n = file.read(&mut buf)?;
        h.update(&buf[..n]);
    }
    Ok(())
}

/// MLX's version (a new MLX may compute other bits).
fn mlx_version() -> String {
    // SAFETY: mlx-c fills a fresh string handle, read while alive, then freed.
    unsafe {
        let mut s = mlx_sys::mlx_string_new();
        if mlx_sys::mlx_version(&mut s) != 0 {
            mlx_sys::mlx_string_free(s);
            return String::new();
        }
        let text = std::ffi::CStr::from_ptr(mlx_sys::mlx_string_data(s)).to_string_lossy().into_owned();
        mlx_sys::mlx_string_free(s);
        text
    }
}

/// One image's placeholder positions in a prompt and its content hash.
#[derive(Debug, Clone, Copy)]
pub struct MediaSpan {
    pub start: usize,
    pub end: usize,
    pub hash: [u8; 32],
}

/// The media spans: each run of one of `media_tokens` in `ids` is the next
/// feature array (an image, or one group of a video), named by `hashes`.
pub fn media_spans(ids: &[u32], media_tokens: &[u32], hashes: &[[u8; 32]]) -> Vec<MediaSpan> {
    let mut spans = Vec::new();
    let mut i = 0;
    while i < ids.len() {
        if !media_tokens.contains(&ids[i]) {
            i += 1;
            continue;
        }
        let start = i;
        let token = ids[i];
        while i < ids.len() && ids[i] == token {
            i += 1;
        }
        let hash = hashes.get(spans.len()).copied().unwrap_or([0; 32]);
        spans.push(MediaSpan { start, end: i, hash });
    }
    spans
}

/// The cache keys of one prompt.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct PromptKeys {
    /// The model's KV root the names start from.
    pub root: BlockHash,
    /// Block `i` covers positions `i*B .. (i+1)*B`; only blocks that may be
    /// reused or stored (ending before the prompt's last position).
    pub blocks: Vec<BlockHash>,
    /// The prefix ending right after the last image, when that is not a
    /// block boundary: its end and hash (it continues block `end / B - 1`).
    pub tail: Option<(usize, BlockHash)>,
    /// Ends a reused prefix may not have: inside an image (its positions
    /// were computed seeing the whole image, and the prefill that follows
    /// must start on a boundary it can see from).
    inside_images: Vec<(usize, usize)>,
    /// The model keeps recurrent states (Qwen3.5): a prefix is reusable
    /// only where a state was stored with it.
    pub recurrent: bool,
}

/// A model's prompt-cache root under a LoRA adapter (its fingerprint):
/// the base model's prefixes are not the adapter's.
pub fn adapted_root(root: &[u8; 32], adapter: &[u8; 32]) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(root);
    h.update(b"lora adapter");
    h.update(adapter);
    h.finalize().into()
}

/// A model's prompt-cache root for a KV cache quantized as `q`: its blocks
/// are stored in that form (16-bit words of packed values, scales and
/// biases), so the bits, group size, start and rotation are all in the
/// name; a full-precision prefix is not one of them, nor one of other bits.
pub fn quantized_root(root: &[u8; 32], q: &KvQuantization) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(root);
    h.update(b"quantized kv");
    for v in [q.bits, q.key_bits, q.group_size, q.start, i32::from(q.rotate)] {
        h.update(v.to_le_bytes());
    }
    h.finalize().into()
}

/// The name a recurrent model's states after the prefix `link` ends are
/// stored under (beside that prefix's last block).
pub fn state_name(link: &BlockHash) -> BlockHash {
    let mut h = Sha256::new();
    h.update(link);
    h.update(b"recurrent state");
    h.finalize().into()
}

impl PromptKeys {
    /// The names rank `rank` of a group of `size` stores its shard of
    /// these blocks under (rank 0's are these: its root already names its
    /// shard): each name hashed with the rank, so a host that serves as
    /// another rank, or in another group, never reads a shard not its own.
    pub fn for_rank(&self, rank: usize, size: usize) -> Self {
        if rank == 0 {
            return self.clone();
        }
        let rename = |h: &BlockHash| -> BlockHash {
            let mut d = Sha256::new();
            d.update(h);
            d.update(format!("rank {rank} of {size}").as_bytes());
            d.finalize().into()
        };
        Self {
            root: rename(&self.root),
            blocks: self.blocks.iter().map(rename).collect(),
            tail: self.tail.map(|(end, h)| (end, rename(&h))),
            inside_images: self.inside_images.clone(),
            recurrent: self.recurrent,
        }
    }

    /// The keys as the other ranks of a group receive them.
    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("prompt keys serialize")
    }

    pub fn from_bytes(bytes: &[u8]) -> anyhow::Result<Self> {
        Ok(serde_json::from_slice(bytes)?)
    }

    /// For a model that keeps recurrent states.
    pub fn for_recurrent(mut self, recurrent: bool) -> Self {
        self.recurrent = recurrent;
        self
    }

    /// The end of the longest prefix that may be stored and reused (a block
    /// boundary or the tail, never inside an image), if any: where a
    /// recurrent model saves its states.
    pub fn longest_storable(&self) -> Option<usize> {
        let tail = self.tail.map(|(end, _)| end);
        let blocks = (1..=self.blocks.len()).rev().map(|i| i * BLOCK_TOKENS).find(|&e| self.may_end_at(e));
        tail.into_iter().chain(blocks).max()
    }

    /// Each link of the chain (blocks, then the tail) with the position it ends at.
    fn links(&self) -> Vec<(BlockHash, usize)> {
        let blocks = self.blocks.iter().enumerate().map(|(i, h)| (*h, (i + 1) * BLOCK_TOKENS));
        blocks.chain(self.tail.map(|(end, h)| (h, end))).collect()
    }

    /// Keys of `ids` (with its images' spans) for the model of `root`.
    pub fn of(root: &[u8; 32], ids: &[u32], media: &[MediaSpan]) -> Self {
        let reusable = ids.len().saturating_sub(1);
        let link = |prev: &[u8; 32], from: usize, to: usize| -> BlockHash {
            let mut h = Sha256::new();
            h.update(prev);
            h.update(((to - from) as u32).to_le_bytes());
            for id in &ids[from..to] {
                h.update(id.to_le_bytes());
            }
            for m in media.iter().filter(|m| m.start < to && m.end > from) {
                h.update(m.hash);
            }
            h.finalize().into()
        };
        let mut blocks = Vec::new();
        let mut prev = *root;
        while (blocks.len() + 1) * BLOCK_TOKENS <= reusable {
            let from = blocks.len() * BLOCK_TOKENS;
            prev = link(&prev, from, from + BLOCK_TOKENS);
            blocks.push(prev);
        }
        let tail = media.last().map(|m| m.end).filter(|&p| p <= reusable && p % BLOCK_TOKENS != 0).map(|p| {
            let full = p / BLOCK_TOKENS;
            let before = if full == 0 { *root } else { blocks[full - 1] };
            (p, link(&before, full * BLOCK_TOKENS, p))
        });
        Self {
            root: *root,
            blocks,
            tail,
            inside_images: media.iter().map(|m| (m.start, m.end)).collect(),
            recurrent: false,
        }
    }

    fn may_end_at(&self, end: usize) -> bool {
        !self.inside_images.iter().any(|&(s, e)| s < end && end < e)
    }
}

/// What request preparation (off the engine thread) shares with the
/// engine thread's [`PromptCache`]: the names of the blocks in RAM, and the
/// measured costs that say whether a disk run is worth reading.
#[derive(Debug, Default)]
pub struct SharedIndex {
    pub in_ram: HashSet<BlockHash>,
    pub costs: PromptCosts,
}

/// Blocks read from disk for one prompt (off the engine thread), by hash,
/// with what reading them took.
#[derive(Default)]
pub struct StoredBlocks {
    blocks: HashMap<BlockHash, Features>,
    bytes: u64,
    read_s: f64,
}

/// Reads `keys`' longest run of blocks that RAM or the disk has, the
/// disk's from the disk, unless computing those positions was measured
/// cheaper (a small model on a fast GPU). Runs on a blocking task.
pub fn read_stored(keys: &PromptKeys, shared: &Mutex<SharedIndex>, disk: &BlockStore) -> StoredBlocks {
    let chain: Vec<(BlockHash, usize)> = keys
        .blocks
        .iter()
        .map(|h| (*h, BLOCK_TOKENS))
        .chain(keys.tail.map(|(end, h)| (h, end % BLOCK_TOKENS)))
        .collect();
    // The disk part of the run: its size, before reading anything.
    let (mut bytes, mut tokens) = (0u64, 0usize);
    {
        let shared = lock(shared);
        for (hash, positions) in &chain {
            if shared.in_ram.contains(hash) {
                continue;
            }
            match disk.size(hash) {
                Some(b) => (bytes, tokens) = (bytes + b, tokens + positions),
                None => break,
            }
        }
    }
    if tokens == 0 {
        return StoredBlocks::default();
    }
    if !lock(shared).costs.disk_pays(&keys.root, bytes, tokens) {
        lock(shared).costs.skipped_tokens += tokens as u64;
        return StoredBlocks::default();
    }
    let started = std::time::Instant::now();
    let mut out = StoredBlocks::default();
    for (hash, _) in &chain {
        if lock(shared).in_ram.contains(hash) {
            continue;
        }
        match disk.read(hash) {
            Some(block) => {
                out.bytes += block.data.len() as u64;
                out.blocks.insert(*hash, block);
            }
            None => break,
        }
    }
    if keys.recurrent {
        // The states saved with the longest stored prefix (one per prompt).
        let read = |h: &BlockHash| out.blocks.contains_key(h) || lock(shared).in_ram.contains(h);
        for (link, _) in keys.links().iter().rev().filter(|(l, _)| read(l)) {
            let name = state_name(link);
            if lock(shared).in_ram.contains(&name) {
                break;
            }
            if let Some(state) = disk.read(&name) {
                out.bytes += state.data.len() as u64;
                out.blocks.insert(name, state);
                break;
            }
        }
    }
    out.read_s = started.elapsed().as_secs_f64();
    out
}

/// A model's KV layout as the prompt cache stores it (a worker rank
/// learns it from its shard's first forward pass).
#[derive(Clone)]
pub struct KvLayout {
    pub kv_shapes: crate::model::kv_cache::KvShapes,
    pub bytes_per_position: u64,
    pub states: crate::model::kv_cache::StateLayout,
}

impl KvLayout {
    /// The layout of a cache that holds at least one position.
    pub fn of(cache: &KvCache) -> anyhow::Result<Self> {
        let kv_shapes = cache.kv_shapes();
        let bytes_per_position = if kv_shapes.is_empty() { 0 } else { cache.positions(0, 0, 1)?.nbytes() as u64 };
        Ok(Self { kv_shapes, bytes_per_position, states: crate::model::kv_cache::state_layout(cache.states()) })
    }
}

/// Opens the prompt cache's disk tier, or says in the log why not.
pub fn open_disk(settings: &mlxbc_shared::settings::Settings) -> Option<Arc<BlockStore>> {
    if settings.prompt_cache_disk_bytes == 0 {
        return None;
    }
    match BlockStore::open(&settings.prompt_cache_dir, settings.prompt_cache_disk_bytes, settings.disk_reserve) {
        Ok(s) => Some(Arc::new(s)),
        Err(e) => {
            tracing::warn!(path = %settings.prompt_cache_dir.display(), error = %e, "the prompt cache's disk tier could not be opened: RAM only");
            None
        }
    }
}

/// What a lookup found.
pub struct Reuse {
    /// A cache holding the reused positions (one row).
    pub cache: KvCache,
    /// Positions from RAM and from disk.
    pub ram_tokens: usize,
    pub disk_tokens: usize,
    /// The disk blocks' bytes and the seconds reading and converting them
    /// took (for [`PromptCache::note_prefilled`]); `None` without any.
    pub disk_cost: Option<(u64, f64)>,
}

/// Counters since the daemon started.
#[derive(Debug, Clone, Copy, Default)]
pub struct PromptCacheCounters {
    pub ram_hit_tokens: u64,
    pub disk_hit_tokens: u64,
    pub stored_blocks: u64,
    pub ram_evictions: u64,
    /// Blocks not written to disk because the writer was behind.
    pub writes_dropped: u64,
}

struct RamBlock {
    /// `[2 * layers, 1, kv heads, positions, head dim]`: every layer's keys
    /// and values, one array (one fresh buffer: it holds no request's cache).
    data: Array,
    positions: usize,
    bytes: u64,
}

/// The RAM tier and the way to the disk tier; owned by the engine thread.
pub struct PromptCache {
    ram: LruCache<BlockHash, RamBlock>,
    ram_bytes: u64,
    ram_budget: u64,
    /// The hashes in RAM and the measured costs, shared with `read_stored`
    /// off the engine thread.
    shared: Arc<Mutex<SharedIndex>>,
    writer: Option<DiskWriter>,
    disk: Option<Arc<BlockStore>>,
    pub counters: PromptCacheCounters,
}

/// The most bytes of blocks waiting for the disk writer at once; a block
/// that would go over is dropped (counted in `writes_dropped`), never
/// waited for. Bounded by bytes, not blocks: a 30k-token prompt is ~480
/// blocks, all offered at once, and a bound of 256 blocks dropped its end
/// whenever the disk wrote slower than the engine copied (after a restart
/// only the prefix before the first dropped block is reused), while 256
/// blocks of a wide model may be gigabytes.
const WRITER_QUEUE_BYTES: u64 = 1 << 30;

/// The way to the disk writer's thread, and the bytes queued on it.
struct DiskWriter {
    queue: std::sync::mpsc::Sender<(BlockHash, Features)>,
    queued_bytes: Arc<std::sync::atomic::AtomicU64>,
    /// [`WRITER_QUEUE_BYTES`] (smaller in tests).
    limit: u64,
}

impl DiskWriter {
    /// Queues the block of `bytes` bytes that `block` makes, unless the
    /// queue has no room for it (then `block` is never run: a dropped
    /// block costs no host copy); false when it was dropped.
    fn offer(&self, hash: BlockHash, bytes: u64, block: impl FnOnce() -> Option<Features>) -> bool {
        use std::sync::atomic::Ordering;
        if self.queued_bytes.fetch_add(bytes, Ordering::SeqCst) + bytes > self.limit {
            self.queued_bytes.fetch_sub(bytes, Ordering::SeqCst);
            return false;
        }
        // The writer gives back what it was sent: `bytes` must be it.
        let sent = block().filter(|b| b.data.len() as u64 == bytes).is_some_and(|b| self.queue.send((hash, b)).is_ok());
        if !sent {
            self.queued_bytes.fetch_sub(bytes, Ordering::SeqCst);
        }
        sent
    }
}

impl PromptCache {
    /// The disk tier, if there is one.
    pub fn disk(&self) -> Option<&Arc<BlockStore>> {
        self.disk.as_ref()
    }

    /// A RAM tier of `ram_budget` bytes whose block names are kept in
    /// `shared` (with request preparation), writing blocks to `disk`
    /// (if any) from a thread of its own.
    pub fn new(ram_budget: u64, disk: Option<Arc<BlockStore>>, shared: Arc<Mutex<SharedIndex>>) -> Self {
        let writer = disk.clone().map(|disk| {
            // Bounded by bytes (DiskWriter::offer): when the disk falls
            // behind, blocks are dropped (counted), never waited for.
            let (queue, rx) = std::sync::mpsc::channel::<(BlockHash, Features)>();
            let queued_bytes = Arc::new(std::sync::atomic::AtomicU64::new(0));
            let written = queued_bytes.clone();
            std::thread::Builder::new()
                .name("mlxbc-kv-writer".into())
                .spawn(move || {
                    for (hash, block) in rx {
                        if let Err(e) = disk.write(&hash, &block) {
                            tracing::warn!(error = %e, "could not write a prompt cache block");
                        }
                        written.fetch_sub(block.data.len() as u64, std::sync::atomic::Ordering::SeqCst);
                    }
                })
                .expect("spawning the prompt cache writer");
            DiskWriter { queue, queued_bytes, limit: WRITER_QUEUE_BYTES }
        });
        Self {
            ram: LruCache::unbounded(),
            ram_bytes: 0,
            ram_budget,
            shared,
            writer,
            disk,
            counters: PromptCacheCounters::default(),
        }
    }

    /// [`read_stored`] on the engine thread, for a prompt that was not
    /// tokenized before its job came (its model was not resident: the
    /// engine has just spent far longer loading it than these reads take).
    pub fn read_stored_here(&self, keys: &PromptKeys) -> StoredBlocks {
        match &self.disk {
            Some(disk) => read_stored(keys, &self.shared, disk),
            None => StoredBlocks::default(),
        }
    }

    /// The longest stored prefix of `keys` (RAM, then this host's disk)
    /// as a cache of the layout `layout` describes: what a worker rank
    /// restores when rank 0 found the prefix in its own store.
    pub fn restore(&mut self, keys: &PromptKeys, layout: &KvLayout) -> Option<Reuse> {
        let stored = self.read_stored_here(keys);
        self.lookup(keys, stored, &layout.kv_shapes, layout.bytes_per_position, &layout.states, None)
    }

    /// False when both tiers are off (no RAM budget, no disk): then nothing
    /// is copied, stored or looked up.
    pub fn is_on(&self) -> bool {
        self.ram_budget > 0 || self.writer.is_some()
    }

    /// Blocks and bytes in RAM.
    pub fn ram_usage(&self) -> (u64, u64) {
        (self.ram.len() as u64, self.ram_bytes)
    }

    /// The RAM budget.
    pub fn ram_budget(&self) -> u64 {
        self.ram_budget
    }

    /// Nothing in RAM.
    pub fn is_empty(&self) -> bool {
        self.ram.is_empty()
    }

    /// Drops the RAM tier (memory pressure, `cache clear --prompts`);
    /// returns the blocks dropped.
    pub fn clear_ram(&mut self) -> usize {
        let n = self.ram.len();
        self.ram.clear();
        self.ram_bytes = 0;
        lock(&self.shared).in_ram.clear();
        n
    }

    /// The longest cached prefix of the prompt `keys` names: RAM blocks
    /// and those `stored` read from disk (which join RAM), as a cache of
    /// `layers` layers whose positions take `bytes_per_position` (a disk
    /// block of any other layout is refused). `None` when not even the
    /// first block is cached.
    pub fn lookup(
        &mut self,
        keys: &PromptKeys,
        mut stored: StoredBlocks,
        kv_shapes: &[(i32, i32)],
        bytes_per_position: u64,
        state_layout: &crate::model::kv_cache::StateLayout,
        quantized: Option<(KvQuantization, Dtype)>,
    ) -> Option<Reuse> {
        let layers = kv_shapes.len();
        // A quantized cache's blocks are 16-bit words (KvCache::positions).
        // Its heads and width too, exactly: a disk block of the right bytes
        // but another split of them is someone else's.
        let (bytes_per_position, block_dtype, quantized_shape) = match quantized {
            Some((q, scales)) => {
                let (heads, width) = quantized_block_shape(kv_shapes, q, scales);
                let bytes = (2 * layers) as u64 * heads as u64 * width as u64 * 2;
                (bytes, Dtype::Uint16, Some((heads, width)))
            }
            None => (bytes_per_position, Dtype::Float32, None),
        };
        if !self.is_on() {
            return None;
        }
        let mut run: Vec<(BlockHash, bool)> = Vec::new();
        for hash in &keys.blocks {
            let in_ram = self.ram.contains(hash);
            if !in_ram && !stored.blocks.contains_key(hash) {
                break;
            }
            run.push((*hash, in_ram));
        }
        // The tail continues the run only where the run reaches its block.
        let mut tail = None;
        if let Some((end, hash)) = keys.tail {
            if run.len() == end / BLOCK_TOKENS && (self.ram.contains(&hash) || stored.blocks.contains_key(&hash)) {
                tail = Some((end, hash, self.ram.contains(&hash)));
            }
        }
        // Never end inside an image.
        if tail.is_none() {
            while !run.is_empty() && !keys.may_end_at(run.len() * BLOCK_TOKENS) {
                run.pop();
            }
        }
        // Each link with the positions it must hold.
        let mut chain: Vec<(BlockHash, bool, usize)> = run
            .into_iter()
            .map(|(h, r)| (h, r, BLOCK_TOKENS))
            .chain(tail.map(|(end, h, r)| (h, r, end % BLOCK_TOKENS)))
            .collect();
        // A recurrent model's prefix ends where its states were stored.
        let mut state = None;
        if keys.recurrent {
            while let Some((last, _, _)) = chain.last() {
                let name = state_name(last);
                let flat = match self.ram.get(&name) {
                    Some(b) => Some(b.data.clone()),
                    None => stored.blocks.remove(&name).and_then(|f| to_array(&f)),
                };
                let states = flat.as_ref().and_then(|f| {
                    let values = f.reshape(&[-1]).ok()?;
                    crate::model::kv_cache::unflatten_states(&values, state_layout)
                });
                if let Some(states) = states {
                    if !self.ram.contains(&name) {
                        self.put_ram(name, flat.unwrap(), 0);
                    }
                    state = Some(states);
                    break;
                }
                chain.pop();
            }
        }
        if chain.is_empty() {
            return None;
        }
        let chain_tokens: usize = chain.iter().map(|(_, _, p)| p).sum();
        let mut pieces = Vec::with_capacity(chain.len());
        let (mut ram_tokens, mut disk_tokens) = (0, 0);
        let converting = std::time::Instant::now();
        // The RAM links' arrays, taken before any disk block is brought into
        // RAM: making room for one may evict another link of this chain (an
        // 8k-token prompt on an 8B model, on the H200, panicked here).
        let held: Vec<Option<(Array, usize)>> = chain
            .iter()
            .map(|(hash, in_ram, _)| {
                in_ram.then(|| self.ram.get(hash).map(|b| (b.data.clone(), b.positions))).flatten()
            })
            .collect();
        for ((hash, in_ram, positions), held) in chain.into_iter().zip(held) {
            if in_ram {
                // Gone (evicted for a recurrent state above): the prefix ends here.
                let Some((data, held_positions)) = held else { break };
                ram_tokens += held_positions;
                pieces.push(data);
            } else {
                // A block from disk must have this model's layout (a file
                // that passed its checksum may still be someone else's).
                let fits = |a: &Array| {
                    let s = a.shape();
                    // Of the form asked for: a full-precision block is a
                    // miss for a quantized cache, and the other way round.
                    (a.dtype() == Dtype::Uint16) == (block_dtype == Dtype::Uint16)
                        && s.len() == 5
                        && quantized_shape.is_none_or(|(h, w)| (s[2], s[4]) == (h, w))
                        && s[0] as usize == 2 * layers
                        && s[1] == 1
                        && s[3] as usize == positions
                        && a.nbytes() as u64 == bytes_per_position * positions as u64
                };
                let Some(data) = stored.blocks.remove(&hash).and_then(|f| to_array(&f)).filter(fits) else { break };
                disk_tokens += positions;
                self.put_ram(hash, data.clone(), positions);
                pieces.push(data);
            }
        }
        if pieces.is_empty() {
            return None;
        }
        let disk_cost = (disk_tokens > 0).then(|| (stored.bytes, stored.read_s + converting.elapsed().as_secs_f64()));
        if keys.recurrent && ram_tokens + disk_tokens != chain_tokens {
            // A block of the run could not be used: its states are not these.
            return None;
        }
        // RAM blocks too must be of the asked form (a quantized request's
        // root differs, so only a damaged index could mix them).
        if pieces.iter().any(|p| (p.dtype() == Dtype::Uint16) != quantized.is_some()) {
            return None;
        }
        let mut cache = assemble(&pieces, kv_shapes, quantized).ok()?;
        if let Some(states) = state {
            cache.set_states(states);
        }
        self.counters.ram_hit_tokens += ram_tokens as u64;
        self.counters.disk_hit_tokens += disk_tokens as u64;
        Some(Reuse { cache, ram_tokens, disk_tokens, disk_cost })
    }

    /// After a prompt's first token: its prefill (`computed` positions in
    /// `prefill_s`) measures the model's rate when nothing came from disk;
    /// otherwise it adds to what the disk blocks cost (`disk`: their bytes
    /// and read time) whatever it took beyond computing its own positions
    /// (joining the blocks, moving them to the device).
    pub fn note_prefilled(&mut self, keys: &PromptKeys, computed: usize, prefill_s: f64, disk: Option<(u64, f64)>) {
        if !self.is_on() {
            return;
        }
        let costs = &mut lock(&self.shared).costs;
        match disk {
            None => costs.note_prefill(&keys.root, computed, prefill_s),
            Some((bytes, read_s)) => {
                let own = costs.prefill_estimate(&keys.root, computed).unwrap_or(0.0);
                costs.note_disk(bytes, read_s + (prefill_s - own).max(0.0));
            }
        }
    }

    /// Stores the blocks of `keys` that row `row` of `cache` covers and
    /// RAM does not have yet: in RAM, and queued for the disk. A split
    /// model's cache journals the store, so every rank stores its shard's
    /// blocks too ([`PromptKeys::for_rank`]).
    pub fn store(&mut self, keys: &PromptKeys, cache: &KvCache, row: usize) {
        if !self.is_on() {
            return;
        }
        cache.journal(|id| crate::model::kv_cache::CacheOp::Store { id, row: row as u32, keys: keys.to_bytes() });
        let mut have = (cache.offset - cache.paddings().get(row).copied().unwrap_or(0)).max(0) as usize;
        // A recurrent model stores up to where its states were saved (and
        // those states), nothing without them.
        let checkpoint = match (&cache.checkpoint, cache.has_states()) {
            (Some((at, states)), _) => Some((*at as usize, states)),
            (None, true) => return,
            (None, false) => None,
        };
        if let Some((at, _)) = checkpoint {
            have = have.min(at);
        }
        let mut spans: Vec<(BlockHash, usize, usize)> =
            keys.blocks.iter().enumerate().map(|(i, h)| (*h, i * BLOCK_TOKENS, (i + 1) * BLOCK_TOKENS)).collect();
        if let Some((end, hash)) = keys.tail {
            spans.push((hash, end / BLOCK_TOKENS * BLOCK_TOKENS, end));
        }
        spans.retain(|&(hash, _, to)| {
            // With no RAM tier a block already on disk needs nothing.
            to <= have
                && !self.ram.contains(&hash)
                && !(self.ram_budget == 0 && self.disk.as_ref().is_some_and(|d| d.contains(&hash)))
        });
        let positions: Vec<(i32, i32)> = spans.iter().map(|&(_, from, to)| (from as i32, to as i32)).collect();
        let mut fresh: Vec<(BlockHash, Array, usize)> = match cache.blocks(row, &positions) {
            Ok(blocks) => spans.iter().zip(blocks).map(|(&(hash, from, to), data)| (hash, data, to - from)).collect(),
            Err(e) => {
                tracing::debug!(error = %format!("{e:#}"), "prompt cache: blocks not stored");
                return;
            }
        };
        if let Some((at, states)) = checkpoint {
            let Some((link, _)) = keys.links().into_iter().find(|&(_, end)| end == at) else { return };
            let name = state_name(&link);
            if !self.ram.contains(&name) {
                // Five axes, as every stored value has.
                match crate::model::kv_cache::flatten_states(states).and_then(|f| Ok(f.reshape(&[1, 1, 1, 1, -1])?)) {
                    Ok(flat) => fresh.push((name, flat, 0)),
                    Err(e) => {
                        tracing::debug!(error = %format!("{e:#}"), "prompt cache: states not stored");
                        return;
                    }
                }
            }
        }
        // One evaluation for all of them: on a GPU each evaluation waits
        // for the device, so one per block would be one round trip each.
        if let Err(e) = mlx_rs::transforms::eval(fresh.iter().map(|(_, d, _)| d)) {
            tracing::warn!(error = %e, "prompt cache: blocks not stored");
            return;
        }
        for (hash, data, positions) in fresh {
            if let Some(w) = &self.writer {
                if !w.offer(hash, data.nbytes() as u64, || to_features(&data)) {
                    self.counters.writes_dropped += 1;
                }
            }
            self.put_ram(hash, data, positions);
            self.counters.stored_blocks += 1;
        }
    }

    fn put_ram(&mut self, hash: BlockHash, data: Array, positions: usize) {
        let bytes = data.nbytes() as u64;
        if bytes > self.ram_budget {
            return;
        }
        self.ram_bytes += bytes;
        self.ram.put(hash, RamBlock { data, positions, bytes });
        lock(&self.shared).in_ram.insert(hash);
        while self.ram_bytes > self.ram_budget {
            let Some((old, b)) = self.ram.pop_lru() else { break };
            self.ram_bytes -= b.bytes;
            lock(&self.shared).in_ram.remove(&old);
            self.counters.ram_evictions += 1;
        }
    }
}

/// A cache of the blocks `pieces` (in order), each `[2L, 1, H, n, D]`:
/// joined once along the positions, then each layer's keys and values are
/// views of the whole (one copy per block; joining layer by layer would be
/// 2L copies per block, thousands of kernel launches for a long prompt).
/// A quantized cache's blocks (16-bit words) are cut back into packed
/// values, scales and biases (`quantized`: the setting and the scales' dtype).
fn assemble(
    pieces: &[Array],
    shapes: &[(i32, i32)],
    quantized: Option<(KvQuantization, Dtype)>,
) -> anyhow::Result<KvCache> {
    use mlx_rs::ops::indexing::IndexOp;
    let whole = if pieces.len() == 1 { pieces[0].clone() } else { mlx_rs::ops::concatenate(pieces, 3)? };
    let per_layer = (0..shapes.len() as i32).map(|l| (whole.index(2 * l), whole.index(2 * l + 1))).collect();
    match quantized {
        Some((q, scales)) => KvCache::from_quantized_prefix(per_layer, whole.shape()[3], shapes, q, scales),
        None => Ok(KvCache::from_prefix(per_layer, whole.shape()[3], shapes)),
    }
}

fn feature_dtype(d: Dtype) -> Option<FeatureDtype> {
    Some(match d {
        Dtype::Float32 => FeatureDtype::F32,
        Dtype::Float16 => FeatureDtype::F16,
        Dtype::Bfloat16 => FeatureDtype::BF16,
        Dtype::Uint16 => FeatureDtype::U16,
        _ => return None,
    })
}

/// An evaluated block's bytes, for the disk.
fn to_features(a: &Array) -> Option<Features> {
    let dtype = feature_dtype(a.dtype())?;
    let bytes: &[u8] = match dtype {
        FeatureDtype::F32 => bytes_of(a.as_slice::<f32>()),
        FeatureDtype::F16 => bytes_of(a.as_slice::<half::f16>()),
        FeatureDtype::BF16 => bytes_of(a.as_slice::<half::bf16>()),
        FeatureDtype::U16 => bytes_of(a.as_slice::<u16>()),
    };
    Some(Features { dtype, shape: a.shape().iter().map(|&d| d as u32).collect(), data: bytes.to_vec() })
}

/// Element types whose values are plain bytes: no padding, every bit
/// pattern valid (what `bytes_of` may view).
trait PlainNumber: Copy {}
impl PlainNumber for f32 {}
impl PlainNumber for half::f16 {}
impl PlainNumber for half::bf16 {}
impl PlainNumber for u16 {}

fn bytes_of<T: PlainNumber>(values: &[T]) -> &[u8] {
    // SAFETY: plain numeric elements (`PlainNumber`), no padding; the bytes are
    // read (little-endian machine, as the stored format says) while
    // `values` is borrowed.
    unsafe { std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), std::mem::size_of_val(values)) }
}

fn to_array(f: &Features) -> Option<Array> {
    let dtype = match f.dtype {
        FeatureDtype::F32 => Dtype::Float32,
        FeatureDtype::F16 => Dtype::Float16,
        FeatureDtype::BF16 => Dtype::Bfloat16,
        FeatureDtype::U16 => Dtype::Uint16,
    };
    let shape: Vec<i32> = f.shape.iter().map(|&d| d as i32).collect();
    if shape.len() != 5 {
        return None;
    }
    // SAFETY: `f.data` holds exactly shape's elements of `dtype` (checked
    // by Features::decode); MLX copies them.
    Some(unsafe { Array::from_raw_data(f.data.as_ptr().cast(), &shape, dtype) })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RAM holds two blocks; a prompt of three finds the first on disk and
    /// the next two in RAM. Bringing the disk block into RAM evicts one of
    /// them, which the lookup must still use (it panicked on the H200 with
    /// an 8k-token prompt on an 8B model).
    #[test]
    fn a_disk_block_brought_into_ram_does_not_lose_a_link_the_lookup_found() {
        let block = |v: f32| Array::full::<f32>(&[2, 1, 1, BLOCK_TOKENS as i32, 2], Array::from_f32(v)).unwrap();
        let bytes = block(0.0).nbytes() as u64;
        let mut cache = PromptCache::new(2 * bytes, None, Arc::default());
        let ids: Vec<u32> = (0..3 * BLOCK_TOKENS as u32 + 1).collect();
        let keys = PromptKeys::of(&[1; 32], &ids, &[]);
        assert_eq!(keys.blocks.len(), 3);
        cache.put_ram(keys.blocks[1], block(1.0), BLOCK_TOKENS);
        cache.put_ram(keys.blocks[2], block(2.0), BLOCK_TOKENS);
        let stored = StoredBlocks {
            blocks: HashMap::from([(keys.blocks[0], to_features(&block(0.0)).unwrap())]),
            bytes,
            read_s: 0.0,
        };
        let per_position = bytes / BLOCK_TOKENS as u64;
        let reuse = cache.lookup(&keys, stored, &[(1, 2)], per_position, &Vec::new(), None).expect("all three blocks");
        assert_eq!((reuse.ram_tokens, reuse.disk_tokens), (2 * BLOCK_TOKENS, BLOCK_TOKENS));
        assert_eq!(reuse.cache.offset, 3 * BLOCK_TOKENS as i32);
    }

    /// The disk writer's queue holds blocks up to its bytes, drops the one
    /// that would go over, and takes more once the writer has written some.
    #[test]
    fn the_disk_writers_queue_is_bounded_by_bytes() {
        use std::sync::atomic::Ordering;
        let (queue, rx) = std::sync::mpsc::channel();
        let writer = DiskWriter { queue, queued_bytes: Arc::default(), limit: 1000 };
        let block = |n: usize| Features { dtype: FeatureDtype::U16, shape: vec![n as u32 / 2], data: vec![0; n] };
        let hash = [0u8; 32];
        let offer = |n: usize| writer.offer(hash, n as u64, || Some(block(n)));
        assert!(offer(600));
        assert!(offer(400), "exactly the limit fits");
        assert!(!writer.offer(hash, 2, || panic!("a block with no room is not copied")), "over the limit: dropped");
        assert_eq!(writer.queued_bytes.load(Ordering::SeqCst), 1000, "a dropped block leaves no bytes counted");
        // The writer takes the first and says so, as its thread does.
        let (_, first) = rx.try_recv().unwrap();
        writer.queued_bytes.fetch_sub(first.data.len() as u64, Ordering::SeqCst);
        assert!(offer(500));
        assert!(!offer(200));
        drop(rx);
        assert!(!offer(1), "no writer: dropped");
        assert_eq!(writer.queued_bytes.load(Ordering::SeqCst), 900);
    }

    #[test]
    fn a_model_whose_weights_change_gets_a_new_root() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("m.gguf");
        std::fs::write(&f, vec![1u8; 1 << 20]).unwrap();
        let a = model_root(&f, "Dense", "cpu").unwrap();
        assert_eq!(model_root(&f, "Dense", "cpu").unwrap(), a, "stable");
        assert_ne!(model_root(&f, "Packed", "cpu").unwrap(), a, "another load form");
        assert_ne!(model_root(&f, "Dense", "gpu").unwrap(), a, "another device");
        let mut bytes = std::fs::read(&f).unwrap();
        bytes[(1 << 20) / 16 * 3 + 5] = 2; // inside a sampled slice
        let mtime = std::fs::metadata(&f).unwrap().modified().unwrap();
        std::fs::write(&f, bytes).unwrap();
        // Even with the old mtime restored, the sampled bytes differ.
        std::fs::File::options().write(true).open(&f).unwrap().set_modified(mtime).unwrap();
        assert_ne!(model_root(&f, "Dense", "cpu").unwrap(), a);
    }

    #[test]
    fn equal_prefixes_share_block_names_and_any_difference_before_a_block_changes_it() {
        let root = [7u8; 32];
        let a: Vec<u32> = (0..300).collect();
        let mut b = a.clone();
        b[200] = 9999;
        let (ka, kb) = (PromptKeys::of(&root, &a, &[]), PromptKeys::of(&root, &b, &[]));
        assert_eq!(ka.blocks.len(), 4, "299 reusable positions: 4 whole blocks");
        assert_eq!(ka.blocks[..3], kb.blocks[..3]);
        assert_ne!(ka.blocks[3], kb.blocks[3], "position 200 is in block 3");
        assert_ne!(PromptKeys::of(&[8u8; 32], &a, &[]).blocks[0], ka.blocks[0], "another model");
        // An image's hash is part of the blocks holding its placeholders.
        let img = |h: u8| vec![MediaSpan { start: 10, end: 100, hash: [h; 32] }];
        let (i1, i2) = (PromptKeys::of(&root, &a, &img(1)), PromptKeys::of(&root, &a, &img(2)));
        assert_ne!(i1.blocks[0], i2.blocks[0]);
        assert_eq!(i1.tail.map(|t| t.0), Some(100), "the prefix ending after the image");
        assert!(!i1.may_end_at(64) && i1.may_end_at(128));
    }
}
