//! Qwen2.5-VL as a vision-language model: the tower's merged features
//! replace the `<|image_pad|>` runs of the prompt, and the Qwen2 decoder uses
//! multimodal rotary positions (see `mrope`). Features are stored as
//! `[grid_h / 2, grid_w / 2, hidden]` so a stored entry still says its grid.

use super::qwen25_vl_tower::{patchify, smart_resize, Qwen25VisionTower};
use crate::model::transformer::Transformer;
use anyhow::{bail, Result};
use mlx_rs::Array;

/// Qwen2-VL image processor parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct Qwen25Preprocess {
    pub min_pixels: u64,
    pub resample: super::image::Resample,
    pub max_pixels: u64,
    pub mean: [f32; 3],
    pub std: [f32; 3],
}

impl Qwen25Preprocess {
    /// Stable description for feature-store keys.
    pub fn describe(&self) -> String {
        format!(
            "qwen2vl;smart_resize=28,{},{};{};mean={:?};std={:?}",
            self.min_pixels,
            self.max_pixels,
            self.resample.name(),
            self.mean,
            self.std
        )
    }
}

/// A loaded Qwen2.5-VL.
pub struct Qwen25Vlm {
    pub text: Transformer,
    pub tower: Qwen25VisionTower,
    pub image_token_id: u32,
    pub preprocess: Qwen25Preprocess,
}

impl Qwen25Vlm {
    /// Features `[grid_h / 2, grid_w / 2, hidden]` of an image.
    pub fn encode_image(&self, img: &image::RgbImage) -> Result<Array> {
        let c = &self.tower.config;
        let factor = (c.patch_size * c.spatial_merge_size) as u32;
        let (h, w) =
            smart_resize(img.height(), img.width(), factor, self.preprocess.min_pixels, self.preprocess.max_pixels);
        let resized = self.preprocess.resample.resize(img, w, h);
        let (m, s) = (self.preprocess.mean, self.preprocess.std);
        let pixels: Vec<f32> =
            resized.pixels().flat_map(|p| (0..3).map(move |k| (p.0[k] as f32 / 255.0 - m[k]) / s[k])).collect();
        let (p, merge, t) = (c.patch_size as usize, c.spatial_merge_size as usize, c.temporal_patch_size as usize);
        let patches = patchify(&pixels, h as usize, w as usize, p, merge, t);
        let (gh, gw) = (h as i32 / c.patch_size, w as i32 / c.patch_size);
        let n = gh * gw;
        let features = self.tower.forward(&Array::from_slice(&patches, &[n, patches.len() as i32 / n]), (1, gh, gw))?;
        Ok(features.reshape(&[gh / c.spatial_merge_size, gw / c.spatial_merge_size, -1])?)
    }

    /// The `(t, h, w)` patch grid a stored feature array came from.
    pub fn grid_of(&self, features: &Array) -> (u32, u32, u32) {
        let m = self.tower.config.spatial_merge_size as u32;
        (1, features.shape()[0] as u32 * m, features.shape()[1] as u32 * m)
    }

    /// Prompt embeddings with image features over the image-token runs.
    pub fn prompt_embeddings(&self, ids: &[u32], images: &[Array]) -> Result<Array> {
        let text = |seg: &[u32]| self.text.embed(&Array::from_slice(seg, &[1, seg.len() as i32]));
        let image = |f: &Array, run: usize| -> Result<Array> {
            let d = *f.shape().last().unwrap();
            let rows = f.reshape(&[-1, d])?;
            if rows.shape()[0] as usize != run {
                bail!("an image has {} feature rows but the prompt holds {run} placeholders", rows.shape()[0]);
            }
            Ok(rows.reshape(&[1, run as i32, d])?)
        };
        super::splice(ids, self.image_token_id, images, text, image)
    }
}
