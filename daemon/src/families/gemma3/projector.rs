//! Gemma 3's multimodal projector, like mlx-vlm's `Gemma3MultiModalProjector`:
//! average-pool the tower's patch grid down to `mm_tokens_per_image`, RMS-norm
//! (Gemma's `1 + weight` form), then project to the text model's width.

use crate::model::weights::TensorMap;
use anyhow::Result;
use mlx_rs::{fast, Array};

/// A loaded projector.
pub struct Gemma3Projector {
    norm_weight: Array,
    projection: Array,
    eps: f32,
    patches_per_side: i32,
    tokens_per_side: i32,
}

impl Gemma3Projector {
    /// Loads `prefix.mm_soft_emb_norm.weight` and `prefix.mm_input_projection_weight`.
    pub fn load(
        t: &mut TensorMap,
        prefix: &str,
        image_size: i32,
        patch_size: i32,
        tokens_per_image: i32,
        eps: f32,
    ) -> Result<Self> {
        let norm_weight = t.float(&format!("{prefix}.mm_soft_emb_norm.weight"))?.add(Array::from_f32(1.0))?;
        Ok(Self {
            norm_weight,
            projection: t.float(&format!("{prefix}.mm_input_projection_weight"))?,
            eps,
            patches_per_side: image_size / patch_size,
            tokens_per_side: (tokens_per_image as f64).sqrt() as i32,
        })
    }

    /// Tokens per image after pooling.
    pub fn tokens(&self) -> i32 {
        self.tokens_per_side * self.tokens_per_side
    }

    /// `[B, patches, vision_hidden]` → `[B, tokens, text_hidden]`.
    pub fn forward(&self, x: &Array) -> Result<Array> {
        let (b, d) = (x.shape()[0], x.shape()[2]);
        let (p, t) = (self.patches_per_side, self.tokens_per_side);
        let k = p / t;
        // Non-overlapping k x k average pool over the (row, column) patch grid.
        let grid = x.reshape(&[b, t, k, t, k, d])?;
        let pooled = grid.mean_axes(&[2, 4], None)?.reshape(&[b, t * t, d])?;
        let normed = fast::rms_norm(&pooled, Some(&self.norm_weight), self.eps)?;
        Ok(normed.matmul(&self.projection)?)
    }
}
