//! The two-tier store: a byte-bounded LRU in RAM in front of sled on disk,
//! with a disk budget enforced by least-recently-used eviction.
//!
//! sled trees: `features` (key → value), `access` (key → last-use tick, u64
//! big-endian). The access order is rebuilt in memory at open, so eviction
//! does not scan the disk. sled's log is crash-safe; a value torn by a kill
//! fails its checksum and is dropped as a miss.

use crate::{FeatureKey, Features};
use lru::LruCache;
use mlxbc_shared::settings::DiskReserve;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// Sizes of the two tiers.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// Most bytes kept in RAM.
    pub ram_bytes: usize,
    /// Most payload bytes kept on disk before evicting.
    pub disk_bytes: u64,
    /// What the filesystem keeps free whatever `disk_bytes` says: a write
    /// that would cross it is skipped (and counted).
    pub reserve: DiskReserve,
}

impl Default for StoreConfig {
    fn default() -> Self {
        Self { ram_bytes: 256 << 20, disk_bytes: 4 << 30, reserve: DiskReserve { percent: 10, min_bytes: 2 << 30 } }
    }
}

/// Counters since the store was opened (entries and bytes are current).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StoreStats {
    pub entries: u64,
    pub disk_bytes: u64,
    pub ram_entries: u64,
    pub ram_bytes: u64,
    pub ram_hits: u64,
    pub disk_hits: u64,
    pub misses: u64,
    pub evictions: u64,
    pub corrupt: u64,
    /// Entries kept in RAM only because the disk was down to its reserve.
    pub skipped_for_space: u64,
}

/// Why the store could not be opened or written.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("opening the feature store at {path}: {source}")]
    Open { path: PathBuf, source: sled::Error },
    #[error("writing the feature store: {0}")]
    Write(#[from] sled::Error),
}

impl StoreError {
    /// The store could not be opened because another process holds it
    /// (sled locks its directory; its error says "could not acquire lock").
    pub fn is_held_elsewhere(&self) -> bool {
        matches!(self, StoreError::Open { source: sled::Error::Io(e), .. } if e.to_string().contains("could not acquire lock"))
    }
}

/// Where a lookup was answered from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tier {
    Ram,
    Disk,
}

/// Vision features by [`FeatureKey`].
pub struct FeatureStore {
    dir: PathBuf,
    db: sled::Db,
    features: sled::Tree,
    access: sled::Tree,
    ram: LruCache<[u8; 99], Features>,
    ram_bytes: usize,
    config: StoreConfig,
    /// Disk LRU: tick → key, and key → (tick, payload bytes).
    order: BTreeMap<u64, Vec<u8>>,
    index: HashMap<Vec<u8>, (u64, u64)>,
    tick: u64,
    stats: StoreStats,
}

/// Reads every entry of a features tree: how many are sound, and the keys
/// of the damaged ones (an unreadable key or value).
pub fn scan_for_damage(features: &sled::Tree) -> (u64, Vec<Vec<u8>>) {
    let (mut ok, mut damaged) = (0, Vec::new());
    for entry in features.iter() {
        match entry {
            Ok((k, v)) if FeatureKey::from_bytes(&k).is_some() && Features::decode(&v).is_some() => ok += 1,
            Ok((k, _)) => damaged.push(k.to_vec()),
            Err(_) => {}
        }
    }
    (ok, damaged)
}

fn ram_key(key: &FeatureKey) -> [u8; 99] {
    key.to_bytes().try_into().expect("99-byte key")
}

impl FeatureStore {
    /// Opens (or creates) the store in `dir`.
    pub fn open(dir: &Path, config: StoreConfig) -> Result<Self, StoreError> {
        let open_err = |source| StoreError::Open { path: dir.to_owned(), source };
        let db = sled::Config::new().path(dir).open().map_err(open_err)?;
        let features = db.open_tree("features").map_err(open_err)?;
        let access = db.open_tree("access").map_err(open_err)?;
        let mut store = Self {
            dir: dir.to_owned(),
            db,
            features,
            access,
            ram: LruCache::unbounded(),
            ram_bytes: 0,
            config,
            order: BTreeMap::new(),
            index: HashMap::new(),
            tick: 0,
            stats: StoreStats::default(),
        };
        store.rebuild_index();
        Ok(store)
    }

    fn rebuild_index(&mut self) {
        for item in self.features.iter() {
            let Ok((k, v)) = item else { continue };
            let tick = self
                .access
                .get(&k)
                .ok()
                .flatten()
                .and_then(|t| Some(u64::from_be_bytes(t.as_ref().try_into().ok()?)))
                .unwrap_or(0);
            self.track(k.to_vec(), tick, v.len() as u64);
            self.tick = self.tick.max(tick);
        }
    }

    fn track(&mut self, key: Vec<u8>, tick: u64, bytes: u64) {
        if let Some((old, old_bytes)) = self.index.insert(key.clone(), (tick, bytes)) {
            self.order.remove(&old);
            self.stats.disk_bytes -= old_bytes;
            self.stats.entries -= 1;
        }
        // Ticks are unique per write; equal ticks only occur for entries
        // whose access record was lost, which then share the oldest slot.
        let mut t = tick;
        while self.order.contains_key(&t) {
            t = t.wrapping_sub(1);
        }
        self.order.insert(t, key.clone());
        self.index.insert(key, (t, bytes));
        self.stats.disk_bytes += bytes;
        self.stats.entries += 1;
    }

    fn untrack(&mut self, key: &[u8]) {
        if let Some((tick, bytes)) = self.index.remove(key) {
            self.order.remove(&tick);
            self.stats.disk_bytes -= bytes;
            self.stats.entries -= 1;
        }
    }

    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    fn touch(&mut self, raw: &[u8]) {
        let tick = self.next_tick();
        if let Some(&(_, bytes)) = self.index.get(raw) {
            self.track(raw.to_vec(), tick, bytes);
        }
        let _ = self.access.insert(raw, &tick.to_be_bytes());
    }

    /// Looks `key` up in RAM, then on disk. A damaged disk entry is removed
    /// and reported as a miss.
    pub fn get(&mut self, key: &FeatureKey) -> Option<(Features, Tier)> {
        let rk = ram_key(key);
        if let Some(f) = self.ram.get(&rk) {
            let f = f.clone();
            self.stats.ram_hits += 1;
            self.touch(&rk);
            return Some((f, Tier::Ram));
        }
        let raw = key.to_bytes();
        match self.features.get(&raw) {
            Ok(Some(bytes)) => match Features::decode(&bytes) {
                Some(f) => {
                    self.stats.disk_hits += 1;
                    self.touch(&raw);
                    self.remember(rk, f.clone());
                    Some((f, Tier::Disk))
                }
                None => {
                    tracing::warn!(key = %key.short(), "corrupt feature entry removed");
                    self.stats.corrupt += 1;
                    self.stats.misses += 1;
                    self.remove_raw(&raw);
                    None
                }
            },
            _ => {
                self.stats.misses += 1;
                None
            }
        }
    }

    /// Stores features in both tiers, then evicts past the disk budget.
    pub fn put(&mut self, key: &FeatureKey, features: &Features) -> Result<(), StoreError> {
        let raw = key.to_bytes();
        let value = features.encode();
        // sled writes a log: a value takes about its size again until
        // compaction, hence the factor of two.
        if crate::disk_room::room(&self.dir, self.config.reserve) < 2 * value.len() as u64 {
            self.stats.skipped_for_space += 1;
            self.remember(ram_key(key), features.clone());
            return Ok(());
        }
        let tick = self.next_tick();
        self.features.insert(&raw, value.as_slice())?;
        self.access.insert(&raw, &tick.to_be_bytes())?;
        self.track(raw, tick, value.len() as u64);
        self.remember(ram_key(key), features.clone());
        self.evict_to_budget();
        Ok(())
    }

    fn remember(&mut self, key: [u8; 99], f: Features) {
        let n = f.nbytes();
        if n > self.config.ram_bytes {
            return;
        }
        if let Some(old) = self.ram.put(key, f) {
            self.ram_bytes -= old.nbytes();
        }
        self.ram_bytes += n;
        while self.ram_bytes > self.config.ram_bytes {
            match self.ram.pop_lru() {
                Some((_, old)) => self.ram_bytes -= old.nbytes(),
                None => break,
            }
        }
    }

    fn evict_to_budget(&mut self) {
        while self.stats.disk_bytes > self.config.disk_bytes {
            let Some((_, key)) = self.order.pop_first() else {
                break;
            };
            self.remove_raw(&key);
            self.stats.evictions += 1;
        }
    }

    fn remove_raw(&mut self, raw: &[u8]) {
        let _ = self.features.remove(raw);
        let _ = self.access.remove(raw);
        self.untrack(raw);
        if let Ok(rk) = <[u8; 99]>::try_from(raw) {
            if let Some(old) = self.ram.pop(&rk) {
                self.ram_bytes -= old.nbytes();
            }
        }
    }

    /// Drops the RAM tier (memory pressure); the disk keeps everything.
    pub fn shed_ram(&mut self) -> usize {
        let freed = self.ram_bytes;
        self.ram.clear();
        self.ram_bytes = 0;
        freed
    }

    /// Current counters.
    pub fn stats(&self) -> StoreStats {
        StoreStats { ram_entries: self.ram.len() as u64, ram_bytes: self.ram_bytes as u64, ..self.stats.clone() }
    }

    /// Every stored key with its payload size, most recently used first.
    pub fn list(&self) -> Vec<(FeatureKey, u64)> {
        self.order.values().rev().filter_map(|k| Some((FeatureKey::from_bytes(k)?, self.index.get(k)?.1))).collect()
    }

    /// Removes everything.
    pub fn clear(&mut self) -> Result<u64, StoreError> {
        let n = self.stats.entries;
        self.features.clear()?;
        self.access.clear()?;
        self.order.clear();
        self.index.clear();
        self.shed_ram();
        self.stats.entries = 0;
        self.stats.disk_bytes = 0;
        Ok(n)
    }

    /// Reads every disk entry, removing damaged ones; returns (ok, removed).
    pub fn verify(&mut self) -> (u64, u64) {
        let (ok, damaged) = scan_for_damage(&self.features);
        let removed = damaged.len() as u64;
        self.remove_damaged(damaged);
        (ok, removed)
    }

    /// Removes entries [`scan_for_damage`] found, counting them as corrupt.
    pub fn remove_damaged(&mut self, keys: Vec<Vec<u8>>) {
        for k in keys {
            self.stats.corrupt += 1;
            self.remove_raw(&k);
        }
    }

    /// The features tree, for scans that run without holding the store
    /// (sled trees are shared handles, safe to read from any thread).
    pub fn features_tree(&self) -> sled::Tree {
        self.features.clone()
    }

    /// Writes everything to disk now.
    pub fn flush(&self) -> Result<(), StoreError> {
        self.db.flush()?;
        Ok(())
    }

    /// Another tree in the same database (e.g. tower fingerprint memos).
    pub fn tree(&self, name: &str) -> Result<sled::Tree, StoreError> {
        Ok(self.db.open_tree(name)?)
    }

    /// The configured sizes.
    pub fn config(&self) -> &StoreConfig {
        &self.config
    }

    /// Direct access for tests that damage entries on purpose.
    #[doc(hidden)]
    pub fn raw_tree(&self) -> &sled::Tree {
        &self.features
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NO_RESERVE: DiskReserve = DiskReserve { percent: 0, min_bytes: 0 };
    use crate::Modality;

    fn key(n: u8) -> FeatureKey {
        FeatureKey { modality: Modality::Image, tower: [7; 32], preprocess: [8; 32], content: [n; 32] }
    }

    fn feats(n: usize, v: f32) -> Features {
        Features::from_f32(vec![n as u32], &vec![v; n])
    }

    #[test]
    fn survives_reopen_and_reports_tiers() {
        let dir = tempfile::tempdir().unwrap();
        {
            let mut s =
                FeatureStore::open(dir.path(), StoreConfig { reserve: NO_RESERVE, ..Default::default() }).unwrap();
            assert!(s.get(&key(1)).is_none());
            s.put(&key(1), &feats(16, 1.5)).unwrap();
            assert_eq!(s.get(&key(1)).unwrap().1, Tier::Ram);
            s.flush().unwrap();
        }
        let mut s = FeatureStore::open(dir.path(), StoreConfig { reserve: NO_RESERVE, ..Default::default() }).unwrap();
        let (f, tier) = s.get(&key(1)).unwrap();
        assert_eq!((f, tier), (feats(16, 1.5), Tier::Disk));
        assert_eq!(s.get(&key(1)).unwrap().1, Tier::Ram);
        let st = s.stats();
        assert_eq!((st.entries, st.disk_hits, st.ram_hits, st.misses), (1, 1, 1, 0));
    }

    #[test]
    fn corrupt_entries_are_misses_and_removed() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = FeatureStore::open(dir.path(), StoreConfig { reserve: NO_RESERVE, ..Default::default() }).unwrap();
        s.put(&key(1), &feats(16, 1.0)).unwrap();
        s.shed_ram();
        let raw = key(1).to_bytes();
        let mut v = s.raw_tree().get(&raw).unwrap().unwrap().to_vec();
        let last = v.len() - 1;
        v[last] ^= 0xff;
        s.raw_tree().insert(&raw, v).unwrap();
        assert!(s.get(&key(1)).is_none());
        assert_eq!(s.stats().corrupt, 1);
        assert_eq!(s.stats().entries, 0);
        assert!(s.raw_tree().get(&raw).unwrap().is_none());
    }

    #[test]
    fn disk_budget_evicts_least_recently_used() {
        let dir = tempfile::tempdir().unwrap();
        let one = feats(256, 0.0).encode().len() as u64;
        let mut s =
            FeatureStore::open(dir.path(), StoreConfig { ram_bytes: 0, disk_bytes: one * 3, reserve: NO_RESERVE })
                .unwrap();
        for n in 1..=3 {
            s.put(&key(n), &feats(256, n as f32)).unwrap();
        }
        assert!(s.get(&key(1)).is_some()); // 1 is now the most recent
        s.put(&key(4), &feats(256, 4.0)).unwrap();
        assert!(s.get(&key(2)).is_none(), "2 was least recently used");
        for n in [1, 3, 4] {
            assert!(s.get(&key(n)).is_some(), "{n} kept");
        }
        assert_eq!(s.stats().evictions, 1);
        assert!(s.stats().disk_bytes <= one * 3);
    }

    #[test]
    fn ram_tier_is_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let mut s =
            FeatureStore::open(dir.path(), StoreConfig { ram_bytes: 2048, disk_bytes: 1 << 30, reserve: NO_RESERVE })
                .unwrap();
        for n in 1..=5 {
            s.put(&key(n), &feats(256, 0.0)).unwrap(); // 1 KiB each
        }
        assert!(s.stats().ram_bytes <= 2048);
        assert_eq!(s.get(&key(5)).unwrap().1, Tier::Ram);
        assert_eq!(s.get(&key(1)).unwrap().1, Tier::Disk);
    }

    #[test]
    fn verify_and_clear() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = FeatureStore::open(dir.path(), StoreConfig { reserve: NO_RESERVE, ..Default::default() }).unwrap();
        s.put(&key(1), &feats(8, 1.0)).unwrap();
        s.put(&key(2), &feats(8, 2.0)).unwrap();
        s.raw_tree().insert(key(2).to_bytes(), &b"garbage"[..]).unwrap();
        assert_eq!(s.verify(), (1, 1));
        assert_eq!(s.list().len(), 1);
        assert_eq!(s.clear().unwrap(), 1);
        assert_eq!(s.stats().entries, 0);
    }

    #[test]
    fn a_disk_down_to_its_reserve_keeps_features_in_ram_only() {
        let dir = tempfile::tempdir().unwrap();
        let full = DiskReserve { percent: 0, min_bytes: u64::MAX };
        let mut s = FeatureStore::open(dir.path(), StoreConfig { reserve: full, ..Default::default() }).unwrap();
        let k = key(1);
        let f = Features::from_f32(vec![2, 2], &[1.0, 2.0, 3.0, 4.0]);
        s.put(&k, &f).unwrap();
        assert_eq!(s.stats().skipped_for_space, 1);
        assert_eq!(s.stats().entries, 0, "nothing on disk");
        assert!(s.get(&k).is_some(), "still served from RAM");
    }
}
