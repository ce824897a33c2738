//! Reads checkpoint tensors under HF names, from a GGUF file or an MLX/HF
//! safetensors directory, and turns them into [`Linear`]/[`Embedding`] in the
//! compute form chosen for the device ([`WeightForm`]).

use super::gguf::Gguf;
use super::layers::{BatchWeights, Embedding, Linear, Quantized};
use crate::model::options::{Fusion, ModelOptions};
use anyhow::{bail, Context, Result};
use mlx_rs::{Array, Dtype};
use std::collections::HashMap;
use std::path::Path;

/// How weights are held in memory for compute.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightForm {
    /// Dequantize everything to dense f32. On x86 CPUs MLX's quantized matmul
    /// is scalar and single-threaded while f32 matmuls go to BLAS: with
    /// OpenBLAS this is the fastest path by far (docs/benchmarks.md, "Compute dtype").
    DenseF32,
    /// Keep quantized weights packed; other floats in this dtype (GPU path).
    Packed(Dtype),
}

impl WeightForm {
    /// The fastest form for the default device, unless `forced`
    /// (`MLXBC_WEIGHTS=dense|packed`, crate::model::options; packed on a CPU runs
    /// the GPU's arithmetic, slowly: tests).
    pub fn for_device(device: &mlx_rs::Device, forced: Option<WeightForm>) -> Self {
        match (forced, device.get_type()) {
            (Some(form), _) => form,
            (None, Ok(mlx_rs::DeviceType::Gpu)) => WeightForm::Packed(Dtype::Float16),
            _ => WeightForm::DenseF32,
        }
    }

    fn float_dtype(self) -> Dtype {
        match self {
            WeightForm::DenseF32 => Dtype::Float32,
            WeightForm::Packed(d) => d,
        }
    }
}

/// Raw tensors under HF names plus what is needed to interpret quantized ones.
pub struct TensorMap {
    tensors: HashMap<String, Array>,
    /// Group size per quantized module prefix (default for all others).
    default_group: i32,
    group_overrides: HashMap<String, i32>,
    form: WeightForm,
    /// Which projections may share one matmul ([`TensorMap::with_options`]).
    pub fusion: Fusion,
    /// How quantized matrices serve batched steps ([`TensorMap::with_options`]).
    batch: BatchWeights,
}

impl TensorMap {
    /// Tensors from a GGUF file under HF names (see [`gguf_tensors`]).
    pub fn from_gguf(file: &Gguf, qk_rows: GgufQkRows, form: WeightForm) -> Result<Self> {
        Self::from_gguf_named(file, qk_rows, gguf_to_hf_name, form)
    }

    /// Tensors from a GGUF file under the names `names` gives its modules
    /// (`blk.0.attn_q` → a family's HF name; `None`: a module it does not know).
    pub fn from_gguf_named(
        file: &Gguf,
        qk_rows: GgufQkRows,
        names: fn(&str) -> Option<String>,
        form: WeightForm,
    ) -> Result<Self> {
        let tensors = gguf_tensors(file, qk_rows, names)?;
        // Every GGUF block type that maps to affine quantization uses groups of 32.
        Ok(Self {
            tensors,
            default_group: 32,
            group_overrides: HashMap::new(),
            form,
            fusion: Fusion::All,
            batch: BatchWeights::Packed,
        })
    }

    /// Tensors from `*.safetensors` in `dir`; `quantization` is config.json's
    /// section of that name (group size, bits, per-module overrides).
    pub fn from_safetensors_dir(
        dir: &Path,
        quantization: Option<&serde_json::Value>,
        form: WeightForm,
    ) -> Result<Self> {
        let mut files: Vec<_> = std::fs::read_dir(dir)
            .with_context(|| format!("reading model directory {}", dir.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        files.sort();
        if files.is_empty() {
            bail!("no *.safetensors files in {}", dir.display());
        }
        let mut tensors = HashMap::new();
        for f in &files {
            check_safetensors(f).with_context(|| format!("reading weights at {}", f.display()))?;
            let loaded = Array::load_safetensors(f).with_context(|| format!("reading weights at {}", f.display()))?;
            tensors.extend(loaded);
        }
        let default_group =
            quantization.and_then(|q| q.get("group_size")).and_then(|g| g.as_i64()).unwrap_or(64) as i32;
        let mut group_overrides = HashMap::new();
        if let Some(obj) = quantization.and_then(|q| q.as_object()) {
            for (k, v) in obj {
                if let Some(g) = v.get("group_size").and_then(|g| g.as_i64()) {
                    group_overrides.insert(k.clone(), g as i32);
                }
            }
        }
        Ok(Self { tensors, default_group, group_overrides, form, fusion: Fusion::All, batch: BatchWeights::Packed })
    }

    /// Tensors already in memory (dense or MLX-quantized with `group_size`).
    pub fn from_arrays(tensors: HashMap<String, Array>, group_size: i32, form: WeightForm) -> Self {
        Self {
            tensors,
            default_group: group_size,
            group_overrides: HashMap::new(),
            form,
            fusion: Fusion::All,
            batch: BatchWeights::Packed,
        }
    }

    /// The same tensors, with projections fused as `options.fusion` allows
    /// and quantized matrices serving batches as `options.batch` says.
    pub fn with_options(self, options: &ModelOptions) -> Self {
        Self { fusion: options.fusion, batch: options.batch, ..self }
    }

    /// The remaining tensors under `prefix`, renamed without it (e.g. a VLM's
    /// `language_model.` part for the text decoder).
    pub fn strip_prefix(self, prefix: &str) -> Self {
        let tensors =
            self.tensors.into_iter().filter_map(|(k, v)| Some((k.strip_prefix(prefix)?.to_string(), v))).collect();
        Self { tensors, ..self }
    }

    /// The same tensors under other names (a checkpoint layout mapped onto
    /// the one a family loads).
    pub fn renamed(self, name: impl Fn(&str) -> String) -> Self {
        let tensors = self.tensors.into_iter().map(|(k, v)| (name(&k), v)).collect();
        Self { tensors, ..self }
    }

    /// The dtype float tensors are taken in.
    pub fn float_dtype(&self) -> mlx_rs::Dtype {
        self.form.float_dtype()
    }

    /// True when a tensor of that exact name exists.
    pub fn has(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// A float tensor (norm weight, bias) in the compute dtype.
    pub fn float(&mut self, name: &str) -> Result<Array> {
        let a = self.tensors.remove(name).with_context(|| format!("missing tensor {name}"))?;
        Ok(a.as_dtype(self.form.float_dtype())?)
    }

    fn optional_float(&mut self, name: &str) -> Result<Option<Array>> {
        if self.has(name) {
            self.float(name).map(Some)
        } else {
            Ok(None)
        }
    }

    fn quantized(&mut self, prefix: &str) -> Result<Option<Quantized>> {
        if !self.has(&format!("{prefix}.scales")) {
            return Ok(None);
        }
        let weight =
            self.tensors.remove(&format!("{prefix}.weight")).with_context(|| format!("missing {prefix}.weight"))?;
        let dtype = self.form.float_dtype();
        let scales = self.tensors.remove(&format!("{prefix}.scales")).unwrap().as_dtype(dtype)?;
        let biases = self
            .tensors
            .remove(&format!("{prefix}.biases"))
            .with_context(|| format!("missing {prefix}.biases"))?
            .as_dtype(dtype)?;
        let group_size = self.group_overrides.get(prefix).copied().unwrap_or(self.default_group);
        let packed_cols = weight.shape().last().copied().unwrap_or(0);
        let groups = scales.shape().last().copied().unwrap_or(0);
        // The counts come from the file: a zero or negative one is an error, not a panic.
        let bits = groups
            .checked_mul(group_size)
            .filter(|&d| d > 0)
            .and_then(|d| packed_cols.checked_mul(32).map(|n| n / d))
            .unwrap_or(0);
        if ![2, 3, 4, 5, 6, 8].contains(&bits) {
            bail!(
                "{prefix}: cannot infer quantization bits (weight {:?}, scales {:?}, group {group_size})",
                weight.shape(),
                scales.shape()
            );
        }
        Ok(Some(Quantized::new(weight, scales, biases, group_size, bits).widen(self.batch)?))
    }

    /// A projection `prefix.weight` (+ `prefix.bias` when present).
    pub fn linear(&mut self, prefix: &str) -> Result<Linear> {
        let bias = self.optional_float(&format!("{prefix}.bias"))?;
        Ok(match self.quantized(prefix)? {
            Some(q) if self.form == WeightForm::DenseF32 => Linear::Dense { weight: q.dequantize()?, bias },
            Some(q) => Linear::Quantized { q, bias },
            None => Linear::Dense { weight: self.float(&format!("{prefix}.weight"))?, bias },
        })
    }

    /// An embedding table `prefix.weight`.
    pub fn embedding(&mut self, prefix: &str) -> Result<Embedding> {
        Ok(match self.quantized(prefix)? {
            Some(q) if self.form == WeightForm::DenseF32 => Embedding::Dense(q.dequantize()?),
            Some(q) => Embedding::Quantized(q),
            None => Embedding::Dense(self.float(&format!("{prefix}.weight"))?),
        })
    }

    /// Rows of the embedding table (vocabulary size) without consuming it.
    pub fn rows(&self, name: &str) -> Option<i32> {
        self.tensors.get(name).map(|a| a.shape()[0])
    }
}

/// How a GGUF file lays out the rows of its q/k projections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgufQkRows {
    /// As HF checkpoints do (most architectures).
    AsHf,
    /// Permuted by llama.cpp for its interleaved rope (Llama): undone on
    /// reading, for `heads` query and `kv_heads` key heads.
    Permuted { heads: i32, kv_heads: i32 },
}

/// A GGUF file's tensors converted for MLX ([`Gguf::tensors`]) under HF
/// names (`model.layers.0.self_attn.q_proj.scales`), with q/k rows put
/// back in HF order (see [`GgufQkRows`]) so one rope layout serves both formats.
pub fn gguf_tensors(
    file: &Gguf,
    qk_rows: GgufQkRows,
    names: fn(&str) -> Option<String>,
) -> Result<HashMap<String, Array>> {
    let mut tensors = HashMap::new();
    for converted in file.tensors() {
        let (module, parts) = converted?;
        let hf = names(&module).with_context(|| format!("unknown GGUF tensor {module}"))?;
        for (suffix, array) in parts {
            let array = match (qk_rows, module.rsplit('.').next()) {
                (GgufQkRows::Permuted { heads, .. }, Some("attn_q")) => unpermute_rows(&array, heads)?,
                (GgufQkRows::Permuted { kv_heads, .. }, Some("attn_k")) => unpermute_rows(&array, kv_heads)?,
                _ => array,
            };
            tensors.insert(format!("{hf}.{suffix}"), array);
        }
    }
    Ok(tensors)
}

/// `blk.3.attn_q` → `model.layers.3.self_attn.q_proj`.
pub fn gguf_to_hf_name(module: &str) -> Option<String> {
    let parts: Vec<&str> = module.split('.').collect();
    match parts.as_slice() {
        ["token_embd"] => Some("model.embed_tokens".into()),
        ["output_norm"] => Some("model.norm".into()),
        ["output"] => Some("lm_head".into()),
        ["blk", n, kind] => {
            let hf = match *kind {
                "attn_q" => "self_attn.q_proj",
                "attn_k" => "self_attn.k_proj",
                "attn_v" => "self_attn.v_proj",
                "attn_output" => "self_attn.o_proj",
                "attn_q_norm" => "self_attn.q_norm",
                "attn_k_norm" => "self_attn.k_norm",
                "ffn_gate" => "mlp.gate_proj",
                "ffn_up" => "mlp.up_proj",
                "ffn_down" => "mlp.down_proj",
                "attn_norm" => "input_layernorm",
                "ffn_norm" => "post_attention_layernorm",
                _ => return None,
            };
            Some(format!("model.layers.{n}.{hf}"))
        }
        _ => None,
    }
}

/// Inverse of llama.cpp's `permute` on axis 0:
/// gguf = hf.reshape(heads, 2, d/2, ...).swapaxes(1, 2).reshape(shape).
/// It acts on output rows only, so it applies exactly to packed weights,
/// scales and biases alike.
fn unpermute_rows(a: &Array, heads: i32) -> Result<Array> {
    let shape = a.shape().to_vec();
    let rows = shape.first().copied().unwrap_or(0);
    if heads <= 0 || rows % (heads * 2) != 0 {
        anyhow::bail!("{rows} rows cannot be split into {heads} heads of rotary pairs");
    }
    let mut split = vec![heads, rows / heads / 2, 2];
    split.extend_from_slice(&shape[1..]);
    Ok(a.reshape(&split)?.swap_axes(1, 2)?.reshape(&shape)?)
}

/// The safetensors format's own limit on its JSON header.
const MAX_SAFETENSORS_HEADER: u64 = 100 << 20;

/// Checks a safetensors file's header before MLX reads it: the declared
/// header length fits the file (and the format's 100 MB limit), and every
/// tensor's byte range lies inside the file and matches its shape and
/// dtype. MLX trusts these numbers; a hostile or truncated file must not
/// make it allocate or read past the end.
pub fn check_safetensors(path: &Path) -> Result<()> {
    use std::io::Read;
    let mut f = std::fs::File::open(path)?;
    let size = f.metadata()?.len();
    let mut len = [0u8; 8];
    f.read_exact(&mut len).context("no safetensors header")?;
    let n = u64::from_le_bytes(len);
    anyhow::ensure!(
        (2..=MAX_SAFETENSORS_HEADER).contains(&n) && n <= size - 8,
        "safetensors header declares {n} bytes in a file of {size}"
    );
    let mut header = vec![0u8; n as usize];
    f.read_exact(&mut header)?;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&header).context("safetensors header is not a JSON object")?;
    let data_len = size - 8 - n;
    for (name, t) in header.iter().filter(|(k, _)| *k != "__metadata__") {
        let bad = || anyhow::anyhow!("safetensors tensor {name} has a bad entry");
        let dtype = t.get("dtype").and_then(|d| d.as_str()).ok_or_else(bad)?;
        let width: u64 = match dtype {
            "F64" | "I64" | "U64" => 8,
            "F32" | "I32" | "U32" => 4,
            "F16" | "BF16" | "I16" | "U16" => 2,
            "I8" | "U8" | "BOOL" | "F8_E4M3" | "F8_E5M2" => 1,
            other => anyhow::bail!("safetensors tensor {name} has unsupported dtype {other}"),
        };
        let shape = t.get("shape").and_then(|s| s.as_array()).ok_or_else(bad)?;
        let elements = shape.iter().try_fold(1u64, |acc, d| acc.checked_mul(d.as_u64()?)).ok_or_else(bad)?;
        let offsets = t.get("data_offsets").and_then(|o| o.as_array()).ok_or_else(bad)?;
        let (Some(a), Some(b)) = (offsets.first().and_then(|v| v.as_u64()), offsets.get(1).and_then(|v| v.as_u64()))
        else {
            return Err(bad());
        };
        anyhow::ensure!(
            a <= b && b <= data_len && elements.checked_mul(width) == Some(b - a),
            "safetensors tensor {name}: bytes {a}..{b} do not fit the file's {data_len} data bytes or its shape"
        );
    }
    Ok(())
}
