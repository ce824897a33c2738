//! Gemma 4's image processor (mlx-vlm 0.7.10's `Gemma4ImageProcessor`,
//! HF's): keep the aspect ratio, scale to the largest size whose patches fit
//! the soft-token budget × pool², both sides whole multiples of patch ×
//! pool; bicubic; rescale to [0, 1] (no normalization: the tower maps to
//! [-1, 1] itself); channels first — or, for Gemma 4 unified (no tower),
//! cut into model patches (48x48, one soft token each). The budget (70,
//! 140, 280, 560, 1120 soft tokens) is part of the feature-store key.

use crate::model::family::{MediaPreprocessor, Prepared};
use crate::model::image::Resample;

/// The budgets Gemma 4 was trained with.
pub const SOFT_TOKEN_BUDGETS: [u32; 5] = [70, 140, 280, 560, 1120];

/// A Gemma 4 checkpoint's image preprocessing.
#[derive(Debug, Clone, PartialEq)]
pub struct Gemma4Preprocess {
    pub patch: u32,
    pub pool: u32,
    /// Most soft tokens an image becomes.
    pub soft_tokens: u32,
    pub rescale: f32,
    pub resample: Resample,
    /// `Some(side)`: the pixels as `[patches, side * side * 3]` model
    /// patches, row-major, each patch's rows, columns, channels (Gemma 4
    /// unified); `None`: `[1, 3, H, W]`.
    pub model_patch: Option<u32>,
}

impl Gemma4Preprocess {
    /// `(height, width)` the image is resized to: HF's
    /// `get_aspect_ratio_preserving_size`.
    pub fn target_size(&self, height: u32, width: u32) -> (u32, u32) {
        let max_patches = (self.soft_tokens * self.pool * self.pool) as f64;
        let target_px = max_patches * (self.patch * self.patch) as f64;
        let factor = (target_px / (height as f64 * width as f64)).sqrt();
        let side = self.patch * self.pool;
        let mut h = (factor * height as f64 / side as f64).floor() as u32 * side;
        let mut w = (factor * width as f64 / side as f64).floor() as u32 * side;
        let max_side = self.soft_tokens * side;
        if h == 0 {
            h = side;
            w = ((width / height.max(1)) * side).min(max_side).max(side);
        } else if w == 0 {
            w = side;
            h = ((height / width.max(1)) * side).min(max_side).max(side);
        }
        (h, w)
    }
}

impl MediaPreprocessor for Gemma4Preprocess {
    fn describe(&self) -> String {
        let layout = self.model_patch.map_or(String::new(), |p| format!(";model_patch={p}"));
        format!(
            "gemma4;patch={};pool={};soft_tokens={};resample={};rescale={}{layout}",
            self.patch,
            self.pool,
            self.soft_tokens,
            self.resample.name(),
            self.rescale
        )
    }

    fn prepare(&self, image: &image::RgbImage) -> Prepared {
        let (h, w) = self.target_size(image.height(), image.width());
        let resized =
            if (h, w) == (image.height(), image.width()) { image.clone() } else { self.resample.resize(image, w, h) };
        if let Some(side) = self.model_patch {
            let (ph, pw) = (h / side, w / side);
            let mut values = Vec::with_capacity((h * w * 3) as usize);
            for (py, px) in (0..ph).flat_map(|y| (0..pw).map(move |x| (y, x))) {
                for y in py * side..(py + 1) * side {
                    for x in px * side..(px + 1) * side {
                        values.extend(resized.get_pixel(x, y).0.iter().map(|&v| v as f32 * self.rescale));
                    }
                }
            }
            let n = (ph * pw) as i32;
            return Prepared { values, shape: vec![n, (side * side * 3) as i32], grid: Some((1, ph, pw)) };
        }
        let plane = (h * w) as usize;
        let mut values = vec![0f32; 3 * plane];
        for (i, px) in resized.pixels().enumerate() {
            for c in 0..3 {
                values[c * plane + i] = px.0[c] as f32 * self.rescale;
            }
        }
        Prepared { values, shape: vec![1, 3, h as i32, w as i32], grid: None }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(soft_tokens: u32) -> Gemma4Preprocess {
        Gemma4Preprocess {
            patch: 16,
            pool: 3,
            soft_tokens,
            rescale: 1.0 / 255.0,
            resample: Resample::BICUBIC,
            model_patch: None,
        }
    }

    #[test]
    fn target_sizes_match_hf() {
        // Worked by hand from HF's get_aspect_ratio_preserving_size.
        assert_eq!(with(70).target_size(75, 100), (336, 432));
        assert_eq!(with(280).target_size(768, 1024), (672, 912));
        assert_eq!(with(280).target_size(1000, 1000), (768, 768));
        // A sliver: one pooled row, the width capped at the budget's side.
        assert_eq!(with(70).target_size(1, 10_000), (48, 3360));
        for budget in SOFT_TOKEN_BUDGETS {
            let (h, w) = with(budget).target_size(480, 640);
            assert!((h / 48) * (w / 48) <= budget, "{budget}: {h}x{w}");
        }
    }
}
