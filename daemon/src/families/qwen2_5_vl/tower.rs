//! Qwen2.5-VL's vision tower, like mlx-vlm's `qwen2_5_vl/vision.py`: patch
//! embedding of (temporal 2 x 14 x 14) pixel cubes, 2-D rotary positions,
//! window attention (full attention in `fullatt_block_indexes`), RMS-norm
//! SwiGLU blocks, and a 2x2 patch merger into the language model's width.
//!
//! Verified on its own against mlx-vlm (daemon/tests/vision_towers.rs) and,
//! with the language model's multimodal rotary positions (`mrope`),
//! end to end against mlx-vlm's generate.

use crate::model::layers::Linear;
use crate::model::weights::TensorMap;
use anyhow::Result;
use mlx_rs::{fast, nn, ops, Array};

/// `vision_config` of a Qwen2.5-VL checkpoint.
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
pub struct Qwen25VisionConfig {
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
    #[serde(default = "d_window")]
    pub window_size: i32,
    #[serde(default)]
    pub fullatt_block_indexes: Vec<i32>,
}

fn d_patch() -> i32 {
    14
}
fn d_merge() -> i32 {
    2
}
fn d_temporal() -> i32 {
    2
}
fn d_window() -> i32 {
    112
}

struct Block {
    norm1: Array,
    norm2: Array,
    qkv: Linear,
    proj: Linear,
    gate: Linear,
    up: Linear,
    down: Linear,
}

/// A loaded Qwen2.5-VL tower.
pub struct Qwen25VisionTower {
    pub config: Qwen25VisionConfig,
    patch_weight: Array,
    blocks: Vec<Block>,
    merger_norm: Array,
    merger_fc1: Linear,
    merger_fc2: Linear,
}

impl Qwen25VisionTower {
    /// Loads `prefix.patch_embed`, `prefix.blocks.N`, `prefix.merger`.
    pub fn load(config: Qwen25VisionConfig, t: &mut TensorMap, prefix: &str) -> Result<Self> {
        let mut blocks = Vec::new();
        for i in 0..config.depth {
            let p = format!("{prefix}.blocks.{i}");
            blocks.push(Block {
                norm1: t.float(&format!("{p}.norm1.weight"))?,
                norm2: t.float(&format!("{p}.norm2.weight"))?,
                qkv: t.linear(&format!("{p}.attn.qkv"))?,
                proj: t.linear(&format!("{p}.attn.proj"))?,
                gate: t.linear(&format!("{p}.mlp.gate_proj"))?,
                up: t.linear(&format!("{p}.mlp.up_proj"))?,
                down: t.linear(&format!("{p}.mlp.down_proj"))?,
            });
        }
        let mut patch_weight = t.float(&format!("{prefix}.patch_embed.proj.weight"))?;
        // PyTorch Conv3d weights are [out, in, t, h, w]; MLX's are [out, t, h, w, in].
        if patch_weight.shape()[1] == 3 && patch_weight.shape()[4] != 3 {
            patch_weight = patch_weight.transpose_axes(&[0, 2, 3, 4, 1])?;
        }
        Ok(Self {
            merger_norm: t.float(&format!("{prefix}.merger.ln_q.weight"))?,
            merger_fc1: t.linear(&format!("{prefix}.merger.mlp.0"))?,
            merger_fc2: t.linear(&format!("{prefix}.merger.mlp.2"))?,
            patch_weight,
            blocks,
            config,
        })
    }

    /// Flattened patches `[N, 3*T*P*P]` of one image on a `grid = (t, h, w)`
    /// patch grid → merged features `[N / merge², out_hidden]`, in raster order.
    pub fn forward(&self, patches: &Array, grid: (i32, i32, i32)) -> Result<Array> {
        let c = &self.config;
        let (p, tp) = (c.patch_size, c.temporal_patch_size);
        let n = patches.shape()[0];
        let unit = c.spatial_merge_size * c.spatial_merge_size;
        // Conv3d with kernel == stride is one matmul over each cube, channels last.
        let cubes = patches.reshape(&[n, 3, tp, p, p])?.transpose_axes(&[0, 2, 3, 4, 1])?.reshape(&[n, -1])?;
        let w = self.patch_weight.reshape(&[c.hidden_size, -1])?;
        let x = cubes.matmul(w.t())?;

        let (window_index, cu_windows) =
            window_index(grid, c.spatial_merge_size, c.window_size / c.spatial_merge_size / p);
        let rotary = rotary(grid, c.spatial_merge_size, c.hidden_size / c.num_heads);
        let order = Array::from_slice(&window_index, &[window_index.len() as i32]);
        let reorder = |a: &Array| -> Result<Array> {
            let d = a.shape()[1];
            Ok(a.reshape(&[n / unit, unit, d])?.take_axis(&order, 0)?.reshape(&[n, d])?)
        };
        let mut x = reorder(&x)?;
        let rotary = reorder(&rotary)?;
        let (cos, sin) = (ops::cos(&rotary)?, ops::sin(&rotary)?);
        let cos = ops::concatenate(&[&cos, &cos], -1)?.reshape(&[n, 1, -1])?;
        let sin = ops::concatenate(&[&sin, &sin], -1)?.reshape(&[n, 1, -1])?;
        // Images have one temporal patch (grid t = 1): full attention spans them.
        let full = [0, n];
        let window_mask = block_mask(&cu_windows, n);
        let full_mask = block_mask(&full, n);
        for (i, b) in self.blocks.iter().enumerate() {
            let mask = if c.fullatt_block_indexes.contains(&(i as i32)) { &full_mask } else { &window_mask };
            let y = fast::rms_norm(&x, Some(&b.norm1), 1e-6)?;
            x = x.add(self.attention(b, &y, &cos, &sin, mask)?)?;
            let y = fast::rms_norm(&x, Some(&b.norm2), 1e-6)?;
            x = x.add(b.down.forward(&nn::silu(b.gate.forward(&y)?)?.multiply(b.up.forward(&y)?)?)?)?;
        }
        let merged = fast::rms_norm(&x, Some(&self.merger_norm), 1e-6)?.reshape(&[n / unit, -1])?;
        let merged = self.merger_fc2.forward(&nn::gelu(self.merger_fc1.forward(&merged)?)?)?;
        let mut reverse = vec![0i32; window_index.len()];
        for (pos, &src) in window_index.iter().enumerate() {
            reverse[src as usize] = pos as i32;
        }
        Ok(merged.take_axis(Array::from_slice(&reverse, &[reverse.len() as i32]), 0)?)
    }

    fn attention(&self, b: &Block, x: &Array, cos: &Array, sin: &Array, mask: &Array) -> Result<Array> {
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
            fast::ScaledDotProductAttentionMask::Array(mask),
            None,
        )?;
        b.proj.forward(&o.reshape(&[heads, n, -1])?.transpose_axes(&[1, 0, 2])?.reshape(&[n, -1])?)
    }
}

/// Boolean `[n, n]` mask: positions attend within their segment of `bounds`.
pub(crate) fn block_mask(bounds: &[i32], n: i32) -> Array {
    let seg = |i: i32| bounds.windows(2).position(|w| i >= w[0] && i < w[1]).unwrap_or(usize::MAX);
    let segs: Vec<usize> = (0..n).map(seg).collect();
    let allowed: Vec<bool> =
        (0..n as usize).flat_map(|i| (0..n as usize).map(move |j| (i, j))).map(|(i, j)| segs[i] == segs[j]).collect();
    Array::from_slice(&allowed, &[n, n])
}

/// mlx-vlm's `get_window_index` for one image: the order of merged units
/// grouped by window, and cumulative patch counts at window boundaries.
fn window_index(grid: (i32, i32, i32), merge: i32, window: i32) -> (Vec<i32>, Vec<i32>) {
    let (gt, gh, gw) = (grid.0, grid.1 / merge, grid.2 / merge);
    let (pad_h, pad_w) = (window - gh % window, window - gw % window);
    let (nh, nw) = ((gh + pad_h) / window, (gw + pad_w) / window);
    let unit = merge * merge;
    let mut index = Vec::new();
    let mut cu = vec![0];
    for t in 0..gt {
        for wh in 0..nh {
            for ww in 0..nw {
                let mut count = 0;
                for y in wh * window..(wh + 1) * window {
                    for x in ww * window..(ww + 1) * window {
                        if y < gh && x < gw {
                            index.push(t * gh * gw + y * gw + x);
                            count += 1;
                        }
                    }
                }
                let last = *cu.last().unwrap();
                let next = last + count * unit;
                if next != last {
                    cu.push(next);
                }
            }
        }
    }
    (index, cu)
}

/// 2-D rotary angles `[N, head_dim / 2]` for patches in merge order.
pub(crate) fn rotary(grid: (i32, i32, i32), merge: i32, head_dim: i32) -> Array {
    let dim = head_dim / 2;
    let inv: Vec<f32> = (0..dim).step_by(2).map(|k| 1.0 / 10000f32.powf(k as f32 / dim as f32)).collect();
    let mut rows = Vec::new();
    for _ in 0..grid.0 {
        for hb in 0..grid.1 / merge {
            for wb in 0..grid.2 / merge {
                for i in 0..merge {
                    for j in 0..merge {
                        let (h, w) = ((hb * merge + i) as f32, (wb * merge + j) as f32);
                        rows.extend(inv.iter().map(|f| h * f));
                        rows.extend(inv.iter().map(|f| w * f));
                    }
                }
            }
        }
    }
    let n = rows.len() as i32 / dim;
    Array::from_slice(&rows, &[n, dim])
}

/// HF `smart_resize` for Qwen2-VL/2.5-VL: both sides multiples of `factor`
/// (28), the pixel count kept within [min_pixels, max_pixels], aspect ratio
/// preserved as far as possible. Python's `round` is half-to-even.
pub fn smart_resize(height: u32, width: u32, factor: u32, min_pixels: u64, max_pixels: u64) -> (u32, u32) {
    let (h, w, f) = (height as f64, width as f64, factor as f64);
    let mut hb = (h / f).round_ties_even() * f;
    let mut wb = (w / f).round_ties_even() * f;
    if hb * wb > max_pixels as f64 {
        let beta = (h * w / max_pixels as f64).sqrt();
        hb = f.max((h / beta / f).floor() * f);
        wb = f.max((w / beta / f).floor() * f);
    } else if hb * wb < min_pixels as f64 {
        let beta = (min_pixels as f64 / (h * w)).sqrt();
        hb = (h * beta / f).ceil() * f;
        wb = (w * beta / f).ceil() * f;
    }
    (hb as u32, wb as u32)
}

/// Normalized pixels `[H, W, 3]` (H, W multiples of patch * merge) → the
/// processor's flattened patches `[H/P * W/P, 3 * T * P * P]`: the frame is
/// repeated `temporal` times and patches are ordered merge group by merge group.
pub fn patchify(pixels: &[f32], height: usize, width: usize, patch: usize, merge: usize, temporal: usize) -> Vec<f32> {
    patchify_frames(&vec![pixels; temporal], height, width, patch, merge)
}

/// [`patchify`] for one temporal group of distinct frames (a video's):
/// each patch holds, per channel, its pixels in every frame in turn.
pub fn patchify_frames(frames: &[&[f32]], height: usize, width: usize, patch: usize, merge: usize) -> Vec<f32> {
    let (gh, gw) = (height / patch, width / patch);
    let mut out = Vec::with_capacity(height * width * 3 * frames.len());
    for hb in 0..gh / merge {
        for wb in 0..gw / merge {
            for i in 0..merge {
                for j in 0..merge {
                    let (py, px) = (hb * merge + i, wb * merge + j);
                    for c in 0..3 {
                        for pixels in frames {
                            for y in 0..patch {
                                for x in 0..patch {
                                    out.push(pixels[((py * patch + y) * width + px * patch + x) * 3 + c]);
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smart_resize_matches_hf() {
        // Values from transformers' qwen2_vl smart_resize (factor 28, 56*56 .. 28*28*1280).
        let (min, max) = (56 * 56, 28 * 28 * 1280);
        assert_eq!(smart_resize(480, 640, 28, min, max), (476, 644));
        assert_eq!(smart_resize(42, 42, 28, min, max), (56, 56));
        assert_eq!(smart_resize(3000, 4000, 28, min, max), (840, 1148));
        // 70 / 28 = 2.5 rounds to even (2), as Python does.
        assert_eq!(smart_resize(70, 70, 28, min, max).0, 56);
    }
}
