//! LoRA adapters as mlx-lm's trainer writes them (`mlx_lm lora`:
//! `adapters.safetensors` holding `lora_a` `[in, rank]` and `lora_b`
//! `[rank, out]` per adapted projection, and `adapter_config.json` with
//! `lora_parameters` (`rank`, `scale`, `dropout`: ignored when serving),
//! `num_layers` and `keys`), served on a resident base model: a projection
//! `y = x Wᵀ` of an adapted module becomes `y + scale · (x A) B`, as
//! mlx-lm's `LoRALinear` computes it, so one base model serves many
//! fine-tunes, rows of several in one batch ([`RowAdapters`]). A fused adapter (`mlx_lm fuse` output) is a plain model
//! directory and needs none of this.

use anyhow::{bail, Context, Result};
use mlx_rs::Array;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The projections of a decoder layer an adapter may adapt, by the module
/// path mlx-lm gives them under `model.layers.N.`.
pub const PROJECTIONS: [&str; 7] = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
];

/// One adapted projection: `scale · (x A) B`.
struct LowRank {
    a: Array,
    b: Array,
    scale: f32,
}

/// A loaded adapter.
pub struct LoraAdapter {
    /// Its name as requests give it.
    pub name: String,
    pub dir: PathBuf,
    /// sha256 over its config and weights: the prompt cache keys its
    /// prefixes under it, so a base model's prefix is not reused under an
    /// adapter that changes it.
    pub fingerprint: [u8; 32],
    /// Bytes of its weights.
    pub bytes: u64,
    pub rank: usize,
    /// Adapted projections, by layer then [`PROJECTIONS`] index.
    layers: Vec<[Option<LowRank>; 7]>,
}

/// The shapes a base model's projections have, for checking an adapter
/// against it: per layer, `(in, out)` of each of [`PROJECTIONS`].
pub type ProjectionShapes = Vec<[(i32, i32); 7]>;

/// True when `dir` holds an adapter (its `adapter_config.json`).
pub fn is_adapter_dir(dir: &Path) -> bool {
    dir.join("adapter_config.json").is_file() && dir.join("adapters.safetensors").is_file()
}

impl LoraAdapter {
    /// Loads the adapter in `dir` (served as `name`) for a base whose
    /// projections are shaped `shapes`; refuses with a sentence what does
    /// not fit it (another base's shapes or layers, modules it cannot
    /// adapt, DoRA, a full fine-tune).
    pub fn load(name: &str, dir: &Path, shapes: &ProjectionShapes) -> Result<Self> {
        let config_text = std::fs::read_to_string(dir.join("adapter_config.json"))
            .with_context(|| format!("adapter {name}: reading {}/adapter_config.json", dir.display()))?;
        let config: serde_json::Value =
            serde_json::from_str(&config_text).with_context(|| format!("adapter {name}: adapter_config.json"))?;
        match config.get("fine_tune_type").and_then(|t| t.as_str()).unwrap_or("lora") {
            "lora" => {}
            "dora" => bail!(
                "adapter {name} is DoRA (its magnitudes rescale each output by the adapted weight's norm), which \
                 is not served yet: fuse it (`mlx_lm fuse --adapter-path {}`) and serve the fused model",
                dir.display()
            ),
            other => bail!("adapter {name} is a {other:?} fine-tune, not LoRA: serve the model it saved"),
        }
        let p = config.get("lora_parameters").context("adapter_config.json has no lora_parameters")?;
        let scale = p.get("scale").and_then(|s| s.as_f64()).unwrap_or(20.0) as f32;
        let path = dir.join("adapters.safetensors");
        let weights = Array::load_safetensors(&path)
            .map_err(|e| anyhow::anyhow!("adapter {name}: reading {}: {e}", path.display()))?;
        let mut layers: Vec<[Option<LowRank>; 7]> = (0..shapes.len()).map(|_| Default::default()).collect();
        let (mut bytes, mut rank) = (0u64, 0usize);
        let mut pairs: HashMap<String, (Option<Array>, Option<Array>)> = HashMap::new();
        for (key, array) in weights {
            let (module, leaf) = key.rsplit_once('.').unwrap_or((&key, ""));
            let slot = pairs.entry(module.to_string()).or_default();
            match leaf {
                "lora_a" => slot.0 = Some(array),
                "lora_b" => slot.1 = Some(array),
                _ => bail!("adapter {name}: {key} is not a LoRA weight (lora_a, lora_b)"),
            }
        }
        for (module, pair) in pairs {
            let (Some(a), Some(b)) = pair else { bail!("adapter {name}: {module} lacks lora_a or lora_b") };
            let Some(rest) = module.strip_prefix("model.layers.") else {
                bail!("adapter {name} adapts {module}, which is not in a decoder layer: only the layers' projections are served")
            };
            let (layer, projection) = rest.split_once('.').context("a module path")?;
            let layer: usize = layer.parse().with_context(|| format!("adapter {name}: {module}"))?;
            let Some(which) = PROJECTIONS.iter().position(|&p| p == projection) else {
                bail!("adapter {name} adapts {module}: only {} are served", PROJECTIONS.join(", "))
            };
            let Some(shape) = shapes.get(layer) else {
                bail!(
                    "adapter {name} adapts layer {layer}, but the model has {} layers: it was trained on another base",
                    shapes.len()
                )
            };
            let (inputs, outputs) = shape[which];
            let (sa, sb) = (a.shape(), b.shape());
            if sa.len() != 2 || sb.len() != 2 || sa[0] != inputs || sb[1] != outputs || sa[1] != sb[0] {
                bail!(
                    "adapter {name}: {module} is shaped {sa:?} x {sb:?}, but the model's projection takes {inputs} \
                     values to {outputs}: it was trained on another base"
                );
            }
            rank = rank.max(sa[1] as usize);
            bytes += (a.nbytes() + b.nbytes()) as u64;
            layers[layer][which] = Some(LowRank { a, b, scale });
        }
        if layers.iter().all(|l| l.iter().all(Option::is_none)) {
            bail!("adapter {name} adapts nothing");
        }
        let fingerprint = {
            use sha2::Digest;
            let mut h = sha2::Sha256::new();
            h.update(config_text.as_bytes());
            h.update(std::fs::read(&path)?);
            h.finalize().into()
        };
        Ok(Self { name: name.to_string(), dir: dir.to_path_buf(), fingerprint, bytes, rank, layers })
    }

    /// `y` (projection `which` of layer `layer` applied to `x`) with this
    /// adapter's low-rank update added, as mlx-lm's `LoRALinear` adds it:
    /// `y + (scale · (x A) B)` in `x`'s dtype.
    pub fn apply(&self, layer: usize, which: usize, x: &Array, y: Array) -> Result<Array, mlx_rs::error::Exception> {
        let Some(Some(lr)) = self.layers.get(layer).map(|l| &l[which]) else { return Ok(y) };
        let z = x.matmul(&lr.a)?.matmul(&lr.b)?;
        // The scale in z's dtype, as a Python float multiplies in mlx-lm.
        let scale = Array::from_f32(lr.scale).as_dtype(z.dtype())?;
        y.add(scale.multiply(&z)?.as_dtype(x.dtype())?)
    }

    /// Its scale (every projection's).
    fn layers_scale(&self) -> f32 {
        self.layers.iter().flatten().flatten().next().map_or(0.0, |lr| lr.scale)
    }

    /// True when it adapts some projection of layer `layer`.
    pub fn adapts(&self, layer: usize) -> bool {
        self.layers.get(layer).is_some_and(|l| l.iter().any(Option::is_some))
    }
}

/// The adapters of a forward pass's rows, as a family applies them.
#[derive(Clone)]
pub enum Lora {
    /// No row runs under one.
    None,
    /// Every row under the same one.
    One(std::rc::Rc<LoraAdapter>),
    /// Rows under different ones (or some under none).
    Rows(std::rc::Rc<RowAdapters>),
}

impl Lora {
    /// True when some row's adapter adapts layer `layer`.
    pub fn adapts(&self, layer: usize) -> bool {
        match self {
            Lora::None => false,
            Lora::One(a) => a.adapts(layer),
            Lora::Rows(r) => r.layers.get(layer).is_some_and(|l| l.iter().any(Option::is_some)),
        }
    }

    /// `y` (projection `which` of layer `layer` on `x`, `[rows, L, in]`)
    /// with each row's adapter update added.
    pub fn apply(&self, layer: usize, which: usize, x: &Array, y: Array) -> Result<Array, mlx_rs::error::Exception> {
        match self {
            Lora::None => Ok(y),
            Lora::One(a) => a.apply(layer, which, x, y),
            Lora::Rows(r) => r.apply(layer, which, x, y),
        }
    }
}

/// Several rows' adapters stacked, per projection, into `A` `[rows, in,
/// rank]` and `B` `[rows, rank, out]` (zeros for a row without one, and
/// past an adapter's own rank), so every row's update is one batched
/// product pair whatever the number of adapters; each row's scale apart
/// (`[rows, 1, 1]`), multiplied after as `LoRALinear` does.
pub struct RowAdapters {
    layers: Vec<[Option<(Array, Array)>; 7]>,
    scales: Array,
}

impl RowAdapters {
    /// Stacks `adapters` (one per row; `None`: the bare base).
    pub fn stack(adapters: &[Option<std::rc::Rc<LoraAdapter>>]) -> Result<Self> {
        let layers = adapters.iter().flatten().map(|a| a.layers.len()).max().unwrap_or(0);
        let rank = adapters.iter().flatten().map(|a| a.rank).max().unwrap_or(0) as i32;
        let mut out: Vec<[Option<(Array, Array)>; 7]> = (0..layers).map(|_| Default::default()).collect();
        for (layer, slots) in out.iter_mut().enumerate() {
            for (which, slot) in slots.iter_mut().enumerate() {
                let parts: Vec<Option<&LowRank>> = adapters
                    .iter()
                    .map(|a| a.as_ref().and_then(|a| a.layers.get(layer)).and_then(|l| l[which].as_ref()))
                    .collect();
                let Some(like) = parts.iter().flatten().next() else { continue };
                let (inputs, outputs) = (like.a.shape()[0], like.b.shape()[1]);
                let dtype = like.a.dtype();
                let mut a_rows = Vec::with_capacity(parts.len());
                let mut b_rows = Vec::with_capacity(parts.len());
                for p in &parts {
                    let (a, b) = match p {
                        Some(lr) => {
                            let r = lr.a.shape()[1];
                            let pad_a: &[(i32, i32)] = &[(0, 0), (0, rank - r)];
                            let pad_b: &[(i32, i32)] = &[(0, rank - r), (0, 0)];
                            (mlx_rs::ops::pad(&lr.a, pad_a, None, None)?, mlx_rs::ops::pad(&lr.b, pad_b, None, None)?)
                        }
                        None => (
                            mlx_rs::ops::zeros_dtype(&[inputs, rank], dtype)?,
                            mlx_rs::ops::zeros_dtype(&[rank, outputs], dtype)?,
                        ),
                    };
                    a_rows.push(a);
                    b_rows.push(b);
                }
                *slot = Some((mlx_rs::ops::stack(&a_rows, 0)?, mlx_rs::ops::stack(&b_rows, 0)?));
            }
        }
        let scales: Vec<f32> = adapters.iter().map(|a| a.as_ref().map_or(0.0, |a| a.layers_scale())).collect();
        let scales = Array::from_slice(&scales, &[scales.len() as i32, 1, 1]);
        Ok(Self { layers: out, scales })
    }

    fn apply(&self, layer: usize, which: usize, x: &Array, y: Array) -> Result<Array, mlx_rs::error::Exception> {
        let Some(Some((a, b))) = self.layers.get(layer).map(|l| &l[which]) else { return Ok(y) };
        let z = x.matmul(a)?.matmul(b)?;
        y.add(self.scales.as_dtype(z.dtype())?.multiply(&z)?.as_dtype(x.dtype())?)
    }
}
