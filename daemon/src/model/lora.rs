//! LoRA adapters as mlx-lm's trainer writes them (`mlx_lm lora`:
//! `adapters.safetensors` holding `lora_a` `[in, rank]` and `lora_b`
//! `[rank, out]` per adapted projection, and `adapter_config.json` with
//! `lora_parameters` (`rank`, `scale`, `dropout`: ignored when serving),
//! `num_layers` and `keys`), served on a resident base model: a projection
//! `y = x Wᵀ` of an adapted module becomes `y + scale · (x A) B`, as
//! mlx-lm's `LoRALinear` computes it, so one base model serves many
//! fine-tunes, rows of several in one batch ([`RowAdapters`]). DoRA
//! adapters (`fine_tune_type: dora`, a magnitude `m` per adapted
//! projection) also rescale each output feature by `m / ‖W + scale · Bᵀ Aᵀ‖`
//! over the feature's weights, as mlx-lm's `DoRALinear` does; that factor
//! depends only on the weights, so it is computed once, at load. A fused
//! adapter (`mlx_lm fuse` output) is a plain model directory and needs none
//! of this.

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

/// One adapted projection: `scale · (x A) B`, and for DoRA its outputs'
/// magnitudes `m`.
struct LowRank {
    a: Array,
    b: Array,
    scale: f32,
    magnitude: Option<Array>,
}

/// A base projection's weight `[out, in]` (dense, dequantized) and bias, by
/// layer and [`PROJECTIONS`] index: what a DoRA adapter's factors are
/// computed from.
pub type BaseWeights<'a> = &'a dyn Fn(usize, usize) -> Result<(Array, Option<Array>)>;

/// What an adapter does to a group's (fused) output `y`:
/// `(y + xa · b) ⊙ rescale + shift` (DoRA's factors, and its bias kept out
/// of the rescaling: `shift = (1 - rescale) ⊙ bias`; plain LoRA adds only).
pub struct Update {
    /// The group's input (`[rows, L, in]`).
    x: Array,
    /// The adapter's `A` side by side over the group's parts (`[in, Σ
    /// rank]`, or stacked per row `[rows, in, R]`), in `x`'s dtype.
    a: Array,
    /// `x A` where it was computed already (a group whose parts are applied
    /// one by one shares it).
    xa: Option<Array>,
    /// The adapter's `scale · B`, block-diagonal over the group's parts.
    b: Array,
    rescale: Option<Array>,
    shift: Option<Array>,
}

impl Update {
    /// The update applied to `y`. Plain LoRA on CUDA, in a decode step:
    /// mlxbc's two kernels ([`crate::model::lora_kernel`]); elsewhere one
    /// product and one fused multiply-add (`addmm`). On a GPU a batched
    /// step is bound by the host's work per operation, and an adapter's
    /// two products, casts and add in every adapted group of every layer
    /// halved 16 clients' tokens per second on the 8B shape
    /// (docs/measurements/h100-2026-12-06-rows.md).
    pub fn apply(&self, y: &Array) -> Result<Array, mlx_rs::error::Exception> {
        let plain = self.rescale.is_none() && self.shift.is_none();
        if plain && self.xa.is_none() {
            match crate::model::lora_kernel::add(y, &self.x, &self.a, &self.b) {
                Ok(Some(out)) => return Ok(out),
                Ok(None) => {}
                Err(e) => {
                    // Once: a failure would repeat in every adapted group of every step.
                    static WARNED: std::sync::Once = std::sync::Once::new();
                    WARNED.call_once(|| {
                        tracing::warn!("a LoRA update through mlxbc's kernels failed, MLX's matmuls instead: {e:#}")
                    });
                }
            }
        }
        let xa = self.xa()?;
        if plain {
            return mlx_rs::ops::addmm(y, &xa, self.b.as_dtype(y.dtype())?, 1.0, 1.0);
        }
        let mut y = y.add(xa.matmul(&self.b)?.as_dtype(y.dtype())?)?;
        if let Some(f) = &self.rescale {
            y = y.multiply(f.as_dtype(y.dtype())?)?;
        }
        if let Some(s) = &self.shift {
            y = y.add(s.as_dtype(y.dtype())?)?;
        }
        Ok(y)
    }

    /// `x A`: the one computed already, else queued now.
    fn xa(&self) -> Result<Array, mlx_rs::error::Exception> {
        match &self.xa {
            Some(xa) => Ok(xa.clone()),
            None => self.x.matmul(&self.a),
        }
    }

    /// Cut at `points` of the last axis (a group's parts, kept separate).
    pub fn split(&self, points: &[i32]) -> Result<Vec<Update>, mlx_rs::error::Exception> {
        let cut = |a: &Array| a.split_at_indices(points, -1);
        let xa = self.xa()?;
        let bs = cut(&self.b)?;
        let rescales = self.rescale.as_ref().map(cut).transpose()?;
        let shifts = self.shift.as_ref().map(cut).transpose()?;
        Ok(bs
            .into_iter()
            .enumerate()
            .map(|(i, b)| Update {
                x: self.x.clone(),
                a: self.a.clone(),
                xa: Some(xa.clone()),
                b,
                rescale: rescales.as_ref().map(|r| r[i].clone()),
                shift: shifts.as_ref().map(|s| s[i].clone()),
            })
            .collect())
    }
}

/// Projections whose updates a family adds as one, in [`PROJECTIONS`]
/// order: q/k/v and gate/up to their fused matmul's output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Group {
    Qkv = 0,
    O = 1,
    GateUp = 2,
    Down = 3,
}

/// Every group, by its index.
const GROUPS: [Group; 4] = [Group::Qkv, Group::O, Group::GateUp, Group::Down];

impl Group {
    /// Its projections ([`PROJECTIONS`] indices), in the order of their outputs.
    fn parts(self) -> &'static [usize] {
        match self {
            Group::Qkv => &[0, 1, 2],
            Group::O => &[3],
            Group::GateUp => &[4, 5],
            Group::Down => &[6],
        }
    }
}

/// A group's update as two products: `a` holds the adapted parts'
/// `lora_a` side by side (`[in, Σ rank]`), `b` their `scale · lora_b`
/// block-diagonally (`[Σ rank, Σ out]`, zeros where a part is not
/// adapted), so `(x a) b` is each part's `scale · (x A) B`, concatenated
/// as the fused projection's output is. The zeros add exact zeros.
struct GroupUpdate {
    a: Array,
    b: Array,
    /// DoRA's factors `[Σ out]` (1 where a part is plain LoRA or not adapted).
    rescale: Option<Array>,
    /// DoRA's `(1 - rescale) ⊙ bias` `[Σ out]`, for a base with biases.
    shift: Option<Array>,
}

impl GroupUpdate {
    /// `group`'s update in a layer whose projections are `adapted` and
    /// shaped `shape` ((in, out) per [`PROJECTIONS`]); `None` when none of
    /// its parts is adapted.
    fn build(
        group: Group,
        adapted: &[Option<LowRank>; 7],
        shape: &[(i32, i32); 7],
        base: &dyn Fn(usize) -> Result<(Array, Option<Array>)>,
        dtype: mlx_rs::Dtype,
    ) -> Result<Option<GroupUpdate>> {
        let parts = group.parts();
        let total: i32 = parts.iter().map(|&p| shape[p].1).sum();
        let (mut a_parts, mut b_rows) = (Vec::new(), Vec::new());
        let dora = parts.iter().any(|&p| adapted[p].as_ref().is_some_and(|lr| lr.magnitude.is_some()));
        let (mut rescales, mut shifts, mut biased) = (Vec::new(), Vec::new(), false);
        let mut offset = 0;
        for &p in parts {
            let out = shape[p].1;
            if dora {
                let (factor, bias) = match adapted[p].as_ref().filter(|lr| lr.magnitude.is_some()) {
                    Some(lr) => {
                        let (w, bias) = base(p)?;
                        (dora_factor(lr, &w)?, bias)
                    }
                    None => (mlx_rs::ops::ones::<f32>(&[out])?, None),
                };
                let shift = match &bias {
                    Some(b) => {
                        biased = true;
                        mlx_rs::ops::subtract(Array::from_f32(1.0), &factor)?
                            .multiply(b.as_dtype(mlx_rs::Dtype::Float32)?)?
                    }
                    None => mlx_rs::ops::zeros::<f32>(&[out])?,
                };
                rescales.push(factor);
                shifts.push(shift);
            }
            if let Some(lr) = &adapted[p] {
                let (rank, dtype) = (lr.a.shape()[1], lr.b.dtype());
                let scaled = lr.b.multiply(Array::from_f32(lr.scale).as_dtype(dtype)?)?;
                let mut row = Vec::new();
                if offset > 0 {
                    row.push(mlx_rs::ops::zeros_dtype(&[rank, offset], dtype)?);
                }
                row.push(scaled);
                if total - offset - out > 0 {
                    row.push(mlx_rs::ops::zeros_dtype(&[rank, total - offset - out], dtype)?);
                }
                a_parts.push(lr.a.clone());
                b_rows.push(mlx_rs::ops::concatenate(&row, 1)?);
            }
            offset += out;
        }
        if a_parts.is_empty() {
            return Ok(None);
        }
        // In the model's compute dtype: a cast of the input and of the
        // result would be two more operations per group and step (mlx-lm
        // computes an f32 adapter's products in f32 over f16 activations;
        // here they round to f16 once more on such a model: the CPU's
        // models are f32, where nothing changes).
        let update = GroupUpdate {
            a: mlx_rs::ops::concatenate(&a_parts, 1)?.as_dtype(dtype)?,
            b: mlx_rs::ops::concatenate(&b_rows, 0)?.as_dtype(dtype)?,
            rescale: dora.then(|| mlx_rs::ops::concatenate(&rescales, 0)).transpose()?,
            shift: biased.then(|| mlx_rs::ops::concatenate(&shifts, 0)).transpose()?,
        };
        mlx_rs::transforms::eval(update.arrays())?;
        Ok(Some(update))
    }

    fn arrays(&self) -> Vec<&Array> {
        [Some(&self.a), Some(&self.b), self.rescale.as_ref(), self.shift.as_ref()].into_iter().flatten().collect()
    }

    /// Its update for input `x`: `scale · (x A) B` in `x`'s dtype, with
    /// DoRA's factors. (The casts are no operations where the adapter is in
    /// `x`'s dtype already, as loading makes it.)
    fn update(&self, x: &Array) -> Result<Update, mlx_rs::error::Exception> {
        Ok(Update {
            x: x.clone(),
            a: self.a.as_dtype(x.dtype())?,
            xa: None,
            b: self.b.as_dtype(x.dtype())?,
            rescale: self.rescale.clone(),
            shift: self.shift.clone(),
        })
    }
}

/// DoRA's factor per output feature of a projection whose base weight is
/// `w` `[out, in]`: `m / ‖w + scale · Bᵀ Aᵀ‖` over each feature's weights,
/// as mlx-lm's `DoRALinear.__call__` computes it (f32).
fn dora_factor(lr: &LowRank, w: &Array) -> Result<Array> {
    let m = lr.magnitude.as_ref().context("a DoRA magnitude")?;
    let f32 = mlx_rs::Dtype::Float32;
    let scaled_b = lr.b.t().as_dtype(f32)?.multiply(Array::from_f32(lr.scale))?;
    let adapted = w.as_dtype(f32)?.add(scaled_b.matmul(lr.a.t().as_dtype(f32)?)?)?;
    let norm = adapted.square()?.sum_axis(1, false)?.sqrt()?;
    Ok(m.as_dtype(f32)?.divide(&norm)?)
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
    /// DoRA (magnitudes) rather than plain LoRA.
    pub dora: bool,
    /// Its updates, by layer then [`Group`].
    groups: Vec<[Option<GroupUpdate>; 4]>,
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
    /// Its products are kept in `dtype`, the model's activations'.
    pub fn load(
        name: &str,
        dir: &Path,
        shapes: &ProjectionShapes,
        base: BaseWeights,
        dtype: mlx_rs::Dtype,
    ) -> Result<Self> {
        let config_text = std::fs::read_to_string(dir.join("adapter_config.json"))
            .with_context(|| format!("adapter {name}: reading {}/adapter_config.json", dir.display()))?;
        let config: serde_json::Value =
            serde_json::from_str(&config_text).with_context(|| format!("adapter {name}: adapter_config.json"))?;
        let dora = match config.get("fine_tune_type").and_then(|t| t.as_str()).unwrap_or("lora") {
            "lora" => false,
            "dora" => true,
            other => bail!("adapter {name} is a {other:?} fine-tune, not LoRA or DoRA: serve the model it saved"),
        };
        let p = config.get("lora_parameters").context("adapter_config.json has no lora_parameters")?;
        let scale = p.get("scale").and_then(|s| s.as_f64()).unwrap_or(20.0) as f32;
        let path = dir.join("adapters.safetensors");
        let weights = Array::load_safetensors(&path)
            .map_err(|e| anyhow::anyhow!("adapter {name}: reading {}: {e}", path.display()))?;
        let mut layers: Vec<[Option<LowRank>; 7]> = (0..shapes.len()).map(|_| Default::default()).collect();
        let (mut bytes, mut rank) = (0u64, 0usize);
        // Per module: lora_a, lora_b and (DoRA) m.
        type Parts = (Option<Array>, Option<Array>, Option<Array>);
        let mut pairs: HashMap<String, Parts> = HashMap::new();
        for (key, array) in weights {
            let (module, leaf) = key.rsplit_once('.').unwrap_or((&key, ""));
            let slot = pairs.entry(module.to_string()).or_default();
            match leaf {
                "lora_a" => slot.0 = Some(array),
                "lora_b" => slot.1 = Some(array),
                "m" if dora => slot.2 = Some(array),
                _ => bail!(
                    "adapter {name}: {key} is not a {} weight ({})",
                    if dora { "DoRA" } else { "LoRA" },
                    if dora { "lora_a, lora_b, m" } else { "lora_a, lora_b" }
                ),
            }
        }
        for (module, (a, b, magnitude)) in pairs {
            let (Some(a), Some(b)) = (a, b) else { bail!("adapter {name}: {module} lacks lora_a or lora_b") };
            if dora && magnitude.is_none() {
                bail!("adapter {name} is DoRA, but {module} has no magnitude (m)");
            }
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
            if let Some(m) = &magnitude {
                if m.shape() != [outputs] {
                    bail!("adapter {name}: {module}'s magnitude is shaped {:?}, not [{outputs}]", m.shape());
                }
            }
            rank = rank.max(sa[1] as usize);
            layers[layer][which] = Some(LowRank { a, b, scale, magnitude });
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
        let mut groups = Vec::with_capacity(layers.len());
        for (layer, (adapted, shape)) in layers.iter().zip(shapes).enumerate() {
            let mut slots: [Option<GroupUpdate>; 4] = Default::default();
            for group in GROUPS {
                slots[group as usize] = GroupUpdate::build(group, adapted, shape, &|p| base(layer, p), dtype)
                    .with_context(|| format!("adapter {name}: layer {layer}"))?;
            }
            bytes += slots.iter().flatten().flat_map(GroupUpdate::arrays).map(|a| a.nbytes() as u64).sum::<u64>();
            groups.push(slots);
        }
        Ok(Self { name: name.to_string(), dir: dir.to_path_buf(), fingerprint, bytes, rank, dora, groups })
    }

    /// This adapter's update of `group` in layer `layer` for input `x`
    /// (`None` where it adapts none of the group's projections), to apply to
    /// the group's (fused) output: what mlx-lm's `LoRALinear` adds to each
    /// part, `scale · (x A) B` in `x`'s dtype, as two products for the
    /// whole group (fewer operations a step: on a CPU each costs more than
    /// its arithmetic at this rank), and `DoRALinear`'s factors.
    pub fn update(&self, layer: usize, group: Group, x: &Array) -> Result<Option<Update>, mlx_rs::error::Exception> {
        let Some(Some(g)) = self.groups.get(layer).map(|l| &l[group as usize]) else { return Ok(None) };
        Ok(Some(g.update(x)?))
    }

    /// True when it adapts some projection of layer `layer`.
    pub fn adapts(&self, layer: usize) -> bool {
        self.groups.get(layer).is_some_and(|l| l.iter().any(Option::is_some))
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
            Lora::Rows(r) => r.groups.get(layer).is_some_and(|l| l.iter().any(Option::is_some)),
        }
    }

    /// The rows' update of `group` in layer `layer` for its input `x`
    /// (`[rows, L, in]`), to apply to the group's (fused) output `[rows, L,
    /// Σ out]`; `None` where no row's adapter adapts it.
    pub fn update(&self, layer: usize, group: Group, x: &Array) -> Result<Option<Update>, mlx_rs::error::Exception> {
        match self {
            Lora::None => Ok(None),
            Lora::One(a) => a.update(layer, group, x),
            Lora::Rows(r) => r.update(layer, group, x),
        }
    }
}

/// Several rows' adapters stacked, per group, into `A` `[rows, in, R]`
/// and `B` `[rows, R, out]` (each row's [`GroupUpdate`], zeros past its
/// own width and for a row without one), so every row's update is one
/// batched product pair whatever the number of adapters.
pub struct RowAdapters {
    groups: Vec<[Option<RowGroup>; 4]>,
}

/// A group's stacked updates: `a` `[rows, in, R]`, `b` `[rows, R, out]`,
/// and where some row's adapter is DoRA its factors and shifts `[rows, 1,
/// out]` (1 and 0 for the other rows).
struct RowGroup {
    a: Array,
    b: Array,
    rescale: Option<Array>,
    shift: Option<Array>,
}

impl RowAdapters {
    /// Stacks `adapters` (one per row; `None`: the bare base).
    pub fn stack(adapters: &[Option<std::rc::Rc<LoraAdapter>>]) -> Result<Self> {
        let layers = adapters.iter().flatten().map(|a| a.groups.len()).max().unwrap_or(0);
        let mut out: Vec<[Option<RowGroup>; 4]> = (0..layers).map(|_| Default::default()).collect();
        for (layer, slots) in out.iter_mut().enumerate() {
            for (g, slot) in slots.iter_mut().enumerate() {
                let parts: Vec<Option<&GroupUpdate>> = adapters
                    .iter()
                    .map(|a| a.as_ref().and_then(|a| a.groups.get(layer)).and_then(|l| l[g].as_ref()))
                    .collect();
                let Some(like) = parts.iter().flatten().next() else { continue };
                let (inputs, outputs, dtype) = (like.a.shape()[0], like.b.shape()[1], like.a.dtype());
                let width = parts.iter().flatten().map(|u| u.a.shape()[1]).max().unwrap_or(0);
                // Few operations: every one is evaluated in the next step,
                // and on a GPU each costs the host ~6 µs. A restack comes
                // with every row that joins or leaves a batch of mixed
                // adapters, for every adapted group of every layer: an
                // adapter of the full width goes in as it is (no padding),
                // and the rows under none share one pair of zeros.
                let mut a_rows = Vec::with_capacity(parts.len());
                let mut b_rows = Vec::with_capacity(parts.len());
                let zeros = match parts.iter().any(Option::is_none) {
                    true => Some((
                        mlx_rs::ops::zeros_dtype(&[inputs, width], dtype)?,
                        mlx_rs::ops::zeros_dtype(&[width, outputs], dtype)?,
                    )),
                    false => None,
                };
                for p in &parts {
                    let (a, b) = match p {
                        Some(u) if u.a.shape()[1] == width => (u.a.clone(), u.b.clone()),
                        Some(u) => {
                            let r = u.a.shape()[1];
                            let pad_a: &[(i32, i32)] = &[(0, 0), (0, width - r)];
                            let pad_b: &[(i32, i32)] = &[(0, width - r), (0, 0)];
                            (mlx_rs::ops::pad(&u.a, pad_a, None, None)?, mlx_rs::ops::pad(&u.b, pad_b, None, None)?)
                        }
                        None => zeros.clone().expect("made when a row has no adapter"),
                    };
                    a_rows.push(a);
                    b_rows.push(b);
                }
                // Per row, its factors (or ones) and shifts (or zeros), `[rows, 1, out]`.
                let per_row = |pick: &dyn Fn(&GroupUpdate) -> Option<&Array>, fill: f32| -> Result<Option<Array>> {
                    if !parts.iter().flatten().any(|u| pick(u).is_some()) {
                        return Ok(None);
                    }
                    let rows = parts
                        .iter()
                        .map(|p| match p.and_then(pick) {
                            Some(v) => Ok(v.as_dtype(mlx_rs::Dtype::Float32)?),
                            None => Ok(mlx_rs::ops::full::<f32>(&[outputs], Array::from_f32(fill))?),
                        })
                        .collect::<Result<Vec<_>>>()?;
                    Ok(Some(mlx_rs::ops::stack(&rows, 0)?.expand_dims(1)?))
                };
                *slot = Some(RowGroup {
                    a: mlx_rs::ops::stack(&a_rows, 0)?,
                    b: mlx_rs::ops::stack(&b_rows, 0)?,
                    rescale: per_row(&|u| u.rescale.as_ref(), 1.0)?,
                    shift: per_row(&|u| u.shift.as_ref(), 0.0)?,
                });
            }
        }
        Ok(Self { groups: out })
    }

    fn update(&self, layer: usize, group: Group, x: &Array) -> Result<Option<Update>, mlx_rs::error::Exception> {
        let Some(Some(g)) = self.groups.get(layer).map(|l| &l[group as usize]) else { return Ok(None) };
        Ok(Some(Update {
            x: x.clone(),
            a: g.a.as_dtype(x.dtype())?,
            xa: None,
            b: g.b.as_dtype(x.dtype())?,
            rescale: g.rescale.clone(),
            shift: g.shift.clone(),
        }))
    }
}
