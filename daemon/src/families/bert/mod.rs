//! BERT-style sentence embedders as sentence-transformers ships them
//! (all-MiniLM, BGE, E5, GTE and others of the `bert` architecture; and
//! `xlm-roberta` ones, multilingual-e5 and bge-m3: the same layers, its
//! positions counted after the padding id): the
//! encoder (`model`), its shape (`config`), and how the directory says to
//! pool and normalize (`model::sentence`). A directory whose checkpoint has a
//! classifier (`BertForSequenceClassification`, as sentence-transformers'
//! `CrossEncoder` rerankers ship: ms-marco-MiniLM, BGE-reranker-base) is a
//! reranker: it reads a (query, document) pair and says how relevant the
//! document is.
//!
//! Checked against mlx-embeddings' `bert.py` (and `xlm_roberta.py`) on the same weights
//! (tests/reference, `numerics::embeddings`; the classifier head there as
//! Hugging Face's `BertForSequenceClassification` computes it).

mod config;
mod gguf;
mod model;
mod native;

pub(crate) use gguf::gguf_settings;
pub use gguf::load_gguf;
pub(crate) use model::{attend, padding_bias};

use crate::model::family::Embedder;
use crate::model::options::ModelOptions;
use crate::model::sentence::{Pooling, SentenceSettings};
use crate::model::weights::TensorMap;
use anyhow::{Context, Result};
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;
use std::path::Path;

/// What an embedder needs of its encoder (BERT's, or another family's
/// built the same way: ModernBERT).
pub trait Encoder {
    /// Token states `[B, L, hidden]` of right-padded `ids` `[B, L]`, where
    /// `keep` (`[B, L]`, bool) marks the real tokens (padding is never
    /// attended to); `types` (`[B, L]`) each token's segment of a pair.
    fn forward(&self, ids: &Array, keep: &Array, types: Option<&Array>) -> Result<Array>;
    /// Bytes of a row's largest intermediate at `tokens` tokens.
    fn row_bytes(&self, tokens: usize) -> usize;
    /// Width of its token states.
    fn hidden_size(&self) -> usize;
    /// On MLX's CPU backend: GELU and softmax from multiplies and adds
    /// (`model::cpu_math`).
    fn use_cpu_math(&mut self, on: bool);
}

/// A loaded sentence embedder, or a cross-encoder reranker.
pub struct Bert {
    encoder: Box<dyn Encoder>,
    /// The architecture it reports.
    name: &'static str,
    settings: SentenceSettings,
    tokenizer: tokenizers::Tokenizer,
    fingerprint: mlxbc_cache::TowerFingerprint,
    dimensions: usize,
    /// A reranker's head, and its pair tokenizer (truncating the longer
    /// of the two texts first, as `CrossEncoder` does); `None`: an embedder.
    reranker: Option<(model::ClassifierHead, tokenizers::Tokenizer)>,
    /// `[SEP]`: where a pair's second segment starts.
    separator: u32,
    /// On the CPU, one stream per core (at most 8) that parts of a batch
    /// run on; empty on a GPU.
    streams: Vec<mlx_rs::Stream>,
}

/// Loads a sentence-transformers (or bare `BertModel`) directory.
pub fn load_dir(
    dir: &Path,
    raw: &serde_json::Value,
    options: ModelOptions,
    memo: Option<&sled::Tree>,
) -> Result<Box<dyn Embedder>> {
    let config = config::BertConfig::from_json(raw)?;
    let t = TensorMap::from_safetensors_dir(dir, crate::model::vlm_dir::quantization(raw), options.form)?;
    let prefixed = t.has("bert.embeddings.word_embeddings.weight");
    let classifies = t.has("classifier.weight");
    let t = match (prefixed, classifies) {
        // The head's tensors (`classifier.*`) sit beside `bert.*`.
        (true, true) => t.renamed(|n| n.strip_prefix("bert.").unwrap_or(n).to_string()),
        (true, false) => t.strip_prefix("bert."),
        (false, _) => t,
    };
    // Older checkpoints name LayerNorm's parameters gamma and beta.
    let mut t =
        t.renamed(|n| n.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias"));
    let encoder = model::BertEncoder::load(config.clone(), &mut t)?;
    let head = if classifies { Some(model::ClassifierHead::load(&mut t)?) } else { None };
    if let Some(h) = head.as_ref().filter(|h| !(1..=2).contains(&h.labels)) {
        anyhow::bail!(
            "{}: a classifier of {} labels is not a relevance score (a reranker has one, or two: no and yes)",
            dir.display(),
            h.labels
        );
    }
    let settings = if head.is_some() {
        // A cross-encoder's directory has no sentence-transformers files:
        // its length is the tokenizer's (or the positions').
        SentenceSettings::for_pairs(dir, encoder.positions())?
    } else {
        SentenceSettings::read(dir, encoder.positions())?
    };
    let tokenizer = crate::model::tokenizer::from_file(&dir.join("tokenizer.json"))?;
    let prefixes: &[&str] = match (prefixed, classifies) {
        (true, false) => &["bert."],
        (true, true) => &["bert.", "classifier."],
        (false, false) => &["embeddings.", "encoder."],
        (false, true) => &["embeddings.", "encoder.", "pooler.", "classifier."],
    };
    let fingerprint = crate::model::vlm_dir::weights_fingerprint(
        dir,
        prefixes,
        &format!("bert {config:?} {}", settings.describe()),
        memo,
    )
    .with_context(|| format!("fingerprinting {}", dir.display()))?;
    assemble(Box::new(encoder), "bert", head, settings, tokenizer, fingerprint)
}

/// The embedder of an encoder loaded from a sentence-transformers
/// directory (another family's: ModernBERT, nomic-bert): pooling, length
/// (at most `positions`) and prompts from the directory, its
/// `tokenizer.json`, its weights' fingerprint over the tensors under
/// `prefixes`, described by `name` and `shape` (the config) with the settings.
pub(crate) fn embedder_from_dir(
    dir: &Path,
    encoder: Box<dyn Encoder>,
    positions: usize,
    name: &'static str,
    prefixes: &[&str],
    shape: &str,
    memo: Option<&sled::Tree>,
) -> Result<Box<dyn Embedder>> {
    let settings = SentenceSettings::read(dir, positions)?;
    let tokenizer = crate::model::tokenizer::from_file(&dir.join("tokenizer.json"))?;
    let fingerprint = crate::model::vlm_dir::weights_fingerprint(
        dir,
        prefixes,
        &format!("{name} {shape} {}", settings.describe()),
        memo,
    )
    .with_context(|| format!("fingerprinting {}", dir.display()))?;
    assemble(encoder, name, None, settings, tokenizer, fingerprint)
}

/// The embedder (or, with a classifier `head`, the reranker) of a loaded
/// encoder, however its files came; `name`: its architecture.
pub fn assemble(
    mut encoder: Box<dyn Encoder>,
    name: &'static str,
    head: Option<model::ClassifierHead>,
    settings: SentenceSettings,
    mut tokenizer: tokenizers::Tokenizer,
    fingerprint: mlxbc_cache::TowerFingerprint,
) -> Result<Box<dyn Embedder>> {
    let dimensions = if head.is_some() { 1 } else { encoder.hidden_size() };
    // Its own truncation and padding (tokenizer.json often fixes both at
    // 128) would change what is embedded: the engine truncates, and pads
    // per batch.
    tokenizer.with_padding(None);
    tokenizer.with_truncation(None).map_err(|e| anyhow::anyhow!("tokenizer: {e}"))?;
    let separator = tokenizer.token_to_id("[SEP]").unwrap_or(102);
    let reranker = match head {
        None => None,
        Some(head) => {
            let mut pairs = tokenizer.clone();
            pairs
                .with_truncation(Some(tokenizers::TruncationParams {
                    max_length: settings.max_tokens,
                    strategy: tokenizers::TruncationStrategy::LongestFirst,
                    ..Default::default()
                }))
                .map_err(|e| anyhow::anyhow!("tokenizer: {e}"))?;
            Some((head, pairs))
        }
    };
    let on_cpu = matches!(mlx_rs::Device::default().get_type(), Ok(mlx_rs::DeviceType::Cpu));
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()).min(8);
    let cpu = mlx_rs::Device::cpu();
    encoder.use_cpu_math(on_cpu && crate::model::cpu_math::enabled());
    if on_cpu {
        crate::model::cpu_math::keep_freed_memory();
    }
    let streams = if on_cpu && cores > 1 {
        (0..cores).map(|_| mlx_rs::Stream::new_with_device(&cpu)).collect()
    } else {
        Vec::new()
    };
    Ok(Box::new(Bert { encoder, name, settings, tokenizer, fingerprint, dimensions, reranker, separator, streams }))
}

/// The fewest rows a part of a batch gets its own stream for.
const MIN_ROWS_PER_PART: usize = 4;

/// On the CPU, the most bytes a part's largest intermediate may take: below
/// glibc's largest mmap threshold (32 MiB), so buffers come from the heap
/// and are reused instead of being mapped and faulted in afresh for every
/// op (a multiply over 94 MB: 2.5 ns an element; over 12 MB: 0.26). A
/// BERT's native layers (`native.rs`) keep the parts too: its passes over
/// a part's buffers stay in cache (MiniLM, 200 chunks of ~237 tokens: 29.0
/// texts/s in parts of 24 MiB, 28.9 of 12, 27.3 of 6, 25.2 of 48, 22.7 for
/// the whole 64-text batch at once, `scripts/bench.d/embed_ab.py 3`).
const PART_BYTES: usize = 24 << 20;

impl Bert {
    /// Vectors `[B, dimensions]` (a reranker's scores `[B, 1]`) of one
    /// padded batch, f32, not yet evaluated.
    fn embed_part(&self, inputs: &[Vec<u32>]) -> Result<Array> {
        let longest = inputs.iter().map(Vec::len).max().unwrap_or(0).max(1);
        let (b, l) = (inputs.len() as i32, longest as i32);
        let mut ids = Vec::with_capacity(inputs.len() * longest);
        let mut keep = Vec::with_capacity(inputs.len() * longest);
        for input in inputs {
            ids.extend_from_slice(input);
            ids.extend(std::iter::repeat_n(0, longest - input.len()));
            keep.extend((0..longest).map(|i| i < input.len()));
        }
        let ids = Array::from_slice(&ids, &[b, l]);
        let keep = Array::from_slice(&keep, &[b, l]);
        if let Some((head, _)) = &self.reranker {
            let types = self.segments(inputs, longest);
            let states = self.encoder.forward(&ids, &keep, Some(&types))?;
            return self.scores(head, &states);
        }
        let states = self.encoder.forward(&ids, &keep, None)?;
        let pooled = match self.settings.pooling {
            Pooling::Mean => {
                let weights = keep.as_dtype(states.dtype())?.reshape(&[b, l, 1])?;
                let sum = states.multiply(&weights)?.sum_axis(1, None)?;
                let count = mlx_rs::ops::maximum(weights.sum_axis(1, None)?, Array::from_f32(1e-9))?;
                sum.divide(&count)?
            }
            Pooling::Cls => states.index((.., 0, ..)),
            Pooling::LastToken => {
                let last: Vec<i32> = inputs.iter().map(|i| i.len().max(1) as i32 - 1).collect();
                let at = Array::from_slice(&last, &[b, 1, 1]);
                states.take_along_axis(&at, 1)?.reshape(&[b, -1])?
            }
        };
        let pooled = if self.settings.normalize {
            let norm = pooled.square()?.sum_axis(-1, true)?.sqrt()?;
            pooled.divide(mlx_rs::ops::maximum(norm, Array::from_f32(1e-12))?)?
        } else {
            pooled
        };
        Ok(pooled.as_dtype(mlx_rs::Dtype::Float32)?)
    }

    /// Each token's segment: the first up to and with the first `[SEP]`,
    /// the second after it (padding's does not matter: it is masked).
    fn segments(&self, inputs: &[Vec<u32>], longest: usize) -> Array {
        let mut types = Vec::with_capacity(inputs.len() * longest);
        for input in inputs {
            let first = input.iter().position(|&t| t == self.separator).map_or(longest, |p| p + 1);
            types.extend((0..longest).map(|i| i32::from(i >= first)));
        }
        Array::from_slice(&types, &[inputs.len() as i32, longest as i32])
    }

    /// Relevance scores `[B]` of pairs' token states: the classifier's
    /// logit through a sigmoid (one label, as `CrossEncoder` scores), or
    /// the second label's probability (two).
    fn scores(&self, head: &model::ClassifierHead, states: &Array) -> Result<Array> {
        let logits = head.forward(states)?.as_dtype(mlx_rs::Dtype::Float32)?;
        Ok(if head.labels == 1 {
            mlx_rs::ops::sigmoid(&logits)?
        } else {
            mlx_rs::ops::softmax_axis(&logits, -1, None)?.index((.., 1..2))
        })
    }
}

impl Embedder for Bert {
    fn architecture(&self) -> &'static str {
        if self.reranker.is_some() {
            "bert cross-encoder"
        } else {
            self.name
        }
    }

    fn dimensions(&self) -> usize {
        self.dimensions
    }

    fn max_tokens(&self) -> usize {
        self.settings.max_tokens
    }

    fn tokenize(&self, text: &str) -> Result<Vec<u32>> {
        crate::model::sentence::encode(&self.tokenizer, text)
    }

    fn vocabulary(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }

    fn truncate(&self, ids: &[u32]) -> Vec<u32> {
        // [CLS] and the first tokens, then the closing [SEP].
        crate::model::sentence::truncate(ids, self.max_tokens(), 1)
    }

    fn prompt(&self, name: Option<&str>) -> Result<String> {
        self.settings.prompt(name).map(String::from)
    }

    fn reranks(&self) -> bool {
        self.reranker.is_some()
    }

    fn tokenize_pair(&self, query: &str, document: &str, _instruction: Option<&str>) -> Result<Vec<u32>> {
        let Some((_, pairs)) = &self.reranker else { anyhow::bail!("an embedding model does not read pairs") };
        let enc = pairs.encode((query, document), true).map_err(|e| anyhow::anyhow!("tokenizing: {e}"))?;
        Ok(enc.get_ids().to_vec())
    }

    fn embed(&self, inputs: &[Vec<u32>]) -> Result<Vec<Vec<f32>>> {
        // On the CPU, MLX runs a stream's element-wise work (GELU's erf,
        // attention's softmax: three quarters of a BERT layer) on one
        // thread: parts of the batch on streams of their own use every
        // core (2x for 2 streams on 2 cores, measured); matrix products
        // are multithreaded by BLAS either way.
        // Parts also small enough for the allocator to reuse their
        // buffers (`PART_BYTES`), taking turns over the streams.
        let mut parts = self.streams.len().min(inputs.len().div_ceil(MIN_ROWS_PER_PART)).max(1);
        if !self.streams.is_empty() {
            let longest = inputs.iter().map(Vec::len).max().unwrap_or(1);
            let rows = (PART_BYTES / self.encoder.row_bytes(longest).max(1)).max(1);
            parts = parts.max(inputs.len().div_ceil(rows));
        }
        let per = inputs.len().div_ceil(parts);
        let mut outs = Vec::with_capacity(parts);
        for (i, part) in inputs.chunks(per.max(1)).enumerate() {
            let stream = (parts > 1 && !self.streams.is_empty()).then(|| &self.streams[i % self.streams.len()]);
            outs.push(match stream {
                Some(stream) => mlx_rs::with_stream(stream, || self.embed_part(part))?,
                None => self.embed_part(part)?,
            });
        }
        mlx_rs::transforms::eval(outs.iter())?;
        let width = if self.reranker.is_some() { 1 } else { self.dimensions };
        Ok(outs
            .iter()
            .flat_map(|o| o.as_slice::<f32>().chunks(width).map(<[f32]>::to_vec).collect::<Vec<_>>())
            .collect())
    }

    fn fingerprint(&self) -> mlxbc_cache::TowerFingerprint {
        self.fingerprint
    }

    fn settings(&self) -> String {
        self.settings.describe()
    }
}
