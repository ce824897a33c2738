//! The BERT encoder's layers on MLX's CPU backend as BLAS products and
//! native passes over buffers of the encoder's own, with no MLX operation
//! between the embeddings and the last layer.
//!
//! Why: MLX's matrix products of a MiniLM batch ran at ~185 GFLOP/s on
//! this project's machine where the same `cblas_sgemm` called directly ran
//! at ~290 (`[15360, 384] × [384, 1536]`, 2 cores: MLX allocates every
//! output afresh, so each product's pages fault in again, and its bias
//! fill is a one-thread broadcast copy), and every MLX operation between
//! the products ran on one core while OpenBLAS's other thread waited.
//! Here the layers' buffers are allocated once per part of a batch (parts
//! as `super::PART_BYTES` bounds them, computed one after another: their
//! passes stay in cache) and reused by every layer; q, k and v are
//! written side by side into one buffer that attention reads in place;
//! the biases, GELU and the residual adds with their layer norms are
//! vectorized passes (`model::cpu_native`). A batch's texts go in one run
//! per core, each run on its own thread with one-thread BLAS calls
//! ([`forward`]); one text, or a BLAS other than OpenBLAS, is one run whose
//! passes and products spread over the cores. The arithmetic is MLX's
//! path's, term for term (each product adds its bias as `addmm` does), so
//! the two agree to rounding.

use super::model::Layer;
use crate::model::cpu_native::{self as native, Attention, Sgemm};
use crate::model::layers::{LayerNorm, Linear};
use anyhow::{bail, Result};
use mlx_rs::{Array, Dtype};

/// A dense f32 projection with a bias, evaluated.
struct Dense {
    weight: Array,
    bias: Array,
}

impl Dense {
    fn of(linear: &Linear) -> Option<Self> {
        match linear {
            Linear::Dense { weight, bias: Some(bias) }
                if weight.dtype() == Dtype::Float32 && bias.dtype() == Dtype::Float32 =>
            {
                let (weight, bias) = (native::f32_data(weight).ok()?, native::f32_data(bias).ok()?);
                Some(Self { weight, bias })
            }
            _ => None,
        }
    }
}

/// A layer norm's scale, shift and epsilon, evaluated.
struct Norm {
    weight: Array,
    shift: Array,
    eps: f32,
}

impl Norm {
    fn of(norm: &LayerNorm) -> Option<Self> {
        let (weight, shift, eps) = norm.parts();
        Some(Self { weight: native::f32_data(weight).ok()?, shift: native::f32_data(shift?).ok()?, eps })
    }
}

/// One layer's weights as the native path reads them.
pub(super) struct NativeLayer {
    /// q, k and v: three products into the thirds of one buffer (their
    /// weights stay where they are: a fused copy would cost 12 MB a layer
    /// for a 1,024-wide BERT, outside the memory budget), after their
    /// biases side by side filled into it.
    qkv: [Dense; 3],
    qkv_bias: Vec<f32>,
    attention_out: Dense,
    attention_norm: Norm,
    intermediate: Dense,
    output: Dense,
    output_norm: Norm,
}

impl NativeLayer {
    /// `None` where a projection is not dense f32 with a bias, or a norm has
    /// no shift (a GGUF's quantized weights, say): MLX's path serves those.
    pub(super) fn of(layer: &Layer) -> Option<Self> {
        let (q, k, v) = (Dense::of(&layer.query)?, Dense::of(&layer.key)?, Dense::of(&layer.value)?);
        let mut qkv_bias = Vec::new();
        for part in [&q, &k, &v] {
            qkv_bias.extend_from_slice(native::slice(&part.bias).ok()?);
        }
        Some(Self {
            qkv: [q, k, v],
            qkv_bias,
            attention_out: Dense::of(&layer.attention_out)?,
            attention_norm: Norm::of(&layer.attention_norm)?,
            intermediate: Dense::of(&layer.intermediate)?,
            output: Dense::of(&layer.output)?,
            output_norm: Norm::of(&layer.output_norm)?,
        })
    }
}

/// A projection's weight and bias as slices (threads share these: MLX's
/// arrays are not `Sync`).
#[derive(Clone, Copy)]
struct DenseView<'a> {
    weight: &'a [f32],
    bias: &'a [f32],
}

impl<'a> DenseView<'a> {
    fn of(dense: &'a Dense) -> Result<Self> {
        Ok(Self { weight: native::slice(&dense.weight)?, bias: native::slice(&dense.bias)? })
    }
}

/// A layer norm's scale and shift as slices.
#[derive(Clone, Copy)]
struct NormView<'a> {
    weight: &'a [f32],
    shift: &'a [f32],
    eps: f32,
}

impl<'a> NormView<'a> {
    fn of(norm: &'a Norm) -> Result<Self> {
        Ok(Self { weight: native::slice(&norm.weight)?, shift: native::slice(&norm.shift)?, eps: norm.eps })
    }
}

/// One layer's weights as slices, for the threads that run parts.
struct LayerView<'a> {
    qkv: [&'a [f32]; 3],
    qkv_bias: &'a [f32],
    attention_out: DenseView<'a>,
    attention_norm: NormView<'a>,
    intermediate: DenseView<'a>,
    output: DenseView<'a>,
    output_norm: NormView<'a>,
}

impl<'a> LayerView<'a> {
    fn of(layer: &'a NativeLayer) -> Result<Self> {
        let [q, k, v] = &layer.qkv;
        Ok(Self {
            qkv: [native::slice(&q.weight)?, native::slice(&k.weight)?, native::slice(&v.weight)?],
            qkv_bias: &layer.qkv_bias,
            attention_out: DenseView::of(&layer.attention_out)?,
            attention_norm: NormView::of(&layer.attention_norm)?,
            intermediate: DenseView::of(&layer.intermediate)?,
            output: DenseView::of(&layer.output)?,
            output_norm: NormView::of(&layer.output_norm)?,
        })
    }
}

/// The layers' buffers for one batch of `rows` token rows.
struct Buffers {
    qkv: Vec<f32>,
    attention: Vec<f32>,
    projected: Vec<f32>,
    intermediate: Vec<f32>,
}

/// How many threads [`forward`] runs a batch of `texts` on: one per core
/// (at most one per text) where OpenBLAS's threads can be held at one
/// (`BlasThreads`), else 1 (every pass and product spread over the cores
/// instead).
fn threads_for(texts: usize) -> usize {
    let cores = native::cores();
    if cores > 1 && texts > 1 && native::BlasThreads::available() {
        cores.min(texts)
    } else {
        1
    }
}

/// Runs `layers` over `x` (`[texts, tokens, hidden]`, the embeddings'
/// normalized output) with the padding bias `bias` (`[texts, 1, 1,
/// tokens]`: 0 to attend, -1e9 at padding).
///
/// Where it can (`threads_for`), the texts are cut into one run of texts
/// per core, each run through all the layers on its own thread with its
/// own buffers and one-thread BLAS calls: the threads never wait on one
/// another, and each run's passes stay in its core's cache (MiniLM, 300
/// chunks on 2 cores: 34.2 against 28.6 texts/s as one run with OpenBLAS's
/// threads, docs/measurements/cpu-2026-12-07-embed-parts.md).
pub(super) fn forward(sgemm: Sgemm, layers: &[NativeLayer], x: &Array, bias: &Array, heads: usize) -> Result<Array> {
    let shape = x.shape().to_vec();
    let &[texts, tokens, hidden] = shape.as_slice() else { bail!("native BERT: states of shape {shape:?}") };
    let (texts, tokens, hidden) = (texts as usize, tokens as usize, hidden as usize);
    if heads == 0 || !hidden.is_multiple_of(heads) {
        bail!("native BERT: {hidden} wide states in {heads} heads");
    }
    let bias = native::f32_data(bias)?;
    let bias = native::slice(&bias)?;
    let mut states = native::slice(&native::f32_data(x)?)?.to_vec();
    let views = layers.iter().map(LayerView::of).collect::<Result<Vec<_>>>()?;
    let run = Run { sgemm, layers: &views, tokens, hidden, heads };
    let threads = threads_for(texts);
    let blas = (threads > 1).then(native::BlasThreads::one).flatten();
    if blas.is_none() {
        run.layers_over(&mut states, bias)?;
        return Ok(native::array_of(states, &shape));
    }
    let per = texts.div_ceil(threads);
    let results = std::thread::scope(|scope| {
        let mut parts = states.chunks_mut(per * tokens * hidden).zip(bias.chunks(per * tokens));
        let last = parts.next_back();
        let handles: Vec<_> =
            parts.map(|(s, b)| scope.spawn(move || native::on_this_core(|| run.layers_over(s, b)))).collect();
        let mut results = vec![last.map_or(Ok(()), |(s, b)| native::on_this_core(|| run.layers_over(s, b)))];
        results.extend(
            handles.into_iter().map(|h| h.join().unwrap_or_else(|_| bail!("native BERT: a part's thread panicked"))),
        );
        results
    });
    drop(blas);
    results.into_iter().collect::<Result<Vec<_>>>()?;
    Ok(native::array_of(states, &shape))
}

/// What every part's run shares: the weights and the batch's sizes.
#[derive(Clone, Copy)]
struct Run<'a> {
    sgemm: Sgemm,
    layers: &'a [LayerView<'a>],
    tokens: usize,
    hidden: usize,
    heads: usize,
}

impl Run<'_> {
    /// Every layer over `states` (`[texts, tokens, hidden]`, in place) with
    /// the padding bias `bias` (`[texts, tokens]`).
    fn layers_over(&self, states: &mut [f32], bias: &[f32]) -> Result<()> {
        let Self { sgemm, tokens, hidden, heads, .. } = *self;
        let rows = states.len() / hidden;
        let texts = rows / tokens.max(1);
        let inner = self.layers.first().map_or(0, |l| l.intermediate.bias.len());
        let mut b = Buffers {
            qkv: vec![0.0; rows * 3 * hidden],
            attention: vec![0.0; rows * hidden],
            projected: vec![0.0; rows * hidden],
            intermediate: vec![0.0; rows * inner],
        };
        let shape_of = Attention {
            texts,
            tokens,
            heads,
            width: hidden,
            stride: 3 * hidden,
            scale: 1.0 / ((hidden / heads) as f32).sqrt(),
        };
        for layer in self.layers {
            // q, k, v: products that add to their biases, side by side.
            native::fill_rows(&mut b.qkv, layer.qkv_bias);
            for (i, weight) in layer.qkv.iter().enumerate() {
                native::gemm_nt_columns(sgemm, states, hidden, weight, 1.0, &mut b.qkv, i * hidden, 3 * hidden);
            }
            let (q, k, v) = (&b.qkv[..], &b.qkv[hidden..], &b.qkv[2 * hidden..]);
            native::attention_into(sgemm, (q, k, v), bias, shape_of, &mut b.attention);
            sublayer(sgemm, &b.attention, hidden, layer.attention_out, layer.attention_norm, &mut b.projected, states);
            let weight = layer.intermediate.weight;
            if b.intermediate.len() != rows * (weight.len() / hidden) {
                bail!("native BERT: layers of different intermediate widths");
            }
            native::gemm_nt(sgemm, states, hidden, weight, 0.0, &mut b.intermediate);
            native::bias_gelu_in_place(&mut b.intermediate, layer.intermediate.bias);
            sublayer(sgemm, &b.intermediate, inner, layer.output, layer.output_norm, &mut b.projected, states);
        }
        Ok(())
    }
}

/// `states = norm(states + input W^T + b)`: a post-norm sublayer's output
/// projection (into `projected`), residual and layer norm.
fn sublayer(
    sgemm: Sgemm,
    input: &[f32],
    inner: usize,
    projection: DenseView,
    norm: NormView,
    projected: &mut [f32],
    states: &mut [f32],
) {
    native::gemm_nt(sgemm, input, inner, projection.weight, 0.0, projected);
    native::residual_norm_in_place(states, projected, projection.bias, norm.weight, norm.shift, norm.eps);
}

#[cfg(test)]
mod tests {
    use super::super::config::BertConfig;
    use super::super::model::BertEncoder;
    use crate::model::weights::{TensorMap, WeightForm};
    use mlx_rs::Array;
    use std::collections::HashMap;

    /// A two-layer BERT of random weights (64 wide, 4 heads).
    fn tiny() -> BertEncoder {
        let config = BertConfig::from_json(&serde_json::json!({
            "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "max_position_embeddings": 40, "intermediate_size": 128, "vocab_size": 50
        }))
        .unwrap();
        let mut tensors = HashMap::new();
        let mut seed = 0u64;
        let mut random = |shape: &[i32], scale: f32| {
            seed += 1;
            let key = mlx_rs::random::key(seed).unwrap();
            let a = mlx_rs::random::normal::<f32>(shape, None, None, &key).unwrap();
            a.multiply(Array::from_f32(scale)).unwrap()
        };
        tensors.insert("embeddings.word_embeddings.weight".into(), random(&[50, 64], 1.0));
        tensors.insert("embeddings.position_embeddings.weight".into(), random(&[40, 64], 0.1));
        tensors.insert("embeddings.token_type_embeddings.weight".into(), random(&[2, 64], 0.1));
        let norm = |t: &mut HashMap<String, Array>, p: &str, random: &mut dyn FnMut(&[i32], f32) -> Array| {
            t.insert(format!("{p}.weight"), random(&[64], 0.1).add(Array::from_f32(1.0)).unwrap());
            t.insert(format!("{p}.bias"), random(&[64], 0.1));
        };
        norm(&mut tensors, "embeddings.LayerNorm", &mut random);
        for i in 0..2 {
            let p = format!("encoder.layer.{i}");
            for (name, out, inp) in [
                ("attention.self.query", 64, 64),
                ("attention.self.key", 64, 64),
                ("attention.self.value", 64, 64),
                ("attention.output.dense", 64, 64),
                ("intermediate.dense", 128, 64),
                ("output.dense", 64, 128),
            ] {
                tensors.insert(format!("{p}.{name}.weight"), random(&[out, inp], 0.2));
                tensors.insert(format!("{p}.{name}.bias"), random(&[out], 0.1));
            }
            norm(&mut tensors, &format!("{p}.attention.output.LayerNorm"), &mut random);
            norm(&mut tensors, &format!("{p}.output.LayerNorm"), &mut random);
        }
        let mut t = TensorMap::from_arrays(tensors, 64, WeightForm::DenseF32);
        BertEncoder::load(config, &mut t).unwrap()
    }

    /// The native layers give MLX's path's states: two texts, one padded.
    #[test]
    fn native_layers_agree_with_mlx() {
        if crate::model::cpu_native::sgemm().is_none() {
            panic!("no cblas_sgemm in this process: the native path cannot run (link OpenBLAS: scripts/install-deps)");
        }
        let mut encoder = tiny();
        // Three texts (runs of 2 and 1 on two cores: uneven), then one
        // (a single run, every pass spread over the cores).
        let lengths = [5, 3, 4];
        let ids: Vec<i32> = (0..15).map(|i| if i % 5 < lengths[i / 5] { 2 + (i as i32 * 7) % 45 } else { 0 }).collect();
        let keep: Vec<bool> = (0..15).map(|i| i % 5 < lengths[i / 5]).collect();
        for texts in [3usize, 1] {
            let n = texts * 5;
            let ids = Array::from_slice(&ids[..n], &[texts as i32, 5]);
            let keep = Array::from_slice(&keep[..n], &[texts as i32, 5]);
            encoder.use_cpu_math(false);
            let reference = encoder.forward(&ids, &keep, None).unwrap();
            use super::super::Encoder;
            encoder.use_cpu_math(true);
            assert!(encoder.computes_natively(), "the native path was not taken");
            let native = encoder.forward(&ids, &keep, None).unwrap();
            assert_eq!(native.shape(), reference.shape());
            let (a, b) = (native.as_slice::<f32>(), reference.as_slice::<f32>());
            // Real tokens only (padding rows are never read by pooling).
            for (text, &real) in lengths.iter().enumerate().take(texts) {
                for i in text * 5 * 64..(text * 5 + real) * 64 {
                    assert!(
                        (a[i] - b[i]).abs() < 1e-4,
                        "{texts} texts, state {i}: native {} against MLX {}",
                        a[i],
                        b[i]
                    );
                }
            }
        }
        assert_eq!(super::threads_for(1), 1, "one text is one run");
    }
}
