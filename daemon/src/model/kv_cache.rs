//! The KV cache every family's attention writes: per layer, key and value
//! buffers with a batch axis, and per row the padding that aligns prompts
//! of different lengths.

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
    layers: Vec<Option<(Array, Array)>>,
    /// Number of positions cached.
    pub offset: i32,
    /// Per row (the batch axis), how many positions at the start are
    /// padding: rows of different lengths are aligned at their ends, as
    /// mlx-lm's `BatchKVCache` aligns them. Empty: one row, no padding.
    left_padding: Vec<i32>,
    /// Multimodal rope positions of the prompt, and the delta later
    /// (decoded) positions add to their offset, for models whose rope
    /// follows an image's grid; set from the tower's `rope_positions`.
    pub mrope: Option<(Vec<[i64; 3]>, i64)>,
}

impl KvCache {
    /// An empty cache for `layers` layers.
    pub fn new(layers: usize) -> Self {
        Self { layers: (0..layers).map(|_| None).collect(), offset: 0, left_padding: Vec::new(), mrope: None }
    }

    /// An empty cache for a batch of `left_padding.len()` rows, row `b`
    /// starting with `left_padding[b]` padding positions (its prompt is that
    /// much shorter than the longest).
    pub fn batch(layers: usize, left_padding: Vec<i32>) -> Self {
        let padded = left_padding.iter().any(|&p| p > 0);
        Self { left_padding: if padded { left_padding } else { Vec::new() }, ..Self::new(layers) }
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
    /// `start + i - j < window`. `None` when no row is padded.
    pub fn padding_mask(&self, start: i32, l: i32, total: i32, window: Option<i32>) -> Result<Option<Array>> {
        if self.left_padding.is_empty() {
            return Ok(None);
        }
        let rows = self.left_padding.len();
        let mut allowed = Vec::with_capacity(rows * (l * total) as usize);
        for &pad in &self.left_padding {
            for i in start..start + l {
                allowed.extend((0..total).map(|j| j >= pad && j <= i && window.is_none_or(|w| i - j < w)));
            }
        }
        Ok(Some(Array::from_slice(&allowed, &[rows as i32, 1, l, total])))
    }

    /// Makes room for `n` more positions in every layer's buffers (growing
    /// them `KV_STEP` positions at a time, keeping what is cached).
    pub fn reserve(&mut self, n: i32) -> Result<()> {
        let end = self.offset + n;
        for slot in &mut self.layers {
            if let Some((k, v)) = slot.take() {
                *slot = Some((grown(k, self.offset, end)?, grown(v, self.offset, end)?));
            }
        }
        Ok(())
    }

    /// Writes `n` new positions' keys and values (`[batch, heads, n, head_dim]`)
    /// after the `offset` cached ones; returns every cached position's.
    pub fn update(&mut self, layer: usize, k: Array, v: Array) -> Result<(Array, Array)> {
        use mlx_rs::ops::indexing::{IndexOp, TryIndexMutOp};
        let (prev, n) = (self.offset, k.shape()[2]);
        let end = prev + n;
        let (mut keys, mut values) = match self.layers[layer].take() {
            Some((bk, bv)) => (grown(bk, prev, end)?, grown(bv, prev, end)?),
            None => (empty_buffer(&k, end)?, empty_buffer(&v, end)?),
        };
        keys.try_index_mut((.., .., prev..end, ..), &k)?;
        values.try_index_mut((.., .., prev..end, ..), &v)?;
        let view = (keys.index((.., .., ..end, ..)), values.index((.., .., ..end, ..)));
        self.layers[layer] = Some((keys, values));
        Ok(view)
    }

    /// Every layer's key and value buffers, in order (k0, v0, k1, ...), taken
    /// out of the cache; `None` unless every layer has them.
    pub fn take_buffers(&mut self) -> Option<Vec<Array>> {
        if self.layers.iter().any(Option::is_none) {
            return None;
        }
        Some(self.layers.iter_mut().flat_map(|slot| <[Array; 2]>::from(slot.take().unwrap())).collect())
    }

    /// Puts back buffers from `take_buffers` (or their successors) holding
    /// `added` more positions.
    pub fn put_buffers(&mut self, buffers: Vec<Array>, added: i32) {
        let mut it = buffers.into_iter();
        for slot in &mut self.layers {
            *slot = Some((it.next().expect("a key buffer"), it.next().expect("a value buffer")));
        }
        self.offset += added;
    }

    /// Bytes the cached keys and values take.
    pub fn nbytes(&self) -> u64 {
        self.arrays().iter().map(|a| a.nbytes() as u64).sum()
    }

    /// Arrays to evaluate so the cache is materialized.
    pub fn arrays(&self) -> Vec<&Array> {
        self.layers.iter().flatten().flat_map(|(k, v)| [k, v]).collect()
    }
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
        let (k, _) = old.layers[0].clone().unwrap();
        let seen = k.index((.., .., ..old.offset, ..));
        assert!(seen.all_close(&want, 0.0, 0.0, None).unwrap(), "the clone kept its state");
    }
}
