//! The measurement behind the prompt cache's disk tier (files, not sled):
//! `cargo run --release -p mlxbc-cache --example kv_block_storage [BLOCKS=96] [ROUNDS=3]`.
//! Writes BLOCKS blocks the size of SmolLM2-135M's (64 positions, 30
//! layers, 3 KV heads of 64, f32: 2.95 MB) with `BlockStore` (a file per
//! block) and with sled (one tree, as the feature store keeps features,
//! flushed), reads them all back, evicts half (the budget's work), and
//! reports time and disk use; rounds interleaved, medians.

use mlxbc_cache::{BlockStore, Features};
use std::time::Instant;

/// The measurement is of the storage, not of the free-space guard.
const NO_RESERVE: mlxbc_shared::settings::DiskReserve =
    mlxbc_shared::settings::DiskReserve { percent: 0, min_bytes: 0 };

fn du(path: &std::path::Path) -> u64 {
    walk(path).iter().map(|p| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0)).sum()
}

fn walk(path: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(path).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).map(|a| a.parse().unwrap()).collect();
    let (blocks, rounds) = (args.first().copied().unwrap_or(96), args.get(1).copied().unwrap_or(3));
    let values: Vec<f32> = (0..30 * 2 * 3 * 64 * 64).map(|i| (i % 977) as f32 * 0.001).collect();
    let block = Features::from_f32(vec![60, 1, 3, 64, 64], &values);
    let hash = |i: usize| -> [u8; 32] {
        let mut h = [0u8; 32];
        h[..8].copy_from_slice(&(i as u64).to_le_bytes());
        h
    };
    let mut results: Vec<(&str, Vec<[f64; 4]>)> = vec![("files (BlockStore)", vec![]), ("sled tree", vec![])];
    for _ in 0..rounds {
        for (name, rows) in results.iter_mut() {
            let dir = tempfile::tempdir_in(std::env::var("TMPDIR").unwrap_or("/tmp".into())).unwrap();
            let (write_s, read_s, peak, after);
            if name.starts_with("files") {
                let store = BlockStore::open(dir.path(), u64::MAX, NO_RESERVE).unwrap();
                let t = Instant::now();
                for i in 0..blocks {
                    store.write(&hash(i), &block).unwrap();
                }
                write_s = t.elapsed().as_secs_f64();
                let t = Instant::now();
                for i in 0..blocks {
                    assert!(store.read(&hash(i)).is_some());
                }
                read_s = t.elapsed().as_secs_f64();
                peak = du(dir.path());
                drop(store);
                let small = BlockStore::open(dir.path(), peak / 2, NO_RESERVE).unwrap();
                drop(small);
                after = du(dir.path());
            } else {
                let db = sled::open(dir.path()).unwrap();
                let tree = db.open_tree("kv").unwrap();
                let t = Instant::now();
                for i in 0..blocks {
                    tree.insert(hash(i), block.encode()).unwrap();
                }
                db.flush().unwrap();
                write_s = t.elapsed().as_secs_f64();
                let t = Instant::now();
                for i in 0..blocks {
                    let v = tree.get(hash(i)).unwrap().unwrap();
                    assert!(Features::decode(&v).is_some());
                }
                read_s = t.elapsed().as_secs_f64();
                peak = du(dir.path());
                for i in 0..blocks / 2 {
                    tree.remove(hash(i)).unwrap();
                }
                db.flush().unwrap();
                drop(tree);
                drop(db);
                after = du(dir.path());
            }
            rows.push([write_s, read_s, peak as f64, after as f64]);
        }
    }
    let mb = block.nbytes() as f64 / 1e6;
    println!("\n{blocks} blocks of {mb:.2} MB, medians of {rounds} rounds (interleaved)\n");
    println!("| storage | write, MB/s (flushed) | read + verify, MB/s | disk after writing (MB) | disk after evicting half (MB) |");
    println!("|---|---:|---:|---:|---:|");
    for (name, rows) in &results {
        let col = |k: usize| median(rows.iter().map(|r| r[k]).collect());
        let total = blocks as f64 * mb;
        println!(
            "| {name} | {:.0} | {:.0} | {:.0} | {:.0} |",
            total / col(0),
            total / col(1),
            col(2) / 1e6,
            col(3) / 1e6
        );
    }
}
