//! The prompt cache's disk tier: KV blocks of prompt prefixes, one file
//! per block, named by the block's chained hash (which covers the model's
//! identity and every token and image before the block's end).
//!
//! Files, not sled: a block is megabytes (64 positions of a 30-layer
//! model's keys and values), written once and read whole. A file per block
//! is written with one `write` and made visible by `rename`, read with one
//! `read`, and evicted with one `unlink`, with no log to compact and no
//! second copy of every write; a daemon killed mid-write leaves only a
//! `.tmp` file, removed at the next open (measured against sled:
//! docs/measurements/cpu-2026-12-01-kv-block-storage.md).
//!
//! A file is `MXKB`, a format version, the block's hash, then the tensor
//! in the feature store's value format (dtype, shape, length, CRC-32,
//! bytes). Anything not exactly right — wrong magic or version, another
//! block's hash, a bad checksum, a short file — is a miss: removed and
//! counted, never served.

use crate::key::hex;
use crate::value::Features;
use mlxbc_shared::settings::DiskReserve;
use mlxbc_shared::sync::lock;
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::SystemTime;

const MAGIC: &[u8; 4] = b"MXKB";
const FORMAT_VERSION: u16 = 1;
const SUFFIX: &str = "kv";
/// No block is larger (64 positions of a large model's KV are tens of MB);
/// a bigger file under a block's name is not read into memory.
const MAX_BLOCK_BYTES: u64 = 1 << 30;

/// A block's identity: its chained hash.
pub type BlockHash = [u8; 32];

/// Counters of the disk tier (since the daemon started, except the sizes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BlockStats {
    pub blocks: u64,
    pub bytes: u64,
    pub budget_bytes: u64,
    pub hits: u64,
    pub misses: u64,
    pub corrupt: u64,
    pub evictions: u64,
    pub writes: u64,
    /// Blocks not written because the disk was down to its reserve.
    pub skipped_for_space: u64,
    /// What the filesystem's free space allows beyond what is stored now
    /// (the budget in force is the smaller of `budget_bytes` and
    /// `bytes + room_bytes`).
    pub room_bytes: u64,
}

struct Entry {
    bytes: u64,
    /// Last written or read, for least-recently-used eviction.
    used: u64,
}

#[derive(Default)]
struct Index {
    entries: HashMap<BlockHash, Entry>,
    bytes: u64,
    clock: u64,
}

/// KV blocks on disk, bounded by a byte budget, least recently used out.
/// `Send + Sync`: lookups run on the request's blocking task, writes on the
/// daemon's writer thread.
pub struct BlockStore {
    dir: PathBuf,
    budget: u64,
    /// What the filesystem keeps free whatever the budget says.
    reserve: DiskReserve,
    skipped_for_space: AtomicU64,
    index: Mutex<Index>,
    hits: AtomicU64,
    misses: AtomicU64,
    corrupt: AtomicU64,
    evictions: AtomicU64,
    writes: AtomicU64,
}

impl BlockStore {
    /// Opens (creating) the store in `dir`: leftover `.tmp` files of a
    /// write that never finished are removed, the rest indexed by their
    /// modification times (oldest evicted first). Writes stop short of
    /// `budget_bytes` and of the filesystem's `reserve`, whichever comes first.
    pub fn open(dir: &Path, budget_bytes: u64, reserve: DiskReserve) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let mut found = Vec::new();
        for e in std::fs::read_dir(dir)? {
            let e = e?;
            let path = e.path();
            let name = e.file_name().to_string_lossy().to_string();
            let Some(hash) = name.strip_suffix(&format!(".{SUFFIX}")).and_then(parse_hex) else {
                // Unfinished writes, and anything that is not ours to keep.
                if name.ends_with(".tmp") {
                    let _ = std::fs::remove_file(&path);
                }
                continue;
            };
            let m = e.metadata()?;
            let mtime = m.modified().ok().and_then(|t| t.duration_since(SystemTime::UNIX_EPOCH).ok());
            found.push((mtime.map_or(0, |d| d.as_nanos()), hash, m.len()));
        }
        found.sort();
        let mut index = Index::default();
        for (_, hash, bytes) in found {
            index.clock += 1;
            index.bytes += bytes;
            index.entries.insert(hash, Entry { bytes, used: index.clock });
        }
        let store = Self {
            dir: dir.to_path_buf(),
            budget: budget_bytes,
            reserve,
            skipped_for_space: AtomicU64::new(0),
            index: Mutex::new(index),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            corrupt: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
            writes: AtomicU64::new(0),
        };
        store.evict_over_budget();
        Ok(store)
    }

    fn path(&self, hash: &BlockHash) -> PathBuf {
        self.dir.join(format!("{}.{SUFFIX}", hex(hash)))
    }

    /// True when a block of that hash is on disk (it may still turn out corrupt).
    pub fn contains(&self, hash: &BlockHash) -> bool {
        lock(&self.index).entries.contains_key(hash)
    }

    /// The size on disk of the block of that hash, if there is one.
    pub fn size(&self, hash: &BlockHash) -> Option<u64> {
        lock(&self.index).entries.get(hash).map(|e| e.bytes)
    }

    /// The block, verified; `None` when absent or damaged (then removed).
    pub fn read(&self, hash: &BlockHash) -> Option<Features> {
        if !self.contains(hash) {
            self.misses.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        let path = self.path(hash);
        let small_enough = std::fs::metadata(&path).is_ok_and(|m| m.len() <= MAX_BLOCK_BYTES);
        let block = small_enough.then(|| std::fs::read(&path).ok()).flatten().and_then(|b| decode(&b, hash));
        let mut index = lock(&self.index);
        match block {
            Some(f) => {
                index.clock += 1;
                let clock = index.clock;
                if let Some(e) = index.entries.get_mut(hash) {
                    e.used = clock;
                }
                self.hits.fetch_add(1, Ordering::Relaxed);
                Some(f)
            }
            None => {
                tracing::warn!(block = %hex(&hash[..8]), "a stored KV block was damaged or unreadable: removed");
                if let Some(e) = index.entries.remove(hash) {
                    index.bytes -= e.bytes;
                }
                drop(index);
                let _ = std::fs::remove_file(&path);
                self.corrupt.fetch_add(1, Ordering::Relaxed);
                self.misses.fetch_add(1, Ordering::Relaxed);
                None
            }
        }
    }

    /// Writes a block (a temporary file renamed into place, so a reader or
    /// a restart never sees half of one), then evicts past the budget.
    pub fn write(&self, hash: &BlockHash, block: &Features) -> std::io::Result<()> {
        if self.contains(hash) {
            return Ok(());
        }
        let bytes = encode(hash, block);
        if !self.make_room(bytes.len() as u64) {
            self.skipped_for_space.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        let path = self.path(hash);
        let tmp = path.with_extension(format!("{}.tmp", std::process::id()));
        let written = (|| {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(&bytes)?;
            std::fs::rename(&tmp, &path)
        })();
        if written.is_err() {
            let _ = std::fs::remove_file(&tmp);
            return written;
        }
        {
            let mut index = lock(&self.index);
            index.clock += 1;
            let used = index.clock;
            index.bytes += bytes.len() as u64;
            index.entries.insert(*hash, Entry { bytes: bytes.len() as u64, used });
        }
        self.writes.fetch_add(1, Ordering::Relaxed);
        self.evict_over_budget();
        Ok(())
    }

    /// Evicts least-recently-used blocks until `need` more bytes fit above
    /// the filesystem's reserve; false when even an empty store would not
    /// leave it (the block is then skipped: the disk belongs to the user's
    /// files and the sessions first).
    fn make_room(&self, need: u64) -> bool {
        while crate::disk_room::room(&self.dir, self.reserve) < need {
            if self.evict_oldest().is_none() {
                return false;
            }
        }
        true
    }

    /// Evicts least-recently-used blocks until `bytes` more are free on the
    /// filesystem (for a session file that could not be written: sessions
    /// get the disk before the cache); returns the bytes removed.
    pub fn free_for_others(&self, bytes: u64) -> u64 {
        let mut freed = 0;
        while freed < bytes {
            match self.evict_oldest() {
                Some(n) => freed += n,
                None => break,
            }
        }
        freed
    }

    /// Removes the least recently used block; its size, or None when empty.
    fn evict_oldest(&self) -> Option<u64> {
        let mut index = lock(&self.index);
        let (&oldest, _) = index.entries.iter().min_by_key(|(_, e)| e.used)?;
        let e = index.entries.remove(&oldest).expect("just found");
        index.bytes -= e.bytes;
        drop(index);
        let _ = std::fs::remove_file(self.path(&oldest));
        self.evictions.fetch_add(1, Ordering::Relaxed);
        Some(e.bytes)
    }

    fn evict_over_budget(&self) {
        let mut index = lock(&self.index);
        while index.bytes > self.budget {
            let Some((&oldest, _)) = index.entries.iter().min_by_key(|(_, e)| e.used) else { break };
            let e = index.entries.remove(&oldest).unwrap();
            index.bytes -= e.bytes;
            let _ = std::fs::remove_file(self.path(&oldest));
            self.evictions.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Removes every block; returns how many there were.
    pub fn clear(&self) -> u64 {
        let mut index = lock(&self.index);
        let n = index.entries.len() as u64;
        for hash in index.entries.keys() {
            let _ = std::fs::remove_file(self.path(hash));
        }
        index.entries.clear();
        index.bytes = 0;
        n
    }

    /// Sizes and counters.
    pub fn stats(&self) -> BlockStats {
        let index = lock(&self.index);
        BlockStats {
            blocks: index.entries.len() as u64,
            bytes: index.bytes,
            budget_bytes: self.budget,
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            corrupt: self.corrupt.load(Ordering::Relaxed),
            evictions: self.evictions.load(Ordering::Relaxed),
            writes: self.writes.load(Ordering::Relaxed),
            skipped_for_space: self.skipped_for_space.load(Ordering::Relaxed),
            room_bytes: crate::disk_room::room(&self.dir, self.reserve).min(self.budget),
        }
    }

    /// The folder the blocks are in.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

fn encode(hash: &BlockHash, block: &Features) -> Vec<u8> {
    let value = block.encode();
    let mut out = Vec::with_capacity(4 + 2 + 32 + value.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(hash);
    out.extend_from_slice(&value);
    out
}

fn decode(b: &[u8], hash: &BlockHash) -> Option<Features> {
    if b.len() < 38 || &b[..4] != MAGIC || u16::from_le_bytes([b[4], b[5]]) != FORMAT_VERSION || &b[6..38] != hash {
        return None;
    }
    Features::decode(&b[38..])
}

fn parse_hex(s: &str) -> Option<BlockHash> {
    if s.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const NO_RESERVE: DiskReserve = DiskReserve { percent: 0, min_bytes: 0 };

    fn block(seed: f32) -> Features {
        Features::from_f32(vec![2, 1, 2, 4, 3], &(0..48).map(|i| i as f32 * seed).collect::<Vec<_>>())
    }

    #[test]
    fn blocks_survive_reopening_and_damage_is_a_counted_miss() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = ([1u8; 32], [2u8; 32]);
        {
            let store = BlockStore::open(dir.path(), 1 << 20, NO_RESERVE).unwrap();
            store.write(&a, &block(1.0)).unwrap();
            store.write(&b, &block(2.0)).unwrap();
            assert_eq!(store.read(&a), Some(block(1.0)));
        }
        // A write that never finished, and a damaged block.
        std::fs::write(dir.path().join(format!("{}.123.tmp", hex(&[3u8; 32]))), b"half").unwrap();
        let path_b = dir.path().join(format!("{}.kv", hex(&b)));
        let mut bytes = std::fs::read(&path_b).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        std::fs::write(&path_b, bytes).unwrap();
        let store = BlockStore::open(dir.path(), 1 << 20, NO_RESERVE).unwrap();
        assert_eq!(store.stats().blocks, 2, "the .tmp file is not a block");
        assert!(std::fs::read_dir(dir.path()).unwrap().all(|e| !e
            .unwrap()
            .file_name()
            .to_string_lossy()
            .ends_with(".tmp")));
        assert_eq!(store.read(&a), Some(block(1.0)));
        assert_eq!(store.read(&b), None, "a flipped bit is a miss");
        assert!(!path_b.exists(), "and the damaged file is removed");
        let s = store.stats();
        assert_eq!((s.blocks, s.corrupt, s.hits), (1, 1, 1));
        // A file holding another block's bytes is not served under this name.
        std::fs::copy(dir.path().join(format!("{}.kv", hex(&a))), &path_b).unwrap();
        let store = BlockStore::open(dir.path(), 1 << 20, NO_RESERVE).unwrap();
        assert_eq!(store.read(&b), None);
    }

    #[test]
    fn the_least_recently_used_blocks_go_past_the_budget() {
        let dir = tempfile::tempdir().unwrap();
        let one = encode(&[0; 32], &block(1.0)).len() as u64;
        let store = BlockStore::open(dir.path(), 2 * one, NO_RESERVE).unwrap();
        store.write(&[1; 32], &block(1.0)).unwrap();
        store.write(&[2; 32], &block(2.0)).unwrap();
        assert!(store.read(&[1; 32]).is_some());
        store.write(&[3; 32], &block(3.0)).unwrap();
        assert!(store.contains(&[1; 32]) && store.contains(&[3; 32]));
        assert!(!store.contains(&[2; 32]), "the one not read since is evicted");
        assert_eq!(store.stats().evictions, 1);
        assert_eq!(store.clear(), 2);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn a_disk_down_to_its_reserve_takes_no_block_and_gives_back_what_it_has() {
        let dir = tempfile::tempdir().unwrap();
        let store = BlockStore::open(dir.path(), 1 << 30, NO_RESERVE).unwrap();
        store.write(&[1; 32], &block(1.0)).unwrap();
        store.write(&[2; 32], &block(2.0)).unwrap();
        drop(store);
        // A reserve larger than the whole disk: nothing fits, and the
        // blocks already there are evicted first, oldest first.
        let full = DiskReserve { percent: 0, min_bytes: u64::MAX };
        let store = BlockStore::open(dir.path(), 1 << 30, full).unwrap();
        store.write(&[3; 32], &block(3.0)).unwrap();
        let s = store.stats();
        assert_eq!((s.blocks, s.writes, s.skipped_for_space, s.evictions, s.room_bytes), (0, 0, 1, 2, 0));
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        let store = BlockStore::open(dir.path(), 1 << 30, NO_RESERVE).unwrap();
        store.write(&[1; 32], &block(1.0)).unwrap();
        assert!(store.free_for_others(1) > 0);
        assert_eq!(store.stats().blocks, 0);
    }
}
