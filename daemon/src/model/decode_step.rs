//! The decode step of a text decoder as one compiled MLX function.
//!
//! Small-model decode on a GPU is bound by per-operation host work, not by
//! the GPU (SmolLM2-135M on an H200: ~3.5 ms per token for ~450 operations
//! at a few µs each, against ~18 µs of weight traffic). Compiling the step traces
//! the graph once and replays it: no per-token graph building through the
//! bindings, and MLX fuses the elementwise chains. The graph's shapes must
//! not change per token, so it reads and writes fixed-capacity KV buffers at
//! a position given as data (`LanguageModel::decode_graph`); it is retraced
//! only when the buffers grow (every `KV_STEP` tokens).

use super::family::DecodeGraph;
use super::kv_cache::KvCache;
use anyhow::Result;
use mlx_rs::{error::Exception, transforms::compile::compile, Array};

/// How decode steps are built.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeMode {
    /// Built op by op for every token (the reference's way).
    Eager,
    /// One compiled graph, replayed (text decoders without multimodal rope).
    Compiled,
}

impl DecodeMode {
    /// `forced` (`MLXBC_DECODE=eager|compiled`, crate::model::options); otherwise what measured faster on the
    /// device: compiled on CPU (1.4x eager on a tiny Qwen3, equal on
    /// SmolLM2), eager on a GPU. There MLX's per-operation host work in
    /// evaluation, not graph building, bounds the step (an H200 spent 99% of
    /// each token queueing it), and every new buffer capacity compiles new
    /// kernels (docs/measurements/h200-2026-11-29-decode-step.md). Since the
    /// compiled step on CUDA attends up to its position without a mask
    /// (`batch_attention::decode_to`), its greedy ids equal eager's, and it
    /// is still slower on an 8B shape: 169 against 195 tok/s
    /// (docs/measurements/gpu-2026-12-04-batch-attention.md).
    pub fn for_device(gpu: bool, forced: Option<DecodeMode>) -> Self {
        match forced {
            Some(mode) => mode,
            None if gpu => DecodeMode::Eager,
            None => DecodeMode::Compiled,
        }
    }
}

type StepFn = Box<dyn FnMut(&[Array]) -> std::result::Result<Vec<Array>, Exception>>;

/// A model's compiled decode step. Dropping it erases its traces from MLX's
/// compile cache (which holds the weights the traces captured).
pub struct CompiledDecode {
    step: StepFn,
}

impl CompiledDecode {
    /// Compiles a model's step (traced on first use). The graph keeps its
    /// own handles on the weights (shared, not copied).
    pub fn new(graph: DecodeGraph) -> Self {
        let graph = move |inputs: &[Array]| -> std::result::Result<Vec<Array>, Exception> {
            graph(inputs).map_err(|e| Exception::custom(format!("{e:#}")))
        };
        Self { step: Box::new(compile(graph, false)) }
    }

    /// Logits `[1, vocab]` after token `ids` (`[1, 1]`), which takes the next
    /// position in `cache`. Lazy: nothing is evaluated.
    pub fn step(&mut self, ids: &Array, cache: &mut KvCache) -> Result<Array> {
        cache.reserve(1)?;
        let position = Array::from_slice(&[cache.offset], &[1]);
        let buffers = cache.take_buffers().ok_or_else(|| anyhow::anyhow!("the cache has no buffers to decode into"))?;
        let mut inputs = Vec::with_capacity(buffers.len() + 2);
        inputs.push(ids.as_dtype(mlx_rs::Dtype::Uint32)?);
        inputs.push(position);
        inputs.extend(buffers);
        let mut outputs = (self.step)(&inputs)?;
        // The old buffers must have no other holder when the step runs, so
        // MLX can write the new position in place instead of copying them.
        drop(inputs);
        let logits = outputs.remove(0);
        cache.put_buffers(outputs, 1);
        Ok(logits)
    }
}
