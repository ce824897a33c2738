//! The two seams a model family plugs into. The engine drives every model
//! through these traits and never names a family; each family (a folder
//! under `crate::families`) implements them.
//!
//! - [`LanguageModel`]: ids → embeddings → hidden states → logits, with a
//!   batch axis `[B, L, hidden]` and one KV cache holding every row.
//! - [`VisionTower`] (engine thread, MLX) and [`MediaPreprocessor`] (any
//!   thread, no MLX): media bytes → prepared pixels → features spliced into
//!   the prompt's embeddings.
//! - [`SpeechRecognizer`] and its [`SpeechTask`]: audio → windows → tower
//!   features (stored) → text, for speech models (Whisper).

use super::kv_cache::KvCache;
use super::positions::MediaPositions;
use anyhow::Result;
use mlx_rs::Array;

/// How a language model's positions inside one image attend during prefill.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MediaAttention {
    /// Causally, like text (most families).
    Causal,
    /// Both ways within one image (Gemma 3's training): a prefill chunk then
    /// may not end inside an image.
    BidirectionalWithinImage,
}

/// A compiled-decode graph: inputs are the token ids `[1, 1]`, the position
/// `[1]` (int32) and every layer's key and value buffers; outputs are the
/// logits and the buffers with that position written.
pub type DecodeGraph = Box<dyn Fn(&[Array]) -> Result<Vec<Array>>>;

/// A family's text decoder.
pub trait LanguageModel {
    /// Architecture name for listings (`llama`, `gemma3`, ...).
    fn architecture(&self) -> &'static str;

    /// Layers, i.e. KV cache slots.
    fn num_layers(&self) -> usize;

    /// Longest prompt plus answer, in tokens.
    fn context_length(&self) -> u32;

    /// Token embeddings `[B, L, width]` of ids `[B, L]`, as the prompt's
    /// text positions take them (any scaling a family applies inside the
    /// layers is not applied here). The width is the family's: `hidden`,
    /// or wider where a decoder carries more per position (Gemma 4's
    /// per-layer inputs follow the embedding); the engine only passes these
    /// rows, zero-padded or spliced by the family's tower, to `forward`.
    fn embed(&self, ids: &Array) -> Result<Array>;

    /// Rows from [`Self::embed`] `[B, L, width]` through the layers at each row's next
    /// positions in `cache` (which grows by `L`); the hidden states that
    /// [`Self::logits`] reads. `media` carries the request's own inputs
    /// (single-row only): its image blocks (per absolute position, the image
    /// it belongs to, -1 for text) for a model whose
    /// [`Self::media_attention`] needs them, its multimodal rope positions
    /// and its deepstack features.
    fn forward(&self, embeds: &Array, cache: &mut KvCache, media: &MediaPositions) -> Result<Array>;

    /// Logits `[B, vocab]` of each row's last position of `hidden`.
    fn logits(&self, hidden: &Array) -> Result<Array>;

    /// The final norm's output `[B, width]` at each row's last position of
    /// `hidden` (what [`Self::logits`] reads before its head): a decoder
    /// read as a sentence embedder pools this (last-token pooling).
    fn last_states(&self, _hidden: &Array) -> Result<Array> {
        anyhow::bail!("{} cannot be read as an embedding model", self.architecture())
    }

    /// True when [`Self::logits_all`] gives every position's logits and
    /// the model's cache can be cut back: its sequences may speculate.
    fn verifies_drafts(&self) -> bool {
        false
    }

    /// Logits `[B, L, vocab]` of every position of `hidden` `[B, L, width]`,
    /// computed as [`Self::logits`] computes the last one: a speculative
    /// verify pass reads the model's pick after each drafted position
    /// (where [`Self::verifies_drafts`]).
    fn logits_all(&self, _hidden: &Array) -> Result<Array> {
        anyhow::bail!("{} does not verify drafts", self.architecture())
    }

    /// How positions within one image attend during prefill.
    fn media_attention(&self) -> MediaAttention {
        MediaAttention::Causal
    }

    /// A decode step that can be compiled once and replayed, when the model
    /// has one (its shapes do not change per token).
    fn decode_graph(&self) -> Option<DecodeGraph> {
        None
    }

    /// True when some layers keep a recurrent state in the cache (Qwen3.5's
    /// Gated DeltaNet): a prefix is then reusable only where its state was
    /// saved, and the model's prompts are prefilled one at a time (each
    /// saving its state at its own block boundary), its decode steps
    /// batched as any model's.
    fn recurrent(&self) -> bool {
        false
    }

    /// The shapes `(in, out)` of each decoder layer's projections, in
    /// `model::lora::PROJECTIONS` order, when it serves LoRA adapters
    /// (`KvCache::adapter`); `None` when it does not.
    fn projection_shapes(&self) -> Option<crate::model::lora::ProjectionShapes> {
        None
    }

    /// The dense weight `[out, in]` and bias of decoder layer `layer`'s
    /// projection `which` (`model::lora::PROJECTIONS` order), for a DoRA
    /// adapter's factors; families without adapters have none.
    fn projection_weight(&self, layer: usize, which: usize) -> Result<(Array, Option<Array>)> {
        anyhow::bail!("{} has no projection {which} in layer {layer} to adapt", self.architecture())
    }

    /// True when its attention reads quantized keys and values
    /// (`KvCache::update_view`): its sequences may keep their KV cache
    /// quantized (`kv_bits`).
    fn reads_quantized_kv(&self) -> bool {
        false
    }

    /// How the model is split over a group, when it is (for the status).
    fn split_description(&self) -> Option<String> {
        None
    }

    /// A split model's other ranks make `cache`, a prefix rank 0 restored
    /// from its prompt cache (`keys` gives the prompt cache's encoding of
    /// its names), from their own; false when one of them lacks part of it
    /// (the prefix is then computed). A whole model has nothing to do (and
    /// encodes nothing).
    fn adopt_prefix(&self, _cache: &mut KvCache, _keys: &dyn Fn() -> Vec<u8>) -> Result<bool> {
        Ok(true)
    }
}

/// Media made ready for a tower on the CPU: values in the layout the tower
/// reads (`shape`), and the patch grid `(t, h, w)` when the tower's output
/// depends on it.
#[derive(Debug, Clone, PartialEq)]
pub struct Prepared {
    pub values: Vec<f32>,
    pub shape: Vec<i32>,
    pub grid: Option<(u32, u32, u32)>,
}

/// A family's media preprocessing: decoded pixels → [`Prepared`]. Runs on
/// tokio's blocking pool, never on the engine thread, so it holds no MLX
/// state.
pub trait MediaPreprocessor: Send + Sync {
    /// A stable description of every parameter that changes the output
    /// (sizes, resampling, normalization): part of the feature-store key.
    fn describe(&self) -> String;

    /// Resizes, normalizes and lays out one decoded image.
    fn prepare(&self, image: &image::RgbImage) -> Prepared;

    /// The family's video preprocessing, when its tower takes video.
    fn video(&self) -> Option<&dyn VideoPreprocessor> {
        None
    }

    /// The family's audio frontend, when the model hears (Gemma 4).
    fn audio(&self) -> Option<&dyn AudioPreprocessor> {
        None
    }
}

/// Audio made ready for a model's audio tower on the CPU: `frames` ×
/// `bins` features row-major (a log-mel), of which the first
/// `valid_frames` are the clip's (the rest padding), and the soft tokens
/// the clip takes in the prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct PreparedAudio {
    pub values: Vec<f32>,
    pub frames: usize,
    pub bins: usize,
    pub valid_frames: usize,
    pub tokens: usize,
}

/// A family's audio frontend for a chat model that hears (no MLX, any
/// thread): 16 kHz mono samples → [`PreparedAudio`].
pub trait AudioPreprocessor: Send + Sync {
    /// Every parameter that changes the features or the token count:
    /// part of the feature-store key.
    fn describe(&self) -> String;

    /// The clip's features; an error is a sentence for the user.
    fn prepare(&self, samples: &[f32]) -> Result<PreparedAudio, String>;
}

/// A family's video preprocessing (no MLX, any thread): which frames to
/// take, and the taken frames → one [`Prepared`] per temporal group, each
/// encoded (and stored) on its own, like an image.
pub trait VideoPreprocessor: Send + Sync {
    /// How frames are taken from a clip.
    fn sampling(&self) -> super::video::Sampling;

    /// Every parameter that changes the groups (sampling included):
    /// part of the feature-store key.
    fn describe(&self) -> String;

    /// Frames per group (the tower's temporal patch).
    fn temporal_patch(&self) -> usize;

    /// Seconds the prompt writes for each group of `clip`: by default the
    /// Hugging Face Qwen3-VL processor's (the mean of a group's first and
    /// last frame's time in the clip).
    fn group_seconds(&self, clip: &super::video::SampledVideo) -> Vec<f64> {
        clip.group_seconds(self.temporal_patch())
    }

    /// Resizes, normalizes and lays out the sampled frames, group by group;
    /// an error is a sentence for the user.
    fn prepare(&self, frames: &[image::RgbImage]) -> Result<Vec<Prepared>, String>;
}

/// A family's vision tower and how its features enter the prompt.
pub trait VisionTower {
    /// Features of one prepared image, lazily: `[rows, hidden]`, or a grid
    /// `[h, w, hidden]` whose leading axes say its shape; the feature store
    /// keeps them as they are.
    fn encode(&self, prepared: &Prepared) -> Result<Array>;

    /// Prompt embeddings `[1, L, hidden]`: the runs of the image token in
    /// `ids` take `features` (one per image, in order), the rest `lm`'s
    /// text embeddings. More or fewer images than runs is an error.
    fn splice(&self, lm: &dyn LanguageModel, ids: &[u32], features: &[Array]) -> Result<Array>;

    /// Rope positions for the whole prompt when the language model's rope
    /// follows the images' grids (Qwen2-VL's multimodal rope): per position
    /// `(t, h, w)`, and the delta later positions add. `None`: positions are
    /// plain offsets.
    fn rope_positions(&self, _ids: &[u32], _features: &[Array]) -> Option<super::positions::MropePositions> {
        None
    }

    /// Soft tokens `[tokens, hidden]` of one clip, lazily, for a model that
    /// hears (its audio tower and projector); spliced like an image's.
    fn encode_audio(&self, _audio: &PreparedAudio) -> Result<Array> {
        anyhow::bail!("this model has no audio tower")
    }

    /// What the language model's first layers add at the prompt's visual
    /// positions (Qwen3-VL's deepstack), from the same features; `None`
    /// for a family without it.
    fn deepstack(&self, _ids: &[u32], _features: &[Array]) -> Result<Option<super::positions::Deepstack>> {
        Ok(None)
    }
}

/// A family's speech recognizer (Whisper): an audio tower whose output the
/// feature store keeps per window, and a decoder that turns it into text.
/// The engine drives a transcription window by window ([`SpeechTask`]),
/// between its other work, looking each window up in the store first.
pub trait SpeechRecognizer {
    /// Architecture name for listings (`whisper`).
    fn architecture(&self) -> &'static str;

    /// Every parameter of the audio frontend that changes the tower's input
    /// (rate, FFT, hop, mel bins, window): part of the feature-store key.
    fn frontend_key(&self) -> String;

    /// Hash over the tower's config and weights (feature-store key part).
    fn fingerprint(&self) -> mlxbc_cache::TowerFingerprint;

    /// The tower on one window's input (lazily).
    fn encode(&self, window: &Array) -> Result<Array>;

    /// Starts transcribing a recording of `frames` 10 ms frames: its
    /// `samples` (16 kHz mono), or `None` when every window it needs is
    /// expected in the feature store (sent by hash).
    /// The task holds its model (`self`), so its steps need no other.
    fn begin(
        self: std::rc::Rc<Self>,
        samples: Option<&[f32]>,
        frames: usize,
        request: &mlxbc_shared::TranscribeRequest,
    ) -> Result<Box<dyn SpeechTask>>;
}

/// One window the tower must encode next.
pub struct SpeechWindow {
    /// Names the window within its recording (its offset, or a purpose such
    /// as language detection): part of the feature-store key.
    pub id: String,
    /// The tower's input; `None` when the recording's samples were not sent.
    pub input: Option<Array>,
}

/// What a finished transcription holds.
pub struct SpeechResult {
    pub text: String,
    pub language: String,
    pub segments: Vec<mlxbc_shared::TranscriptSegment>,
}

/// A transcription in progress.
pub trait SpeechTask {
    /// The window to encode next; `None` when the recording is done.
    fn next_window(&self) -> Result<Option<SpeechWindow>>;

    /// Decodes that window from its encoder output and moves on.
    fn step(&mut self, features: &Array) -> Result<()>;

    /// Windows decoded so far (a fallback decodes one again).
    fn windows(&self) -> u32;

    /// Seconds of audio.
    fn seconds(&self) -> f64;

    /// The transcript.
    fn finish(self: Box<Self>) -> Result<SpeechResult>;
}

/// A family's text embedder (sentence embeddings: BERT-style encoders as
/// sentence-transformers ships them): texts in, one vector each. The
/// engine looks every input up in the feature store first (its key: this
/// model's [`Self::fingerprint`], [`Self::settings`] and the text's
/// sha256) and embeds only the misses, a batch at a time.
pub trait Embedder {
    /// Architecture name for listings (`bert`).
    fn architecture(&self) -> &'static str;

    /// Length of its vectors.
    fn dimensions(&self) -> usize;

    /// The most tokens an input may have, special tokens included
    /// (sentence-transformers' `max_seq_length`).
    fn max_tokens(&self) -> usize;

    /// Token ids of `text` with the model's special tokens, not truncated
    /// (stripped of surrounding whitespace first, as sentence-transformers
    /// strips its inputs).
    fn tokenize(&self, text: &str) -> Result<Vec<u32>>;

    /// Token ids its tokenizer knows (ids from a peer are checked against
    /// it: an id past the embedding table is refused, never looked up).
    fn vocabulary(&self) -> usize;

    /// `ids` cut to [`Self::max_tokens`] as the model's tokenizer truncates
    /// (keeping its closing special token).
    fn truncate(&self, ids: &[u32]) -> Vec<u32>;

    /// Vectors of tokenized inputs (each at most [`Self::max_tokens`]),
    /// pooled and normalized as the model's directory says, as one padded
    /// batch. A reranker's "vector" is one relevance score per pair.
    fn embed(&self, inputs: &[Vec<u32>]) -> Result<Vec<Vec<f32>>>;

    /// True for a reranker (a cross-encoder): its inputs are (query,
    /// document) pairs ([`Self::tokenize_pair`]) and its output a score.
    fn reranks(&self) -> bool {
        false
    }

    /// The instruction put before each input for the prompt `name` (its
    /// directory's `prompts`: `query`, `document`, ...; `None`: its
    /// default), or why there is none of that name.
    fn prompt(&self, name: Option<&str>) -> Result<String> {
        match name {
            None | Some("query" | "document" | "search_query" | "search_document") => Ok(String::new()),
            Some(other) => anyhow::bail!("this model has no prompt {other:?}"),
        }
    }

    /// True for a reranker that reads an instruction with each pair (a
    /// decoder reranker: Qwen3-Reranker's `<Instruct>`); a cross-encoder
    /// reads none.
    fn takes_instruction(&self) -> bool {
        false
    }

    /// Token ids of a (query, document) pair as a reranker reads them,
    /// truncated to [`Self::max_tokens`] (a cross-encoder cuts the longer
    /// text first, a decoder reranker the document's tail), after the
    /// `instruction` where [`Self::takes_instruction`] (`None`: its
    /// default).
    fn tokenize_pair(&self, _query: &str, _document: &str, _instruction: Option<&str>) -> Result<Vec<u32>> {
        anyhow::bail!("an embedding model does not read pairs")
    }

    /// Hash over its config and weights (feature-store key part).
    fn fingerprint(&self) -> mlxbc_cache::TowerFingerprint;

    /// Everything besides the weights that changes a vector (pooling,
    /// normalization, truncation): feature-store key part, and `mlxbc ps`.
    fn settings(&self) -> String;
}
