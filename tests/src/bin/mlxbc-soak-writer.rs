//! The writer of the crash soak (tests `crash_soak`, `scripts/soak`): it
//! writes to the daemon's real on-disk stores as fast as it can, forever,
//! until it is killed with SIGKILL at a random moment:
//!
//! - the encoder-feature store (`mlxbc_cache::FeatureStore`, sled), one
//!   entry per step, whose features are a pure function of its content hash
//!   ([`expected_features`]), so a reader can recompute ("encode afresh")
//!   what every entry must hold;
//! - a session (`SessionStore`, the daemon's), one complete turn per step:
//!   the user's `q{n}` and the assistant's `a{n}`.
//!
//! `mlxbc-soak-writer DIR [START]` writes under DIR; `--check DIR` verifies
//! and prints `entries=N turns=M` (or fails with what is wrong).

use mlxbc_cache::{FeatureKey, FeatureStore, Features, Modality, StoreConfig};
use mlxbc_daemon::sessions::SessionStore;
use mlxbc_shared::{ChatMessage, Role};
use std::path::Path;

/// What an entry with this content hash must hold.
pub fn expected_features(content: &[u8; 32]) -> Features {
    let mut x = u64::from_le_bytes(content[..8].try_into().unwrap());
    let values: Vec<f32> = (0..256)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 10_000) as f32 / 100.0
        })
        .collect();
    Features::from_f32(vec![16, 16], &values)
}

fn key(n: u64) -> FeatureKey {
    FeatureKey {
        modality: Modality::Image,
        tower: [1; 32],
        preprocess: [2; 32],
        content: mlxbc_cache::content_hash(&n.to_le_bytes()),
    }
}

fn store(dir: &Path) -> FeatureStore {
    let config = StoreConfig { ram_bytes: 1 << 20, disk_bytes: 64 << 20, ..Default::default() };
    FeatureStore::open(&dir.join("features"), config).expect("opening the feature store")
}

fn write(dir: &Path, start: u64) -> ! {
    let mut features = store(dir);
    let sessions = SessionStore::new(&dir.join("sessions"));
    for n in start.. {
        let k = key(n);
        features.put(&k, &expected_features(&k.content)).expect("feature write");
        if n % 8 == 0 {
            features.flush().expect("flush");
        }
        let turn = [ChatMessage::user(format!("q{n}")), ChatMessage::assistant(format!("a{n}"))];
        sessions.append("soak", &turn).expect("session write");
        if n == start {
            // The reader waits for this before it starts the clock on a kill.
            println!("writing");
        }
    }
    unreachable!()
}

fn check(dir: &Path) -> Result<(usize, usize), String> {
    let mut features = store(dir);
    let mut entries = 0;
    for (k, _) in features.list() {
        // A damaged entry is a miss (removed), never wrong features.
        if let Some((got, _)) = features.get(&k) {
            if got != expected_features(&k.content) {
                return Err(format!("entry {} holds wrong features", k.short()));
            }
            entries += 1;
        }
    }
    let messages = SessionStore::new(&dir.join("sessions")).load("soak").map_err(|e| e.to_string())?;
    if messages.len() % 2 != 0 {
        return Err(format!("the session has {} messages: a half turn", messages.len()));
    }
    for (i, pair) in messages.chunks(2).enumerate() {
        let ok = pair[0].role == Role::User
            && pair[1].role == Role::Assistant
            && pair[0].content.strip_prefix('q') == pair[1].content.strip_prefix('a');
        if !ok {
            return Err(format!("turn {i} is not a whole question and answer: {pair:?}"));
        }
    }
    Ok((entries, messages.len() / 2))
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.as_slice() {
        [flag, dir] if flag == "--check" => match check(Path::new(dir)) {
            Ok((entries, turns)) => println!("entries={entries} turns={turns}"),
            Err(e) => {
                eprintln!("soak check failed: {e}");
                std::process::exit(1);
            }
        },
        [dir] => write(Path::new(dir), 0),
        [dir, start] => write(Path::new(dir), start.parse().expect("START is a number")),
        _ => {
            eprintln!("usage: mlxbc-soak-writer DIR [START] | --check DIR");
            std::process::exit(2);
        }
    }
}
