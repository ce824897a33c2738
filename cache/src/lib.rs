//! The encoder-feature store: an image goes through a vision tower once,
//! ever. Features are stored on disk (sled) under a key made of everything
//! that changes them — schema version, modality, a fingerprint of the tower's
//! weights, a hash of the preprocessing parameters, and the sha256 of the
//! media bytes — with a size-bounded RAM tier in front.
//!
//! Corrupt, truncated or old-format entries are misses (removed and counted),
//! never wrong features and never errors. The store is bounded on disk too:
//! least-recently-used entries are evicted past the budget.
//!
//! The prompt cache's disk tier lives here too ([`BlockStore`]): KV blocks
//! of prompt prefixes, one file each, with the same header-and-checksum rule.
//!
//! No MLX here: features are plain bytes plus dtype and shape, so the store
//! can be inspected (`mlxbc cache ...`) without linking MLX.

mod disk_room;
mod fingerprint;
mod key;
mod kv_blocks;
mod store;
mod value;

pub use disk_room::{disk_space, room, DiskSpace};
pub use fingerprint::{TowerFingerprint, WeightFileIdentity};
pub use key::{content_hash, hex, FeatureKey, Modality, SCHEMA_VERSION};
pub use kv_blocks::{BlockHash, BlockStats, BlockStore};
pub use store::{scan_for_damage, FeatureStore, StoreConfig, StoreError, StoreStats, Tier};
pub use value::{FeatureDtype, Features};
