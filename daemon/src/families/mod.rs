//! Model families, one folder each (Config → layers → model, as
//! candle-transformers and mlx-lm write them), and the one table that maps
//! a checkpoint to its family. Each family implements the seams of
//! `crate::model::family` and builds a `crate::model::Model`; nothing
//! outside this folder names a family. Adding one: docs/adding-a-family.md.

pub mod bert;
pub mod gemma3;
pub mod gemma4;
pub mod gemma4_unified;
pub mod llama;
pub mod modernbert;
pub mod nomic_bert;
pub mod qwen2_5_vl;
pub mod qwen3_5;
pub mod qwen3_vl;
pub mod whisper;

use crate::model::family::{Embedder, SpeechRecognizer};
use crate::model::gguf::{gguf_string, Gguf};
use crate::model::options::ModelOptions;
use crate::model::Model;
use anyhow::{bail, Context, Result};
use std::path::Path;

/// Loads a model directory: its files, its parsed `config.json`, how to
/// hold the weights, and the store's memo of tower fingerprints.
pub type ChatDirLoader = fn(&Path, &serde_json::Value, ModelOptions, Option<&sled::Tree>) -> Result<Model>;
/// Loads a speech model's directory, given the same.
pub type SpeechDirLoader =
    fn(&Path, &serde_json::Value, ModelOptions, Option<&sled::Tree>) -> Result<Box<dyn SpeechRecognizer>>;

/// Loads a sentence embedder's directory, given the same.
pub type EmbedDirLoader = fn(&Path, &serde_json::Value, ModelOptions, Option<&sled::Tree>) -> Result<Box<dyn Embedder>>;

/// What a family's directories load as.
pub enum DirLoader {
    /// A language model (text or vision-language), answering chats.
    Chat(ChatDirLoader),
    /// A speech recognizer, answering transcriptions.
    Speech(SpeechDirLoader),
    /// A text embedder, answering embeddings.
    Embed(EmbedDirLoader),
}

/// A loaded model of either kind.
#[expect(
    clippy::large_enum_variant,
    reason = "one value per request or load, moved a few times and matched at once; boxing the large variant buys nothing"
)]
pub enum LoadedModel {
    Chat(Model),
    Speech(Box<dyn SpeechRecognizer>),
    Embed(Box<dyn Embedder>),
}

/// What a family's GGUF files load as (an opened file, how to hold the
/// weights; an embedder also the store's memo of fingerprints).
pub enum GgufLoader {
    /// A language model.
    Chat(ChatGgufLoader),
    /// A text embedder.
    Embed(EmbedGgufLoader),
}

/// Loads a language model's GGUF file.
pub type ChatGgufLoader = fn(&Gguf, ModelOptions) -> Result<Model>;
/// Loads a text embedder's GGUF file (with the store's fingerprint memo).
pub type EmbedGgufLoader = fn(&Gguf, ModelOptions, Option<&sled::Tree>) -> Result<Box<dyn Embedder>>;

/// One family: the names checkpoints give it, and its loaders.
pub struct Family {
    /// `config.json`'s `model_type` values.
    pub model_types: &'static [&'static str],
    /// GGUF `general.architecture` values.
    pub gguf_architectures: &'static [&'static str],
    pub load_dir: DirLoader,
    pub load_gguf: Option<GgufLoader>,
    /// Its text decoder can be split over a group (tensor parallel).
    pub tensor_parallel: bool,
}

/// Every family served.
pub const FAMILIES: &[Family] = &[
    Family {
        model_types: &["llama", "mistral", "qwen2", "qwen3"],
        gguf_architectures: &["llama", "mistral", "qwen2", "qwen3"],
        load_dir: DirLoader::Chat(llama::load_dir),
        load_gguf: Some(GgufLoader::Chat(llama::load_gguf)),
        tensor_parallel: true,
    },
    Family {
        model_types: &["gemma3"],
        gguf_architectures: &[],
        load_dir: DirLoader::Chat(gemma3::load_dir),
        load_gguf: None,
        tensor_parallel: true,
    },
    Family {
        model_types: &["gemma4"],
        gguf_architectures: &[],
        load_dir: DirLoader::Chat(gemma4::load_dir),
        load_gguf: None,
        tensor_parallel: true,
    },
    Family {
        model_types: &["gemma4_unified"],
        gguf_architectures: &[],
        load_dir: DirLoader::Chat(gemma4_unified::load_dir),
        load_gguf: None,
        tensor_parallel: true,
    },
    Family {
        model_types: &["qwen2_5_vl"],
        gguf_architectures: &[],
        load_dir: DirLoader::Chat(qwen2_5_vl::load_dir),
        load_gguf: None,
        tensor_parallel: true,
    },
    Family {
        model_types: &["qwen3_5"],
        gguf_architectures: &[],
        load_dir: DirLoader::Chat(qwen3_5::load_dir),
        load_gguf: None,
        tensor_parallel: true,
    },
    Family {
        model_types: &["qwen3_vl"],
        gguf_architectures: &[],
        load_dir: DirLoader::Chat(qwen3_vl::load_dir),
        load_gguf: None,
        tensor_parallel: true,
    },
    Family {
        model_types: &["bert", "xlm-roberta"],
        gguf_architectures: &["bert"],
        load_dir: DirLoader::Embed(bert::load_dir),
        load_gguf: Some(GgufLoader::Embed(bert::load_gguf)),
        tensor_parallel: false,
    },
    Family {
        model_types: &["modernbert"],
        gguf_architectures: &[],
        load_dir: DirLoader::Embed(modernbert::load_dir),
        load_gguf: None,
        tensor_parallel: false,
    },
    Family {
        model_types: &["nomic_bert"],
        gguf_architectures: &["nomic-bert"],
        load_dir: DirLoader::Embed(nomic_bert::load_dir),
        load_gguf: Some(GgufLoader::Embed(nomic_bert::load_gguf)),
        tensor_parallel: false,
    },
    // mlx-whisper's config.json has no model_type: see `model_type_of`.
    Family {
        model_types: &["whisper"],
        gguf_architectures: &[],
        load_dir: DirLoader::Speech(whisper::load_dir),
        load_gguf: None,
        tensor_parallel: false,
    },
];

/// A directory's `model_type`; mlx-whisper's config names none, but its
/// `n_mels` and `n_audio_ctx` say what it is.
pub fn model_type_of(raw: &serde_json::Value) -> Option<&str> {
    raw.get("model_type")
        .and_then(|t| t.as_str())
        .or_else(|| (raw.get("n_mels").is_some() && raw.get("n_audio_ctx").is_some()).then_some("whisper"))
}

/// The family of a directory's parsed `config.json`, if one serves it.
pub fn family_of(raw: &serde_json::Value) -> Option<&'static Family> {
    let model_type = model_type_of(raw)?;
    FAMILIES.iter().find(|f| f.model_types.contains(&model_type))
}

/// The `model_type`s served, for error messages.
fn supported() -> String {
    names_of(|f| f.model_types)
}

/// The GGUF architectures served, for error messages.
fn supported_gguf() -> String {
    names_of(|f| f.gguf_architectures)
}

fn names_of(names: fn(&Family) -> &'static [&'static str]) -> String {
    let mut all: Vec<&str> = FAMILIES.iter().flat_map(|f| names(f).iter().copied()).collect();
    all.dedup();
    all.join(", ")
}

/// Whether a GGUF file's architecture embeds text (a family with an
/// embedding loader for it), from its header.
pub fn gguf_embeds(path: &Path) -> bool {
    let Ok(arch) = crate::model::gguf::architecture(path) else { return false };
    FAMILIES
        .iter()
        .any(|f| f.gguf_architectures.contains(&arch.as_str()) && matches!(f.load_gguf, Some(GgufLoader::Embed(_))))
}

/// Loads a `.gguf` file or a chat model's directory with its family's
/// loader (a speech model is refused: see [`load_any`]).
/// `memo` remembers tower fingerprints per weight-file identity.
pub fn load(path: &Path, options: impl Into<ModelOptions>, memo: Option<&sled::Tree>) -> Result<Model> {
    match load_any(path, options, memo)? {
        LoadedModel::Chat(m) => Ok(m),
        LoadedModel::Speech(s) => {
            bail!("{} is a speech model ({}): it transcribes audio and does not chat", path.display(), s.architecture())
        }
        LoadedModel::Embed(e) => {
            bail!("{} is an embedding model ({}): it embeds text and does not chat", path.display(), e.architecture())
        }
    }
}

/// Loads a model of either kind.
pub fn load_any(path: &Path, options: impl Into<ModelOptions>, memo: Option<&sled::Tree>) -> Result<LoadedModel> {
    let options = options.into();
    if path.is_dir() {
        let text = std::fs::read_to_string(path.join("config.json"))
            .with_context(|| format!("reading {}/config.json", path.display()))?;
        let raw: serde_json::Value = serde_json::from_str(&text).context("parsing config.json")?;
        let Some(model_type) = model_type_of(&raw) else {
            bail!("{}/config.json names no model_type", path.display());
        };
        let Some(family) = FAMILIES.iter().find(|f| f.model_types.contains(&model_type)) else {
            bail!("unsupported architecture {model_type:?} (supported: {})", supported());
        };
        refuse_unsplittable(family, model_type, &options)?;
        match family.load_dir {
            // A chat family's decoder in a sentence-transformers directory
            // (Qwen3-Embedding) embeds.
            DirLoader::Chat(load) if crate::model::sentence::SentenceSettings::is_sentence_dir(path) => {
                let model = load(path, &raw, options, memo)?;
                crate::model::decoder_embedder::from_decoder(path, &raw, model.lm, memo).map(LoadedModel::Embed)
            }
            // One named as a reranker (Qwen3-Reranker) reranks.
            DirLoader::Chat(load) if crate::model::lm_reranker::is_reranker_dir(path, &raw) => {
                let model = load(path, &raw, options, memo)?;
                crate::model::lm_reranker::from_decoder(path, &raw, model.lm, memo).map(LoadedModel::Embed)
            }
            DirLoader::Chat(load) => load(path, &raw, options, memo).map(LoadedModel::Chat),
            DirLoader::Speech(load) => load(path, &raw, options, memo).map(LoadedModel::Speech),
            DirLoader::Embed(load) => load(path, &raw, options, memo).map(LoadedModel::Embed),
        }
    } else if path.is_file() {
        let file = Gguf::open(path).with_context(|| format!("reading GGUF at {}", path.display()))?;
        let arch = gguf_string(&file, "general.architecture")?;
        let family = FAMILIES.iter().find(|f| f.gguf_architectures.contains(&arch.as_str()));
        if let Some(family) = family {
            refuse_unsplittable(family, &arch, &options)?;
        }
        match family.and_then(|f| f.load_gguf.as_ref()) {
            Some(GgufLoader::Chat(load)) => load(&file, options).map(LoadedModel::Chat),
            Some(GgufLoader::Embed(load)) => load(&file, options, memo).map(LoadedModel::Embed),
            None => bail!("unsupported architecture {arch:?} in GGUF (supported: {})", supported_gguf()),
        }
    } else {
        bail!("model path {} does not exist", path.display())
    }
}

/// A shard asked of a family whose decoder cannot be split yet.
fn refuse_unsplittable(family: &Family, name: &str, options: &ModelOptions) -> Result<()> {
    if options.shard.is_some() && !family.tensor_parallel {
        let splittable: Vec<&str> =
            FAMILIES.iter().filter(|f| f.tensor_parallel).flat_map(|f| f.model_types.iter().copied()).collect();
        bail!(
            "a {name} model cannot be split over a group yet (tensor parallel covers {}); serve it on rank 0 alone",
            splittable.join(", ")
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Compiles the tokens given and keeps their text.
    macro_rules! compiled_with_text {
        ($($t:tt)*) => {
            ($($t)*, stringify!($($t)*))
        };
    }

    /// docs/adding-a-family.md's table line, with Llama standing in for
    /// `newfamily`: it compiles, and the doc says exactly this.
    #[test]
    fn the_documented_table_line_compiles() {
        use llama as newfamily;
        let (line, text) = compiled_with_text!(Family {
            model_types: &["newfamily"],
            gguf_architectures: &[],
            load_dir: DirLoader::Chat(newfamily::load_dir),
            load_gguf: None,
            tensor_parallel: false
        });
        assert!(matches!(line.load_dir, DirLoader::Chat(_)));
        let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/adding-a-family.md")).unwrap();
        let squash = |s: &str| s.chars().filter(|c| !c.is_whitespace()).collect::<String>();
        assert!(squash(&doc).contains(&squash(text)), "docs/adding-a-family.md's table line is not {text}");
    }
}
