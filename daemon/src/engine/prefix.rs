//! KV state of prompt prefixes that end after their last image, kept in RAM
//! (bounded, least recently used first out) so a second question about the
//! same images skips both the tower and the prefix's prefill.
//!
//! The KV cache writes each step into fixed-capacity buffers with
//! `slice_update`, which (MLX arrays being immutable) yields new arrays and
//! leaves the old ones as they were, so a stored state can be shared by any
//! number of later generations without copying.

use crate::model::kv_cache::KvCache;
use lru::LruCache;
use mlxbc_shared::MediaRef;
use sha2::{Digest, Sha256};
use std::num::NonZeroUsize;

/// A prefix's identity: model, token prefix, media content hashes.
pub type PrefixId = [u8; 32];

/// The in-memory prefix store.
pub struct PrefixCache {
    entries: LruCache<PrefixId, KvCache>,
}

impl PrefixCache {
    /// Keeps at most `capacity` prefixes.
    pub fn new(capacity: usize) -> Self {
        Self { entries: LruCache::new(NonZeroUsize::new(capacity.max(1)).unwrap()) }
    }

    /// The identity of `ids` (a prompt prefix) with `media` for `model`. The
    /// media hashes are part of it because the token ids of two different
    /// images are the same placeholders.
    pub fn identity(model: &str, ids: &[u32], media: &[&MediaRef]) -> PrefixId {
        let mut h = Sha256::new();
        h.update(model.as_bytes());
        h.update([0]);
        for id in ids {
            h.update(id.to_le_bytes());
        }
        for m in media {
            h.update(m.sha256);
        }
        h.finalize().into()
    }

    /// A copy of the stored state, if any.
    pub fn get(&mut self, id: &PrefixId) -> Option<KvCache> {
        self.entries.get(id).cloned()
    }

    /// Remembers a state.
    pub fn put(&mut self, id: PrefixId, cache: &KvCache) {
        self.entries.put(id, cache.clone());
    }

    /// Nothing held.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Bytes the held KV states take.
    pub fn bytes(&self) -> u64 {
        self.entries.iter().map(|(_, c)| c.nbytes()).sum()
    }

    /// Drops everything (memory pressure, model unload).
    pub fn clear(&mut self) -> usize {
        let n = self.entries.len();
        self.entries.clear();
        n
    }
}
