//! The decoder-only transformer shared by Llama, Qwen2 and Qwen3, written
//! op for op like mlx-lm's `llama.py`/`qwen2.py`/`qwen3.py` so that greedy
//! token ids match the reference exactly on the same weights.

use super::config::{Architecture, TextConfig};
use crate::distributed::Shard;
use crate::model::batch_attention;
use crate::model::family::{DecodeGraph, LanguageModel};
use crate::model::kv_cache::{KvCache, KvView};
use crate::model::layers::{from_heads, swiglu, to_heads, Embedding, FusedLinear, Linear, RmsNormed};
use crate::model::lora::Group;
use crate::model::positions::{MediaPositions, MropePositions};
use crate::model::qk_rope::QkRope;
use crate::model::quantized_attention;
use crate::model::sharding::Split;
use crate::model::w4a16;
use crate::model::weights::TensorMap;
use anyhow::{bail, Result};
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{
    fast::{self, ScaledDotProductAttentionMask},
    Array,
};

#[derive(Clone)]
struct Attention {
    /// q, k and v projections.
    qkv: FusedLinear,
    o_proj: Linear,
    /// Qwen3 only.
    q_norm: Option<Array>,
    k_norm: Option<Array>,
}

#[derive(Clone)]
struct Mlp {
    /// gate and up projections.
    gate_up: FusedLinear,
    down_proj: Linear,
}

#[derive(Clone)]
struct DecoderLayer {
    attn: Attention,
    mlp: Mlp,
    input_layernorm: Array,
    post_attention_layernorm: Array,
}

/// A loaded text model. Cloning shares the weights (MLX arrays are handles).
#[derive(Clone)]
pub struct Transformer {
    pub config: TextConfig,
    embed_tokens: Embedding,
    layers: Vec<DecoderLayer>,
    norm: Array,
    /// `None` when tied to the embedding.
    lm_head: Option<Linear>,
    /// Llama 3 rope frequencies (otherwise plain `rope_theta`).
    rope_freqs: Option<Array>,
    scale: f32,
    /// This rank's query and key/value heads (all of them unless sharded).
    heads: i32,
    kv_heads: i32,
    /// How the model is cut over a group ([`Split::whole`] when it is not).
    split: Split,
    /// The settings of the one-kernel norm and rope of decode steps.
    qk_rope: QkRope,
}

impl Transformer {
    /// Builds the model from tensors under HF names; with `shard`, only
    /// this rank's part (see [`Split`]).
    pub fn from_tensors(config: TextConfig, mut t: TensorMap, shard: Option<&Shard>) -> Result<Self> {
        let qk_norm = config.architecture == Architecture::Qwen3;
        let split =
            Split::plan(shard, config.num_heads, &[config.num_kv_heads], config.intermediate_size, config.vocab_size);
        let (heads, kv_heads) = (split.heads(config.num_heads), split.heads(config.num_kv_heads));
        let (attn_on, mlp_on) = (split.attention, split.mlp);
        let (hd, ff) = (config.head_dim, config.intermediate_size);
        let mut layers = Vec::with_capacity(config.num_layers as usize);
        for i in 0..config.num_layers {
            let p = format!("model.layers.{i}");
            layers.push(DecoderLayer {
                attn: Attention {
                    qkv: FusedLinear::new(
                        vec![
                            split.rows(t.linear(&format!("{p}.self_attn.q_proj"))?, config.num_heads * hd, attn_on)?,
                            split.rows(
                                t.linear(&format!("{p}.self_attn.k_proj"))?,
                                config.num_kv_heads * hd,
                                attn_on,
                            )?,
                            split.rows(
                                t.linear(&format!("{p}.self_attn.v_proj"))?,
                                config.num_kv_heads * hd,
                                attn_on,
                            )?,
                        ],
                        t.fusion,
                    )?,
                    o_proj: split.cols(t.linear(&format!("{p}.self_attn.o_proj"))?, config.num_heads * hd, attn_on)?,
                    q_norm: if qk_norm { Some(t.float(&format!("{p}.self_attn.q_norm.weight"))?) } else { None },
                    k_norm: if qk_norm { Some(t.float(&format!("{p}.self_attn.k_norm.weight"))?) } else { None },
                },
                mlp: Mlp {
                    gate_up: FusedLinear::new(
                        vec![
                            split.rows(t.linear(&format!("{p}.mlp.gate_proj"))?, ff, mlp_on)?,
                            split.rows(t.linear(&format!("{p}.mlp.up_proj"))?, ff, mlp_on)?,
                        ],
                        t.fusion,
                    )?,
                    down_proj: split.cols(t.linear(&format!("{p}.mlp.down_proj"))?, ff, mlp_on)?,
                },
                input_layernorm: t.float(&format!("{p}.input_layernorm.weight"))?,
                post_attention_layernorm: t.float(&format!("{p}.post_attention_layernorm.weight"))?,
            });
            // Materialize layer by layer: the fused matrices replace their
            // parts now (not at the first request), and the parts' memory is
            // released before the next layer is read.
            let l = layers.last().unwrap();
            mlx_rs::transforms::eval(l.attn.qkv.arrays().into_iter().chain(l.mlp.gate_up.arrays()))?;
        }
        let lm_head =
            if !config.tie_word_embeddings && t.has("lm_head.weight") { Some(t.linear("lm_head")?) } else { None };
        let lm_head = lm_head.map(|h| split.vocab_head(h)).transpose()?;
        let embed_tokens = split.vocab_rows(t.embedding("model.embed_tokens")?)?;
        split.log();
        let rope_freqs = config.rope_scaling.as_ref().map(|s| llama3_rope_freqs(&config, s));
        let scale = (config.head_dim as f64).powf(-0.5) as f32;
        let qk_rope = QkRope::new(heads, kv_heads, hd, config.rope_theta, rope_freqs.as_ref(), config.rms_norm_eps)?;
        Ok(Self {
            qk_rope,
            embed_tokens,
            norm: t.float("model.norm.weight")?,
            layers,
            lm_head,
            rope_freqs,
            scale,
            heads,
            kv_heads,
            split,
            config,
        })
    }

    /// Bytes of all weights.
    pub fn nbytes(&self) -> usize {
        let per_layer: usize = self
            .layers
            .iter()
            .map(|l| {
                l.attn.qkv.nbytes()
                    + l.attn.o_proj.nbytes()
                    + l.mlp.gate_up.nbytes()
                    + l.mlp.down_proj.nbytes()
                    + l.input_layernorm.nbytes()
                    + l.post_attention_layernorm.nbytes()
            })
            .sum();
        per_layer + self.embed_tokens.nbytes() + self.lm_head.as_ref().map_or(0, |h| h.nbytes()) + self.norm.nbytes()
    }

    /// Token embeddings `[B, L, hidden]` of ids `[B, L]` (with the
    /// vocabulary split, each rank's block summed: [`Split::lookup`]).
    pub fn embed(&self, ids: &Array) -> Result<Array> {
        self.split.lookup(&self.embed_tokens, ids)
    }

    /// Runs embeddings `[B, L, hidden]` through the layers, appending to
    /// `cache`; returns the final hidden states (before the last norm).
    pub fn hidden(&self, embeds: &Array, cache: &mut KvCache, media: &MediaPositions) -> Result<Array> {
        let len = embeds.shape()[1];
        let mut h = embeds.clone();
        let offset = cache.offset;
        // Padded rows each start their positions after their padding.
        let row_offsets = cache.is_padded().then(|| cache.row_offsets());
        if row_offsets.is_some() && self.config.mrope_section.is_some() {
            bail!("a batch of padded rows with multimodal rope is not supported yet");
        }
        let step_position = (len == 1 && row_offsets.is_none() && crate::model::options::cuda_available())
            .then(|| Array::from_slice(&[offset], &[1]));
        let at = match &row_offsets {
            Some(rows) => Position::Rows(rows),
            None => Position::Fixed(offset, step_position.as_ref()),
        };
        // The LoRA adapters the rows run under, if any.
        let adapters = cache.lora()?;
        for (i, layer) in self.layers.iter().enumerate() {
            let lora = Some((&adapters, i)).filter(|_| adapters.adapts(i));
            let h2 =
                self.attention(&layer.attn, self.normed(&h, &layer.input_layernorm), cache, media.mrope, i, at, lora)?;
            h = self.mlp(&layer.mlp, self.normed(&h2, &layer.post_attention_layernorm), lora)?;
            if let Some(deepstack) = media.deepstack {
                if let Some(added) = deepstack.addend(i, offset, len)? {
                    h = h.add(&added)?;
                }
            }
        }
        cache.offset += len;
        Ok(h)
    }

    /// `rms_norm(x)` with the model's epsilon and `weight`, left for the
    /// projection that reads it to build (or to apply in its kernel).
    fn normed<'a>(&self, x: &'a Array, weight: &'a Array) -> RmsNormed<'a> {
        RmsNormed { input: x, weight, eps: self.config.rms_norm_eps }
    }

    /// Logits `[B, vocab]` for the last position of each row of `hidden`.
    pub fn logits_last(&self, hidden: &Array) -> Result<Array> {
        let (b, l) = (hidden.shape()[0], hidden.shape()[1]);
        let last = if l == 1 { hidden.clone() } else { hidden.take_axis(Array::from_slice(&[l - 1], &[1]), 1)? };
        let x = self.normed(&last, &self.norm);
        let logits = match &self.lm_head {
            Some(head) => head.forward_normed(x)?,
            None => self.embed_tokens.as_linear(&x.array()?)?,
        };
        self.split.gather_vocab(logits.reshape(&[b, -1])?)
    }

    /// The final norm's output `[B, width]` at each row's last position:
    /// what a decoder embedder pools (last-token pooling).
    pub fn states_last(&self, hidden: &Array) -> Result<Array> {
        let (b, l) = (hidden.shape()[0], hidden.shape()[1]);
        let last = if l == 1 { hidden.clone() } else { hidden.take_axis(Array::from_slice(&[l - 1], &[1]), 1)? };
        Ok(fast::rms_norm(&last, Some(&self.norm), self.config.rms_norm_eps)?.reshape(&[b, -1])?)
    }

    /// Logits `[B, L, vocab]` of every position of `hidden`.
    fn logits_every(&self, hidden: &Array) -> Result<Array> {
        let (b, l) = (hidden.shape()[0], hidden.shape()[1]);
        let x = fast::rms_norm(hidden, Some(&self.norm), self.config.rms_norm_eps)?;
        let logits = match &self.lm_head {
            Some(head) => head.forward(&x)?,
            None => self.embed_tokens.as_linear(&x)?,
        };
        // A head split by vocabulary gathers every rank's part.
        Ok(self.split.gather_vocab(logits.reshape(&[b * l, -1])?)?.reshape(&[b, l, -1])?)
    }

    /// The residual stream `x.input` plus the attention block's output for
    /// `x` (its norm).
    #[expect(clippy::too_many_arguments, reason = "a layer's inputs, each used once; a struct would only rename them")]
    fn attention(
        &self,
        a: &Attention,
        x: RmsNormed,
        cache: &mut KvCache,
        mrope: Option<&MropePositions>,
        layer: usize,
        at: Position,
        lora: Lora,
    ) -> Result<Array> {
        let l = x.input.shape()[1];
        let offset = cache.offset;
        let (q, k, v) = match &self.config.mrope_section {
            Some(section) => {
                let (q, k, v) = self.project(a, x, at, false, lora)?;
                let (cos, sin) = mrope_cos_sin(&self.config, section, mrope, offset, l)?;
                (rotate(&q, &cos, &sin)?, rotate(&k, &cos, &sin)?, v)
            }
            None => self.project(a, x, at, true, lora)?,
        };
        let o = match cache.update_view(layer, k, v)? {
            KvView::Full(k, v) => match batch_attention::padded(&q, &k, &v, self.scale, cache, offset, None)? {
                Some(o) => o,
                // A verify pass's few positions: one kernel, not MLX's unfused path.
                None => match batch_attention::few_queries(&q, &k, &v, self.scale, cache)? {
                    Some(o) => o,
                    None => {
                        let mask = if l > 1 { Some(ScaledDotProductAttentionMask::Causal) } else { None };
                        fast::scaled_dot_product_attention(&q, &k, &v, self.scale, mask, None)?
                    }
                },
            },
            KvView::Quantized { keys, values, q: quantization } => {
                let total = keys[0].shape()[2];
                let rows = cache.padding_mask(offset, l, total, None)?;
                let mask = match &rows {
                    Some(m) => quantized_attention::Mask::Rows(m),
                    None if l > 1 => quantized_attention::Mask::Causal,
                    None => quantized_attention::Mask::None,
                };
                quantized_attention::attend(&q, &keys, &values, quantization, self.scale, mask)?
            }
        };
        self.output(a, o, x.input, lora)
    }

    /// q, k, v `[batch, heads, L, head_dim]` of `x` (a norm, built only
    /// where no kernel applies it as it reads), with rope applied to q and k
    /// when `rope` (the multimodal rope is applied by the caller).
    fn project(
        &self,
        a: &Attention,
        x: RmsNormed,
        at: Position,
        rope: bool,
        lora: Lora,
    ) -> Result<(Array, Array, Array)> {
        let c = &self.config;
        let (b, l) = (x.input.shape()[0], x.input.shape()[1]);
        let heads = |y: Array, n: i32, norm: &Option<Array>| -> Result<Array> {
            let y = to_heads(&y, b, l, n)?;
            Ok(match norm {
                Some(w) => fast::rms_norm(&y, Some(w), c.rms_norm_eps)?,
                None => y,
            })
        };
        let fused = a.qkv.is_fused();
        // A fused matrix without an adapter reads the norm's input itself.
        let normed = if fused && lora.is_none() { None } else { Some(x.array()?) };
        let update = match &normed {
            Some(xn) => lora_update(lora, Group::Qkv, xn)?,
            None => None,
        };
        let output = match &normed {
            None => a.qkv.fused_output_normed(x)?,
            Some(xn) => a.qkv.fused_output(xn, update.as_ref())?,
        };
        let parts = match output {
            Some(y) => {
                // One position per row: q and k normed and roped by one
                // kernel on CUDA (crate::model::qk_rope), v a view.
                let positions = match at {
                    Position::Fixed(_, Some(position)) if l == 1 && rope => Some(position.clone()),
                    Position::Rows(rows) if l == 1 && rope => Some(rows.clone()),
                    _ => None,
                };
                if let Some(positions) = positions {
                    if let Some((q, k)) = self.qk_rope.apply(&y, a.q_norm.as_ref(), a.k_norm.as_ref(), &positions)? {
                        let v = y.index((.., .., (self.heads + self.kv_heads) * c.head_dim..));
                        return Ok((q, k, heads(v, self.kv_heads, &None)?));
                    }
                }
                a.qkv.split_output(y, x.input)?
            }
            None => a
                .qkv
                .forward_adding(normed.as_ref().expect("separate projections are given the normed input"), update)?,
        };
        let [q, k, v]: [Array; 3] = parts.try_into().expect("three projections");
        // Parts handed on as views (layers::SplitParts::Views) that rope will
        // read straight from the fused output are copied: MLX 0.32.2's CUDA
        // rope misreads a multi-row view. A normed part is a fresh array, and
        // so is a separate projection's output (GGUF files that mix block
        // types per tensor): neither is copied.
        let for_rope = |y: Array, norm: &Option<Array>| -> Result<Array> {
            Ok(if fused && b * l > 1 && norm.is_none() && crate::model::layers::split_parts_as_views() {
                y.contiguous()?
            } else {
                y
            })
        };
        let q = heads(for_rope(q, &a.q_norm)?, self.heads, &a.q_norm)?;
        let k = heads(for_rope(k, &a.k_norm)?, self.kv_heads, &a.k_norm)?;
        let v = heads(v, self.kv_heads, &None)?;
        if !rope {
            return Ok((q, k, v));
        }
        Ok((self.rope(&q, at)?, self.rope(&k, at)?, v))
    }

    /// `residual` plus attention output `[batch, heads, L, head_dim]` →
    /// `[batch, L, hidden]` through o_proj (one operation on CUDA for a
    /// step of few rows: [`Linear::forward_plus`]).
    fn output(&self, a: &Attention, o: Array, residual: &Array, lora: Lora) -> Result<Array> {
        if lora.is_none() && self.split.shard.is_none() {
            // One position a row: the kernel reads the heads as they lie.
            if let Linear::Quantized { q, bias: None } = &a.o_proj {
                if let Some(y) = w4a16::matmul_add_heads(&o, q, residual)? {
                    return Ok(y);
                }
            }
            return a.o_proj.forward_plus(&from_heads(&o)?, residual);
        }
        let o = from_heads(&o)?;
        let y = a.o_proj.forward(&o)?;
        let y = match lora_update(lora, Group::O, &o)? {
            Some(u) => u.apply(&y)?,
            None => y,
        };
        Ok(residual.add(self.split.sum(y, self.split.attention)?)?)
    }

    fn rope(&self, x: &Array, at: Position) -> Result<Array> {
        let (d, base, freqs) = match &self.rope_freqs {
            Some(f) => (self.config.head_dim, None, Some(f)),
            None => (self.config.head_dim, Some(self.config.rope_theta), None),
        };
        Ok(match at {
            Position::Fixed(offset, _) => fast::rope(x, d, false, base, 1.0, offset, freqs)?,
            Position::Dynamic(offset) | Position::Rows(offset) => {
                fast::rope_dynamic(x, d, false, base, 1.0, offset, freqs)?
            }
        })
    }

    /// One decode step as a function of arrays only, so it can be compiled
    /// once and replayed for every token: `inputs` are the token id `[1, 1]`,
    /// the position `[1]` (int32) and every layer's key and value buffers
    /// (`KvCache::take_buffers`, capacity C); outputs are the logits `[vocab]`
    /// and the buffers with this position written. Positions past the token's
    /// are masked out, so the shapes are the same at every position below C
    /// (the graph is traced once per capacity, every `KV_STEP` tokens).
    pub fn decode_graph(&self, inputs: &[Array]) -> Result<Vec<Array>> {
        let (ids, offset, buffers) = (&inputs[0], &inputs[1], &inputs[2..]);
        let capacity = buffers[0].shape()[2];
        let visible = mlx_rs::ops::arange::<_, i32>(0, capacity, 1)?.le(offset)?;
        let mut outputs = Vec::with_capacity(inputs.len() - 1);
        let mut h = self.embed(ids)?;
        for (i, layer) in self.layers.iter().enumerate() {
            let x = self.normed(&h, &layer.input_layernorm);
            let (q, k, v) = self.project(&layer.attn, x, Position::Dynamic(offset), true, None)?;
            let keys = slice_update_dynamic(&buffers[2 * i], &k, offset, 2)?;
            let values = slice_update_dynamic(&buffers[2 * i + 1], &v, offset, 2)?;
            // On CUDA the positions up to `offset` as data (our kernel);
            // elsewhere a mask over the whole buffer.
            let o = match batch_attention::decode_to(&q, &keys, &values, self.scale, offset)? {
                Some(o) => o,
                None => {
                    let mask = ScaledDotProductAttentionMask::Array(&visible);
                    fast::scaled_dot_product_attention(&q, &keys, &values, self.scale, mask, None)?
                }
            };
            let h2 = self.output(&layer.attn, o, &h, None)?;
            h = self.mlp(&layer.mlp, self.normed(&h2, &layer.post_attention_layernorm), None)?;
            outputs.extend([keys, values]);
        }
        outputs.insert(0, self.logits_last(&h)?);
        Ok(outputs)
    }

    /// The residual stream `x.input` plus the MLP's output for `x` (its
    /// norm). On CUDA, for a step of few rows, the gate/up kernel normalizes
    /// its input as it reads it and writes the SwiGLU
    /// ([`w4a16::gate_up_swiglu_normed`]), and the down kernel adds the
    /// residual ([`Linear::forward_plus`]): two operations, not seven.
    fn mlp(&self, m: &Mlp, x: RmsNormed, lora: Lora) -> Result<Array> {
        let residual = x.input;
        if lora.is_none() && self.split.shard.is_none() {
            let halves = match m.gate_up.as_halves() {
                Some(Linear::Quantized { q, bias: None }) => Some(q),
                _ => None,
            };
            if let Some(h) = halves.map(|q| w4a16::gate_up_swiglu_normed(x, q)).transpose()?.flatten() {
                return m.down_proj.forward_plus(&h, residual);
            }
            let x = x.array()?;
            if let Some(h) = halves.map(|q| w4a16::gate_up_swiglu(&x, q)).transpose()?.flatten() {
                return m.down_proj.forward_plus(&h, residual);
            }
            let [gate, up]: [Array; 2] = m.gate_up.forward(&x)?.try_into().expect("two projections");
            return m.down_proj.forward_plus(&swiglu(&gate, &up)?, residual);
        }
        let x = &x.array()?;
        let [gate, up]: [Array; 2] =
            m.gate_up.forward_adding(x, lora_update(lora, Group::GateUp, x)?)?.try_into().expect("two projections");
        let h = swiglu(&gate, &up)?;
        let y = m.down_proj.forward(&h)?;
        let y = match lora_update(lora, Group::Down, &h)? {
            Some(u) => u.apply(&y)?,
            None => y,
        };
        Ok(residual.add(self.split.sum(y, self.split.mlp)?)?)
    }
}

/// A layer's LoRA adapter and the layer's index, when it runs under one.
type Lora<'a> = Option<(&'a crate::model::lora::Lora, usize)>;

/// The layer's adapter update of `group` for input `x`, if it has one.
fn lora_update(lora: Lora, group: Group, x: &Array) -> Result<Option<crate::model::lora::Update>> {
    match lora {
        Some((adapter, i)) => Ok(adapter.update(i, group, x)?),
        None => Ok(None),
    }
}

/// Where new positions start: a number fixed in the graph (and, for a
/// step of one position on CUDA, the same as `[1]` int32 for the one-kernel
/// norm and rope, made once a step), an array so that one compiled graph
/// serves every position, or one offset per row (`[B]`) for a padded batch.
#[derive(Clone, Copy)]
enum Position<'a> {
    Fixed(i32, Option<&'a Array>),
    Dynamic(&'a Array),
    Rows(&'a Array),
}

/// `src` with `update` written at `start` (`[1]`, int32) along `axis`: a
/// slice update whose position is data, not part of the graph. mlx-rs does
/// not wrap MLX's `slice_update` with an array start; this calls mlx-c's.
fn slice_update_dynamic(src: &Array, update: &Array, start: &Array, axis: i32) -> Result<Array> {
    let stream = mlx_rs::Stream::thread_local_or_default();
    // SAFETY: every handle passed is a live mlx-c array or stream; `res` is a
    // fresh handle that mlx-c fills on success and that `Array` then owns.
    unsafe {
        let mut res = mlx_sys::mlx_array_new();
        let status = mlx_sys::mlx_slice_update_dynamic(
            &mut res,
            src.as_ptr(),
            update.as_ptr(),
            start.as_ptr(),
            &axis,
            1,
            stream.as_ptr(),
        );
        let out = Array::from_ptr(res);
        anyhow::ensure!(
            status == 0,
            "MLX slice_update_dynamic failed on shapes {:?} <- {:?}",
            src.shape(),
            update.shape()
        );
        Ok(out)
    }
}

/// cos/sin `[1, 1, L, head_dim]` of Qwen2-VL's "chunked" multimodal rope, as
/// mlx-vlm computes them: frequency f follows the time, height or width
/// position by `section`; positions past the prompt are `offset + delta`.
fn mrope_cos_sin(
    c: &TextConfig,
    section: &[i32],
    mrope: Option<&(Vec<[i64; 3]>, i64)>,
    offset: i32,
    l: i32,
) -> Result<(Array, Array)> {
    let half = c.head_dim / 2;
    let steps =
        mlx_rs::ops::arange::<_, f32>(0.0, c.head_dim as f32, 2.0)?.divide(Array::from_f32(c.head_dim as f32))?;
    let inv_freq = Array::from_f32(1.0).divide(mlx_rs::ops::power(Array::from_f32(c.rope_theta), &steps)?)?;
    let axis_of: Vec<usize> = if c.mrope_interleaved {
        // mlx-vlm's interleaved selector: frequency i follows height when
        // i % 3 == 1 and i < 3 * section[1], width when i % 3 == 2 and
        // i < 3 * section[2], time otherwise.
        (0..half as usize)
            .map(|i| match i % 3 {
                1 if i < 3 * section[1] as usize => 1,
                2 if i < 3 * section[2] as usize => 2,
                _ => 0,
            })
            .collect()
    } else {
        section.iter().enumerate().flat_map(|(a, &n)| std::iter::repeat_n(a, n as usize)).collect()
    };
    let positions: Vec<f32> = (offset..offset + l)
        .flat_map(|p| {
            let pos = match mrope {
                Some((prompt, _)) if (p as usize) < prompt.len() => prompt[p as usize],
                Some((_, delta)) => [p as i64 + delta; 3],
                None => [p as i64; 3],
            };
            axis_of.iter().map(move |&a| pos[a] as f32).collect::<Vec<_>>()
        })
        .collect();
    let freqs = Array::from_slice(&positions, &[l, half]).multiply(&inv_freq)?;
    let emb = mlx_rs::ops::concatenate(&[&freqs, &freqs], -1)?.reshape(&[1, 1, l, c.head_dim])?;
    Ok((mlx_rs::ops::cos(&emb)?, mlx_rs::ops::sin(&emb)?))
}

/// `x * cos + rotate_half(x) * sin` over the last axis.
fn rotate(x: &Array, cos: &Array, sin: &Array) -> Result<Array> {
    let d = x.shape()[3];
    let lo = x.take_axis(Array::from_slice(&(0..d / 2).collect::<Vec<i32>>(), &[d / 2]), 3)?;
    let hi = x.take_axis(Array::from_slice(&(d / 2..d).collect::<Vec<i32>>(), &[d / 2]), 3)?;
    let rotated = mlx_rs::ops::concatenate(&[&mlx_rs::ops::negative(&hi)?, &lo], -1)?;
    Ok(x.multiply(cos)?.add(rotated.multiply(sin)?)?)
}

/// mlx-lm's `Llama3RoPE._freqs`, computed on the host.
fn llama3_rope_freqs(c: &TextConfig, s: &super::config::Llama3RopeScaling) -> Array {
    let dims = c.head_dim;
    let low_wavelen = s.original_max_position_embeddings / s.low_freq_factor;
    let high_wavelen = s.original_max_position_embeddings / s.high_freq_factor;
    let freqs: Vec<f32> = (0..dims)
        .step_by(2)
        .map(|i| {
            let f = c.rope_theta.powf(i as f32 / dims as f32);
            let wavelen = 2.0 * std::f32::consts::PI * f;
            let f = if wavelen > low_wavelen { f * s.factor } else { f };
            if wavelen > high_wavelen && wavelen < low_wavelen {
                let smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor)
                    / (s.high_freq_factor - s.low_freq_factor);
                f / ((1.0 - smooth) / s.factor + smooth)
            } else {
                f
            }
        })
        .collect();
    Array::from_slice(&freqs, &[freqs.len() as i32])
}

impl LanguageModel for Transformer {
    fn architecture(&self) -> &'static str {
        self.config.architecture.name()
    }

    fn num_layers(&self) -> usize {
        self.config.num_layers as usize
    }

    fn context_length(&self) -> u32 {
        self.config.context_length
    }

    fn embed(&self, ids: &Array) -> Result<Array> {
        Transformer::embed(self, ids)
    }

    fn forward(&self, embeds: &Array, cache: &mut KvCache, media: &MediaPositions) -> Result<Array> {
        self.hidden(embeds, cache, media)
    }

    fn logits(&self, hidden: &Array) -> Result<Array> {
        self.logits_last(hidden)
    }

    fn last_states(&self, hidden: &Array) -> Result<Array> {
        self.states_last(hidden)
    }

    fn verifies_drafts(&self) -> bool {
        // A split model's verify pass is an ordinary sharded pass, and its
        // cache's trim is journaled for the other ranks.
        self.config.mrope_section.is_none()
    }

    fn logits_all(&self, hidden: &Array) -> Result<Array> {
        self.logits_every(hidden)
    }

    /// Its projections' shapes, for checking a LoRA adapter against it
    /// (a split model serves none: its ranks hold parts of each).
    fn projection_shapes(&self) -> Option<crate::model::lora::ProjectionShapes> {
        if self.split.shard.is_some() {
            return None;
        }
        let c = &self.config;
        let (h, q, kv, ff) =
            (c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size);
        Some(vec![[(h, q), (h, kv), (h, kv), (q, h), (h, ff), (h, ff), (ff, h)]; self.layers.len()])
    }

    /// The dense weight and bias of layer `layer`'s projection `which`
    /// (`model::lora::PROJECTIONS` order): what a DoRA adapter's factors
    /// are computed from.
    fn projection_weight(&self, layer: usize, which: usize) -> Result<(Array, Option<Array>)> {
        let l = self.layers.get(layer).ok_or_else(|| anyhow::anyhow!("layer {layer} of {}", self.layers.len()))?;
        match which {
            0..=2 => l.attn.qkv.part_weight(which),
            3 => l.attn.o_proj.dense_weight(),
            4 | 5 => l.mlp.gate_up.part_weight(which - 4),
            6 => l.mlp.down_proj.dense_weight(),
            _ => anyhow::bail!("projection {which}"),
        }
    }

    /// Split models too: each rank quantizes its own heads' keys and
    /// values, and the journal's new caches carry the quantization.
    fn reads_quantized_kv(&self) -> bool {
        true
    }

    fn split_description(&self) -> Option<String> {
        self.split.describe()
    }

    /// The multimodal rope needs host-computed positions, so only plain
    /// decoders have a graph.
    fn decode_graph(&self) -> Option<DecodeGraph> {
        // A sharded step's collectives are issued call by call (and a
        // compiled graph cannot hold them).
        if self.config.mrope_section.is_some() || self.split.shard.is_some() {
            return None;
        }
        let model = self.clone();
        Some(Box::new(move |inputs: &[Array]| model.decode_graph(inputs)))
    }
}
