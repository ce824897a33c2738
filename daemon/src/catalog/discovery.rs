//! Models other tools already keep on disk, so nothing is downloaded twice:
//! the Hugging Face hub cache (where `mlxbc pull` and Python's
//! huggingface_hub put snapshots), ollama's blob store, and LM Studio's
//! model folders. Each is read-only here.
//!
//! Names: `org/name` (an HF snapshot with config.json), `org/name/file.gguf`
//! (a GGUF in an HF snapshot), `ollama:model:tag`, `lmstudio:publisher/repo/file.gguf`.

use mlxbc_shared::sync::lock;
use std::path::{Path, PathBuf};

/// A model found in another tool's store.
#[derive(Debug, Clone, PartialEq)]
pub struct Found {
    pub name: String,
    pub path: PathBuf,
    /// "hf-cache", "ollama" or "lmstudio".
    pub source: &'static str,
}

fn home() -> Option<PathBuf> {
    std::env::var_os("HOME").map(PathBuf::from)
}

/// The hub cache: `HF_HUB_CACHE`, else `HF_HOME/hub`, else `~/.cache/huggingface/hub`.
pub fn hf_hub_cache() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("HF_HUB_CACHE") {
        return Some(p.into());
    }
    if let Some(p) = std::env::var_os("HF_HOME") {
        return Some(PathBuf::from(p).join("hub"));
    }
    home().map(|h| h.join(".cache/huggingface/hub"))
}

/// The folders a scan starts from.
fn roots() -> Vec<PathBuf> {
    let mut roots: Vec<PathBuf> = hf_hub_cache().into_iter().collect();
    roots.extend(
        std::env::var_os("OLLAMA_MODELS").map(PathBuf::from).or_else(|| home().map(|h| h.join(".ollama/models"))),
    );
    if let Some(h) = home() {
        roots.extend([h.join(".lmstudio/models"), h.join(".cache/lm-studio/models")]);
    }
    roots
}

/// A scan kept for reuse: scanning walks the HF cache and ollama's
/// manifests, far too slow to repeat for every request that names a model.
/// It is redone when a scanned root's modification time changes (a model
/// added or removed at its top) or after [`RESCAN_AFTER`].
#[derive(Default)]
pub struct Discovery {
    last: std::sync::Mutex<Option<Scanned>>,
}

struct Scanned {
    at: std::time::Instant,
    stamps: Vec<Option<std::time::SystemTime>>,
    found: Vec<Found>,
}

/// How long a scan is trusted when no root has changed.
pub const RESCAN_AFTER: std::time::Duration = std::time::Duration::from_secs(10);

impl Discovery {
    /// Every model the three stores hold, from the last scan while it is fresh.
    pub fn models(&self) -> Vec<Found> {
        let stamps: Vec<_> = roots().iter().map(|r| std::fs::metadata(r).and_then(|m| m.modified()).ok()).collect();
        let mut last = lock(&self.last);
        match &*last {
            Some(s) if s.stamps == stamps && s.at.elapsed() < RESCAN_AFTER => s.found.clone(),
            _ => {
                let found = scan();
                *last = Some(Scanned { at: std::time::Instant::now(), stamps, found: found.clone() });
                found
            }
        }
    }
}

/// Every model the three stores hold (a fresh scan; see [`Discovery`]).
pub fn scan() -> Vec<Found> {
    let mut out = Vec::new();
    if let Some(hub) = hf_hub_cache() {
        out.extend(hf_cache(&hub));
    }
    let ollama =
        std::env::var_os("OLLAMA_MODELS").map(PathBuf::from).or_else(|| home().map(|h| h.join(".ollama/models")));
    if let Some(root) = ollama {
        out.extend(ollama_models(&root));
    }
    if let Some(h) = home() {
        for root in [h.join(".lmstudio/models"), h.join(".cache/lm-studio/models")] {
            out.extend(lmstudio(&root));
        }
    }
    out
}

fn read_dir(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir).into_iter().flatten().flatten().map(|e| e.path()).collect();
    v.sort();
    v
}

fn is_gguf(p: &Path) -> bool {
    p.is_file() && p.extension().is_some_and(|e| e == "gguf")
}

/// `models--org--name/refs/main` names the snapshot to use.
fn hf_cache(hub: &Path) -> Vec<Found> {
    let mut out = Vec::new();
    for repo in read_dir(hub) {
        let Some(dir) = repo.file_name().and_then(|n| n.to_str()).and_then(|n| n.strip_prefix("models--")) else {
            continue;
        };
        let name = dir.replace("--", "/");
        let Ok(commit) = std::fs::read_to_string(repo.join("refs/main")) else { continue };
        let snapshot = repo.join("snapshots").join(commit.trim());
        if snapshot.join("config.json").is_file() {
            out.push(Found { name: name.clone(), path: snapshot.clone(), source: "hf-cache" });
        }
        for f in read_dir(&snapshot).into_iter().filter(|p| is_gguf(p)) {
            let file = f.file_name().unwrap().to_string_lossy().into_owned();
            out.push(Found { name: format!("{name}/{file}"), path: f, source: "hf-cache" });
        }
    }
    out
}

/// `manifests/<registry>/<namespace>/<model>/<tag>` lists layers; the model
/// layer's digest names its blob (`blobs/sha256-<hex>`, a GGUF file).
fn ollama_models(root: &Path) -> Vec<Found> {
    let mut out = Vec::new();
    for registry in read_dir(&root.join("manifests")) {
        for namespace in read_dir(&registry) {
            for model in read_dir(&namespace) {
                for tag in read_dir(&model) {
                    let Some(manifest) =
                        std::fs::read(&tag).ok().and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
                    else {
                        continue;
                    };
                    let layers = manifest["layers"].as_array().cloned().unwrap_or_default();
                    let Some(digest) = layers
                        .iter()
                        .find(|l| l["mediaType"] == "application/vnd.ollama.image.model")
                        .and_then(|l| l["digest"].as_str())
                    else {
                        continue;
                    };
                    let blob = root.join("blobs").join(digest.replace(':', "-"));
                    if blob.is_file() {
                        let (m, t) =
                            (model.file_name().unwrap().to_string_lossy(), tag.file_name().unwrap().to_string_lossy());
                        let ns = namespace.file_name().unwrap().to_string_lossy();
                        let name =
                            if ns == "library" { format!("ollama:{m}:{t}") } else { format!("ollama:{ns}/{m}:{t}") };
                        out.push(Found { name, path: blob, source: "ollama" });
                    }
                }
            }
        }
    }
    out
}

/// `<publisher>/<repo>/*.gguf`.
fn lmstudio(root: &Path) -> Vec<Found> {
    let mut out = Vec::new();
    for publisher in read_dir(root) {
        for repo in read_dir(&publisher) {
            for f in read_dir(&repo).into_iter().filter(|p| is_gguf(p)) {
                let rel = f.strip_prefix(root).unwrap_or(&f).display().to_string();
                out.push(Found { name: format!("lmstudio:{rel}"), path: f, source: "lmstudio" });
            }
        }
    }
    out
}
