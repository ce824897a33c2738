//! Gemma 3 as a vision-language model: the text decoder, the SigLIP tower
//! and the projector composed as mlx-vlm's `gemma3.Model` composes them.
//! Image features replace the `<image_soft_token>` positions of the prompt,
//! divided by sqrt(hidden) (the decoder scales every embedding back up).

use super::gemma3_projector::Gemma3Projector;
use super::siglip::{SiglipConfig, SiglipTower};
use crate::model::gemma3_text::{Gemma3Text, Gemma3TextConfig};
use crate::model::weights::TensorMap;
use anyhow::{bail, Result};
use mlx_rs::Array;

/// A loaded Gemma 3 VLM.
pub struct Gemma3Vlm {
    pub text: Gemma3Text,
    pub tower: SiglipTower,
    pub projector: Gemma3Projector,
    pub image_token_id: u32,
    pub pad_token_id: u32,
    /// Attend bidirectionally within each image during prefill (Gemma 3's
    /// training and HF's behaviour). mlx-vlm 0.7.10 attends causally: its
    /// 4-D mask is dropped on the way to the language model.
    pub bidirectional_images: bool,
}

impl Gemma3Vlm {
    /// Loads from checkpoint tensors (`language_model.*`, `vision_tower.*`,
    /// `multi_modal_projector.*`).
    pub fn load(text: Gemma3TextConfig, vision: SiglipConfig, image_token_id: u32, t: &mut TensorMap) -> Result<Self> {
        let projector = Gemma3Projector::load(
            t,
            "multi_modal_projector",
            vision.image_size,
            vision.patch_size,
            text.mm_tokens_per_image,
            vision.layer_norm_eps,
        )?;
        Ok(Self {
            tower: SiglipTower::load(vision, t, "vision_tower.vision_model")?,
            text: Gemma3Text::load(text, t, "language_model")?,
            projector,
            image_token_id,
            pad_token_id: 0,
            bidirectional_images: true,
        })
    }

    /// For each position of `ids`, the index of the image it belongs to, or -1.
    pub fn image_blocks(&self, ids: &[u32]) -> Vec<i32> {
        let mut block = -1;
        let mut out = Vec::with_capacity(ids.len());
        for (i, &t) in ids.iter().enumerate() {
            if t == self.image_token_id {
                if i == 0 || ids[i - 1] != self.image_token_id {
                    block += 1;
                }
                out.push(block);
            } else {
                out.push(-1);
            }
        }
        out
    }

    /// Image features `[tokens, hidden]` for pixels `[1, H, W, 3]`.
    pub fn encode_image(&self, pixels: &Array) -> Result<Array> {
        let f = self.projector.forward(&self.tower.forward(pixels)?)?;
        let (t, d) = (f.shape()[1], f.shape()[2]);
        Ok(f.reshape(&[t, d])?)
    }

    /// Prompt embeddings `[1, L, hidden]` with `images` (one `[tokens, hidden]`
    /// array per image, in order) spliced over the image-token runs.
    pub fn prompt_embeddings(&self, ids: &[u32], images: &[Array]) -> Result<Array> {
        let hidden = self.text.config.hidden_size;
        let scale = Array::from_f32((hidden as f64).sqrt() as f32);
        let text = |seg: &[u32]| -> Result<Array> {
            let e = self.text.embed(&Array::from_slice(seg, &[1, seg.len() as i32]))?;
            // Padding positions carry no embedding in the reference.
            let keep: Vec<f32> = seg.iter().map(|&t| if t == self.pad_token_id { 0.0 } else { 1.0 }).collect();
            Ok(if keep.contains(&0.0) { e.multiply(Array::from_slice(&keep, &[1, seg.len() as i32, 1]))? } else { e })
        };
        let image = |f: &Array, run: usize| -> Result<Array> {
            if f.shape()[0] as usize != run {
                bail!("an image has {} feature rows but the prompt holds {run} placeholders", f.shape()[0]);
            }
            Ok(f.divide(&scale)?.reshape(&[1, run as i32, hidden])?)
        };
        super::splice(ids, self.image_token_id, images, text, image)
    }
}
