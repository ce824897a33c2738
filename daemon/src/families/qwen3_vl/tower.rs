//! Qwen3-VL's vision tower, like mlx-vlm's `qwen3_vl/vision.py`: patch
//! embedding of (temporal 2 x 16 x 16) pixel cubes with a bias, a learned
//! position table bilinearly interpolated to the image's grid, 2-D rotary
//! positions, full attention within each frame, LayerNorm GELU blocks, a
//! 2x2 merger into the language model's width, and **deepstack** mergers:
//! the outputs of chosen blocks, merged the same way, which the language
//! model adds to its hidden states at the visual positions after its first
//! layers.
//!
//! Verified against mlx-vlm 0.7.10's classes on the same random weights
//! and patches (daemon/tests/vision_towers.rs).

use crate::families::qwen2_5_vl::tower::{block_mask, rotary};
use crate::model::layers::{Embedding, LayerNorm, Linear};
use crate::model::weights::TensorMap;
use anyhow::{ensure, Result};
use mlx_rs::{fast, nn, ops, Array};

/// `vision_config` of a Qwen3-VL (and Qwen3.5) checkpoint.
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
pub struct Qwen3VisionConfig {
    pub depth: i32,
    pub hidden_size: i32,
    pub intermediate_size: i32,
    pub out_hidden_size: i32,
    pub num_heads: i32,
    #[serde(default = "d_patch")]
    pub patch_size: i32,
    #[serde(default = "d_merge")]
    pub spatial_merge_size: i32,
    #[serde(default = "d_temporal")]
    pub temporal_patch_size: i32,
    #[serde(default = "d_positions")]
    pub num_position_embeddings: i32,
    /// Blocks whose outputs feed the deepstack mergers, in the order the
    /// language model's first layers take them.
    #[serde(default)]
    pub deepstack_visual_indexes: Vec<i32>,
}

fn d_patch() -> i32 {
    16
}
fn d_merge() -> i32 {
    2
}
fn d_temporal() -> i32 {
    2
}
fn d_positions() -> i32 {
    2304
}

/// The tower's LayerNorm epsilon (mlx-vlm's Qwen3-VL passes 1e-6).
const TOWER_LN_EPS: f32 = 1e-6;

struct Block {
    norm1: LayerNorm,
    norm2: LayerNorm,
    qkv: Linear,
    proj: Linear,
    fc1: Linear,
    fc2: Linear,
}

/// A 2x2 merger: LayerNorm (before the 2x2 regrouping for the main merger,
/// after it for the deepstack ones) → Linear → GELU → Linear.
struct Merger {
    norm: LayerNorm,
    norm_after_shuffle: bool,
    fc1: Linear,
    fc2: Linear,
}

impl Merger {
    fn load(t: &mut TensorMap, prefix: &str, norm_after_shuffle: bool) -> Result<Self> {
        Ok(Self {
            norm: LayerNorm::load(t, &format!("{prefix}.norm"), TOWER_LN_EPS)?,
            norm_after_shuffle,
            fc1: t.linear(&format!("{prefix}.linear_fc1"))?,
            fc2: t.linear(&format!("{prefix}.linear_fc2"))?,
        })
    }

    /// `[N, hidden]` patches in merge order → `[N / 4, out_hidden]`.
    fn forward(&self, x: &Array, unit: i32) -> Result<Array> {
        let d = x.shape()[1] * unit;
        let x = if self.norm_after_shuffle {
            self.norm.forward(&x.reshape(&[-1, d])?)?
        } else {
            self.norm.forward(x)?.reshape(&[-1, d])?
        };
        self.fc2.forward(&nn::gelu(self.fc1.forward(&x)?)?)
    }
}

/// A loaded Qwen3-VL tower.
pub struct Qwen3VisionTower {
    pub config: Qwen3VisionConfig,
    patch_weight: Array,
    patch_bias: Array,
    pos_embed: Embedding,
    pos_rows: i32,
    blocks: Vec<Block>,
    merger: Merger,
    deepstack: Vec<Merger>,
}

impl Qwen3VisionTower {
    /// Loads `prefix.patch_embed`, `prefix.pos_embed`, `prefix.blocks.N`,
    /// `prefix.merger` and `prefix.deepstack_merger_list.N`.
    pub fn load(config: Qwen3VisionConfig, t: &mut TensorMap, prefix: &str) -> Result<Self> {
        let mut blocks = Vec::new();
        for i in 0..config.depth {
            let p = format!("{prefix}.blocks.{i}");
            blocks.push(Block {
                norm1: LayerNorm::load(t, &format!("{p}.norm1"), TOWER_LN_EPS)?,
                norm2: LayerNorm::load(t, &format!("{p}.norm2"), TOWER_LN_EPS)?,
                qkv: t.linear(&format!("{p}.attn.qkv"))?,
                proj: t.linear(&format!("{p}.attn.proj"))?,
                fc1: t.linear(&format!("{p}.mlp.linear_fc1"))?,
                fc2: t.linear(&format!("{p}.mlp.linear_fc2"))?,
            });
        }
        let mut patch_weight = t.float(&format!("{prefix}.patch_embed.proj.weight"))?;
        // PyTorch Conv3d weights are [out, in, t, h, w]; MLX's are [out, t, h, w, in].
        if patch_weight.shape()[1] == 3 && patch_weight.shape()[4] != 3 {
            patch_weight = patch_weight.transpose_axes(&[0, 2, 3, 4, 1])?;
        }
        let deepstack = (0..config.deepstack_visual_indexes.len())
            .map(|j| Merger::load(t, &format!("{prefix}.deepstack_merger_list.{j}"), true))
            .collect::<Result<Vec<_>>>()?;
        // A quantized checkpoint may quantize the table: looked up, not read.
        let pos_embed = t.embedding(&format!("{prefix}.pos_embed"))?;
        let pos_rows = config.num_position_embeddings;
        let side = (pos_rows as f64).sqrt() as i32;
        ensure!(side * side == pos_rows, "num_position_embeddings {pos_rows} is not a square");
        Ok(Self {
            patch_bias: t.float(&format!("{prefix}.patch_embed.proj.bias"))?,
            merger: Merger::load(t, &format!("{prefix}.merger"), false)?,
            patch_weight,
            pos_embed,
            pos_rows,
            blocks,
            deepstack,
            config,
        })
    }

    /// Deepstack tensors each image's features carry after the main ones.
    pub fn deepstack_count(&self) -> usize {
        self.deepstack.len()
    }

    /// Flattened patches `[N, 3*T*P*P]` on a `grid = (t, h, w)` patch grid
    /// (in the processor's merge order) → the merged features
    /// `[N / merge², out_hidden]` and one deepstack tensor of that shape per
    /// deepstack merger.
    pub fn forward(&self, patches: &Array, grid: (i32, i32, i32)) -> Result<(Array, Vec<Array>)> {
        let c = &self.config;
        let (p, tp) = (c.patch_size, c.temporal_patch_size);
        let n = patches.shape()[0];
        ensure!(n == grid.0 * grid.1 * grid.2, "{n} patches for a {grid:?} grid");
        let unit = c.spatial_merge_size * c.spatial_merge_size;
        // Conv3d with kernel == stride is one matmul over each cube, channels last.
        let cubes = patches.reshape(&[n, 3, tp, p, p])?.transpose_axes(&[0, 2, 3, 4, 1])?.reshape(&[n, -1])?;
        let w = self.patch_weight.reshape(&[c.hidden_size, -1])?;
        let mut x = cubes.matmul(w.t())?.add(&self.patch_bias)?.add(self.interpolated_positions(grid)?)?;

        let rotary = rotary(grid, c.spatial_merge_size, c.hidden_size / c.num_heads);
        let (cos, sin) = (ops::cos(&rotary)?, ops::sin(&rotary)?);
        let cos = ops::concatenate(&[&cos, &cos], -1)?.reshape(&[n, 1, -1])?;
        let sin = ops::concatenate(&[&sin, &sin], -1)?.reshape(&[n, 1, -1])?;
        // Each frame (temporal patch) attends within itself; one frame (an
        // image) needs no mask, which would be n² booleans at full size.
        let frame = grid.1 * grid.2;
        let bounds: Vec<i32> = (0..=grid.0).map(|f| f * frame).collect();
        let mask = (grid.0 > 1).then(|| block_mask(&bounds, n));
        let mut deepstack = Vec::new();
        for (i, b) in self.blocks.iter().enumerate() {
            let y = b.norm1.forward(&x)?;
            x = x.add(self.attention(b, &y, &cos, &sin, mask.as_ref())?)?;
            let y = b.norm2.forward(&x)?;
            x = x.add(b.fc2.forward(&nn::gelu_approximate(b.fc1.forward(&y)?)?)?)?;
            if let Some(j) = c.deepstack_visual_indexes.iter().position(|&d| d == i as i32) {
                deepstack.push(self.deepstack[j].forward(&x, unit)?);
            }
        }
        Ok((self.merger.forward(&x, unit)?, deepstack))
    }

    /// mlx-vlm's `fast_pos_embed_interpolate`: the `S x S` learned table
    /// sampled bilinearly at `h x w` evenly spaced points (corners aligned),
    /// repeated per frame, in merge order: `[N, hidden]`.
    fn interpolated_positions(&self, (t, h, w): (i32, i32, i32)) -> Result<Array> {
        let side = (self.pos_rows as f64).sqrt() as i32;
        let m = self.config.spatial_merge_size;
        // mx.linspace in f32: start + i * (stop - start) / (num - 1).
        let points = |num: i32| -> Vec<f32> {
            let step = if num > 1 { (side - 1) as f32 / (num - 1) as f32 } else { 0.0 };
            (0..num).map(|i| i as f32 * step).collect()
        };
        let (hs, ws) = (points(h), points(w));
        let mut index = vec![Vec::new(); 4];
        let mut weight = vec![Vec::new(); 4];
        for _ in 0..t {
            for hb in 0..h / m {
                for wb in 0..w / m {
                    for i in 0..m {
                        for j in 0..m {
                            let (y, x) = (hs[(hb * m + i) as usize], ws[(wb * m + j) as usize]);
                            let (y0, x0) = (y as i32, x as i32);
                            let (y1, x1) = ((y0 + 1).min(side - 1), (x0 + 1).min(side - 1));
                            let (dy, dx) = (y - y0 as f32, x - x0 as f32);
                            let corners = [
                                (y0 * side + x0, (1.0 - dy) * (1.0 - dx)),
                                (y0 * side + x1, (1.0 - dy) * dx),
                                (y1 * side + x0, dy * (1.0 - dx)),
                                (y1 * side + x1, dy * dx),
                            ];
                            for (k, (idx, wt)) in corners.into_iter().enumerate() {
                                index[k].push(idx);
                                weight[k].push(wt);
                            }
                        }
                    }
                }
            }
        }
        let n = index[0].len() as i32;
        let index: Vec<i32> = index.concat();
        let weight: Vec<f32> = weight.concat();
        let rows = self.pos_embed.lookup(&Array::from_slice(&index, &[4 * n]))?.reshape(&[4, n, -1])?;
        let weighted = rows.multiply(Array::from_slice(&weight, &[4, n, 1]))?;
        Ok(weighted.sum_axis(0, None)?)
    }

    fn attention(&self, b: &Block, x: &Array, cos: &Array, sin: &Array, mask: Option<&Array>) -> Result<Array> {
        let heads = self.config.num_heads;
        let n = x.shape()[0];
        let qkv = b.qkv.forward(x)?.reshape(&[n, 3, heads, -1])?;
        let part = |i: i32| -> Result<Array> {
            Ok(qkv.take_axis(Array::from_slice(&[i], &[1]), 1)?.reshape(&[n, heads, -1])?)
        };
        let rope = |a: Array| -> Result<Array> {
            let half = a.shape()[2] / 2;
            let lo = a.take_axis(Array::from_slice(&(0..half).collect::<Vec<i32>>(), &[half]), 2)?;
            let hi = a.take_axis(Array::from_slice(&(half..2 * half).collect::<Vec<i32>>(), &[half]), 2)?;
            let rotated = ops::concatenate(&[&ops::negative(&hi)?, &lo], -1)?;
            Ok(a.multiply(cos)?.add(rotated.multiply(sin)?)?)
        };
        let to_heads = |a: Array| -> Result<Array> { Ok(a.transpose_axes(&[1, 0, 2])?.reshape(&[1, heads, n, -1])?) };
        let q = to_heads(rope(part(0)?)?)?;
        let k = to_heads(rope(part(1)?)?)?;
        let v = to_heads(part(2)?)?;
        let scale = ((self.config.hidden_size / heads) as f64).powf(-0.5) as f32;
        let o = fast::scaled_dot_product_attention(
            &q,
            &k,
            &v,
            scale,
            mask.map(fast::ScaledDotProductAttentionMask::Array),
            None,
        )?;
        b.proj.forward(&o.reshape(&[heads, n, -1])?.transpose_axes(&[1, 0, 2])?.reshape(&[n, -1])?)
    }
}
