//! Qwen3-VL's video preprocessing (mlx-vlm 0.7.10's `Qwen3VLVideoProcessor`,
//! a port of Hugging Face's): every sampled frame resized to one size chosen
//! for the whole clip (the pixel budget counts frames), normalized, the last
//! frame repeated to fill the final pair, and each pair of frames cut into
//! patches as one temporal group. A group is encoded and stored on its own:
//! the tower attends within a frame group only, so a clip's groups encoded
//! one by one are the clip encoded at once.

use super::super::qwen2_5_vl::tower::patchify_frames;
use super::super::qwen2_5_vl::vision::Qwen25Preprocess;
use crate::model::family::{MediaPreprocessor, Prepared, VideoPreprocessor};
use crate::model::video::Sampling;

/// `video_preprocessor_config.json`'s parameters: how frames are taken, and
/// how they are sized and normalized (the image processor's parameters —
/// budget, mean, std, patch geometry — read from the video config; the
/// resize is always bicubic, as mlx-vlm's video path does).
#[derive(Debug, Clone, PartialEq)]
pub struct Qwen3VideoPreprocess {
    pub sampling: Sampling,
    pub frames: Qwen25Preprocess,
}

/// Qwen3-VL's media preprocessing: images as Qwen2.5-VL's (16-pixel
/// patches), video by its own config.
pub struct Qwen3Preprocess {
    pub image: Qwen25Preprocess,
    pub video: Qwen3VideoPreprocess,
}

impl MediaPreprocessor for Qwen3Preprocess {
    fn describe(&self) -> String {
        self.image.describe()
    }

    fn prepare(&self, image: &image::RgbImage) -> Prepared {
        self.image.prepare(image)
    }

    fn video(&self) -> Option<&dyn VideoPreprocessor> {
        Some(&self.video)
    }
}

/// HF's `smart_resize` for video: the budget holds `frames` (rounded up to
/// whole temporal groups) frames of the chosen size.
pub fn smart_resize_video(
    frames: usize,
    height: u32,
    width: u32,
    temporal: u32,
    factor: u32,
    min_pixels: u64,
    max_pixels: u64,
) -> Result<(u32, u32), String> {
    if height < factor || width < factor {
        return Err(format!("video frames are {width}x{height}; each side must be at least {factor} pixels"));
    }
    if height.max(width) as f64 / height.min(width) as f64 > 200.0 {
        return Err(format!("video frames are {width}x{height}: the aspect ratio must be under 200"));
    }
    let (h, w, f, n) = (height as f64, width as f64, factor as f64, frames as f64);
    let mut hb = (h / f).round_ties_even() * f;
    let mut wb = (w / f).round_ties_even() * f;
    let tb = (n / temporal as f64).ceil() * temporal as f64;
    if tb * hb * wb > max_pixels as f64 {
        let beta = (n * h * w / max_pixels as f64).sqrt();
        hb = f.max((h / beta / f).floor() * f);
        wb = f.max((w / beta / f).floor() * f);
    } else if tb * hb * wb < min_pixels as f64 {
        let beta = (min_pixels as f64 / (n * h * w)).sqrt();
        hb = (h * beta / f).ceil() * f;
        wb = (w * beta / f).ceil() * f;
    }
    Ok((hb as u32, wb as u32))
}

impl VideoPreprocessor for Qwen3VideoPreprocess {
    fn sampling(&self) -> Sampling {
        self.sampling
    }

    fn describe(&self) -> String {
        let f = &self.frames;
        format!(
            "qwen3vl-video;{};{};patch={}x{}",
            self.sampling.describe(),
            f.describe(),
            f.patch_size,
            f.temporal_patch_size
        )
    }

    fn temporal_patch(&self) -> usize {
        self.frames.temporal_patch_size as usize
    }

    fn prepare(&self, frames: &[image::RgbImage]) -> Result<Vec<Prepared>, String> {
        let Some(first) = frames.first() else { return Err("the video has no frames".into()) };
        let c = &self.frames;
        let (p, merge, t) = (c.patch_size, c.merge_size, c.temporal_patch_size);
        let (height, width) = (first.height(), first.width());
        if frames.iter().any(|f| f.dimensions() != (width, height)) {
            return Err("the video's frames change size; every frame must have the same size".into());
        }
        let (h, w) = smart_resize_video(frames.len(), height, width, t, p * merge, c.min_pixels, c.max_pixels)?;
        let (m, s) = (c.mean, c.std);
        let mut normalized: Vec<Vec<f32>> = frames
            .iter()
            .map(|f| {
                let resized = c.resample.resize(f, w, h);
                resized.pixels().flat_map(|px| (0..3).map(move |k| (px.0[k] as f32 / 255.0 - m[k]) / s[k])).collect()
            })
            .collect();
        while !normalized.len().is_multiple_of(t as usize) {
            normalized.push(normalized.last().cloned().unwrap_or_default());
        }
        let (gh, gw) = (h / p, w / p);
        let n = (gh * gw) as i32;
        Ok(normalized
            .chunks(t as usize)
            .map(|group| {
                let group: Vec<&[f32]> = group.iter().map(Vec::as_slice).collect();
                let values = patchify_frames(&group, h as usize, w as usize, p as usize, merge as usize);
                Prepared { shape: vec![n, values.len() as i32 / n], values, grid: Some((1, gh, gw)) }
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_counts_frames() {
        // Values from mlx-vlm 0.7.10's _smart_resize_video (factor 32).
        assert_eq!(smart_resize_video(16, 64, 96, 2, 32, 4096, 131_072), Ok((64, 96)));
        // 16 frames of 480x640 over a 128*128*8 budget: scaled down by sqrt(16*480*640/131072).
        assert_eq!(smart_resize_video(16, 480, 640, 2, 32, 4096, 131_072), Ok((64, 96)));
        assert!(smart_resize_video(4, 20, 640, 2, 32, 4096, 131_072).is_err());
    }
}
