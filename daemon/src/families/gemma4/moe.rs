//! Gemma 4's mixture-of-experts feed-forward (26B-A4B), op for op like
//! mlx-vlm 0.7.10's `gemma4/language.py` (`Router`, `Experts`) and
//! `switch_layers.py` (`SwitchGLU`): beside the dense MLP, a router picks
//! each position's top-k experts and weighs them, and the chosen experts'
//! GELU-gated projections run through `gather_mm` (`gather_qmm` on packed
//! 4-bit weights), so only they are computed. Weights by mlx-vlm's names
//! after its sanitize (`experts.switch_glu.{gate,up,down}_proj`, stacked
//! `[experts, out, in]`), as mlx-community directories hold them.

use crate::model::layers::Linear;
use crate::model::sharding::Split;
use crate::model::weights::TensorMap;
use anyhow::{bail, Result};
use mlx_rs::{fast, nn, ops, ops::indexing::IndexOp, Array};

/// One layer's router, experts and the norms around them.
pub(super) struct MoeBlock {
    router: Linear,
    /// The router's RMS-norm weight, `scale · hidden^-0.5`, as mlx-vlm folds it.
    router_norm: Array,
    per_expert_scale: Array,
    top_k: i32,
    gate: Linear,
    up: Linear,
    down: Linear,
    /// Normalizes the dense MLP's output before the two branches are summed.
    pub post_dense_norm: Array,
    pre_experts_norm: Array,
    post_experts_norm: Array,
    /// Whether this rank holds a block of every expert's features (its
    /// branch's output is then a partial sum over the ranks).
    pub split_experts: bool,
}

impl MoeBlock {
    /// Loads layer `p`'s router and experts; with a split, each expert's
    /// intermediate features are cut in place (gate/up rows, down columns,
    /// mlx-lm's `SwitchGLU` shard), the router replicated.
    pub fn load(t: &mut TensorMap, p: &str, hidden: i32, experts: i32, top_k: i32, split: &Split) -> Result<Self> {
        if top_k < 1 || top_k > experts {
            bail!("Gemma 4 MoE: top_k_experts {top_k} of num_experts {experts}");
        }
        let scale = t.float(&format!("{p}.router.scale"))?;
        let e = format!("{p}.experts.switch_glu");
        let router = t.linear(&format!("{p}.router.proj"))?;
        let per_expert_scale = t.float(&format!("{p}.router.per_expert_scale"))?;
        let (gate, up, down) = (
            t.linear(&format!("{e}.gate_proj"))?,
            t.linear(&format!("{e}.up_proj"))?,
            t.linear(&format!("{e}.down_proj"))?,
        );
        // The router's picks index the scales and the stacks, and MLX's
        // gathers do not bound-check: every one must hold `experts` rows.
        let rows = |l: &Linear| match l {
            Linear::Dense { weight, .. } => weight.shape()[0],
            Linear::Quantized { q, .. } => q.weight.shape()[0],
        };
        let counts = [rows(&router), per_expert_scale.shape()[0], rows(&gate), rows(&up), rows(&down)];
        if counts.iter().any(|&n| n != experts) || [&gate, &up, &down].iter().any(|l| l.arrays()[0].ndim() != 3) {
            bail!(
                "{p}: Gemma 4 MoE weights hold {counts:?} experts (router, scales, gate, up, down), config {experts}"
            );
        }
        let width = gate.out_features();
        let on = split.shard.is_some() && split.can_cut_cols(&down, width);
        let (gate, up, down) = (split.rows(gate, width, on)?, split.rows(up, width, on)?, split.cols(down, width, on)?);
        Ok(Self {
            split_experts: on,
            router,
            router_norm: scale.multiply(Array::from_f32((hidden as f64).powf(-0.5) as f32))?,
            per_expert_scale,
            top_k,
            gate,
            up,
            down,
            post_dense_norm: t.float(&format!("{p}.post_feedforward_layernorm_1.weight"))?,
            pre_experts_norm: t.float(&format!("{p}.pre_feedforward_layernorm_2.weight"))?,
            post_experts_norm: t.float(&format!("{p}.post_feedforward_layernorm_2.weight"))?,
        })
    }

    /// The experts' branch for the residual stream `h` `[B, L, D]` before
    /// its last norm: route, run the chosen experts, weigh and sum them
    /// (this rank's part of the sum when the experts are split).
    pub fn experts_unnormed(&self, h: &Array, eps: f32) -> Result<Array> {
        let scores = self.router.forward(&fast::rms_norm(h, Some(&self.router_norm), eps)?)?;
        let k = self.top_k;
        let picked = ops::argpartition_axis(&scores, -k, -1)?;
        let last = *picked.shape().last().unwrap();
        let picked = picked.index((.., .., last - k..));
        let weights = ops::softmax_axis(&scores.take_along_axis(&picked, -1)?, -1, None)?
            .multiply(self.per_expert_scale.take(&picked)?)?;
        // [B, L, 1, 1, D] against the picked experts' [D, I]: [B, L, k, 1, I].
        let x = fast::rms_norm(h, Some(&self.pre_experts_norm), eps)?;
        let x = ops::expand_dims_axes(&x, &[-2, -3])?;
        let up = switch(&self.up, &x, &picked)?;
        let gate = switch(&self.gate, &x, &picked)?;
        let y = switch(&self.down, &nn::gelu_approximate(&gate)?.multiply(&up)?, &picked)?.squeeze_axes(&[-2])?;
        Ok(y.multiply(ops::expand_dims(&weights, -1)?)?.sum_axis(-2, None)?)
    }

    /// The branch's last norm, over the ranks' summed output.
    pub fn finish(&self, summed: &Array, eps: f32) -> Result<Array> {
        Ok(fast::rms_norm(summed, Some(&self.post_experts_norm), eps)?)
    }
}

/// `x` through the experts `indices` picks of a stacked projection
/// (mlx-vlm's `SwitchLinear`).
fn switch(projection: &Linear, x: &Array, indices: &Array) -> Result<Array> {
    Ok(match projection {
        Linear::Dense { weight, bias: None } => ops::gather_mm(x, weight.swap_axes(-1, -2)?, None, indices, false)?,
        Linear::Quantized { q, bias: None } => {
            ops::gather_qmm(x, &q.weight, &q.scales, &q.biases, None, indices, true, q.group_size, q.bits, false)?
        }
        _ => bail!("Gemma 4's experts have no biases"),
    })
}
