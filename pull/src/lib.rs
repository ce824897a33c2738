//! Fetches a model from the Hugging Face hub (or the mirror `HF_ENDPOINT`
//! names) into the standard hub cache (`HF_HOME`), with hf-hub: shared
//! with Python's huggingface_hub, resumable (an interrupted file continues
//! from its last committed chunk). The daemon finds the snapshot there
//! under the repo's name. Used by `mlxbc pull` (a progress bar) and the
//! gateway's ollama-style `/api/pull` (progress as NDJSON lines).

use anyhow::{bail, Context, Result};
use hf_hub::api::tokio::{ApiBuilder, ApiRepo};
use hf_hub::{Repo, RepoType};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use hf_hub::api::tokio::Progress;

/// How long the hub may take to answer the repo lookup.
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a download may go without receiving a byte before it is given
/// up (a stalled mirror must not hold a pull, or the gateway's task, forever).
/// `MLXBC_PULL_STALL_S` overrides it (the tests use a short one).
const STALL_TIMEOUT: Duration = Duration::from_secs(120);

fn stall_timeout() -> Duration {
    std::env::var("MLXBC_PULL_STALL_S")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .filter(|s| *s > 0)
        .map(Duration::from_secs)
        .unwrap_or(STALL_TIMEOUT)
}

/// Files an MLX or HF model directory needs (weights, configs, tokenizer, template).
const MODEL_FILES: &[&str] =
    &["*.safetensors", "*.json", "*.jinja", "tokenizer.model", "*.tiktoken", "merges.txt", "vocab.txt"];

/// What a pull will fetch: the repo at one commit and the files wanted.
pub struct Plan {
    pub repo_id: String,
    /// The commit the revision resolved to.
    pub commit: String,
    pub files: Vec<String>,
    /// Where the files of that commit live in the cache.
    pub snapshot_dir: PathBuf,
    /// The name to ask the daemon for: the repo, or `repo/file.gguf` for a
    /// repo pulled for one GGUF file.
    pub model_name: String,
    repo: ApiRepo,
}

/// Looks `repo_id` at `revision` up on the hub and chooses its files:
/// those matching `include`, else the model files (and its GGUF, when it
/// holds exactly one; several must be chosen with `include`).
pub async fn plan(repo_id: &str, revision: &str, include: &[String]) -> Result<Plan> {
    let api = ApiBuilder::from_env().with_progress(false).build().context("setting up the hub client")?;
    let repo = api.repo(Repo::with_revision(repo_id.to_string(), RepoType::Model, revision.to_string()));
    let info = tokio::time::timeout(LOOKUP_TIMEOUT, repo.info())
        .await
        .map_err(|_| anyhow::anyhow!("the hub did not answer in {}s", LOOKUP_TIMEOUT.as_secs()))
        .and_then(|r| r.map_err(anyhow::Error::from))
        .with_context(|| format!("looking up {repo_id} ({revision}) on the hub"))?;
    let snapshot_dir = hf_hub::Cache::from_env()
        .path()
        .join(format!("models--{}", repo_id.replace('/', "--")))
        .join("snapshots")
        .join(&info.sha);
    let files: Vec<String> = info.siblings.into_iter().map(|s| s.rfilename).collect();
    let patterns: Vec<glob::Pattern> = if include.is_empty() {
        let ggufs: Vec<&String> = files.iter().filter(|f| f.ends_with(".gguf")).collect();
        let has_weights = files.iter().any(|f| f.ends_with(".safetensors"));
        if !has_weights && ggufs.len() > 1 {
            let names: Vec<&str> = ggufs.iter().map(|s| s.as_str()).collect();
            bail!(
                "{repo_id} holds {} GGUF files; choose one with --include, e.g. --include '{}'\n  {}",
                ggufs.len(),
                ggufs[0],
                names.join("\n  ")
            );
        }
        let mut p: Vec<&str> = MODEL_FILES.to_vec();
        p.push("*.gguf");
        p.iter().map(|s| glob::Pattern::new(s).expect("valid pattern")).collect()
    } else {
        include.iter().map(|s| glob::Pattern::new(s)).collect::<Result<_, _>>().context("--include pattern")?
    };
    let wanted: Vec<String> = files.iter().filter(|f| patterns.iter().any(|p| p.matches(f))).cloned().collect();
    if wanted.is_empty() {
        bail!("nothing in {repo_id} matches; its files: {}", files.join(", "));
    }
    let ggufs: Vec<&String> = wanted.iter().filter(|f| f.ends_with(".gguf")).collect();
    let model_name = match ggufs.as_slice() {
        [one] if !wanted.iter().any(|f| f.ends_with(".safetensors")) => format!("{repo_id}/{one}"),
        _ => repo_id.to_string(),
    };
    Ok(Plan { repo_id: repo_id.to_string(), commit: info.sha, files: wanted, snapshot_dir, model_name, repo })
}

impl Plan {
    /// True when `file` of this commit is in the cache already (not fetched again).
    pub fn is_cached(&self, file: &str) -> bool {
        self.snapshot_dir.join(file).is_file()
    }

    /// Fetches one of the plan's files (resuming a partial one), reporting to
    /// `progress`; gives up when no byte arrives for the stall timeout.
    pub async fn fetch<P: Progress + Clone + Send + Sync + 'static>(&self, file: &str, progress: P) -> Result<PathBuf> {
        let started = Instant::now();
        let last_byte = Arc::new(AtomicU64::new(0));
        let watched = Watched { inner: progress, started, last_byte_ms: last_byte.clone() };
        let stall = stall_timeout();
        let download = self.repo.download_with_progress(file, watched);
        tokio::pin!(download);
        let result = loop {
            tokio::select! {
                r = &mut download => break r.map_err(anyhow::Error::from),
                _ = tokio::time::sleep(Duration::from_secs(1)) => {
                    let idle = started.elapsed().saturating_sub(Duration::from_millis(last_byte.load(Ordering::Relaxed)));
                    if idle >= stall {
                        break Err(anyhow::anyhow!("no data for {}s: the download stalled", stall.as_secs()));
                    }
                }
            }
        };
        result
            .with_context(|| format!("downloading {file} from {} (run the same command again to resume)", self.repo_id))
    }
}

/// Passes progress through, noting when the last bytes arrived (for the
/// stall watchdog in [`Plan::fetch`]).
#[derive(Clone)]
struct Watched<P> {
    inner: P,
    started: Instant,
    last_byte_ms: Arc<AtomicU64>,
}

impl<P: Progress + Send + Sync> Progress for Watched<P> {
    async fn init(&mut self, size: usize, filename: &str) {
        self.touch();
        self.inner.init(size, filename).await
    }
    async fn update(&mut self, size: usize) {
        self.touch();
        self.inner.update(size).await
    }
    async fn finish(&mut self) {
        self.inner.finish().await
    }
}

impl<P> Watched<P> {
    fn touch(&self) {
        self.last_byte_ms.store(self.started.elapsed().as_millis() as u64, Ordering::Relaxed);
    }
}
