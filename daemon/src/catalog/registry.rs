//! The model store: which names the daemon answers to and where their files
//! are. A name is an alias from the settings, a file or directory name in the
//! models directory, a path, or a model another tool keeps (see `discovery`).

use crate::error::EngineError;
use mlxbc_shared::{settings::Settings, ModelInfo};
use std::path::{Path, PathBuf};

/// A model name resolved to its files.
#[derive(Debug, Clone, PartialEq)]
pub struct ResolvedModel {
    /// The canonical name (file or directory name in the store, or the path given).
    pub name: String,
    pub path: PathBuf,
}

/// Resolves names against the settings' aliases and models directory.
pub struct ModelRegistry {
    models_dir: PathBuf,
    aliases: std::collections::BTreeMap<String, String>,
    default_model: String,
    /// Other tools' models, scanned at most every few seconds.
    discovery: super::discovery::Discovery,
}

impl ModelRegistry {
    /// A registry over the settings' store.
    pub fn new(settings: &Settings) -> Self {
        Self {
            models_dir: settings.models_dir.clone(),
            aliases: settings.aliases.clone(),
            default_model: settings.default_model.clone(),
            discovery: Default::default(),
        }
    }

    /// The speech model a transcription that names none uses: the first
    /// one listed (the models directory first, by name).
    pub fn default_speech(&self) -> Result<String, EngineError> {
        self.list().into_iter().find(|m| m.capability == "speech").map(|m| m.name).ok_or_else(|| {
            EngineError::UnknownModel(
                "no speech model is installed: fetch Whisper tiny.en with `scripts/fetch-models whisper-tiny.en`, \
                 or pull one (`mlxbc pull openai/whisper-base`)"
                    .into(),
            )
        })
    }

    /// Resolves `name` (`None`: the default model). The error lists what is known.
    pub fn resolve(&self, name: Option<&str>) -> Result<ResolvedModel, EngineError> {
        let name = name.unwrap_or(&self.default_model);
        let target = self.aliases.get(name).map(String::as_str).unwrap_or(name);
        let candidate = Path::new(target);
        let path = if candidate.is_absolute() { candidate.to_path_buf() } else { self.models_dir.join(target) };
        if is_model(&path) {
            let name = if candidate.is_absolute() { target.to_string() } else { file_name(&path) };
            return Ok(ResolvedModel { name, path });
        }
        if let Some(found) = self.discovery.models().into_iter().find(|f| f.name == target) {
            return Ok(ResolvedModel { name: found.name, path: found.path });
        }
        let known: Vec<String> =
            self.list().into_iter().flat_map(|m| std::iter::once(m.name).chain(m.aliases)).collect();
        let known = if known.is_empty() {
            format!(
                "none: the models directory {} is empty (run scripts/setup to fetch the default model)",
                self.models_dir.display()
            )
        } else {
            known.join(", ")
        };
        if self.aliases.contains_key(name) {
            Err(EngineError::UnknownModel(format!(
                "model {name:?} is an alias for {}, which is not there; known models: {known}",
                path.display()
            )))
        } else {
            Err(EngineError::UnknownModel(format!("unknown model {name:?}; known models: {known}")))
        }
    }

    /// The LoRA adapter directory `name` names: in the models directory
    /// (or, given by the socket's owner, a path).
    pub fn resolve_adapter(&self, name: &str) -> Result<PathBuf, EngineError> {
        let candidate = Path::new(name);
        let path = if candidate.is_absolute() { candidate.to_path_buf() } else { self.models_dir.join(name) };
        if crate::model::lora::is_adapter_dir(&path) {
            return Ok(path);
        }
        let known: Vec<String> =
            self.list().into_iter().filter(|m| m.capability == "adapter").map(|m| m.name).collect();
        Err(EngineError::UnknownModel(format!(
            "unknown adapter {name:?}: no adapter_config.json and adapters.safetensors there (adapters in {}: {})",
            self.models_dir.display(),
            if known.is_empty() { "none".to_string() } else { known.join(", ") }
        )))
    }

    /// Every model in the store, with its aliases.
    pub fn list(&self) -> Vec<ModelInfo> {
        let mut out = Vec::new();
        let Ok(entries) = std::fs::read_dir(&self.models_dir) else {
            return out;
        };
        let mut paths: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| is_model(p) || crate::model::lora::is_adapter_dir(p))
            .collect();
        paths.sort();
        for path in paths {
            let name = file_name(&path);
            let aliases = self.aliases.iter().filter(|(_, t)| **t == name).map(|(a, _)| a.clone()).collect();
            let (format, size_bytes) = if crate::model::lora::is_adapter_dir(&path) {
                ("lora", dir_size(&path))
            } else if path.is_dir() {
                ("mlx", dir_size(&path))
            } else {
                ("gguf", path.metadata().map(|m| m.len()).unwrap_or(0))
            };
            out.push(ModelInfo {
                name,
                aliases,
                path: path.display().to_string(),
                format: format.into(),
                size_bytes,
                loaded: false,
                source: "store".into(),
                capability: capability(&path).into(),
            });
        }
        for f in self.discovery.models() {
            let (format, size_bytes) = if f.path.is_dir() {
                ("mlx", dir_size(&f.path))
            } else {
                ("gguf", f.path.metadata().map_or(0, |m| m.len()))
            };
            let aliases = self.aliases.iter().filter(|(_, t)| **t == f.name).map(|(a, _)| a.clone()).collect();
            out.push(ModelInfo {
                name: f.name,
                aliases,
                path: f.path.display().to_string(),
                format: format.into(),
                size_bytes,
                loaded: false,
                capability: capability(&f.path).into(),
                source: f.source.into(),
            });
        }
        out
    }
}

/// What a model does, from its files: a directory whose family loads a
/// speech recognizer transcribes ("speech"), an embedder's embeds
/// ("embedding") or, a cross-encoder or a decoder named as a reranker
/// (Qwen3-Reranker), reranks ("rerank"), one with a vision
/// config sees ("vision"); the rest chat.
pub fn capability(path: &Path) -> &'static str {
    if !path.is_dir() {
        // A GGUF file: its header's architecture (a BERT embeds).
        return if crate::families::gguf_embeds(path) { "embedding" } else { "chat" };
    }
    if crate::model::lora::is_adapter_dir(path) {
        // A LoRA adapter: served on its base (`--adapter`), not alone.
        return "adapter";
    }
    let Ok(Some(raw)) = crate::model::read_json(&path.join("config.json")) else { return "chat" };
    let family = crate::families::family_of(&raw);
    if family.is_some_and(|f| matches!(f.load_dir, crate::families::DirLoader::Speech(_))) {
        "speech"
    } else if crate::model::sentence::SentenceSettings::is_sentence_dir(path) {
        // A decoder with sentence-transformers' files (Qwen3-Embedding).
        "embedding"
    } else if family.is_some_and(|f| matches!(f.load_dir, crate::families::DirLoader::Embed(_))) {
        // A cross-encoder (a classifier over pairs) reranks.
        let classifies = raw
            .get("architectures")
            .and_then(|a| a.as_array())
            .is_some_and(|a| a.iter().any(|x| x.as_str().is_some_and(|x| x.ends_with("ForSequenceClassification"))));
        if classifies {
            "rerank"
        } else {
            "embedding"
        }
    } else if crate::model::lm_reranker::is_reranker_dir(path, &raw) {
        "rerank"
    } else if raw.get("vision_config").is_some() {
        "vision"
    } else {
        "chat"
    }
}

/// A name, not a path: neither absolute nor climbing out with `..`. Such a
/// name can only resolve to an alias, the models directory or another tool's
/// store, which is what `mlxbc models` lists; the HTTP gateway accepts only
/// these (the socket, which only its owner reaches, also takes paths).
pub fn is_plain_name(name: &str) -> bool {
    let p = Path::new(name);
    !p.is_absolute() && !name.starts_with('~') && p.components().all(|c| matches!(c, std::path::Component::Normal(_)))
}

fn file_name(path: &Path) -> String {
    path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
}

fn is_model(path: &Path) -> bool {
    (path.is_file() && path.extension().is_some_and(|e| e == "gguf")) || path.join("config.json").is_file()
}

/// Bytes in a directory (symlinks followed: HF snapshots link into blobs/).
fn dir_size(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|it| it.filter_map(|e| std::fs::metadata(e.ok()?.path()).ok()).map(|m| m.len()).sum())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    #[test]
    fn plain_names_and_paths() {
        for ok in ["smollm2", "SmolLM2.Q4_1.gguf", "org/name", "org/name/file.gguf", "ollama:qwen:0.5b"] {
            assert!(super::is_plain_name(ok), "{ok}");
        }
        for bad in ["/etc/passwd", "../x.gguf", "a/../../b", "~/models/x.gguf", "./x"] {
            assert!(!super::is_plain_name(bad), "{bad}");
        }
    }
}
