//! The kit every family builds from, and the servable model the engine
//! holds. This module knows no family: `crate::families` implements the
//! traits of [`family`] and assembles a [`Model`] from a model's files.

pub mod batch_attention;
pub mod chat_template;
pub mod cpu_math;
pub mod cpu_native;
pub mod cuda_kernel;
pub mod decode_step;
pub mod decoder_embedder;
pub mod dense_rows;
pub mod family;
pub mod gguf;
pub mod image;
pub mod kv_cache;
pub mod layers;
pub mod lm_reranker;
pub mod lora;
pub mod lora_kernel;
pub mod options;
pub mod positions;
pub mod prompt;
pub mod qk_rope;
pub mod quantized_attention;
pub mod raw_prompt;
pub mod sentence;
pub mod sharding;
pub mod splice;
pub mod tokenizer;
pub mod tool_format;
pub mod video;
pub mod vlm_dir;
pub mod w4a16;
pub mod weights;

use anyhow::{Context, Result};
use chat_template::ChatTemplate;
use decode_step::{CompiledDecode, DecodeMode};
use family::{LanguageModel, MediaPreprocessor, VisionTower};
use kv_cache::{KvCache, KvQuantization};
use std::cell::RefCell;
use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Arc;
use tokenizers::Tokenizer;

/// A multimodal model's encoder (a vision tower, which may also take
/// video frames and audio clips), its preprocessing and prompt placeholders.
pub struct MediaTower {
    pub tower: Box<dyn VisionTower>,
    /// Shared with the connections, which prepare media off the engine thread.
    pub preprocessor: Arc<dyn MediaPreprocessor>,
    /// `preprocessor.describe()`, computed once (feature-store key part).
    pub preprocess_key: String,
    /// Hash over the tower's config and weights (feature-store key part).
    pub fingerprint: mlxbc_cache::TowerFingerprint,
    /// Text the chat template writes where an image goes.
    pub placeholder: String,
    /// What each placeholder becomes before tokenization: `prefix`, the
    /// image token once per feature row, `suffix`.
    pub expansion_prefix: String,
    pub image_token: String,
    pub expansion_suffix: String,
    /// Token id of the positions that receive image features.
    pub image_token_id: u32,
    /// How a video enters the prompt, for a tower that takes video.
    pub video: Option<VideoPrompt>,
    /// How a clip enters the prompt, for a model that hears (its features
    /// come from [`family::VisionTower::encode_audio`]).
    pub audio: Option<AudioPrompt>,
}

/// How a chat template's audio placeholder expands: `prefix`, the audio
/// token once per soft token, `suffix` (Gemma 4's `<|audio>` … `<audio|>`).
#[derive(Debug, Clone)]
pub struct AudioPrompt {
    /// What the template writes where a clip goes.
    pub text: String,
    pub prefix: String,
    pub token: String,
    pub suffix: String,
    /// Token id of the positions that receive audio features.
    pub token_id: u32,
    /// `describe()` of the family's audio frontend (feature-store key part).
    pub frontend_key: String,
    /// Hash over the audio tower's config and weights (feature-store key part).
    pub fingerprint: mlxbc_cache::TowerFingerprint,
}

/// How a chat template's video placeholder expands: per temporal group,
/// its time, `start`, the video token once per feature row, `end`.
#[derive(Debug, Clone)]
pub struct VideoPrompt {
    /// What the template writes where a video goes.
    pub text: String,
    pub start: String,
    pub token: String,
    pub end: String,
    /// Token id of the positions that receive video features.
    pub token_id: u32,
    /// How the groups' times are written.
    pub timestamps: VideoTimestamps,
}

/// How a family's processor writes a video group's time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VideoTimestamps {
    /// `<1.5 seconds>` before each group, groups back to back (Hugging
    /// Face's Qwen3-VL processor).
    Seconds,
    /// `00:01 ` before each frame, frames joined by a space (Gemma 4's:
    /// whole seconds, `mm:ss`).
    MinutesSeconds,
}

impl VideoPrompt {
    /// One video's expansion: per group its time (tenths of a second) and
    /// feature rows.
    fn expand(&self, groups: impl Iterator<Item = (u32, usize)>) -> String {
        let parts = groups.map(|(t, n)| {
            let body = format!("{}{}{}", self.start, self.token.repeat(n), self.end);
            match self.timestamps {
                VideoTimestamps::Seconds => format!("<{}.{} seconds>{body}", t / 10, t % 10),
                VideoTimestamps::MinutesSeconds => {
                    let s = t / 10;
                    format!("{:02}:{:02} {body}", s / 60, s % 60)
                }
            }
        });
        let joint = if self.timestamps == VideoTimestamps::MinutesSeconds { " " } else { "" };
        parts.collect::<Vec<_>>().join(joint)
    }
}

/// What one of a request's media became in the prompt.
#[derive(Debug, Clone, PartialEq)]
pub enum MediaLayout {
    /// One image: one feature array.
    Image,
    /// A video: one feature array per temporal group, at these times (in
    /// tenths of a second, as the prompt writes them).
    Video { tenths: Vec<u32> },
    /// An audio clip: one feature array.
    Audio,
}

impl MediaLayout {
    /// Feature arrays it takes.
    pub fn arrays(&self) -> usize {
        match self {
            MediaLayout::Image | MediaLayout::Audio => 1,
            MediaLayout::Video { tenths } => tenths.len(),
        }
    }
}

impl MediaTower {
    /// Assembles the parts; the preprocessing key is computed here, once.
    pub fn new(
        tower: Box<dyn VisionTower>,
        preprocessor: Arc<dyn MediaPreprocessor>,
        fingerprint: mlxbc_cache::TowerFingerprint,
        placeholder: Placeholder,
        image_token_id: u32,
    ) -> Self {
        Self {
            tower,
            preprocess_key: preprocessor.describe(),
            preprocessor,
            fingerprint,
            placeholder: placeholder.text,
            expansion_prefix: placeholder.prefix,
            image_token: placeholder.image_token,
            expansion_suffix: placeholder.suffix,
            image_token_id,
            video: None,
            audio: None,
        }
    }

    /// The token ids that receive media features (images', videos', audio's).
    pub fn media_tokens(&self) -> Vec<u32> {
        let mut tokens = self.visual_tokens();
        tokens.extend(self.audio.as_ref().map(|a| a.token_id));
        tokens
    }

    /// The token ids that receive image and video features (the ones a
    /// bidirectional family attends both ways within).
    pub fn visual_tokens(&self) -> Vec<u32> {
        std::iter::once(self.image_token_id).chain(self.video.as_ref().map(|v| v.token_id)).collect()
    }

    /// The prompt with each media placeholder, in order, replaced by its
    /// expansion: `layout[i]` says what medium `i` is, `rows[j]` how many
    /// feature rows feature array `j` has (a video's groups take one each).
    /// `Err`: the placeholders do not match the media, as a sentence.
    pub fn expand_media(&self, prompt: &str, layout: &[MediaLayout], rows: &[usize]) -> Result<String, String> {
        let video_text = self.video.as_ref().map(|v| v.text.as_str());
        let audio_text = self.audio.as_ref().map(|a| a.text.as_str());
        // Each kind's placeholder, and how many of it the prompt and the media have.
        let kinds = [("image", Some(self.placeholder.as_str())), ("video", video_text), ("audio", audio_text)];
        let kind_of = |l: &MediaLayout| match l {
            MediaLayout::Image => 0,
            MediaLayout::Video { .. } => 1,
            MediaLayout::Audio => 2,
        };
        for (k, (name, text)) in kinds.iter().enumerate() {
            let sent = layout.iter().filter(|l| kind_of(l) == k).count();
            let Some(text) = text else {
                if sent > 0 {
                    return Err(format!("this model does not take {name}"));
                }
                continue;
            };
            let written = prompt.matches(text).count();
            if written != sent {
                return Err(format!("the prompt has {written} {name} placeholders but {sent} {name} inputs were sent"));
            }
        }
        let mut expanded = String::with_capacity(prompt.len() + rows.iter().sum::<usize>() * self.image_token.len());
        let mut rest = prompt;
        let mut rows = rows.iter();
        let mismatch = || "the prompt's media placeholders do not match its media".to_string();
        for item in layout {
            let k = kind_of(item);
            let text = kinds[k].1.ok_or_else(mismatch)?;
            let expansion = match item {
                MediaLayout::Image => {
                    let n = *rows.next().ok_or_else(mismatch)?;
                    format!("{}{}{}", self.expansion_prefix, self.image_token.repeat(n), self.expansion_suffix)
                }
                MediaLayout::Video { tenths } => {
                    let v = self.video.as_ref().ok_or_else(mismatch)?;
                    let groups: Vec<(u32, usize)> = tenths
                        .iter()
                        .map(|&t| rows.next().map(|&n| (t, n)).ok_or_else(mismatch))
                        .collect::<Result<_, _>>()?;
                    v.expand(groups.into_iter())
                }
                MediaLayout::Audio => {
                    let a = self.audio.as_ref().ok_or_else(mismatch)?;
                    let n = *rows.next().ok_or_else(mismatch)?;
                    format!("{}{}{}", a.prefix, a.token.repeat(n), a.suffix)
                }
            };
            let at = rest.find(text).ok_or_else(mismatch)?;
            // Media must come in the order the placeholders do.
            let earlier = kinds
                .iter()
                .enumerate()
                .filter(|(j, _)| *j != k)
                .filter_map(|(_, (_, t))| t.and_then(|t| rest.find(t)))
                .any(|o| o < at);
            if earlier {
                return Err(mismatch());
            }
            expanded.push_str(&rest[..at]);
            expanded.push_str(&expansion);
            rest = &rest[at + text.len()..];
        }
        if rows.next().is_some() {
            return Err(mismatch());
        }
        expanded.push_str(rest);
        Ok(expanded)
    }

    /// For each position of `ids`, the index of the image (or video frame
    /// group: a run of one visual token) it belongs to, or -1 (text, audio).
    pub fn image_blocks(&self, ids: &[u32]) -> Vec<i32> {
        let media = self.visual_tokens();
        let mut block = -1;
        let mut out = Vec::with_capacity(ids.len());
        for (i, &t) in ids.iter().enumerate() {
            if media.contains(&t) {
                if i == 0 || ids[i - 1] != t {
                    block += 1;
                }
                out.push(block);
            } else {
                out.push(-1);
            }
        }
        out
    }
}

/// How a chat template's image placeholder expands before tokenization.
pub struct Placeholder {
    /// What the template writes where an image goes.
    pub text: String,
    /// Written before the image tokens.
    pub prefix: String,
    /// Repeated once per feature row.
    pub image_token: String,
    /// Written after them.
    pub suffix: String,
}

/// Everything needed to answer a chat request with one model.
pub struct Model {
    pub lm: Box<dyn LanguageModel>,
    /// Template and tokenizer, shareable off the engine thread.
    pub prompter: Arc<prompt::Prompter>,
    /// Token ids that end a generation.
    pub eos_ids: BTreeSet<u32>,
    /// Present for models that take images, video or audio.
    pub media_tower: Option<MediaTower>,
    /// The compiled decode step when the language model has one (traced on
    /// first use; engine thread only).
    compiled_decode: Option<RefCell<CompiledDecode>>,
    /// KV cache bytes one position takes in every layer (measured by
    /// [`Self::warm_up`]): what the scheduler reserves per position.
    pub kv_bytes_per_position: u64,
    /// One row's recurrent states' shapes (measured by [`Self::warm_up`];
    /// empty for a model without them): how the prompt cache reads a
    /// stored state back.
    pub state_layout: kv_cache::StateLayout,
    /// Per KV slot, `(heads, head_dim)` (measured at warm-up).
    pub kv_shapes: kv_cache::KvShapes,
    /// What one position takes in a stored prompt-cache block (its layers
    /// padded to one shape: more than `kv_bytes_per_position` when they
    /// differ), measured at warm-up.
    pub kv_block_bytes_per_position: u64,
    /// The dtype of its keys and values (measured at warm-up): a quantized
    /// cache's scales and biases have it.
    pub kv_dtype: mlx_rs::Dtype,
    /// The identity of this model's KV (weights, load form, device), which
    /// the prompt cache's block names start from; `None`: not cached.
    pub kv_root: Option<[u8; 32]>,
    /// How its quantized matrices serve batched steps (`mlxbc ps` says).
    pub batch_weights: layers::BatchWeights,
    /// Batch sizes whose paths are still to be warmed ([`Self::warm_batches`]),
    /// one at a time while the engine is idle; `mlxbc ps` says "warming".
    pub warm_pending: RefCell<Vec<usize>>,
    /// Tokens drafted by speculation and of those accepted, over its
    /// finished generations (`mlxbc ps`).
    pub drafts: std::cell::Cell<(u64, u64)>,
    /// Accepted drafted tokens and rejected drafts of its recent finished
    /// sequences, decayed per sequence: a new sequence's prior
    /// ([`Self::draft_prior`]).
    draft_evidence: std::cell::Cell<(f64, f64)>,
    /// Seconds per token it drafts when it drafts for another model
    /// (catching up included), smoothed over its sequences: a new
    /// sequence's draft cost before it measures its own.
    pub draft_secs: std::cell::Cell<Option<f64>>,
    /// The draft models loaded beside it (speculative decoding), the least
    /// recently used first: their memory is counted with this model's, and
    /// they go when this does. Several, so that requests naming different
    /// drafts do not load them again in turn.
    pub draft_models: RefCell<Vec<AttachedDraft>>,
    /// LoRA adapters loaded on it, by directory (loaded on first use, kept
    /// while it stays loaded).
    pub adapters: RefCell<std::collections::BTreeMap<std::path::PathBuf, std::rc::Rc<lora::LoraAdapter>>>,
    /// llguidance's view of the tokenizer, for constrained requests (built
    /// on the first one: a trie of every token's bytes).
    constraints: std::cell::OnceCell<Result<Arc<llguidance::ParserFactory>, String>>,
}

/// A draft model resident beside its target ([`Model::draft_models`]).
pub struct AttachedDraft {
    /// Its canonical name.
    pub name: String,
    pub model: std::rc::Rc<Model>,
    /// What it took at load (counted in its target's memory).
    pub bytes: u64,
}

impl Model {
    /// The parser factory for this model's constrained requests.
    pub fn constraint_factory(&self) -> Result<Arc<llguidance::ParserFactory>, String> {
        self.constraints
            .get_or_init(|| {
                let eos: Vec<u32> = self.eos_ids.iter().copied().collect();
                tokenizer::constraint_factory(&self.prompter.tokenizer, &eos)
                    .map_err(|e| format!("this model's tokenizer cannot be used for constraints: {e:#}"))
            })
            .clone()
    }

    /// Assembles a loaded model (on the engine thread: it may hold a
    /// compiled function).
    pub fn new(
        lm: Box<dyn LanguageModel>,
        tokenizer: Tokenizer,
        template: ChatTemplate,
        eos_ids: BTreeSet<u32>,
        media_tower: Option<MediaTower>,
    ) -> Self {
        let prompter = Arc::new(prompt::Prompter { tokenizer, template });
        let compiled_decode = lm.decode_graph().map(|g| RefCell::new(CompiledDecode::new(g)));
        Self {
            lm,
            prompter,
            eos_ids,
            media_tower,
            compiled_decode,
            kv_bytes_per_position: 0,
            state_layout: Vec::new(),
            kv_shapes: Vec::new(),
            kv_block_bytes_per_position: 0,
            kv_dtype: mlx_rs::Dtype::Float32,
            kv_root: None,
            batch_weights: layers::BatchWeights::Packed,
            warm_pending: RefCell::default(),
            adapters: Default::default(),
            drafts: Default::default(),
            draft_evidence: Default::default(),
            draft_models: RefCell::default(),
            draft_secs: Default::default(),
            constraints: Default::default(),
        }
    }

    /// The acceptance rate a new sequence's drafts start from: its recent
    /// sequences' accepted drafted tokens against rejected drafts, with
    /// one of each assumed (0.5 before any sequence drafted).
    pub fn draft_prior(&self) -> f64 {
        let (accepted, rejected) = self.draft_evidence.get();
        (accepted + 1.0) / (accepted + rejected + 2.0)
    }

    /// Folds a finished sequence's drafts into [`Self::draft_prior`]'s
    /// evidence; older sequences count half as much per sequence since.
    pub fn record_drafts(&self, accepted: u32, rejected: u32) {
        if accepted + rejected == 0 {
            return;
        }
        let (a, r) = self.draft_evidence.get();
        self.draft_evidence.set((a * 0.5 + f64::from(accepted), r * 0.5 + f64::from(rejected)));
    }

    /// How this model's decode steps are built when `wanted`: compiled only
    /// when the language model has a decode graph.
    pub fn decode_mode(&self, wanted: DecodeMode) -> DecodeMode {
        if self.compiled_decode.is_some() {
            wanted
        } else {
            DecodeMode::Eager
        }
    }

    /// Logits `[1, vocab]` after decoding token `ids` (`[1, 1]`) at the next
    /// position of `cache`, lazily, built as `decode_mode(mode)` says.
    pub fn decode_logits(
        &self,
        ids: &mlx_rs::Array,
        cache: &mut KvCache,
        media: &positions::MediaPositions,
        mode: DecodeMode,
    ) -> Result<mlx_rs::Array> {
        match &self.compiled_decode {
            // Only plain decoders have a compiled graph: no media positions.
            Some(compiled) if mode == DecodeMode::Compiled => compiled.borrow_mut().step(ids, cache),
            _ => self.lm.logits(&self.lm.forward(&self.lm.embed(ids)?, cache, media)?),
        }
    }

    /// The adapter in `dir` (served as `name`) on this model, loaded now
    /// if it is not yet; refused with a sentence when it does not fit.
    pub fn adapter(&self, name: &str, dir: &std::path::Path) -> anyhow::Result<std::rc::Rc<lora::LoraAdapter>> {
        if let Some(a) = self.adapters.borrow().get(dir) {
            return Ok(a.clone());
        }
        let Some(shapes) = self.lm.projection_shapes() else {
            anyhow::bail!(
                "this model ({}{}) does not serve LoRA adapters; fuse the adapter (`mlx_lm fuse`) and serve the fused model",
                self.lm.architecture(),
                if self.lm.split_description().is_some() { ", split over a group" } else { "" }
            );
        };
        let base = |layer: usize, which: usize| self.lm.projection_weight(layer, which);
        let adapter = std::rc::Rc::new(lora::LoraAdapter::load(name, dir, &shapes, &base, self.kv_dtype)?);
        tracing::info!(adapter = %name, rank = adapter.rank, dora = adapter.dora, bytes = adapter.bytes, "adapter loaded");
        self.adapters.borrow_mut().insert(dir.to_path_buf(), adapter.clone());
        Ok(adapter)
    }

    /// Bytes of the adapters loaded on it.
    pub fn adapter_bytes(&self) -> u64 {
        self.adapters.borrow().values().map(|a| a.bytes).sum()
    }

    /// KV bytes one position takes, its keys and values kept as `q` says:
    /// quantized, each value's bits plus its group's scale and bias in the
    /// cache's own dtype.
    pub fn kv_bytes_per_position_as(&self, q: Option<KvQuantization>) -> u64 {
        let Some(q) = q else { return self.kv_bytes_per_position };
        let values: u64 = self.kv_shapes.iter().map(|&(h, d)| 2 * (h * d) as u64).sum();
        if values == 0 {
            return self.kv_bytes_per_position;
        }
        let full = self.kv_bytes_per_position as f64 / values as f64;
        (values as f64 * q.bytes_per_value(full)).ceil() as u64
    }

    /// Runs one token through the model: materializes the (lazily
    /// dequantized) weights, dense copies included, so load time and memory
    /// are accounted at load,
    /// and MLX's first-use costs are not paid by the first request. Also
    /// measures what one KV position costs (the cache's bytes over its
    /// capacity), so no family has to state its KV layout.
    pub fn warm_up(&mut self) -> Result<()> {
        let ids = mlx_rs::Array::from_slice(&[0u32], &[1, 1]);
        let mut cache = KvCache::new(self.lm.num_layers());
        let h = self.lm.forward(&self.lm.embed(&ids)?, &mut cache, &positions::MediaPositions::default())?;
        self.lm.logits(&h)?.eval()?;
        self.kv_bytes_per_position = cache.nbytes() / cache.capacity().max(1) as u64;
        self.state_layout = kv_cache::state_layout(cache.states());
        self.kv_shapes = cache.kv_shapes();
        if !self.kv_shapes.is_empty() {
            let block = cache.positions(0, 0, 1)?;
            self.kv_block_bytes_per_position = block.nbytes() as u64;
            self.kv_dtype = block.dtype();
        }
        Ok(())
    }

    /// Traces the compiled decode step now, at load, when decode steps are
    /// built `mode`: MLX compiles a new graph's fused kernels on its first
    /// run (seconds on a CPU, where it runs the C++ compiler, cached under
    /// MLX's temp directory after), which would otherwise land in the first
    /// request's decode time and its tokens per second.
    pub fn warm_decode(&self, mode: DecodeMode) -> Result<()> {
        let Some(compiled) = self.compiled_decode.as_ref().filter(|_| mode == DecodeMode::Compiled) else {
            return Ok(());
        };
        let t = std::time::Instant::now();
        let mut cache = KvCache::new(self.lm.num_layers());
        let ids = mlx_rs::Array::from_slice(&[0u32], &[1, 1]);
        // A prompt's position first, as a request has, then one step.
        self.lm.forward(&self.lm.embed(&ids)?, &mut cache, &positions::MediaPositions::default())?.eval()?;
        compiled.borrow_mut().step(&ids, &mut cache)?.eval()?;
        tracing::debug!(ms = t.elapsed().as_secs_f64() * 1000.0, "compiled decode step traced");
        Ok(())
    }

    /// Runs the batched paths once at `rows` rows (padded batched
    /// prefill, batched decode steps, a row leaving and one joining, a
    /// sampled pick): on a GPU, MLX compiles kernels (NVRTC, ~5 s each on
    /// an H200) at their first use, which a first burst of clients would
    /// otherwise wait for (40 s on an 8B shape, 99 s on SmolLM2, issue "The
    /// GPU step at real sizes"). Kept in MLX's kernel cache under the
    /// daemon's home, a restarted daemon finds them compiled. With dense
    /// copies, the first batched step also materializes them.
    /// `sampled` picks a token from one row's logits as a sampled request
    /// does (the engine's sampler: the model sits below it).
    pub fn warm_batches(&self, rows: i32, sampled: &dyn Fn(&mlx_rs::Array) -> Result<mlx_rs::Array>) -> Result<()> {
        use mlx_rs::ops::indexing::{argmax_axis, IndexOp};
        let plain = positions::MediaPositions::default();
        let t = std::time::Instant::now();
        let n = rows.max(2);
        // Row i is padded by i % 2 positions, as prompts of two lengths are.
        let pads: Vec<i32> = (0..n).map(|i| i % 2).collect();
        let mut cache = KvCache::batch(self.lm.num_layers(), pads);
        let ids = mlx_rs::Array::from_slice(&vec![0u32; (n * 3) as usize], &[n, 3]);
        let h = self.lm.forward(&self.lm.embed(&ids.index((.., 0..2)))?, &mut cache, &plain)?;
        h.eval()?;
        let h = self.lm.forward(&self.lm.embed(&ids.index((.., 2..3)))?, &mut cache, &plain)?;
        let mut next = argmax_axis(&self.lm.logits(&h)?, -1, None)?.reshape(&[-1, 1])?;
        for _ in 0..2 {
            let logits = self.lm.logits(&self.lm.forward(&self.lm.embed(&next)?, &mut cache, &plain)?)?;
            next = argmax_axis(&logits, -1, None)?.reshape(&[-1, 1])?;
            next.eval()?;
        }
        // A sampled row's pick.
        let logits = self.lm.logits(&self.lm.forward(&self.lm.embed(&next)?, &mut cache, &plain)?)?;
        sampled(&logits.index((0..1, ..)))?.eval()?;
        // The first row leaves; a row prefilled alone joins.
        cache.keep_rows(&(1..n as usize).collect::<Vec<_>>())?;
        let mut alone = KvCache::new(self.lm.num_layers());
        self.lm.forward(&self.lm.embed(&ids.index((0..1, ..)))?, &mut alone, &plain)?.eval()?;
        cache.join(alone)?;
        let logits = self.lm.logits(&self.lm.forward(&self.lm.embed(&next)?, &mut cache, &plain)?)?;
        let next = argmax_axis(&logits, -1, None)?.reshape(&[-1, 1])?;
        next.eval()?;
        // Rows forgetting different numbers of positions (speculation's
        // rejected drafts) realign by a gather over the cache, which the
        // next step evaluates: on a GPU its kernel builds at first use, and
        // that held a 16-client batch for 9 s (an H100, a verify pass in a
        // batch: docs/measurements/h100-2026-12-06-rows.md).
        if self.lm.verifies_drafts() {
            let forget: Vec<i32> = (0..n).map(|i| i32::from(i == 0)).collect();
            anyhow::ensure!(cache.trim_rows(&forget)?, "the warmed cache could not forget {forget:?} positions");
            let logits = self.lm.logits(&self.lm.forward(&self.lm.embed(&next)?, &mut cache, &plain)?)?;
            argmax_axis(&logits, -1, None)?.eval()?;
            // A quantized cache (a request's kv_bits) realigns its packed
            // values with a gather of their own dtype: best effort, once
            // (the kernel is the same at every row count).
            if rows == 2 {
                if let Err(e) = self.warm_quantized_realignment() {
                    tracing::debug!(error = %format!("{e:#}"), "a quantized cache's realignment was not warmed");
                }
            }
        }
        tracing::info!(ms = t.elapsed().as_secs_f64() * 1000.0, rows = n, "batched paths warmed");
        Ok(())
    }

    /// Realigns the rows of a two-row cache quantized at 8 bits (as a
    /// batched verify pass under a request's `kv_bits` does) and runs the
    /// step after it, where the family reads a quantized cache and a group
    /// size divides its heads: the packed values' gather is built now.
    /// False where it does not apply (after [`Self::warm_up`], which
    /// measures the heads).
    pub fn warm_quantized_realignment(&self) -> Result<bool> {
        let Some(group_size) = [64, 32].into_iter().find(|g| self.kv_shapes.iter().all(|&(_, d)| d % g == 0)) else {
            return Ok(false);
        };
        if !self.lm.reads_quantized_kv() || self.lm.recurrent() || self.kv_shapes.is_empty() {
            return Ok(false);
        }
        let plain = positions::MediaPositions::default();
        let mut cache = KvCache::batch(self.lm.num_layers(), vec![0, 1]);
        cache.quantization = Some(KvQuantization { bits: 8, key_bits: 8, group_size, start: 0, rotate: false });
        let ids = mlx_rs::Array::from_slice(&[0u32; 6], &[2, 3]);
        self.lm.forward(&self.lm.embed(&ids)?, &mut cache, &plain)?.eval()?;
        // Quantized where mlx-lm quantizes: after a single position.
        let next = mlx_rs::Array::from_slice(&[0u32; 2], &[2, 1]);
        self.lm.forward(&self.lm.embed(&next)?, &mut cache, &plain)?.eval()?;
        anyhow::ensure!(cache.is_quantized(), "the warmed cache was not quantized");
        anyhow::ensure!(cache.trim_rows(&[1, 0])?, "the warmed quantized cache could not forget a position");
        self.lm.logits(&self.lm.forward(&self.lm.embed(&next)?, &mut cache, &plain)?)?.eval()?;
        Ok(true)
    }

    /// Token ids of a prompt text (special tokens in the text are honoured,
    /// no BOS added: chat templates write it themselves).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        self.prompter.encode(text)
    }
}

/// A token's text, or empty for none.
pub fn token_text(tokenizer: &Tokenizer, id: Option<u32>) -> String {
    id.and_then(|id| tokenizer.id_to_token(id)).unwrap_or_default()
}

/// Reads a JSON file; `None` when it does not exist.
pub fn read_json(path: &Path) -> Result<Option<serde_json::Value>> {
    match std::fs::read_to_string(path) {
        Ok(t) => Ok(Some(serde_json::from_str(&t).with_context(|| format!("parsing {}", path.display()))?)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
    }
}

/// Ids from a JSON int or list of ints.
pub fn ids_of(v: Option<&serde_json::Value>) -> Vec<u32> {
    match v {
        Some(serde_json::Value::Number(n)) => n.as_u64().map(|n| vec![n as u32]).unwrap_or_default(),
        Some(serde_json::Value::Array(a)) => a.iter().filter_map(|x| x.as_u64()).map(|n| n as u32).collect(),
        _ => Vec::new(),
    }
}

/// A token given as a string or as `{"content": ...}` in tokenizer_config.json.
pub fn special_token(cfg: &serde_json::Value, key: &str) -> Option<String> {
    match cfg.get(key)? {
        serde_json::Value::String(s) => Some(s.clone()),
        v => v.get("content").and_then(|c| c.as_str()).map(String::from),
    }
}

/// Tokenizer, chat template and stop ids of an HF/MLX model directory.
pub fn chat_parts(dir: &Path, config: &serde_json::Value) -> Result<(Tokenizer, ChatTemplate, BTreeSet<u32>)> {
    let tokenizer = tokenizer::from_file(&dir.join("tokenizer.json"))?;
    let tok_cfg = read_json(&dir.join("tokenizer_config.json"))?.unwrap_or_default();
    let source = match std::fs::read_to_string(dir.join("chat_template.jinja")) {
        Ok(s) => s,
        Err(_) => tok_cfg.get("chat_template").and_then(|t| t.as_str()).unwrap_or(chat_template::CHATML).to_string(),
    };
    let bos = special_token(&tok_cfg, "bos_token").unwrap_or_default();
    let eos = special_token(&tok_cfg, "eos_token").unwrap_or_default();
    let mut eos_ids: BTreeSet<u32> = ids_of(config.get("eos_token_id")).into_iter().collect();
    if let Some(gen) = read_json(&dir.join("generation_config.json"))? {
        eos_ids.extend(ids_of(gen.get("eos_token_id")));
    }
    eos_ids.extend(tokenizer.token_to_id(&eos));
    let template = ChatTemplate::new(source, bos, eos)?;
    Ok((tokenizer, template, eos_ids))
}
