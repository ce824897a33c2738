//! `mlxbc cache stats|ls|clear|verify`: the daemon owns the sled database
//! (sled allows one process), so maintenance goes through it. These run on
//! tokio's blocking pool, never on the engine thread; `verify` reads every
//! entry without holding the store, so lookups and writes go on meanwhile.

use crate::media::SharedStore;
use mlxbc_cache::hex;
use mlxbc_shared::{CacheCommand, CacheEntry, CacheReport, ErrorKind, PromptCacheReport, Response};
use std::path::Path;

/// Runs a cache command and reports the store's state afterwards, beside
/// the prompt cache's (`prompts`; `removed_prompts` blocks a
/// `ClearPrompts` removed from disk).
pub fn run(
    store: Option<&SharedStore>,
    path: &Path,
    command: CacheCommand,
    prompts: PromptCacheReport,
    removed_prompts: u64,
) -> Response {
    let Some(store) = store else {
        return Response::Error {
            kind: ErrorKind::Internal,
            message: format!("the feature store at {} could not be opened; see the daemon log", path.display()),
        };
    };
    let mut removed = 0;
    let mut listing = Vec::new();
    if command == CacheCommand::Verify {
        let tree = store.lock().features_tree();
        let (_, damaged) = mlxbc_cache::scan_for_damage(&tree);
        removed = damaged.len() as u64;
        store.lock().remove_damaged(damaged);
    }
    let mut store = store.lock();
    match command {
        CacheCommand::Stats => {}
        CacheCommand::List => {
            listing = store
                .list()
                .into_iter()
                .map(|(k, bytes)| CacheEntry { content: hex(&k.content), tower: hex(&k.tower[..6]), bytes })
                .collect();
        }
        CacheCommand::Clear => match store.clear() {
            Ok(n) => removed = n,
            Err(e) => return Response::Error { kind: ErrorKind::Internal, message: e.to_string() },
        },
        CacheCommand::Verify => {}
        CacheCommand::ClearPrompts => removed = removed_prompts,
    }
    Response::Cache(CacheReport { removed, listing, ..crate::media::report(&store, path, prompts) })
}
