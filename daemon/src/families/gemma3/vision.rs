//! Gemma 3's vision side, composed as mlx-vlm's `gemma3.Model` composes it:
//! a fixed-size resize, the SigLIP tower and the projector. Image features
//! replace the `<image_soft_token>` positions of the prompt, divided by
//! sqrt(hidden) (the decoder scales every embedding back up).

use super::projector::Gemma3Projector;
use super::siglip::{SiglipConfig, SiglipTower};
use crate::model::family::{LanguageModel, Prepared, VisionTower};
use crate::model::weights::TensorMap;
use anyhow::{bail, Result};
use mlx_rs::Array;

/// The SigLIP tower and projector of a Gemma 3 checkpoint.
pub struct Gemma3Tower {
    pub tower: SiglipTower,
    pub projector: Gemma3Projector,
    pub image_token_id: u32,
    /// Padding positions carry no embedding in the reference.
    pub pad_token_id: u32,
    /// The decoder's hidden size: features are divided by its square root.
    pub hidden_size: i32,
}

impl Gemma3Tower {
    /// Loads `vision_tower.*` and `multi_modal_projector.*`.
    pub fn load(
        vision: SiglipConfig,
        mm_tokens_per_image: i32,
        hidden_size: i32,
        image_token_id: u32,
        t: &mut TensorMap,
    ) -> Result<Self> {
        let projector = Gemma3Projector::load(
            t,
            "multi_modal_projector",
            vision.image_size,
            vision.patch_size,
            mm_tokens_per_image,
            vision.layer_norm_eps,
        )?;
        Ok(Self {
            tower: SiglipTower::load(vision, t, "vision_tower.vision_model")?,
            projector,
            image_token_id,
            pad_token_id: 0,
            hidden_size,
        })
    }

    /// Image features `[tokens, hidden]` for pixels `[1, H, W, 3]`.
    pub fn encode_pixels(&self, pixels: &Array) -> Result<Array> {
        let f = self.projector.forward(&self.tower.forward(pixels)?)?;
        let (t, d) = (f.shape()[1], f.shape()[2]);
        Ok(f.reshape(&[t, d])?)
    }
}

impl VisionTower for Gemma3Tower {
    fn encode(&self, prepared: &Prepared) -> Result<Array> {
        self.encode_pixels(&Array::from_slice(&prepared.values, &prepared.shape))
    }

    fn splice(&self, lm: &dyn LanguageModel, ids: &[u32], images: &[Array]) -> Result<Array> {
        let hidden = self.hidden_size;
        let scale = Array::from_f32((hidden as f64).sqrt() as f32);
        let text = |seg: &[u32]| -> Result<Array> {
            let e = lm.embed(&Array::from_slice(seg, &[1, seg.len() as i32]))?;
            let keep: Vec<f32> = seg.iter().map(|&t| if t == self.pad_token_id { 0.0 } else { 1.0 }).collect();
            Ok(if keep.contains(&0.0) { e.multiply(Array::from_slice(&keep, &[1, seg.len() as i32, 1]))? } else { e })
        };
        let image = |f: &Array, run: usize| -> Result<Array> {
            if f.shape()[0] as usize != run {
                bail!("an image has {} feature rows but the prompt holds {run} placeholders", f.shape()[0]);
            }
            Ok(f.divide(&scale)?.reshape(&[1, run as i32, hidden])?)
        };
        crate::model::splice::splice(ids, self.image_token_id, images, text, image)
    }
}
