//! The KV cache every family's attention writes: per layer, key and value
//! buffers with a batch axis, and per row the padding that aligns prompts
//! of different lengths; the recurrent states of layers that keep one
//! instead (and their checkpoint, the states at the prefix the prompt cache
//! may store). A memo of padding masks rides along because it is a function
//! of this cache's padding. What belongs to one request rather than to its
//! keys and values (image blocks, multimodal rope positions, deepstack
//! features) is the sequence's: `model::positions`.

use anyhow::Result;
use mlx_rs::Array;

/// Positions a layer's key/value buffers grow by (mlx-lm's KVCache.step).
const KV_STEP: i32 = 256;

/// Per-layer keys and values of everything processed so far. Each layer's
/// keys and values live in buffers `[batch, heads, capacity, head_dim]` that
/// grow `KV_STEP` positions at a time and are written with slice updates, as
/// mlx-lm's KVCache does: a decode step writes one position instead of copying
/// the whole history, and the buffer shapes stay fixed between growths (what
/// a compiled step needs). Attention reads the view of the first `offset`
/// positions. Clones share buffers until one of them writes (MLX's slice
/// update copies a buffer that is still referenced elsewhere).
#[derive(Clone)]
pub struct KvCache {
    /// Per layer, its buffers: `[keys, values]`, or once quantized
    /// ([`KvQuantization`]) `[keys, key scales, key biases, values, value
    /// scales, value biases]`, every one with the rows on axis 0 and the
    /// positions on axis 2, so what cuts, pads, joins and filters rows and
    /// positions does the same to each.
    layers: Vec<Option<Vec<Array>>>,
    /// Keys and values kept quantized, once the cache holds at least
    /// `start` positions (set per sequence; `None`: full precision).
    pub quantization: Option<KvQuantization>,
    /// Per row, the LoRA adapter it runs under (set per sequence; a batch
    /// holds rows of several): the family's projections add each row's
    /// update. Empty: no row has one.
    pub adapters: Vec<Option<std::rc::Rc<crate::model::lora::LoraAdapter>>>,
    /// The rows' adapters stacked for one batched product per projection,
    /// made for the rows as they are (`crate::model::lora::RowAdapters`).
    lora_rows: Option<std::rc::Rc<crate::model::lora::RowAdapters>>,
    /// Number of positions cached.
    pub offset: i32,
    /// Per row (the batch axis), how many positions at the start are
    /// padding: rows of different lengths are aligned at their ends, as
    /// mlx-lm's `BatchKVCache` aligns them. Empty: one row, no padding.
    left_padding: Vec<i32>,
    /// Padding masks made for the current padding, by
    /// `(start, queries, keys, window)`: every layer of a forward pass asks
    /// for the same one (two kinds with sliding-window layers).
    masks: Vec<(MaskKey, Array)>,
    /// Each row's first visible key of a one-position step, by `(keys,
    /// window)` (`crate::model::batch_attention`), for the current padding.
    starts: Vec<((i32, Option<i32>), Array)>,
    /// Per recurrent layer (a family's own slot numbers), its state arrays
    /// with the rows on axis 0: Qwen3.5's Gated DeltaNet keeps its
    /// convolution window and its delta-rule state here instead of keys
    /// and values. A state covers every position so far, so it cannot be
    /// cut at an earlier position the way keys and values can.
    states: Vec<Option<Vec<Array>>>,
    /// The states as they were after `.0` positions of a one-row cache
    /// (taken by [`Self::checkpoint_states`] where a prefill chunk ended):
    /// the prompt cache stores them with the prefix ending there, the only
    /// prefix of this prompt a later prompt can reuse.
    pub checkpoint: Option<(i32, Vec<Option<Vec<Array>>>)>,
    /// Set when the cache belongs to a model split over a group: what is
    /// done to it here is journaled, so that every other rank does the
    /// same to its own shard of it ([`Journal`]).
    tag: Option<Tag>,
}

/// What rank 0 did to its caches of a sharded model between two calls of
/// the model, replayed by the other ranks on theirs (whose keys and values
/// are their own heads'): a cache's rows are joined, filtered, cloned and
/// dropped by the scheduler on rank 0 alone; forward passes are sent on
/// their own.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum CacheOp {
    /// A new, empty cache with this padding per row, its keys and values
    /// quantized as `quantization` says.
    New {
        id: u64,
        paddings: Vec<i32>,
        quantization: Option<KvQuantization>,
    },
    Clone {
        from: u64,
        to: u64,
    },
    /// `from`'s rows appended to `into`'s ([`KvCache::join`]); `from` is gone.
    Join {
        into: u64,
        from: u64,
    },
    KeepRows {
        id: u64,
        keep: Vec<u32>,
    },
    /// [`KvCache::trim_rows`]: the last `n[r]` positions of each row forgotten
    /// (a verify pass's rejected drafts).
    TrimRows {
        id: u64,
        n: Vec<i32>,
    },
    Drop {
        id: u64,
    },
    /// [`KvCache::checkpoint_states`].
    Checkpoint {
        id: u64,
    },
    /// Row `row`'s blocks stored in the prompt cache under `keys` (the
    /// prompt cache's encoding of a prompt's block names; each rank stores
    /// its own shard's blocks under names of its own).
    Store {
        id: u64,
        row: u32,
        keys: Vec<u8>,
    },
}

/// The journal of a sharded model's caches, shared by all of them.
#[derive(Clone, Default)]
pub struct Journal(std::sync::Arc<JournalInner>);

#[derive(Default)]
struct JournalInner {
    ops: std::sync::Mutex<Vec<CacheOp>>,
    next_id: std::sync::atomic::AtomicU64,
}

impl Journal {
    fn push(&self, op: CacheOp) {
        mlxbc_shared::sync::lock(&self.0.ops).push(op);
    }

    /// Everything journaled since the last call.
    pub fn take(&self) -> Vec<CacheOp> {
        std::mem::take(&mut *mlxbc_shared::sync::lock(&self.0.ops))
    }

    fn next_id(&self) -> u64 {
        self.0.next_id.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1
    }
}

/// A journaled cache's name; cloning it journals a clone, dropping it a drop.
struct Tag {
    id: u64,
    journal: Option<Journal>,
}

impl Tag {
    /// The name, without journaling a drop (the cache went into another).
    fn consume(mut self) -> u64 {
        self.journal = None;
        self.id
    }
}

impl Clone for Tag {
    fn clone(&self) -> Self {
        let Some(journal) = &self.journal else { return Tag { id: self.id, journal: None } };
        let to = journal.next_id();
        journal.push(CacheOp::Clone { from: self.id, to });
        Tag { id: to, journal: Some(journal.clone()) }
    }
}

impl Drop for Tag {
    fn drop(&mut self) {
        if let Some(j) = &self.journal {
            j.push(CacheOp::Drop { id: self.id });
        }
    }
}

type MaskKey = (i32, i32, i32, Option<i32>);

impl KvCache {
    /// An empty cache for `layers` layers.
    pub fn new(layers: usize) -> Self {
        Self {
            layers: (0..layers).map(|_| None).collect(),
            offset: 0,
            quantization: None,
            adapters: Vec::new(),
            lora_rows: None,
            left_padding: Vec::new(),
            masks: Vec::new(),
            starts: Vec::new(),
            states: Vec::new(),
            checkpoint: None,
            tag: None,
        }
    }

    /// This cache's name in `journal`, naming (and journaling) it now if
    /// it has none: a cache enters a sharded model's journal at its first
    /// forward pass, empty, so the other ranks can make the same.
    pub fn journaled(&mut self, journal: &Journal) -> Result<u64> {
        if let Some(t) = &self.tag {
            return Ok(t.id);
        }
        anyhow::ensure!(
            self.offset == 0 && !self.has_states(),
            "a cache that holds positions made outside the group (a sharded model's prompts are not cached)"
        );
        let id = journal.next_id();
        journal.push(CacheOp::New { id, paddings: self.paddings(), quantization: self.quantization });
        self.tag = Some(Tag { id, journal: Some(journal.clone()) });
        Ok(id)
    }

    /// Names a cache the other ranks made on their own (a prefix each
    /// restored from its prompt cache) in `journal`, journaling nothing.
    pub fn adopt(&mut self, journal: &Journal) -> u64 {
        let id = journal.next_id();
        self.tag = Some(Tag { id, journal: Some(journal.clone()) });
        id
    }

    /// Journals `op` (given this cache's name) when the cache is named in
    /// a journal; false otherwise.
    pub fn journal(&self, op: impl FnOnce(u64) -> CacheOp) -> bool {
        match &self.tag {
            Some(Tag { id, journal: Some(j) }) => {
                j.push(op(*id));
                true
            }
            _ => false,
        }
    }

    /// True when the cache is named in `journal` (not in an older one,
    /// from before its group re-formed).
    pub fn is_in(&self, journal: &Journal) -> bool {
        self.tag.as_ref().is_some_and(|t| t.journal.as_ref().is_some_and(|j| std::sync::Arc::ptr_eq(&j.0, &journal.0)))
    }

    /// True when the cache was named in some journal.
    pub fn is_journaled(&self) -> bool {
        self.tag.is_some()
    }

    /// Applies `op` to the caches of a rank that replays rank 0's journal.
    pub fn replay(caches: &mut std::collections::HashMap<u64, KvCache>, layers: usize, op: CacheOp) -> Result<()> {
        match op {
            CacheOp::New { id, paddings, quantization } => {
                // From another rank: checked as a request's setting is.
                if let Some(q) = quantization {
                    let bits = [2, 3, 4, 5, 6, 8];
                    anyhow::ensure!(
                        bits.contains(&q.bits) && bits.contains(&q.key_bits) && [32, 64, 128].contains(&q.group_size),
                        "cache {id}: a quantization MLX does not make ({q:?})"
                    );
                }
                let mut cache = KvCache::batch(layers, paddings);
                cache.quantization = quantization;
                caches.insert(id, cache);
            }
            CacheOp::Clone { from, to } => {
                let c = caches.get(&from).ok_or_else(|| anyhow::anyhow!("no cache {from} to clone"))?.clone();
                caches.insert(to, c);
            }
            CacheOp::Join { into, from } => {
                let other = caches.remove(&from).ok_or_else(|| anyhow::anyhow!("no cache {from} to join"))?;
                caches.get_mut(&into).ok_or_else(|| anyhow::anyhow!("no cache {into} to join into"))?.join(other)?;
            }
            CacheOp::KeepRows { id, keep } => {
                let keep: Vec<usize> = keep.into_iter().map(|r| r as usize).collect();
                caches.get_mut(&id).ok_or_else(|| anyhow::anyhow!("no cache {id} to filter"))?.keep_rows(&keep)?;
            }
            CacheOp::TrimRows { id, n } => {
                let c = caches.get_mut(&id).ok_or_else(|| anyhow::anyhow!("no cache {id} to trim"))?;
                anyhow::ensure!(c.trim_rows(&n)?, "cache {id} cannot forget {n:?} positions");
            }
            CacheOp::Drop { id } => {
                caches.remove(&id);
            }
            CacheOp::Checkpoint { id } => {
                caches.get_mut(&id).ok_or_else(|| anyhow::anyhow!("no cache {id} to checkpoint"))?.checkpoint_states();
            }
            CacheOp::Store { .. } => anyhow::bail!("a prompt cache store is the worker's to replay"),
        }
        Ok(())
    }

    /// Recurrent layer `slot`'s state arrays, when it has run.
    pub fn state(&self, slot: usize) -> Option<&[Array]> {
        self.states.get(slot).and_then(|s| s.as_deref())
    }

    /// Replaces recurrent layer `slot`'s state arrays.
    pub fn set_state(&mut self, slot: usize, arrays: Vec<Array>) {
        if self.states.len() <= slot {
            self.states.resize(slot + 1, None);
        }
        self.states[slot] = Some(arrays);
    }

    /// True when some layer keeps a recurrent state (its prefixes are
    /// reusable only where the state was saved).
    pub fn has_states(&self) -> bool {
        self.states.iter().any(Option::is_some)
    }

    /// Every recurrent layer's state, by slot (for a checkpoint or the
    /// prompt cache).
    pub fn states(&self) -> &[Option<Vec<Array>>] {
        &self.states
    }

    /// Sets every recurrent layer's state (a reused prefix's).
    pub fn set_states(&mut self, states: Vec<Option<Vec<Array>>>) {
        self.states = states;
    }

    /// Remembers the states as they are now, after `offset` positions.
    pub fn checkpoint_states(&mut self) {
        if self.has_states() {
            self.checkpoint = Some((self.offset, self.states.clone()));
            self.journal(|id| CacheOp::Checkpoint { id });
        }
    }

    /// An empty cache for a batch of `left_padding.len()` rows, row `b`
    /// starting with `left_padding[b]` padding positions (its prompt is that
    /// much shorter than the longest).
    pub fn batch(layers: usize, left_padding: Vec<i32>) -> Self {
        let padded = left_padding.iter().any(|&p| p > 0);
        Self { left_padding: if padded { left_padding } else { Vec::new() }, ..Self::new(layers) }
    }

    /// A one-row cache holding `positions` positions whose keys and values
    /// per layer are `layers` (`[1, heads, positions, head_dim]` each), as
    /// the prompt cache reassembles them; with `shapes`, each layer's are
    /// cut to its `(heads, head_dim)` (see [`Self::positions`]).
    pub fn from_prefix(layers: Vec<(Array, Array)>, positions: i32, shapes: &[(i32, i32)]) -> Self {
        use mlx_rs::ops::indexing::IndexOp;
        let cut = |(k, v): (Array, Array), shape: Option<&(i32, i32)>| match shape {
            Some(&(h, d)) if (k.shape()[1], k.shape()[3]) != (h, d) => {
                (k.index((.., ..h, .., ..d)), v.index((.., ..h, .., ..d)))
            }
            _ => (k, v),
        };
        let layers = layers
            .into_iter()
            .enumerate()
            .map(|(i, kv)| {
                let (k, v) = cut(kv, shapes.get(i));
                Some(vec![k, v])
            })
            .collect();
        Self { layers, offset: positions, ..Self::new(0) }
    }

    /// A one-row cache of `positions` quantized positions from the prompt
    /// cache's blocks joined (`layers`: per layer, keys and values as 16-bit
    /// words `[1, heads, positions, width]`, [`Self::positions`]), each cut
    /// back into its packed values, scales and biases (`scales`: their
    /// dtype, the cache's own) for `shapes` and `q`.
    pub fn from_quantized_prefix(
        layers: Vec<(Array, Array)>,
        positions: i32,
        shapes: &[(i32, i32)],
        q: KvQuantization,
        scales: mlx_rs::Dtype,
    ) -> Result<Self> {
        anyhow::ensure!(layers.len() == shapes.len(), "{} layers of blocks for {} layers", layers.len(), shapes.len());
        let mut slots = Vec::with_capacity(layers.len());
        for ((k, v), &(heads, dims)) in layers.into_iter().zip(shapes) {
            let mut parts = from_words(&k, heads, dims, q.key_bits, q.group_size, scales)?;
            parts.extend(from_words(&v, heads, dims, q.bits, q.group_size, scales)?);
            slots.push(Some(parts));
        }
        Ok(Self { layers: slots, offset: positions, quantization: Some(q), ..Self::new(0) })
    }

    /// Per layer, its keys' `(heads, head_dim)`; empty until every layer
    /// holds some (Gemma 4's full layers are wider than its sliding ones).
    pub fn kv_shapes(&self) -> KvShapes {
        let q = self.quantization;
        let shape = |parts: &Vec<Array>| {
            let k = &parts[0];
            // A packed row of `bits`-bit values holds 32 / bits per word.
            let width = match (parts.len(), q) {
                (6, Some(q)) => k.shape()[3] * 32 / q.key_bits,
                _ => k.shape()[3],
            };
            (k.shape()[1], width)
        };
        let shapes: Option<KvShapes> = self.layers.iter().map(|s| s.as_ref().map(shape)).collect();
        shapes.unwrap_or_default()
    }

    /// Positions `from..to` of row `row` (counted from that row's own
    /// start, past its padding) of every layer's keys and values, stacked
    /// into one fresh array `[2 * layers, 1, heads, to - from, head_dim]`
    /// (k0, v0, k1, ...), lazily. Layers of different shapes are padded
    /// with zeros to the largest heads and head size ([`Self::from_prefix`]
    /// cuts them back). A quantized cache's layers are 16-bit words
    /// ([`as_words`]).
    pub fn positions(&self, row: usize, from: i32, to: i32) -> Result<Array> {
        let mut one = self.blocks(row, &[(from, to)])?;
        one.pop().ok_or_else(|| anyhow::anyhow!("no block"))
    }

    /// [`Self::positions`] of each of `spans` (ascending, not overlapping),
    /// each its own array. The spans are cut from windows of up to
    /// [`BLOCK_WINDOW`] positions, each built once: a 30k-token prompt is
    /// ~480 blocks of 64, and building every block from every layer's
    /// parts took ~50 operations a block at full precision and ~480
    /// quantized (each part's slice, copy and view, then a join), a
    /// second of graph building on a GPU's host between a long prompt's
    /// first and second tokens.
    pub fn blocks(&self, row: usize, spans: &[(i32, i32)]) -> Result<Vec<Array>> {
        use mlx_rs::ops::indexing::IndexOp;
        anyhow::ensure!(row < self.rows(), "row {row} of {}", self.rows());
        let pad = self.paddings()[row];
        for &(from, to) in spans {
            anyhow::ensure!(0 <= from && from < to && pad + to <= self.offset, "positions {from}..{to} of row {row}");
        }
        let mut out = Vec::with_capacity(spans.len());
        let mut rest = spans;
        while let Some(&(first, _)) = rest.first() {
            // The spans of this window: those that end within BLOCK_WINDOW of its start.
            let n = rest.iter().take_while(|&&(_, to)| to - first <= BLOCK_WINDOW).count().max(1);
            let (window, later) = rest.split_at(n);
            rest = later;
            let end = window.iter().map(|&(_, to)| to).max().unwrap_or(first);
            let stacked = self.stacked(row as i32, pad + first, pad + end)?;
            if let [(from, to)] = window {
                if (*from, *to) == (first, end) {
                    out.push(stacked);
                    continue;
                }
            }
            for &(from, to) in window {
                // A copy of its own: a view would keep the window's buffer
                // alive as long as any of its blocks, uncounted.
                out.push(stacked.index((.., .., .., from - first..to - first, ..)).contiguous()?);
            }
        }
        Ok(out)
    }

    /// Positions `a..b` (of the cache's own axis, padding included) of row
    /// `r` of every layer, stacked as [`Self::positions`] says.
    fn stacked(&self, r: i32, a: i32, b: i32) -> Result<Array> {
        use mlx_rs::ops::indexing::IndexOp;
        let mut parts = Vec::with_capacity(2 * self.layers.len());
        for slot in &self.layers {
            let kv = slot.as_ref().ok_or_else(|| anyhow::anyhow!("a layer holds nothing"))?;
            match kv.len() {
                2 => {
                    parts.push(kv[0].index((r..r + 1, .., a..b, ..)));
                    parts.push(kv[1].index((r..r + 1, .., a..b, ..)));
                }
                6 => {
                    parts.push(as_words(&kv[..3], r, a, b)?);
                    parts.push(as_words(&kv[3..], r, a, b)?);
                }
                n => anyhow::bail!("a layer of {n} parts"),
            }
        }
        anyhow::ensure!(
            parts.iter().all(|p| p.dtype() == parts[0].dtype()),
            "a cache whose layers are partly quantized is not stored as blocks"
        );
        let heads = parts.iter().map(|p| p.shape()[1]).max().unwrap_or(0);
        let dims = parts.iter().map(|p| p.shape()[3]).max().unwrap_or(0);
        for p in parts.iter_mut() {
            let (h, d) = (p.shape()[1], p.shape()[3]);
            if (h, d) != (heads, dims) {
                let width: &[(i32, i32)] = &[(0, 0), (0, heads - h), (0, 0), (0, dims - d)];
                *p = mlx_rs::ops::pad(&*p, width, None, None)?;
            }
        }
        Ok(mlx_rs::ops::stack(&parts, 0)?)
    }

    /// True when some row is padded: attention then needs each row's own
    /// mask and rope positions (an unpadded batch computes exactly as one row).
    pub fn is_padded(&self) -> bool {
        !self.left_padding.is_empty()
    }

    /// Each row's position of the next cached entry, `[B]` int32 (for a rope
    /// with per-row offsets).
    pub fn row_offsets(&self) -> Array {
        let offsets: Vec<i32> = self.left_padding.iter().map(|p| self.offset - p).collect();
        Array::from_slice(&offsets, &[offsets.len() as i32])
    }

    /// The attention mask `[B, 1, l, total]` of `l` queries written at
    /// `start` against `total` keys, when rows are padded: query i of row b
    /// sees key j when `pad[b] <= j <= start + i` and, with a `window`,
    /// `start + i - j < window`. `None` when no row is padded. Built on the
    /// device from the `[B]` paddings (a batch of 64 rows and 1,000
    /// positions would be 64,000 host booleans per layer), once per pass.
    pub fn padding_mask(&mut self, start: i32, l: i32, total: i32, window: Option<i32>) -> Result<Option<Array>> {
        use mlx_rs::ops::arange;
        if self.left_padding.is_empty() {
            return Ok(None);
        }
        let key = (start, l, total, window);
        if let Some((_, m)) = self.masks.iter().find(|(k, _)| *k == key) {
            return Ok(Some(m.clone()));
        }
        let rows = self.left_padding.len() as i32;
        let pad = Array::from_slice(&self.left_padding, &[rows, 1, 1, 1]);
        let keys = arange::<_, i32>(0, total, 1)?.reshape(&[1, 1, 1, total])?;
        let queries = arange::<_, i32>(start, start + l, 1)?.reshape(&[1, 1, l, 1])?;
        let mut allowed = keys.ge(&pad)?.logical_and(&keys.le(&queries)?)?;
        if let Some(w) = window {
            allowed = allowed.logical_and(&queries.subtract(&keys)?.lt(Array::from_int(w))?)?;
        }
        if self.masks.len() >= 2 {
            self.masks.remove(0);
        }
        self.masks.push((key, allowed.clone()));
        Ok(Some(allowed))
    }

    /// Each row's first visible key `[rows]` (int32) for a one-position
    /// step over `total` keys: its padding, and with a sliding `window` no
    /// earlier than `total - window` (what [`Self::padding_mask`] allows
    /// for that step, as data instead of a mask).
    pub fn row_starts(&mut self, total: i32, window: Option<i32>) -> Result<Array> {
        if let Some((_, s)) = self.starts.iter().find(|(k, _)| *k == (total, window)) {
            return Ok(s.clone());
        }
        let first = window.map_or(0, |w| total - w);
        let starts: Vec<i32> = self.paddings().iter().map(|&p| p.max(first)).collect();
        let starts = Array::from_slice(&starts, &[starts.len() as i32]);
        if self.starts.len() >= 2 {
            self.starts.remove(0);
        }
        self.starts.push(((total, window), starts.clone()));
        Ok(starts)
    }

    /// Rows in the batch.
    pub fn rows(&self) -> usize {
        if !self.left_padding.is_empty() {
            return self.left_padding.len();
        }
        let from_states = || self.states.iter().flatten().next().map_or(1, |s| s[0].shape()[0] as usize);
        self.layers.iter().flatten().next().map_or_else(from_states, |parts| parts[0].shape()[0] as usize)
    }

    /// Each row's padding (zeros when unpadded).
    pub fn paddings(&self) -> Vec<i32> {
        if self.left_padding.is_empty() {
            vec![0; self.rows()]
        } else {
            self.left_padding.clone()
        }
    }

    fn set_paddings(&mut self, pads: Vec<i32>) {
        self.masks.clear();
        self.starts.clear();
        self.left_padding = if pads.iter().any(|&p| p > 0) { pads } else { Vec::new() };
    }

    /// Every layer's buffers (each part of them) replaced by `f(buffer)`.
    fn map_buffers(&mut self, mut f: impl FnMut(Array) -> Result<Array>) -> Result<()> {
        for slot in &mut self.layers {
            if let Some(parts) = slot.take() {
                *slot = Some(parts.into_iter().map(&mut f).collect::<Result<_>>()?);
            }
        }
        Ok(())
    }

    /// The rows' LoRA adapters as the family's projections apply them:
    /// none, one shared by every row, or per row (stacked once for these
    /// rows and kept until they change).
    pub fn lora(&mut self) -> Result<crate::model::lora::Lora> {
        use crate::model::lora::{Lora, RowAdapters};
        let Some(first) = self.adapters.first() else { return Ok(Lora::None) };
        let rows = self.rows();
        let same = |a: &Option<std::rc::Rc<crate::model::lora::LoraAdapter>>| {
            a.as_ref().map(|a| a.fingerprint) == first.as_ref().map(|f| f.fingerprint)
        };
        if self.adapters.len() == rows && self.adapters.iter().all(same) {
            return Ok(first.clone().map_or(Lora::None, Lora::One));
        }
        if self.lora_rows.is_none() {
            let mut adapters = self.adapters.clone();
            adapters.resize(rows, None);
            self.lora_rows = Some(std::rc::Rc::new(RowAdapters::stack(&adapters)?));
        }
        Ok(Lora::Rows(self.lora_rows.clone().expect("just made")))
    }

    /// True when some layer holds quantized keys and values.
    pub fn is_quantized(&self) -> bool {
        self.layers.iter().flatten().any(|parts| parts.len() == 6)
    }

    /// Quantizes layer slot `parts` (full precision) as `q` says: the
    /// positions so far as mlx-lm's `KVCache.to_quantized` does.
    fn quantized(parts: Vec<Array>, end: i32, q: KvQuantization) -> Result<Vec<Array>> {
        use mlx_rs::ops::indexing::IndexOp;
        let mut out = Vec::with_capacity(6);
        for (i, part) in parts.iter().enumerate() {
            let part = crate::model::quantized_attention::rotated(&part.index((.., .., ..end, ..)), q)?;
            let bits = if i == 0 { q.key_bits } else { q.bits };
            let (w, s, b) = mlx_rs::ops::quantize(part, q.group_size, bits)?;
            out.extend([w, s, b]);
        }
        Ok(out)
    }

    /// Every full-precision layer quantized (a row joining a batch whose
    /// rows are quantized).
    fn quantize_all(&mut self, q: KvQuantization) -> Result<()> {
        let end = self.offset;
        for slot in &mut self.layers {
            if let Some(parts) = slot.take_if(|p| p.len() == 2) {
                *slot = Some(Self::quantized(parts, end, q)?);
            }
        }
        self.quantization = Some(q);
        Ok(())
    }

    /// `n` more padding positions before every row (the batch's positions
    /// move right; what each row sees is unchanged).
    fn pad_left(&mut self, n: i32) -> Result<()> {
        use mlx_rs::ops::indexing::IndexOp;
        if n == 0 {
            return Ok(());
        }
        let end = self.offset;
        let pad = |b: Array| -> Result<Array> {
            let s = b.shape();
            let zeros = mlx_rs::ops::zeros_dtype(&[s[0], s[1], n, s[3]], b.dtype())?;
            Ok(mlx_rs::ops::concatenate(&[zeros, b.index((.., .., ..end, ..))], 2)?)
        };
        self.map_buffers(pad)?;
        self.offset += n;
        let pads = self.paddings().into_iter().map(|p| p + n).collect();
        self.set_paddings(pads);
        Ok(())
    }

    /// Adds `other`'s rows after this cache's, aligning every row at its
    /// end (mlx-lm's `BatchKVCache.extend`): the shorter side gets left
    /// padding. (Rows with multimodal rope positions decode alone: the
    /// scheduler never joins them.)
    pub fn join(&mut self, mut other: KvCache) -> Result<()> {
        use mlx_rs::ops::indexing::IndexOp;
        anyhow::ensure!(self.layers.len() == other.layers.len(), "caches of different models");
        // Rows of one batch share a form: a full-precision side joining a
        // quantized one is quantized (the scheduler batches sequences of
        // one quantization setting together, so only the start differs).
        match (self.is_quantized(), other.is_quantized()) {
            (true, false) => other.quantize_all(self.quantization.or(other.quantization).expect("quantized"))?,
            (false, true) => self.quantize_all(other.quantization.or(self.quantization).expect("quantized"))?,
            _ => {}
        }
        self.quantization = self.quantization.or(other.quantization);
        if !self.adapters.is_empty() || !other.adapters.is_empty() {
            let (mine, theirs) = (self.rows(), other.rows());
            self.adapters.resize(mine, None);
            let mut more = std::mem::take(&mut other.adapters);
            more.resize(theirs, None);
            self.adapters.extend(more);
            self.lora_rows = None;
        }
        let end = self.offset.max(other.offset);
        self.pad_left(end - self.offset)?;
        other.pad_left(end - other.offset)?;
        let mut pads = self.paddings();
        pads.extend(other.paddings());
        match (&self.tag, other.tag.take()) {
            (Some(t), Some(o)) => {
                if let Some(j) = &t.journal {
                    j.push(CacheOp::Join { into: t.id, from: o.consume() });
                }
            }
            (None, None) => {}
            _ => anyhow::bail!("joining a sharded model's cache with one made outside its group"),
        }
        for (mine, theirs) in self.layers.iter_mut().zip(other.layers) {
            let (Some(a), Some(b)) = (mine.take(), theirs) else {
                anyhow::bail!("joining a cache that holds nothing");
            };
            let cat = |(a, b): (Array, Array)| -> Result<Array> {
                Ok(mlx_rs::ops::concatenate(&[a.index((.., .., ..end, ..)), b.index((.., .., ..end, ..))], 0)?)
            };
            *mine = Some(a.into_iter().zip(b).map(cat).collect::<Result<_>>()?);
        }
        // A recurrent state holds no positions: rows are just stacked.
        anyhow::ensure!(self.states.len() == other.states.len(), "caches of different models");
        for (mine, theirs) in self.states.iter_mut().zip(other.states) {
            if let (Some(a), Some(b)) = (mine.as_mut(), theirs) {
                for (x, y) in a.iter_mut().zip(b) {
                    *x = mlx_rs::ops::concatenate(&[&*x, &y], 0)?;
                }
            }
        }
        self.checkpoint = None;
        self.set_paddings(pads);
        Ok(())
    }

    /// Keeps rows `keep` (in that order) and drops the padding every kept
    /// row shares (mlx-lm's `BatchKVCache.filter`): a single row left ends
    /// up unpadded, computing exactly as a cache that was never batched.
    pub fn keep_rows(&mut self, keep: &[usize]) -> Result<()> {
        use mlx_rs::ops::indexing::IndexOp;
        let rows = self.rows();
        anyhow::ensure!(keep.iter().all(|&r| r < rows), "keeping rows {keep:?} of a batch of {rows}");
        if let Some(Tag { id, journal: Some(j) }) = &self.tag {
            j.push(CacheOp::KeepRows { id: *id, keep: keep.iter().map(|&r| r as u32).collect() });
        }
        let pads = self.paddings();
        let kept: Vec<i32> = keep.iter().map(|&r| pads[r]).collect();
        let shared = kept.iter().copied().min().unwrap_or(0);
        if !self.adapters.is_empty() {
            self.adapters = keep.iter().map(|&r| self.adapters.get(r).cloned().flatten()).collect();
            if self.adapters.iter().all(Option::is_none) {
                self.adapters.clear();
            }
            self.lora_rows = None;
        }
        let idx: Vec<i32> = keep.iter().map(|&r| r as i32).collect();
        let idx = Array::from_slice(&idx, &[idx.len() as i32]);
        let end = self.offset;
        let rows = |b: Array| -> Result<Array> { Ok(b.index((.., .., shared..end, ..)).take_axis(&idx, 0)?) };
        self.map_buffers(rows)?;
        for arrays in self.states.iter_mut().flatten() {
            for a in arrays.iter_mut() {
                *a = a.take_axis(&idx, 0)?;
            }
        }
        self.offset -= shared;
        self.set_paddings(kept.into_iter().map(|p| p - shared).collect());
        Ok(())
    }

    /// Forgets the last `n[r]` positions of each row `r` (a batched verify
    /// pass's rejected drafts, a different number per row), keeping the
    /// rows aligned at their ends: the positions every row forgets are cut
    /// from the end, and a row that forgets more moves right by the
    /// difference, which becomes padding before it. Its keys keep their
    /// rope positions (a row's positions count from its padding's end).
    /// The buffers keep their bytes past the end, which the next writes
    /// overwrite and no attention reads. A journaled (split) cache journals
    /// it, for every rank to do the same to its shard. False, and nothing
    /// changed, where that cannot be done: recurrent states (they cover
    /// every position), or more positions than a row holds.
    pub fn trim_rows(&mut self, n: &[i32]) -> Result<bool> {
        use mlx_rs::ops::indexing::IndexOp;
        anyhow::ensure!(n.len() == self.rows(), "trimming {} rows of a batch of {}", n.len(), self.rows());
        let shared = n.iter().copied().min().unwrap_or(0);
        let pads = self.paddings();
        let fits = |(&k, &p): (&i32, &i32)| k >= 0 && p + k <= self.offset;
        if self.has_states() || !n.iter().zip(&pads).all(fits) {
            return Ok(false);
        }
        self.journal(|id| CacheOp::TrimRows { id, n: n.to_vec() });
        let end = self.offset - shared;
        let moves: Vec<i32> = n.iter().map(|&k| k - shared).collect();
        if moves.iter().any(|&m| m > 0) {
            // Row r's position j comes from j - moves[r] (clamped: what lands
            // in the new padding is never read).
            let rows = moves.len() as i32;
            let mut idx = Vec::with_capacity((rows * end) as usize);
            for &m in &moves {
                idx.extend((0..end).map(|j| (j - m).max(0)));
            }
            let idx = Array::from_slice(&idx, &[rows, 1, end, 1]);
            let shift = |b: Array| -> Result<Array> { Ok(b.index((.., .., ..end, ..)).take_along_axis(&idx, 2)?) };
            self.map_buffers(shift)?;
            self.set_paddings(pads.iter().zip(&moves).map(|(p, m)| p + m).collect());
        }
        self.offset = end;
        Ok(true)
    }

    /// Makes room for `n` more positions in every layer's buffers (growing
    /// them `KV_STEP` positions at a time, keeping what is cached).
    pub fn reserve(&mut self, n: i32) -> Result<()> {
        let end = self.offset + n;
        for slot in &mut self.layers {
            if let Some(parts) = slot.take() {
                *slot = Some(parts.into_iter().map(|p| grown(p, self.offset, end)).collect::<Result<_>>()?);
            }
        }
        Ok(())
    }

    /// Writes `n` new positions' keys and values (`[batch, heads, n, head_dim]`)
    /// after the `offset` cached ones; returns every cached position's.
    /// (A family whose attention reads only full precision calls this;
    /// the engine does not quantize its caches.)
    pub fn update(&mut self, layer: usize, k: Array, v: Array) -> Result<(Array, Array)> {
        match self.write(layer, vec![k, v])?.as_slice() {
            [k, v] => Ok((k.clone(), v.clone())),
            _ => anyhow::bail!("this family's attention reads full-precision keys and values only"),
        }
    }

    /// As [`Self::update`], for an attention that also reads quantized keys
    /// and values: once the cache holds [`KvQuantization::start`] positions
    /// they are quantized (those so far first, as mlx-lm's
    /// `maybe_quantize_kv_cache` does after a prefill chunk or step), and
    /// the new ones are written quantized.
    pub fn update_view(&mut self, layer: usize, k: Array, v: Array) -> Result<KvView> {
        let q = self.quantization;
        // mlx-lm quantizes after each of its prefill chunks (2048 positions)
        // and after every single position (the prompt's last, then each
        // decode step); the scheduler's own chunks (smaller, as the prefill
        // budget is shared) must not move that point, or the prompt's tail
        // would attend to quantized keys here and full-precision ones there.
        let new_positions = k.shape().get(2).copied().unwrap_or(1);
        let at_mlx_lm_point = new_positions == 1 || self.offset >= MLX_LM_PREFILL_STEP;
        let due = q.filter(|q| self.offset > 0 && self.offset >= q.start && at_mlx_lm_point);
        if let Some(q) = due {
            if let Some(parts) = self.layers[layer].take_if(|p| p.len() == 2) {
                self.layers[layer] = Some(Self::quantized(parts, self.offset, q)?);
            }
        }
        let new = match (self.layers[layer].as_ref().map(Vec::len), q) {
            (Some(6), Some(q)) => {
                use crate::model::quantized_attention::rotated;
                let (kw, ks, kb) = mlx_rs::ops::quantize(rotated(&k, q)?, q.group_size, q.key_bits)?;
                let (vw, vs, vb) = mlx_rs::ops::quantize(rotated(&v, q)?, q.group_size, q.bits)?;
                vec![kw, ks, kb, vw, vs, vb]
            }
            _ => vec![k, v],
        };
        let mut view = self.write(layer, new)?.into_iter();
        let mut next = || view.next().expect("a part");
        Ok(match q.filter(|_| self.layers[layer].as_ref().is_some_and(|p| p.len() == 6)) {
            Some(q) => KvView::Quantized { keys: [next(), next(), next()], values: [next(), next(), next()], q },
            None => KvView::Full(next(), next()),
        })
    }

    /// Writes `new` (a slot's parts for the next positions) after the
    /// `offset` cached ones of layer `layer`; returns every cached
    /// position's parts.
    fn write(&mut self, layer: usize, new: Vec<Array>) -> Result<Vec<Array>> {
        use mlx_rs::ops::indexing::IndexOp;
        let (prev, n) = (self.offset, new[0].shape()[2]);
        let end = prev + n;
        let mut buffers: Vec<Array> = match self.layers[layer].take() {
            Some(parts) => parts.into_iter().map(|p| grown(p, prev, end)).collect::<Result<_>>()?,
            None => new.iter().map(|p| empty_buffer(p, end)).collect::<Result<_>>()?,
        };
        anyhow::ensure!(buffers.len() == new.len(), "a layer's keys and values changed form");
        let mut view = Vec::with_capacity(new.len());
        for (buffer, part) in buffers.iter_mut().zip(&new) {
            *buffer = write_positions(buffer, part, prev)?;
            view.push(buffer.index((.., .., ..end, ..)));
        }
        self.layers[layer] = Some(buffers);
        Ok(view)
    }

    /// Every layer's key and value buffers, in order (k0, v0, k1, ...), taken
    /// out of the cache; `None` unless every layer has them.
    pub fn take_buffers(&mut self) -> Option<Vec<Array>> {
        if self.layers.iter().any(|s| s.as_ref().is_none_or(|p| p.len() != 2)) {
            return None;
        }
        Some(self.layers.iter_mut().flat_map(|slot| slot.take().unwrap()).collect())
    }

    /// Puts back buffers from `take_buffers` (or their successors) holding
    /// `added` more positions.
    pub fn put_buffers(&mut self, buffers: Vec<Array>, added: i32) {
        let mut it = buffers.into_iter();
        for slot in &mut self.layers {
            *slot = Some(vec![it.next().expect("a key buffer"), it.next().expect("a value buffer")]);
        }
        self.offset += added;
    }

    /// Positions the buffers have room for (0 before the first write).
    pub fn capacity(&self) -> i32 {
        self.layers.iter().flatten().next().map_or(0, |parts| parts[0].shape()[2])
    }

    /// Bytes the cached keys and values take (recurrent states, whose
    /// size does not grow with the positions, not counted).
    pub fn nbytes(&self) -> u64 {
        self.layers.iter().flatten().flatten().map(|p| p.nbytes() as u64).sum()
    }

    /// Arrays to evaluate so the cache is materialized (states included).
    pub fn arrays(&self) -> Vec<&Array> {
        let kv = self.layers.iter().flatten().flatten();
        kv.chain(self.states.iter().flatten().flatten()).collect()
    }
}

/// How a sequence's keys and values are kept quantized: mlx-lm's
/// mlx-lm's `prefill_step_size`: the positions of its prefill chunks.
const MLX_LM_PREFILL_STEP: i32 = 2048;

/// The most positions [`KvCache::blocks`] builds at once: bounds the
/// transient copy a window is (it stacks every layer's positions) while
/// the blocks are cut from it.
const BLOCK_WINDOW: i32 = 2048;

/// `kv_bits`, `kv_group_size` and `quantized_kv_start` (affine, MLX's
/// `quantize` over each head's values).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct KvQuantization {
    /// The values' bits: 4 or 8 (also 6, 5, 3, 2).
    pub bits: i32,
    /// The keys' bits: `bits` unless asked otherwise. Keys carry the
    /// outlier channels (Qwen2.5's): 8-bit keys with 4-bit values is
    /// llama.cpp's `-ctk q8_0 -ctv q4_0`.
    pub key_bits: i32,
    /// Values per scale and bias (32, 64 or 128; it divides the head size).
    pub group_size: i32,
    /// Positions kept in full precision before the cache is quantized.
    pub start: i32,
    /// Keys and values rotated by a Hadamard matrix before they are
    /// quantized (queries alike, the output rotated back): the scores and
    /// outputs are unchanged, but a channel of outliers (Qwen2.5's keys)
    /// is spread over every channel instead of stretching its group's
    /// scale. Off: mlx-lm's arithmetic exactly.
    pub rotate: bool,
}

impl KvQuantization {
    /// Bytes one cached value takes quantized, against `full` bytes.
    pub fn bytes_per_value(&self, full: f64) -> f64 {
        f64::from(self.key_bits + self.bits) / 16.0 + 2.0 * full / f64::from(self.group_size)
    }
}

/// A layer's keys and values as its attention reads them.
pub enum KvView {
    /// `[batch, heads, positions, head_dim]` each.
    Full(Array, Array),
    /// MLX's `quantize` output (packed values, scales, biases) of each.
    Quantized { keys: [Array; 3], values: [Array; 3], q: KvQuantization },
}

/// A buffer of `KV_STEP`-rounded capacity for `end` positions shaped like `like`.
fn empty_buffer(like: &Array, end: i32) -> Result<Array> {
    let s = like.shape();
    Ok(mlx_rs::ops::zeros_dtype(&[s[0], s[1], round_up(end), s[3]], like.dtype())?)
}

fn round_up(end: i32) -> i32 {
    (end + KV_STEP - 1) / KV_STEP * KV_STEP
}

/// `buf` (holding `kept` positions) with room for `end`: itself when it is
/// big enough, else its first `kept` positions followed by zeros.
fn grown(buf: Array, kept: i32, end: i32) -> Result<Array> {
    use mlx_rs::ops::indexing::IndexOp;
    if buf.shape()[2] >= end {
        return Ok(buf);
    }
    let s = buf.shape();
    let zeros = mlx_rs::ops::zeros_dtype(&[s[0], s[1], round_up(end) - kept, s[3]], buf.dtype())?;
    Ok(mlx_rs::ops::concatenate(&[buf.index((.., .., ..kept, ..)), zeros], 2)?)
}

/// `buf` with `part` (`[B, heads, n, width]`) written at positions
/// `at..at + n`: MLX's `slice_update`, called directly. mlx-rs's indexed
/// assignment reshapes the update twice first (its leading ones dropped,
/// then restored): two more operations a write, four a layer, in a decode
/// step whose time on a GPU is the host's work per operation.
fn write_positions(buf: &Array, part: &Array, at: i32) -> Result<Array> {
    let b = buf.shape();
    anyhow::ensure!(b.len() == 4 && part.ndim() == 4, "KV buffers are [batch, heads, positions, width]");
    let start = [0, 0, at, 0];
    let stop = [b[0], b[1], at + part.shape()[2], b[3]];
    let strides = [1i32; 4];
    let stream = mlx_rs::Stream::thread_local_or_default();
    // SAFETY: every handle passed is a live mlx-c array or stream, the
    // index arrays live for the call; `res` is a fresh handle that mlx-c
    // fills on success and that `Array` then owns.
    unsafe {
        let mut res = mlx_sys::mlx_array_new();
        let status = mlx_sys::mlx_slice_update(
            &mut res,
            buf.as_ptr(),
            part.as_ptr(),
            start.as_ptr(),
            4,
            stop.as_ptr(),
            4,
            strides.as_ptr(),
            4,
            stream.as_ptr(),
        );
        let out = Array::from_ptr(res);
        anyhow::ensure!(status == 0, "MLX slice_update failed on shapes {b:?} <- {:?} at {at}", part.shape());
        Ok(out)
    }
}

/// Per KV slot, `(heads, head_dim)`.
pub type KvShapes = Vec<(i32, i32)>;

/// One quantized tensor's packed values, scales and biases (`[B, heads,
/// positions, *]` each) at positions `a..b` of row `r`, side by side as
/// 16-bit words `[1, heads, b - a, width]`: one dtype, so a quantized
/// cache's block is one array, as a full-precision one is.
fn as_words(parts: &[Array], r: i32, a: i32, b: i32) -> Result<Array> {
    use mlx_rs::ops::indexing::IndexOp;
    let words = parts
        .iter()
        .map(|p| p.index((r..r + 1, .., a..b, ..)).contiguous()?.view::<u16>())
        .collect::<std::result::Result<Vec<_>, _>>()?;
    Ok(mlx_rs::ops::concatenate(&words, 3)?)
}

/// 16-bit words one scale (or bias) of dtype `d` takes: the cache's float
/// dtypes, 2 for f32 and 1 for f16 and bf16.
fn scale_words(d: mlx_rs::Dtype) -> i32 {
    if d == mlx_rs::Dtype::Float32 {
        2
    } else {
        1
    }
}

/// [`as_words`] undone for a tensor of `heads` x `dims` values of `bits`
/// bits in groups of `group`, its scales and biases of dtype `scales`
/// (`words` may be wider: the block's widest layer sets its width).
fn from_words(
    words: &Array,
    heads: i32,
    dims: i32,
    bits: i32,
    group: i32,
    scales: mlx_rs::Dtype,
) -> Result<Vec<Array>> {
    use mlx_rs::ops::indexing::IndexOp;
    let packed = dims * bits / 16;
    let per_scale = scale_words(scales);
    let side = dims / group * per_scale;
    anyhow::ensure!(words.shape()[3] >= packed + 2 * side, "a quantized block narrower than its layer");
    let cut = |from: i32, to: i32| words.index((.., ..heads, .., from..to)).contiguous();
    Ok(vec![
        cut(0, packed)?.view::<u32>()?,
        cut(packed, packed + side)?.view_dtype(scales)?,
        cut(packed + side, packed + 2 * side)?.view_dtype(scales)?,
    ])
}

/// The heads and width (16-bit words) of a quantized block
/// ([`KvCache::positions`] of a cache quantized as `q`, its scales of dtype
/// `scales`): keys and values of every layer padded to the most heads and
/// the widest; a position takes `2 · layers · heads · width` words.
pub fn quantized_block_shape(shapes: &[(i32, i32)], q: KvQuantization, scales: mlx_rs::Dtype) -> (i32, i32) {
    let per_scale = scale_words(scales);
    let width = |dims: i32, bits: i32| dims * bits / 16 + 2 * (dims / q.group_size) * per_scale;
    let widest = shapes.iter().map(|&(_, d)| width(d, q.key_bits).max(width(d, q.bits))).max().unwrap_or(0);
    (shapes.iter().map(|&(h, _)| h).max().unwrap_or(0), widest)
}

/// The shapes and dtypes of one row's recurrent states, slot by slot (what
/// [`flatten_states`] writes and [`unflatten_states`] reads back).
pub type StateLayout = Vec<Option<Vec<(Vec<i32>, mlx_rs::Dtype)>>>;

/// The layout of `states` (one row).
pub fn state_layout(states: &[Option<Vec<Array>>]) -> StateLayout {
    states
        .iter()
        .map(|s| s.as_ref().map(|arrays| arrays.iter().map(|a| (a.shape().to_vec(), a.dtype())).collect()))
        .collect()
}

/// One row's recurrent states as one float32 vector, slot by slot (each
/// state's dtype converts back exactly: float16 and bfloat16 are subsets).
pub fn flatten_states(states: &[Option<Vec<Array>>]) -> Result<Array> {
    let mut parts = Vec::new();
    for a in states.iter().flatten().flatten() {
        parts.push(a.as_dtype(mlx_rs::Dtype::Float32)?.reshape(&[-1])?);
    }
    anyhow::ensure!(!parts.is_empty(), "no recurrent state");
    Ok(mlx_rs::ops::concatenate(&parts, 0)?)
}

/// The states [`flatten_states`] wrote, in `layout`; `None` when `flat`
/// does not hold exactly that many values.
pub fn unflatten_states(flat: &Array, layout: &StateLayout) -> Option<Vec<Option<Vec<Array>>>> {
    use mlx_rs::ops::indexing::IndexOp;
    let total: i64 = layout.iter().flatten().flatten().map(|(s, _)| s.iter().map(|&d| d as i64).product::<i64>()).sum();
    if flat.ndim() != 1 || flat.shape()[0] as i64 != total || flat.dtype() != mlx_rs::Dtype::Float32 {
        return None;
    }
    let mut at = 0i32;
    let mut out = Vec::with_capacity(layout.len());
    for slot in layout {
        out.push(match slot {
            None => None,
            Some(arrays) => {
                let mut got = Vec::with_capacity(arrays.len());
                for (shape, dtype) in arrays {
                    let n: i32 = shape.iter().product();
                    got.push(flat.index(at..at + n).reshape(shape).ok()?.as_dtype(*dtype).ok()?);
                    at += n;
                }
                Some(got)
            }
        });
    }
    Some(out)
}

#[cfg(test)]
mod kv_cache_tests {
    use super::*;
    use mlx_rs::ops::indexing::IndexOp;

    /// The buffered cache returns exactly what concatenating every write
    /// would, across growths (a prefill of 250 positions, then single steps
    /// past the 256 boundary), and a clone is not disturbed by later writes.
    #[test]
    fn buffered_writes_equal_concatenation_across_growth() {
        let mut cache = KvCache::new(1);
        let mut all: Option<Array> = None;
        let mut snapshot = None;
        for (i, n) in [250, 1, 1, 1, 1, 1, 1, 1, 1, 300].into_iter().enumerate() {
            let k = mlx_rs::random::normal::<f32>(&[1, 2, n, 4], None, None, None).unwrap();
            let (got, _) = cache.update(0, k.clone(), k.clone()).unwrap();
            cache.offset += n;
            let want = match all.take() {
                None => k,
                Some(a) => mlx_rs::ops::concatenate(&[a, k], 2).unwrap(),
            };
            assert_eq!(got.shape(), want.shape());
            assert!(got.all_close(&want, 0.0, 0.0, None).unwrap(), "write {i}");
            if i == 3 {
                snapshot = Some((cache.clone(), want.clone()));
            }
            all = Some(want);
        }
        let (old, want) = snapshot.unwrap();
        let k = old.layers[0].clone().unwrap()[0].clone();
        let seen = k.index((.., .., ..old.offset, ..));
        assert!(seen.all_close(&want, 0.0, 0.0, None).unwrap(), "the clone kept its state");
    }

    /// A trimmed cache (a verify pass's rejected drafts) returns exactly
    /// what a cache that never held the trimmed positions would, after the
    /// next writes; a recurrent cache refuses the trim.
    #[test]
    fn trimmed_positions_are_forgotten_and_overwritten() {
        let normal = |n: i32| mlx_rs::random::normal::<f32>(&[1, 2, n, 4], None, None, None).unwrap();
        let (prompt, drafts, next) = (normal(7), normal(5), normal(3));
        let mut spec = KvCache::new(1);
        let mut plain = KvCache::new(1);
        for (cache, writes) in [(&mut spec, vec![&prompt, &drafts]), (&mut plain, vec![&prompt])] {
            for k in writes {
                cache.update(0, k.clone(), k.clone()).unwrap();
                cache.offset += k.shape()[2];
            }
        }
        // Two of the five drafted positions were accepted.
        assert!(spec.trim_rows(&[3]).unwrap());
        let accepted = drafts.index((.., .., ..2, ..));
        plain.update(0, accepted.clone(), accepted).unwrap();
        plain.offset += 2;
        assert_eq!(spec.offset, plain.offset);
        let (got, _) = spec.update(0, next.clone(), next.clone()).unwrap();
        let (want, _) = plain.update(0, next.clone(), next).unwrap();
        assert_eq!(got.shape(), want.shape());
        assert!(got.all_close(&want, 0.0, 0.0, None).unwrap());
        assert!(!spec.trim_rows(&[spec.offset + 1]).unwrap(), "more positions than it holds");
        let mut recurrent = KvCache::new(1);
        recurrent.set_state(0, vec![normal(1)]);
        recurrent.offset = 4;
        assert!(!recurrent.trim_rows(&[1]).unwrap(), "recurrent states cover every position");
    }

    /// A split model's cache journals its trim, and another rank replaying
    /// the journal on its own copy forgets the same positions.
    #[test]
    fn a_journaled_trim_is_replayed_by_the_other_ranks() {
        let normal = |n: i32| mlx_rs::random::normal::<f32>(&[1, 2, n, 4], None, None, None).unwrap();
        let journal = Journal::default();
        let mut mine = KvCache::new(1);
        let id = mine.journaled(&journal).unwrap();
        let mut theirs = std::collections::HashMap::new();
        for op in journal.take() {
            KvCache::replay(&mut theirs, 1, op).unwrap();
        }
        let written = normal(9);
        for cache in [&mut mine, theirs.get_mut(&id).unwrap()] {
            cache.update(0, written.clone(), written.clone()).unwrap();
            cache.offset += 9;
        }
        assert!(mine.trim_rows(&[4]).unwrap());
        let ops = journal.take();
        assert_eq!(ops, vec![CacheOp::TrimRows { id, n: vec![4] }]);
        for op in ops {
            KvCache::replay(&mut theirs, 1, op).unwrap();
        }
        let next = normal(2);
        let (a, _) = mine.update(0, next.clone(), next.clone()).unwrap();
        let (b, _) = theirs.get_mut(&id).unwrap().update(0, next.clone(), next).unwrap();
        assert_eq!(mine.offset, 5);
        assert!(a.index((.., .., ..7, ..)).all_close(b.index((.., .., ..7, ..)), 0.0, 0.0, None).unwrap());
    }

    /// A padded batch whose rows forget different numbers of positions
    /// keeps each row's remaining keys, in order, at the batch's end, with
    /// the rope positions (row offsets) of a row that never held the
    /// forgotten ones, and the next write lands after each row's last kept key.
    #[test]
    fn rows_trimmed_by_different_amounts_stay_aligned_at_their_ends() {
        let normal = |n: i32| mlx_rs::random::normal::<f32>(&[1, 2, n, 4], None, None, None).unwrap();
        let (a, b, drafts, next) = (normal(7), normal(5), normal(10), normal(2));
        let one = |x: &Array| {
            let mut c = KvCache::new(1);
            c.update(0, x.clone(), x.clone()).unwrap();
            c.offset = x.shape()[2];
            c
        };
        let mut batch = one(&a);
        batch.join(one(&b)).unwrap();
        assert_eq!(batch.paddings(), vec![0, 2]);
        let both =
            mlx_rs::ops::concatenate(&[drafts.index((.., .., ..5, ..)), drafts.index((.., .., 5.., ..))], 0).unwrap();
        batch.update(0, both.clone(), both).unwrap();
        batch.offset += 5;
        // Row 0 accepted 1 of 5 drafts (forgets 4), row 1 accepted 4 (forgets 1):
        // row 0, now the shorter, moves right by 3.
        assert!(batch.trim_rows(&[4, 1]).unwrap());
        assert_eq!(batch.paddings(), vec![3, 2]);
        let lengths: Vec<i32> = batch.row_offsets().as_slice::<i32>().to_vec();
        assert_eq!(lengths, vec![7 + 1, 5 + 4]);
        let step = mlx_rs::ops::concatenate(&[next.clone(), next.clone()], 0).unwrap();
        let (keys, _) = batch.update(0, step.clone(), step).unwrap();
        let want = [
            mlx_rs::ops::concatenate(&[a.clone(), drafts.index((.., .., ..1, ..)), next.clone()], 2).unwrap(),
            mlx_rs::ops::concatenate(&[b.clone(), drafts.index((.., .., 5..9, ..)), next.clone()], 2).unwrap(),
        ];
        for (row, want) in want.iter().enumerate() {
            let pad = batch.paddings()[row];
            let got = keys.index((row as i32..row as i32 + 1, .., pad.., ..));
            assert_eq!(got.shape(), want.shape(), "row {row}");
            assert!(got.all_close(want, 0.0, 0.0, None).unwrap(), "row {row}");
        }
    }

    /// Each row's first visible key (what the batch attention kernel takes
    /// instead of a mask) is exactly the first key the padding mask allows
    /// for a one-position step, with and without a sliding window, and a
    /// new padding forgets the memo.
    #[test]
    fn row_starts_are_the_masks_first_allowed_keys() {
        let mut cache = KvCache::batch(1, vec![0, 3, 9]);
        for (total, window) in [(12, None), (12, Some(4)), (30, Some(25)), (13, None)] {
            let starts = cache.row_starts(total, window).unwrap();
            let mask = cache.padding_mask(total - 1, 1, total, window).unwrap().unwrap();
            mask.eval().unwrap();
            let allowed = mask.as_slice::<bool>();
            for (row, &start) in starts.as_slice::<i32>().iter().enumerate() {
                let keys = &allowed[row * total as usize..(row + 1) * total as usize];
                let first = keys.iter().position(|&a| a).unwrap() as i32;
                assert_eq!(start, first, "row {row}, {total} keys, window {window:?}");
                assert!(keys[first as usize..].iter().all(|&a| a), "visible keys run to the end");
            }
        }
        cache.set_paddings(vec![5, 0, 0]);
        assert_eq!(cache.row_starts(12, None).unwrap().as_slice::<i32>(), [5, 0, 0]);
    }

    fn quantized_view(cache: &mut KvCache, x: &Array) -> [Array; 3] {
        match cache.update_view(0, x.clone(), x.clone()).unwrap() {
            KvView::Quantized { keys, .. } => keys,
            KvView::Full(..) => panic!("full precision past the start"),
        }
    }

    /// A quantized cache stays full precision until it holds `start`
    /// positions, then quantizes those and every later write (its bytes a
    /// quarter of f32's at 8 bits, and under an eighth at 4); two joined
    /// and split again give each row back exactly; a trim forgets the last
    /// positions as in full precision.
    #[test]
    fn a_quantized_cache_quantizes_at_its_start_and_joins_filters_and_trims_as_a_full_one() {
        let q = KvQuantization { bits: 8, key_bits: 8, group_size: 32, start: 3, rotate: false };
        let step = |seed: f32, n: i32| {
            let v: Vec<f32> = (0..2 * n * 64).map(|i| (i as f32 * 0.37 + seed).sin()).collect();
            Array::from_slice(&v, &[1, 2, n, 64])
        };
        let mut a = KvCache::new(1);
        a.quantization = Some(q);
        assert!(matches!(a.update_view(0, step(0.0, 2), step(0.0, 2)).unwrap(), KvView::Full(..)));
        a.offset += 2;
        assert!(matches!(a.update_view(0, step(1.0, 1), step(1.0, 1)).unwrap(), KvView::Full(..)), "2 < start 3");
        a.offset += 1;
        let keys = quantized_view(&mut a, &step(2.0, 1));
        a.offset += 1;
        assert_eq!(keys[0].shape(), &[1, 2, 4, 64 * 8 / 32]);
        assert!(a.is_quantized());
        // 256 positions of room: k and v, 2 heads of 64 values each, at 8
        // bits plus an f32 scale and bias per 32 values (0.31 of f32's).
        let per_position = 2.0 * 2.0 * 64.0 * q.bytes_per_value(4.0);
        assert_eq!(a.nbytes(), (256.0 * per_position) as u64);
        assert_eq!(a.nbytes() * 16, 2 * 2 * 256 * 64 * 4 * 5);
        let mut b = KvCache::new(1);
        b.quantization = Some(q);
        for i in 0..6 {
            let _ = b.update_view(0, step(10.0 + i as f32, 1), step(10.0 + i as f32, 1)).unwrap();
            b.offset += 1;
        }
        let (a_keys, b_keys) =
            (quantized_view(&mut a.clone(), &step(3.0, 1)), quantized_view(&mut b.clone(), &step(3.0, 1)));
        let mut both = a.clone();
        both.join(b.clone()).unwrap();
        assert_eq!((both.rows(), both.paddings()), (2, vec![2, 0]));
        let mut second = both.clone();
        second.keep_rows(&[1]).unwrap();
        let again = quantized_view(&mut second, &step(3.0, 1));
        assert!(again.iter().zip(&b_keys).all(|(x, y)| x.eq_values(y).unwrap()));
        let mut first = both.clone();
        first.keep_rows(&[0]).unwrap();
        let again = quantized_view(&mut first, &step(3.0, 1));
        assert!(again.iter().zip(&a_keys).all(|(x, y)| x.eq_values(y).unwrap()));
        // Trimming two positions of row 1 and none of row 0.
        assert!(both.trim_rows(&[0, 2]).unwrap());
        let mut trimmed = both.clone();
        trimmed.keep_rows(&[1]).unwrap();
        assert_eq!(trimmed.offset, 4);
    }

    /// Blocks cut from windows (spans with a gap, across a window's end,
    /// a short tail) equal each span built alone, for a full-precision
    /// and a quantized cache with layers of different head counts.
    #[test]
    fn blocks_cut_from_windows_equal_each_span_alone() {
        let n = BLOCK_WINDOW + 150;
        let step = |seed: f32, heads: i32, n: i32| {
            let v: Vec<f32> = (0..heads * n * 32).map(|i| (i as f32 * 0.37 + seed).sin()).collect();
            Array::from_slice(&v, &[1, heads, n, 32])
        };
        let q = KvQuantization { bits: 4, key_bits: 8, group_size: 32, start: 0, rotate: false };
        for quantization in [None, Some(q)] {
            let mut cache = KvCache::new(2);
            cache.quantization = quantization;
            // A prompt, then one position (where a quantized cache quantizes).
            for (i, len) in [(0.0, n - 1), (1.0, 1)] {
                for (layer, heads) in [(0, 1), (1, 2)] {
                    cache.update_view(layer, step(i + layer as f32, heads, len), step(i - 1.0, heads, len)).unwrap();
                }
                cache.offset += len;
            }
            assert_eq!(cache.is_quantized(), quantization.is_some());
            let mut spans: Vec<(i32, i32)> =
                (0..n / 64).filter(|b| b % 5 != 2).map(|b| (b * 64, b * 64 + 64)).collect();
            spans.push((n / 64 * 64, n));
            let blocks = cache.blocks(0, &spans).unwrap();
            assert_eq!(blocks.len(), spans.len());
            for (&(from, to), got) in spans.iter().zip(&blocks) {
                let want = cache.positions(0, from, to).unwrap();
                assert_eq!(got.shape(), want.shape(), "{from}..{to}");
                assert_eq!(got.shape()[3], to - from);
                assert!(got.eq_values(&want).unwrap(), "{from}..{to} quantized: {}", quantization.is_some());
            }
        }
    }

    /// A quantized cache's positions stored as a block (16-bit words) and
    /// read back give every layer's packed values, scales and biases
    /// exactly, for f32 and f16 caches, keys of other bits than values, and
    /// layers of different head counts (the block padded to the widest);
    /// the block's bytes are what the prompt cache checks a disk block by.
    #[test]
    fn quantized_positions_stored_as_blocks_come_back_exactly() {
        for dtype in [mlx_rs::Dtype::Float32, mlx_rs::Dtype::Float16] {
            let q = KvQuantization { bits: 4, key_bits: 8, group_size: 32, start: 0, rotate: true };
            let step = |seed: f32, heads: i32, n: i32| {
                let v: Vec<f32> = (0..heads * n * 64).map(|i| (i as f32 * 0.37 + seed).sin()).collect();
                Array::from_slice(&v, &[1, heads, n, 64]).as_dtype(dtype).unwrap()
            };
            let mut cache = KvCache::new(2);
            cache.quantization = Some(q);
            // A chunk, one position (where it quantizes, as mlx-lm does), a chunk.
            for (i, n) in [(0.0, 3), (1.0, 1), (2.0, 4)] {
                for (layer, heads) in [(0, 2), (1, 4)] {
                    let _ =
                        cache.update_view(layer, step(i + layer as f32, heads, n), step(i - 1.0, heads, n)).unwrap();
                }
                cache.offset += n;
            }
            assert!(cache.is_quantized());
            let shapes = vec![(2, 64), (4, 64)];
            let block = cache.positions(0, 2, 7).unwrap();
            assert_eq!(block.dtype(), mlx_rs::Dtype::Uint16);
            let (heads, width) = quantized_block_shape(&shapes, q, dtype);
            assert_eq!(block.shape(), &[4, 1, heads, 5, width]);
            let per_layer = (0..2).map(|l| (block.index(2 * l), block.index(2 * l + 1))).collect();
            let back = KvCache::from_quantized_prefix(per_layer, 5, &shapes, q, dtype).unwrap();
            assert_eq!((back.offset, back.quantization), (5, Some(q)));
            for layer in 0..2 {
                let (want, got) = (cache.layers[layer].as_ref().unwrap(), back.layers[layer].as_ref().unwrap());
                assert_eq!(got.len(), 6);
                for (w, g) in want.iter().zip(got) {
                    let w = w.index((.., .., 2..7, ..));
                    assert_eq!((w.shape(), w.dtype()), (g.shape(), g.dtype()), "layer {layer}");
                    assert!(w.eq_values(g).unwrap(), "layer {layer} {dtype:?}");
                }
            }
        }
    }
}
