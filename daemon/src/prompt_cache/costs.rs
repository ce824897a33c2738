//! Whether reading a prompt's blocks from disk beats computing them again.
//!
//! On this project's CPU a 135M model prefills ~50 tokens/s and its blocks
//! read at ~1 GB/s: the disk wins by ~80x. On an H200 the same model
//! prefills ~120,000 tokens/s (4,896 tokens in ~40 ms) while reading their
//! 107 MB of KV costs ~150 ms: there the disk loses (measured in
//! docs/measurements/h200-2026-12-01-prompts.md). So both rates are
//! measured as the daemon works, and a disk run is read only when its
//! measured cost is below the prefill it saves. RAM blocks are always used.

use std::collections::HashMap;

use mlxbc_cache::BlockHash;

/// How much a new measurement moves an estimate (exponential average).
const WEIGHT: f64 = 0.3;

/// Prefills shorter than this say little about a model's rate (fixed costs
/// dominate them) and are not measured.
const MIN_MEASURED_TOKENS: usize = 128;

/// Measured costs of the disk tier and of prefills, shared by request
/// preparation (which reads disk blocks) and the engine thread.
#[derive(Debug, Default)]
pub struct PromptCosts {
    /// Seconds per byte to read, verify and convert a disk block.
    disk_s_per_byte: Option<f64>,
    /// Seconds per prefilled token, by model (its KV root).
    prefill_s_per_token: HashMap<BlockHash, f64>,
    /// Disk positions not read because computing them was measured cheaper.
    pub skipped_tokens: u64,
}

fn blend(old: Option<f64>, new: f64) -> f64 {
    old.map_or(new, |o| o + WEIGHT * (new - o))
}

impl PromptCosts {
    /// Notes that `bytes` of disk blocks took `secs` to read, verify and
    /// turn into arrays.
    pub fn note_disk(&mut self, bytes: u64, secs: f64) {
        if bytes > 0 {
            self.disk_s_per_byte = Some(blend(self.disk_s_per_byte, secs / bytes as f64));
        }
    }

    /// Notes that model `root` prefilled `tokens` in `secs`.
    pub fn note_prefill(&mut self, root: &BlockHash, tokens: usize, secs: f64) {
        if tokens < MIN_MEASURED_TOKENS || secs <= 0.0 {
            return;
        }
        let old = self.prefill_s_per_token.get(root).copied();
        self.prefill_s_per_token.insert(*root, blend(old, secs / tokens as f64));
    }

    /// The seconds model `root` was measured to need for `tokens` positions.
    pub fn prefill_estimate(&self, root: &BlockHash, tokens: usize) -> Option<f64> {
        self.prefill_s_per_token.get(root).map(|p| p * tokens as f64)
    }

    /// True unless both rates are known and computing `tokens` positions of
    /// model `root` is cheaper than reading their `bytes` from disk.
    pub fn disk_pays(&self, root: &BlockHash, bytes: u64, tokens: usize) -> bool {
        match (self.disk_s_per_byte, self.prefill_s_per_token.get(root)) {
            (Some(d), Some(p)) => d * bytes as f64 <= p * tokens as f64,
            _ => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_disk_is_read_only_where_it_is_measured_cheaper() {
        let root = [1u8; 32];
        let mut c = PromptCosts::default();
        // Nothing measured: read.
        assert!(c.disk_pays(&root, 100 << 20, 4096));
        // A CPU: 1 GB/s reads, 50 tokens/s prefill.
        c.note_disk(1 << 30, 1.0);
        c.note_prefill(&root, 500, 10.0);
        assert!(c.disk_pays(&root, 100 << 20, 4096));
        // A GPU: 120,000 tokens/s prefill; the same disk.
        let gpu = [2u8; 32];
        c.note_prefill(&gpu, 4896, 0.04);
        assert!(!c.disk_pays(&gpu, 107 << 20, 4864));
        // Short prefills are not measured.
        let other = [3u8; 32];
        c.note_prefill(&other, 10, 0.000_01);
        assert!(c.disk_pays(&other, 107 << 20, 4864));
    }
}
