//! Gemma 4's text decoder, op for op like mlx-vlm 0.7.10's
//! `gemma4/language.py`: RMS norms that use their weight as it is (not
//! Gemma 3's `1 + weight`), q/k norms and a scale-free v norm, attention
//! scale 1, sliding-window layers (rope "default") between full layers
//! (rope "proportional": a fraction of a wider head rotated), a GELU-gated
//! MLP (twice as wide on KV-shared layers), per-layer input embeddings
//! gated into every layer, a per-layer scalar, the last layers reading the
//! keys and values of the last unshared layer of their kind, and a logit
//! soft-cap; on the mixture-of-experts shape (26B-A4B) a routed experts'
//! branch beside each dense MLP ([`super::moe`]).
//!
//! The per-layer inputs ride the embedding seam: [`LanguageModel::embed`]
//! returns rows `[B, L, hidden + layers × per_layer]` — the scaled token
//! embeddings, then the per-layer token embeddings — so a splice can give
//! media positions their features and pad-id per-layer embeddings, as
//! mlx-vlm does, and `forward` splits them again.

use super::moe::MoeBlock;
use crate::distributed::Shard;
use crate::families::gemma3::text::attend;
use crate::model::batch_attention;
use crate::model::family::{LanguageModel, MediaAttention};
use crate::model::kv_cache::KvCache;
use crate::model::layers::{from_heads, to_heads, Embedding, Linear};
use crate::model::positions::MediaPositions;
use crate::model::sharding::Split;
use crate::model::weights::TensorMap;
use anyhow::{bail, Result};
use mlx_rs::{fast, nn, ops::indexing::IndexOp, Array, Dtype};

/// `text_config` of a Gemma 4 checkpoint (mlx-vlm's `TextConfig` defaults).
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
pub struct Gemma4TextConfig {
    #[serde(default = "d_hidden")]
    pub hidden_size: i32,
    #[serde(default = "d_layers")]
    pub num_hidden_layers: i32,
    #[serde(default = "d_intermediate")]
    pub intermediate_size: i32,
    #[serde(default = "d_heads")]
    pub num_attention_heads: i32,
    #[serde(default = "d_head_dim")]
    pub head_dim: i32,
    #[serde(default = "d_global_head_dim")]
    pub global_head_dim: i32,
    #[serde(default = "d_eps")]
    pub rms_norm_eps: f32,
    #[serde(default = "d_vocab")]
    pub vocab_size: i32,
    #[serde(default = "d_kv_heads")]
    pub num_key_value_heads: i32,
    #[serde(default)]
    pub num_global_key_value_heads: Option<i32>,
    #[serde(default = "d_kv_shared")]
    pub num_kv_shared_layers: i32,
    #[serde(default = "d_per_layer")]
    pub hidden_size_per_layer_input: i32,
    #[serde(default)]
    pub rope_parameters: Option<serde_json::Value>,
    #[serde(default = "d_window")]
    pub sliding_window: i32,
    #[serde(default = "d_pattern")]
    pub sliding_window_pattern: i32,
    #[serde(default = "d_ctx")]
    pub max_position_embeddings: u32,
    #[serde(default)]
    pub attention_k_eq_v: bool,
    #[serde(default)]
    pub use_bidirectional_attention: Option<String>,
    #[serde(default = "d_softcap")]
    pub final_logit_softcapping: Option<f32>,
    #[serde(default = "d_true")]
    pub use_double_wide_mlp: bool,
    #[serde(default)]
    pub enable_moe_block: bool,
    /// The MoE shape (26B-A4B): experts per layer and how many each
    /// position uses (their width comes from the weights).
    #[serde(default)]
    pub num_experts: Option<i32>,
    #[serde(default)]
    pub top_k_experts: Option<i32>,
    #[serde(default)]
    pub layer_types: Option<Vec<String>>,
}

fn d_hidden() -> i32 {
    1536
}
fn d_layers() -> i32 {
    35
}
fn d_intermediate() -> i32 {
    6144
}
fn d_heads() -> i32 {
    8
}
fn d_head_dim() -> i32 {
    256
}
fn d_global_head_dim() -> i32 {
    512
}
fn d_eps() -> f32 {
    1e-6
}
fn d_vocab() -> i32 {
    262144
}
fn d_kv_heads() -> i32 {
    1
}
fn d_kv_shared() -> i32 {
    20
}
fn d_per_layer() -> i32 {
    256
}
fn d_window() -> i32 {
    512
}
fn d_pattern() -> i32 {
    5
}
fn d_ctx() -> u32 {
    131072
}
fn d_softcap() -> Option<f32> {
    Some(30.0)
}
fn d_true() -> bool {
    true
}

impl Gemma4TextConfig {
    /// Each layer's kind: `layer_types`, or `sliding_window_pattern - 1`
    /// sliding layers before each full one.
    pub fn sliding(&self) -> Vec<bool> {
        match &self.layer_types {
            Some(t) => t.iter().map(|k| k == "sliding_attention").collect(),
            None => (0..self.num_hidden_layers).map(|i| (i + 1) % self.sliding_window_pattern != 0).collect(),
        }
    }
}

/// How one kind of layer rotates its queries and keys.
struct Rope {
    dims: i32,
    base: Option<f32>,
    scale: f32,
    /// Proportional rope's inverse frequencies (`inf` past the rotated part).
    freqs: Option<Array>,
}

impl Rope {
    /// From `rope_parameters[kind]`, as mlx-vlm's `initialize_rope`.
    fn of(params: Option<&serde_json::Value>, dims: i32, default_theta: f32) -> Result<Self> {
        let get = |k: &str| params.and_then(|p| p.get(k)).and_then(|v| v.as_f64());
        let theta = get("rope_theta").unwrap_or(default_theta as f64) as f32;
        let kind = params.and_then(|p| p.get("rope_type").or_else(|| p.get("type"))).and_then(|v| v.as_str());
        match kind.unwrap_or("default") {
            "default" => Ok(Self { dims, base: Some(theta), scale: 1.0, freqs: None }),
            "linear" => {
                Ok(Self { dims, base: Some(theta), scale: 1.0 / get("factor").unwrap_or(1.0) as f32, freqs: None })
            }
            "proportional" => {
                let factor = get("factor").unwrap_or(1.0);
                let partial = get("partial_rotary_factor").unwrap_or(1.0);
                let angles = (partial * dims as f64 / 2.0).floor() as i32;
                // mlx-vlm: factor * base ** (arange(0, 2·angles, 2) / dims) in
                // float32, then inf for the angles left unrotated.
                let exponents = mlx_rs::ops::arange::<_, f32>(0.0, (2 * angles) as f32, 2.0)?
                    .divide(Array::from_f32(dims as f32))?;
                let rotated =
                    mlx_rs::ops::power(Array::from_f32(theta), &exponents)?.multiply(Array::from_f32(factor as f32))?;
                let rest = mlx_rs::ops::full::<f32>(&[dims / 2 - angles], Array::from_f32(f32::INFINITY))?;
                let freqs = mlx_rs::ops::concatenate(&[rotated, rest], 0)?;
                freqs.eval()?;
                Ok(Self { dims, base: None, scale: 1.0, freqs: Some(freqs) })
            }
            other => bail!("Gemma 4 rope type {other:?} is not supported (default, linear, proportional)"),
        }
    }

    fn apply(&self, x: &Array, offset: i32, row_offsets: Option<&Array>) -> Result<Array> {
        Ok(match row_offsets {
            Some(at) => fast::rope_dynamic(x, self.dims, false, self.base, self.scale, at, self.freqs.as_ref())?,
            None => fast::rope(x, self.dims, false, self.base, self.scale, offset, self.freqs.as_ref())?,
        })
    }
}

/// A layer's own key and value projections (absent on a KV-shared layer).
struct KvProj {
    k: Linear,
    /// `None`: values are the raw keys (`attention_k_eq_v` full layers).
    v: Option<Linear>,
    k_norm: Array,
    /// The cache slot it writes.
    slot: usize,
}

struct Block {
    q: Linear,
    o: Linear,
    q_norm: Array,
    kv: Option<KvProj>,
    /// For a KV-shared layer, the layer whose keys and values it reads.
    reads: usize,
    heads: i32,
    kv_heads: i32,
    gate: Linear,
    up: Linear,
    down: Linear,
    /// Whether this rank holds a block of the dense MLP's features.
    mlp_split: bool,
    input_norm: Array,
    post_attn_norm: Array,
    pre_ff_norm: Array,
    post_ff_norm: Array,
    per_layer: Option<(Linear, Linear, Array)>,
    layer_scalar: Option<Array>,
    /// The experts' branch (`enable_moe_block`).
    moe: Option<MoeBlock>,
    sliding: bool,
}

/// The per-layer input embeddings' parts.
struct PerLayer {
    width: i32,
    /// Cut by the same vocabulary blocks as the token embeddings (when
    /// its rows are the same vocabulary), else whole on every rank.
    embed_split: bool,
    embed: Embedding,
    embed_scale: Array,
    projection: Linear,
    projection_norm: Array,
}

/// A loaded Gemma 4 text decoder.
pub struct Gemma4Text {
    pub config: Gemma4TextConfig,
    embed: Embedding,
    embed_scale: Array,
    per_layer: Option<PerLayer>,
    blocks: Vec<Block>,
    norm: Array,
    sliding_rope: Rope,
    full_rope: Rope,
    kv_slots: usize,
    /// How the decoder is cut over a group (see [`Split`]).
    split: Split,
}

/// A scale as mlx-vlm multiplies it in: a Python float takes the array's
/// dtype, so bf16 weights see it rounded to bf16.
fn scale_in(value: f64, dtype: Dtype) -> Result<Array> {
    Ok(Array::from_f32(value as f32).as_dtype(dtype)?.as_dtype(Dtype::Float32)?)
}

impl Gemma4Text {
    /// Loads `prefix.model.*` (mlx-vlm's names after its sanitize); with
    /// `shard`, only this rank's part ([`Split`]: attention by heads when
    /// every layer's head counts divide, the dense MLP and each expert by
    /// features, the vocabulary and the per-layer token embeddings by
    /// blocks; routers and the small per-layer projections replicated).
    pub fn load(config: Gemma4TextConfig, t: &mut TensorMap, prefix: &str, shard: Option<&Shard>) -> Result<Self> {
        let c = &config;
        let moe_shape = match (c.enable_moe_block, c.num_experts, c.top_k_experts) {
            (false, _, _) => None,
            (true, Some(experts), Some(top_k)) => Some((experts, top_k)),
            _ => bail!("text_config.enable_moe_block without num_experts and top_k_experts"),
        };
        let sliding = c.sliding();
        if sliding.len() != c.num_hidden_layers as usize {
            bail!("text_config.layer_types names {} layers, num_hidden_layers {}", sliding.len(), c.num_hidden_layers);
        }
        let kv_counts: Vec<i32> =
            [Some(c.num_key_value_heads), c.num_global_key_value_heads.filter(|_| c.attention_k_eq_v)]
                .into_iter()
                .flatten()
                .collect();
        let mut split = Split::plan(shard, c.num_attention_heads, &kv_counts, c.intermediate_size, c.vocab_size);
        let att = split.attention;
        let n = c.num_hidden_layers as usize;
        let first_shared = n - (c.num_kv_shared_layers.max(0) as usize).min(n);
        let m = format!("{prefix}.model");
        let stored = t.float_dtype();
        let mut blocks = Vec::new();
        let mut slots = 0;
        // The last unshared layer of each kind, read by the shared ones.
        let (mut last_sliding, mut last_full) = (None, None);
        for (i, &is_sliding) in sliding.iter().enumerate() {
            let p = format!("{m}.layers.{i}");
            let full = !is_sliding;
            let k_eq_v = c.attention_k_eq_v && full;
            let kv_heads = match (k_eq_v, c.num_global_key_value_heads) {
                (true, Some(h)) => h,
                _ => c.num_key_value_heads,
            };
            let rows = |l: Linear| {
                let w = l.out_features();
                split.rows(l, w, att)
            };
            let (kv, reads) = if i < first_shared {
                let kv = KvProj {
                    k: rows(t.linear(&format!("{p}.self_attn.k_proj"))?)?,
                    v: if k_eq_v { None } else { Some(rows(t.linear(&format!("{p}.self_attn.v_proj"))?)?) },
                    k_norm: t.float(&format!("{p}.self_attn.k_norm.weight"))?,
                    slot: slots,
                };
                slots += 1;
                *(if is_sliding { &mut last_sliding } else { &mut last_full }) = Some(i);
                (Some(kv), i)
            } else {
                let source = if is_sliding { last_sliding } else { last_full };
                let Some(source) = source else {
                    bail!("Gemma 4 layer {i} shares the KV of a kind no earlier layer has")
                };
                (None, source)
            };
            let per_layer = if c.hidden_size_per_layer_input > 0 {
                Some((
                    t.linear(&format!("{p}.per_layer_input_gate"))?,
                    t.linear(&format!("{p}.per_layer_projection"))?,
                    t.float(&format!("{p}.post_per_layer_input_norm.weight"))?,
                ))
            } else {
                None
            };
            let layer_scalar =
                if t.has(&format!("{p}.layer_scalar")) { Some(t.float(&format!("{p}.layer_scalar"))?) } else { None };
            let moe = match moe_shape {
                Some((experts, top_k)) => Some(MoeBlock::load(t, &p, c.hidden_size, experts, top_k, &split)?),
                None => None,
            };
            let q = t.linear(&format!("{p}.self_attn.q_proj"))?;
            let q_width = q.out_features();
            let q = split.rows(q, q_width, att)?;
            let gate = t.linear(&format!("{p}.mlp.gate_proj"))?;
            // Twice as wide on the KV-shared layers (`use_double_wide_mlp`).
            let ff = gate.out_features();
            let down = t.linear(&format!("{p}.mlp.down_proj"))?;
            let mlp = split.mlp && split.can_cut_cols(&down, ff);
            blocks.push(Block {
                q,
                o: split.cols(t.linear(&format!("{p}.self_attn.o_proj"))?, q_width, att)?,
                q_norm: t.float(&format!("{p}.self_attn.q_norm.weight"))?,
                kv,
                reads,
                heads: split.heads(c.num_attention_heads),
                kv_heads: split.heads(kv_heads),
                gate: split.rows(gate, ff, mlp)?,
                up: split.rows(t.linear(&format!("{p}.mlp.up_proj"))?, ff, mlp)?,
                down: split.cols(down, ff, mlp)?,
                mlp_split: mlp,
                input_norm: t.float(&format!("{p}.input_layernorm.weight"))?,
                post_attn_norm: t.float(&format!("{p}.post_attention_layernorm.weight"))?,
                pre_ff_norm: t.float(&format!("{p}.pre_feedforward_layernorm.weight"))?,
                post_ff_norm: t.float(&format!("{p}.post_feedforward_layernorm.weight"))?,
                per_layer,
                layer_scalar,
                moe,
                sliding: is_sliding,
            });
        }
        let per_layer = if c.hidden_size_per_layer_input > 0 {
            let embed = t.embedding(&format!("{m}.embed_tokens_per_layer"))?;
            let embed_split = split.vocab.is_some() && embed.rows() == c.vocab_size;
            Some(PerLayer {
                width: c.hidden_size_per_layer_input,
                embed_split,
                embed: if embed_split { split.vocab_rows(embed)? } else { embed },
                embed_scale: scale_in((c.hidden_size_per_layer_input as f64).sqrt(), stored)?,
                projection: t.linear(&format!("{m}.per_layer_model_projection"))?,
                projection_norm: t.float(&format!("{m}.per_layer_projection_norm.weight"))?,
            })
        } else {
            None
        };
        let params = |kind: &str| c.rope_parameters.as_ref().and_then(|p| p.get(kind)).cloned();
        let full_dim = if c.global_head_dim > 0 { c.global_head_dim } else { c.head_dim };
        let full_default = serde_json::json!({"rope_type": "proportional", "rope_theta": 1e6});
        let full_params = params("full_attention").unwrap_or(full_default);
        if split.shard.is_some() && moe_shape.is_some() {
            let on = blocks.iter().all(|b| b.moe.as_ref().is_some_and(|m| m.split_experts));
            split.notes.push(if on { "experts split by features" } else { "experts replicated" }.to_string());
        }
        split.log();
        Ok(Self {
            embed: split.vocab_rows(t.embedding(&format!("{m}.embed_tokens"))?)?,
            embed_scale: scale_in((c.hidden_size as f64).sqrt(), stored)?,
            per_layer,
            norm: t.float(&format!("{m}.norm.weight"))?,
            sliding_rope: Rope::of(params("sliding_attention").as_ref(), c.head_dim, 10_000.0)?,
            full_rope: Rope::of(Some(&full_params), full_dim, 1e6)?,
            blocks,
            kv_slots: slots,
            split,
            config,
        })
    }

    /// Whether images attend both ways within themselves (the config's
    /// `use_bidirectional_attention: "vision"`).
    pub fn bidirectional_images(&self) -> bool {
        self.config.use_bidirectional_attention.as_deref() == Some("vision")
    }

    /// Rows `[B, L, hidden (+ layers × per_layer)]`: the token embeddings
    /// scaled by sqrt(hidden), then (E models) the per-layer token
    /// embeddings scaled by sqrt(per_layer).
    /// With the vocabulary split, each rank looks up its block (zeros for
    /// the other ids) and one sum over the ranks joins both tables' rows.
    pub fn embed_rows(&self, ids: &Array) -> Result<Array> {
        let split = &self.split;
        let e = split.lookup_part(&self.embed, ids)?.multiply(&self.embed_scale)?;
        let whole = split.vocab.is_some();
        match &self.per_layer {
            Some(p) if p.embed_split => {
                let per = split.lookup_part(&p.embed, ids)?.multiply(&p.embed_scale)?;
                split.sum(mlx_rs::ops::concatenate(&[e, per], -1)?, whole)
            }
            Some(p) => {
                let per = p.embed.lookup(ids)?.multiply(&p.embed_scale)?;
                Ok(mlx_rs::ops::concatenate(&[split.sum(e, whole)?, per], -1)?)
            }
            None => split.sum(e, whole),
        }
    }

    /// The final normed hidden states of rows from [`Self::embed_rows`]
    /// (media positions spliced in), appending to `cache`.
    pub fn hidden(&self, rows_in: &Array, cache: &mut KvCache, blocks: Option<&[i32]>) -> Result<Array> {
        let c = &self.config;
        let (rows, l) = (rows_in.shape()[0], rows_in.shape()[1]);
        let d = c.hidden_size;
        let offset = cache.offset;
        let row_offsets = cache.is_padded().then(|| cache.row_offsets());
        if row_offsets.is_some() && blocks.is_some() {
            bail!("image blocks are for a single-row prefill");
        }
        let mut h = rows_in.index((.., .., ..d));
        // mlx-vlm's project_per_layer_inputs: from the spliced embeddings.
        let per_layer_inputs = match &self.per_layer {
            Some(p) => {
                let n = c.num_hidden_layers;
                let tokens = rows_in.index((.., .., d..)).reshape(&[rows, l, n, p.width])?;
                let projected = p
                    .projection
                    .forward(&h)?
                    .multiply(Array::from_f32((d as f64).powf(-0.5) as f32))?
                    .reshape(&[rows, l, n, p.width])?;
                let projected = fast::rms_norm(&projected, Some(&p.projection_norm), c.rms_norm_eps)?;
                Some(projected.add(&tokens)?.multiply(Array::from_f32(0.5f64.sqrt() as f32))?)
            }
            None => None,
        };
        let eps = c.rms_norm_eps;
        let mut shared: Vec<Option<(Array, Array)>> = vec![None; self.blocks.len()];
        for (i, b) in self.blocks.iter().enumerate() {
            let rope = if b.sliding { &self.sliding_rope } else { &self.full_rope };
            let x = fast::rms_norm(&h, Some(&b.input_norm), eps)?;
            let q = fast::rms_norm(to_heads(&b.q.forward(&x)?, rows, l, b.heads)?, Some(&b.q_norm), eps)?;
            let q = rope.apply(&q, offset, row_offsets.as_ref())?;
            let (k, v) = match &b.kv {
                Some(kv) => {
                    let raw = to_heads(&kv.k.forward(&x)?, rows, l, b.kv_heads)?;
                    let values = match &kv.v {
                        Some(v) => to_heads(&v.forward(&x)?, rows, l, b.kv_heads)?,
                        None => raw.clone(),
                    };
                    let k = rope.apply(&fast::rms_norm(&raw, Some(&kv.k_norm), eps)?, offset, row_offsets.as_ref())?;
                    let v = fast::rms_norm(&values, None::<&Array>, eps)?;
                    let kv_view = cache.update(kv.slot, k, v)?;
                    shared[i] = Some(kv_view.clone());
                    kv_view
                }
                None => shared[b.reads].clone().expect("a shared layer reads an earlier layer"),
            };
            let window = b.sliding.then_some(c.sliding_window);
            let o = match batch_attention::padded(&q, &k, &v, 1.0, cache, offset, window)? {
                Some(o) => o,
                None => attend(&q, k, v, 1.0, window, offset, blocks)?,
            };
            let o = self.split.sum(b.o.forward(&from_heads(&o)?)?, self.split.attention)?;
            let r = fast::rms_norm(&o, Some(&b.post_attn_norm), eps)?;
            let h2 = h.add(&r)?;
            let x = fast::rms_norm(&h2, Some(&b.pre_ff_norm), eps)?;
            let m = b.down.forward(&nn::gelu_approximate(b.gate.forward(&x)?)?.multiply(b.up.forward(&x)?)?)?;
            let m = match &b.moe {
                Some(moe) => {
                    let (m, e) = self.sum_pair(m, b.mlp_split, moe.experts_unnormed(&h2, eps)?, moe.split_experts)?;
                    fast::rms_norm(&m, Some(&moe.post_dense_norm), eps)?.add(moe.finish(&e, eps)?)?
                }
                None => self.split.sum(m, b.mlp_split)?,
            };
            h = h2.add(fast::rms_norm(&m, Some(&b.post_ff_norm), eps)?)?;
            if let (Some((gate, projection, norm)), Some(inputs)) = (&b.per_layer, &per_layer_inputs) {
                let mine = inputs.index((.., .., i as i32, ..));
                let g = nn::gelu_approximate(gate.forward(&h)?)?.multiply(&mine)?;
                h = h.add(fast::rms_norm(projection.forward(&g)?, Some(norm), eps)?)?;
            }
            if let Some(s) = &b.layer_scalar {
                h = h.multiply(s)?;
            }
        }
        cache.offset += l;
        Ok(fast::rms_norm(&h, Some(&self.norm), eps)?)
    }

    /// The dense MLP's and the experts' outputs each summed over the ranks
    /// where split: one collective for both (side by side) when both are.
    fn sum_pair(&self, m: Array, m_split: bool, e: Array, e_split: bool) -> Result<(Array, Array)> {
        if m_split && e_split {
            let d = m.shape()[m.ndim() - 1];
            let both = self.split.sum(mlx_rs::ops::concatenate(&[&m, &e], -1)?, true)?;
            return Ok((both.index((.., .., ..d)), both.index((.., .., d..))));
        }
        Ok((self.split.sum(m, m_split)?, self.split.sum(e, e_split)?))
    }

    /// Soft-capped logits `[B, vocab]` of each row's last position.
    pub fn logits_last(&self, hidden: &Array) -> Result<Array> {
        let (rows, l) = (hidden.shape()[0], hidden.shape()[1]);
        let last = if l == 1 { hidden.clone() } else { hidden.index((.., l - 1.., ..)) };
        let mut logits = self.split.gather_vocab(self.embed.as_linear(&last)?.reshape(&[rows, -1])?)?;
        if let Some(cap) = self.config.final_logit_softcapping {
            let cap = Array::from_f32(cap);
            logits = mlx_rs::ops::tanh(&logits.divide(&cap)?)?.multiply(&cap)?;
        }
        Ok(logits.reshape(&[rows, -1])?)
    }
}

impl LanguageModel for Gemma4Text {
    fn architecture(&self) -> &'static str {
        "gemma4"
    }

    /// KV slots: the layers with their own keys and values.
    fn num_layers(&self) -> usize {
        self.kv_slots
    }

    fn context_length(&self) -> u32 {
        self.config.max_position_embeddings
    }

    /// Wide rows (see the module doc): token embeddings, already scaled,
    /// then the per-layer token embeddings.
    fn embed(&self, ids: &Array) -> Result<Array> {
        self.embed_rows(ids)
    }

    fn forward(&self, embeds: &Array, cache: &mut KvCache, media: &MediaPositions) -> Result<Array> {
        self.hidden(embeds, cache, media.image_blocks.filter(|_| self.bidirectional_images()))
    }

    fn split_description(&self) -> Option<String> {
        self.split.describe()
    }

    fn logits(&self, hidden: &Array) -> Result<Array> {
        self.logits_last(hidden)
    }

    fn media_attention(&self) -> MediaAttention {
        if self.bidirectional_images() {
            MediaAttention::BidirectionalWithinImage
        } else {
            MediaAttention::Causal
        }
    }
}
