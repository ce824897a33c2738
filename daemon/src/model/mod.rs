//! A servable model: transformer weights, tokenizer, chat template and stop
//! tokens, loaded from a GGUF file or an HF/MLX directory.

pub mod chat_template;
pub mod config;
pub mod decode_step;
pub mod export;
pub mod gemma3_text;
pub mod gguf;
pub mod layers;
pub mod prompt;
pub mod tokenizer;
pub mod transformer;
pub mod weights;

use crate::options::ModelOptions;
use anyhow::{bail, Context, Result};
use chat_template::ChatTemplate;
use config::TextConfig;
use std::cell::RefCell;
use std::collections::BTreeSet;
use std::path::Path;
use tokenizers::Tokenizer;
use transformer::Transformer;
use weights::TensorMap;

/// The network that turns prompt embeddings into next-token logits.
pub enum Backbone {
    /// Llama / Qwen2 / Qwen3 text decoders.
    Decoder(Transformer),
    /// Gemma 3 with its vision tower.
    Gemma3(Box<crate::vision::gemma3_vlm::Gemma3Vlm>),
    /// Qwen2.5-VL: a Qwen2 decoder with multimodal rope, and its tower.
    Qwen25Vl(Box<crate::vision::qwen25_vl::Qwen25Vlm>),
}

impl Backbone {
    /// Token embeddings `[1, L, hidden]` of ids `[1, L]`.
    pub fn embed(&self, ids: &mlx_rs::Array) -> Result<mlx_rs::Array> {
        match self {
            Backbone::Decoder(t) => t.embed(ids),
            Backbone::Gemma3(v) => v.text.embed(ids),
            Backbone::Qwen25Vl(v) => v.text.embed(ids),
        }
    }

    /// Embeddings through the layers (appending to `cache`).
    pub fn hidden(&self, embeds: &mlx_rs::Array, cache: &mut transformer::KvCache) -> Result<mlx_rs::Array> {
        match self {
            Backbone::Decoder(t) => t.hidden(embeds, cache),
            Backbone::Gemma3(v) => v.text.hidden(embeds, cache),
            Backbone::Qwen25Vl(v) => v.text.hidden(embeds, cache),
        }
    }

    /// Prompt positions through the layers during prefill; `ids` is the
    /// whole prompt, so image positions can see their whole image.
    pub fn prefill(
        &self,
        embeds: &mlx_rs::Array,
        cache: &mut transformer::KvCache,
        ids: &[u32],
    ) -> Result<mlx_rs::Array> {
        match self {
            Backbone::Gemma3(v) if v.bidirectional_images => {
                v.text.hidden_with_blocks(embeds, cache, Some(&v.image_blocks(ids)))
            }
            _ => self.hidden(embeds, cache),
        }
    }

    /// Where a prefill chunk starting at `from` may end (at most `to`, never
    /// inside an image whose positions must see each other).
    pub fn chunk_end(&self, ids: &[u32], from: usize, to: usize, chunk: usize) -> usize {
        let mut end = (from + chunk).min(to);
        if let Backbone::Gemma3(v) = self {
            if v.bidirectional_images {
                while end < to && end > 0 && ids[end] == v.image_token_id && ids[end - 1] == v.image_token_id {
                    end += 1;
                }
            }
        }
        end
    }

    /// Logits `[vocab]` of the last position.
    pub fn logits_last(&self, hidden: &mlx_rs::Array) -> Result<mlx_rs::Array> {
        match self {
            Backbone::Decoder(t) => t.logits_last(hidden),
            Backbone::Gemma3(v) => v.text.logits_last(hidden),
            Backbone::Qwen25Vl(v) => v.text.logits_last(hidden),
        }
    }

    /// Layers, i.e. KV cache slots.
    pub fn num_layers(&self) -> usize {
        match self {
            Backbone::Decoder(t) => t.config.num_layers as usize,
            Backbone::Gemma3(v) => v.text.num_layers(),
            Backbone::Qwen25Vl(v) => v.text.config.num_layers as usize,
        }
    }

    /// Longest prompt plus answer, in tokens.
    pub fn context_length(&self) -> u32 {
        match self {
            Backbone::Decoder(t) => t.config.context_length,
            Backbone::Gemma3(v) => v.text.config.max_position_embeddings,
            Backbone::Qwen25Vl(v) => v.text.config.context_length,
        }
    }

    /// Architecture name for listings.
    pub fn architecture(&self) -> &'static str {
        match self {
            Backbone::Decoder(t) => t.config.architecture.name(),
            Backbone::Gemma3(_) => "gemma3",
            Backbone::Qwen25Vl(_) => "qwen2_5_vl",
        }
    }
}

/// What a vision-language model needs besides its weights.
pub struct VisionSpec {
    /// Stable text of the preprocessing parameters (feature-store key part).
    pub preprocess_key: String,
    /// Fixed-size resize + normalize (Gemma 3); Qwen2.5-VL resizes per image.
    pub preprocess: Option<crate::vision::image::Preprocess>,
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
}

impl VisionSpec {
    /// The prompt with its `i`-th placeholder replaced by the expansion for
    /// an image of `rows[i]` feature rows. The caller has checked that the
    /// prompt holds exactly `rows.len()` placeholders.
    pub fn expand(&self, prompt: &str, rows: &[usize]) -> String {
        let mut expanded = String::with_capacity(prompt.len() + rows.iter().sum::<usize>() * self.image_token.len());
        let mut rest = prompt;
        for &n in rows {
            let at = rest.find(self.placeholder.as_str()).expect("one placeholder per image, checked by the caller");
            expanded.push_str(&rest[..at]);
            expanded.push_str(&self.expansion_prefix);
            expanded.push_str(&self.image_token.repeat(n));
            expanded.push_str(&self.expansion_suffix);
            rest = &rest[at + self.placeholder.len()..];
        }
        expanded.push_str(rest);
        expanded
    }
}

/// Everything needed to answer a chat request with one model.
pub struct TextModel {
    pub backbone: Backbone,
    /// Template and tokenizer, shareable off the engine thread.
    pub prompter: std::sync::Arc<prompt::Prompter>,
    /// Token ids that end a generation.
    pub eos_ids: BTreeSet<u32>,
    /// Present for vision-language models.
    pub vision: Option<VisionSpec>,
    /// The compiled decode step, built on first use (engine thread only).
    pub compiled_decode: RefCell<Option<decode_step::CompiledDecode>>,
}

impl TextModel {
    /// Assembles a loaded model.
    pub fn new(
        backbone: Backbone,
        tokenizer: Tokenizer,
        template: ChatTemplate,
        eos_ids: BTreeSet<u32>,
        vision: Option<VisionSpec>,
    ) -> Self {
        let prompter = std::sync::Arc::new(prompt::Prompter { tokenizer, template });
        Self { backbone, prompter, eos_ids, vision, compiled_decode: RefCell::new(None) }
    }

    /// How this model's decode steps are built when `wanted`: compiled only
    /// for text decoders (VLM backbones build theirs op by op).
    pub fn decode_mode(&self, wanted: decode_step::DecodeMode) -> decode_step::DecodeMode {
        match &self.backbone {
            Backbone::Decoder(t) if t.has_decode_graph() => wanted,
            _ => decode_step::DecodeMode::Eager,
        }
    }

    /// Logits `[vocab]` after decoding token `ids` (`[1, 1]`) at the next
    /// position of `cache`, lazily, built as `decode_mode(mode)` says.
    pub fn decode_logits(
        &self,
        ids: &mlx_rs::Array,
        cache: &mut transformer::KvCache,
        mode: decode_step::DecodeMode,
    ) -> Result<mlx_rs::Array> {
        match &self.backbone {
            Backbone::Decoder(t) if self.decode_mode(mode) == decode_step::DecodeMode::Compiled => {
                let mut slot = self.compiled_decode.borrow_mut();
                slot.get_or_insert_with(|| decode_step::CompiledDecode::new(t)).step(ids, cache)
            }
            b => b.logits_last(&b.hidden(&b.embed(ids)?, cache)?),
        }
    }

    /// Loads a `.gguf` file or a model directory. `fingerprints` remembers
    /// tower fingerprints per weight-file identity.
    pub fn load(path: &Path, options: impl Into<ModelOptions>, fingerprints: Option<&sled::Tree>) -> Result<Self> {
        let form = options.into();
        if path.is_dir() {
            let config_text = std::fs::read_to_string(path.join("config.json"))
                .with_context(|| format!("reading {}/config.json", path.display()))?;
            let raw: serde_json::Value = serde_json::from_str(&config_text).context("parsing config.json")?;
            match raw.get("model_type").and_then(|t| t.as_str()) {
                Some("gemma3") => return crate::vision::loader::load_gemma3_dir(path, &raw, form, fingerprints),
                Some("qwen2_5_vl") => return crate::vision::loader::load_qwen25_vl_dir(path, &raw, form, fingerprints),
                _ => {}
            }
            load_dir(path, form)
        } else if path.is_file() {
            load_gguf(path, form)
        } else {
            bail!("model path {} does not exist", path.display())
        }
    }

    /// Runs one token through the model: materializes the (lazily
    /// dequantized) weights so load time and memory are accounted at load,
    /// and MLX's first-use costs are not paid by the first request.
    pub fn warm_up(&self) -> Result<()> {
        let ids = mlx_rs::Array::from_slice(&[0u32], &[1, 1]);
        let mut cache = transformer::KvCache::new(self.backbone.num_layers());
        let h = self.backbone.hidden(&self.backbone.embed(&ids)?, &mut cache)?;
        self.backbone.logits_last(&h)?.eval()?;
        Ok(())
    }

    /// Features of one decoded image: the model's own preprocessing, tower
    /// and projector (`[rows, hidden]`-like; Qwen2.5-VL keeps its grid as
    /// `[grid_h / 2, grid_w / 2, hidden]`). Fails for text-only models.
    pub fn encode_image(&self, img: &image::RgbImage) -> Result<mlx_rs::Array> {
        match (&self.backbone, &self.vision) {
            (Backbone::Gemma3(v), Some(VisionSpec { preprocess: Some(pre), .. })) => {
                let pixels = mlx_rs::Array::from_slice(&pre.apply(img), &[1, pre.height as i32, pre.width as i32, 3]);
                v.encode_image(&pixels)
            }
            (Backbone::Qwen25Vl(v), _) => v.encode_image(img),
            _ => bail!("this model has no vision tower"),
        }
    }

    /// Token ids of a prompt text (special tokens in the text are honoured,
    /// no BOS added: chat templates write it themselves).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        self.prompter.encode(text)
    }
}

pub(crate) fn token_text(tokenizer: &Tokenizer, id: Option<u32>) -> String {
    id.and_then(|id| tokenizer.id_to_token(id)).unwrap_or_default()
}

/// Loads a GGUF file (any name: ollama keeps them as content-addressed blobs).
fn load_gguf(path: &Path, form: ModelOptions) -> Result<TextModel> {
    let file = gguf::Gguf::open(path).with_context(|| format!("reading GGUF at {}", path.display()))?;
    let has_output = file.has_tensor("output.weight");
    let embd_rows = file.rows("token_embd.weight").unwrap_or(0) as i32;
    let config = TextConfig::from_gguf(&file, has_output, embd_rows)?;
    let tensors = TensorMap::from_gguf(&file, config.architecture, config.num_heads, config.num_kv_heads, form.form)?
        .with_fusion(form.fusion);
    let tokenizer = tokenizer::from_gguf(&file)?;
    let id = |key: &str| config::gguf_number(&file, key).ok().map(|v| v as u32);
    let (bos, eos, eot) =
        (id("tokenizer.ggml.bos_token_id"), id("tokenizer.ggml.eos_token_id"), id("tokenizer.ggml.eot_token_id"));
    let source =
        file.string("tokenizer.chat_template").map(str::to_string).unwrap_or_else(|| chat_template::CHATML.to_string());
    let template = ChatTemplate::new(source, token_text(&tokenizer, bos), token_text(&tokenizer, eos))?;
    let eos_ids = [eos, eot].into_iter().flatten().collect();
    let backbone = Backbone::Decoder(Transformer::from_tensors(config, tensors)?);
    Ok(TextModel::new(backbone, tokenizer, template, eos_ids, None))
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

fn load_dir(dir: &Path, form: ModelOptions) -> Result<TextModel> {
    let config_text = std::fs::read_to_string(dir.join("config.json"))
        .with_context(|| format!("reading {}/config.json", dir.display()))?;
    let config = TextConfig::from_hf_json(&config_text)?;
    let raw: serde_json::Value = serde_json::from_str(&config_text)?;
    let quantization = raw.get("quantization").or(raw.get("quantization_config"));
    let tensors = TensorMap::from_safetensors_dir(dir, quantization, form.form)?.with_fusion(form.fusion);
    let (tokenizer, template, eos_ids) = chat_parts(dir, &raw)?;
    let backbone = Backbone::Decoder(Transformer::from_tensors(config, tensors)?);
    Ok(TextModel::new(backbone, tokenizer, template, eos_ids, None))
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
