//! Qwen2.5-VL's vision side: dynamic-resolution preprocessing (resize to a
//! multiple of 28 within a pixel budget, normalize, cut into patches), the
//! tower, and the splice. The tower's merged features replace the
//! `<|image_pad|>` runs of the prompt, and the Qwen2 decoder rotates with
//! multimodal positions (see `mrope`). Features are stored as
//! `[grid_h / 2, grid_w / 2, hidden]` so a stored entry still says its grid.

use super::tower::{patchify, smart_resize, Qwen25VisionTower};
use crate::model::family::{LanguageModel, MediaPreprocessor, Prepared, VisionTower};
use crate::model::image::Resample;
use anyhow::{bail, Result};
use mlx_rs::Array;

/// Qwen2-VL image processor parameters, and the tower's patch geometry.
#[derive(Debug, Clone, PartialEq)]
pub struct Qwen25Preprocess {
    pub min_pixels: u64,
    pub resample: Resample,
    pub max_pixels: u64,
    pub mean: [f32; 3],
    pub std: [f32; 3],
    pub patch_size: u32,
    pub merge_size: u32,
    pub temporal_patch_size: u32,
}

impl MediaPreprocessor for Qwen25Preprocess {
    fn describe(&self) -> String {
        format!(
            "qwen2vl;smart_resize={},{},{};{};mean={:?};std={:?}",
            self.patch_size * self.merge_size,
            self.min_pixels,
            self.max_pixels,
            self.resample.name(),
            self.mean,
            self.std
        )
    }

    /// Patches `[grid_h * grid_w, 3 * temporal * patch * patch]` and their grid.
    fn prepare(&self, img: &image::RgbImage) -> Prepared {
        let (p, merge, t) = (self.patch_size, self.merge_size, self.temporal_patch_size);
        let (h, w) = smart_resize(img.height(), img.width(), p * merge, self.min_pixels, self.max_pixels);
        let resized = self.resample.resize(img, w, h);
        let (m, s) = (self.mean, self.std);
        let pixels: Vec<f32> =
            resized.pixels().flat_map(|px| (0..3).map(move |k| (px.0[k] as f32 / 255.0 - m[k]) / s[k])).collect();
        let values = patchify(&pixels, h as usize, w as usize, p as usize, merge as usize, t as usize);
        let (gh, gw) = (h / p, w / p);
        let n = (gh * gw) as i32;
        Prepared { shape: vec![n, values.len() as i32 / n], values, grid: Some((1, gh, gw)) }
    }
}

/// The tower of a Qwen2.5-VL checkpoint.
pub struct Qwen25Tower {
    pub tower: Qwen25VisionTower,
    pub image_token_id: u32,
}

impl Qwen25Tower {
    /// The `(t, h, w)` patch grid a stored feature array came from.
    pub fn grid_of(&self, features: &Array) -> (u32, u32, u32) {
        let m = self.tower.config.spatial_merge_size as u32;
        (1, features.shape()[0] as u32 * m, features.shape()[1] as u32 * m)
    }
}

impl VisionTower for Qwen25Tower {
    /// Features `[grid_h / 2, grid_w / 2, hidden]`.
    fn encode(&self, prepared: &Prepared) -> Result<Array> {
        let Some((t, gh, gw)) = prepared.grid else { bail!("Qwen2.5-VL patches come with their grid") };
        let merge = self.tower.config.spatial_merge_size;
        let features = self
            .tower
            .forward(&Array::from_slice(&prepared.values, &prepared.shape), (t as i32, gh as i32, gw as i32))?;
        Ok(features.reshape(&[gh as i32 / merge, gw as i32 / merge, -1])?)
    }

    fn splice(&self, lm: &dyn LanguageModel, ids: &[u32], images: &[Array]) -> Result<Array> {
        let text = |seg: &[u32]| lm.embed(&Array::from_slice(seg, &[1, seg.len() as i32]));
        let image = |f: &Array, run: usize| -> Result<Array> {
            let d = f.shape()[f.ndim() - 1];
            let rows = f.reshape(&[-1, d])?;
            if rows.shape()[0] as usize != run {
                bail!("an image has {} feature rows but the prompt holds {run} placeholders", rows.shape()[0]);
            }
            Ok(rows.reshape(&[1, run as i32, d])?)
        };
        crate::model::splice::splice(ids, self.image_token_id, images, text, image)
    }

    fn rope_positions(&self, ids: &[u32], features: &[Array]) -> Option<(Vec<[i64; 3]>, i64)> {
        let grids: Vec<_> = features.iter().map(|f| self.grid_of(f)).collect();
        let merge = self.tower.config.spatial_merge_size as u32;
        Some(super::mrope::positions(ids, &[self.image_token_id], &grids, merge))
    }
}
