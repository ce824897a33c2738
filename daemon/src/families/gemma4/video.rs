//! Gemma 4's video preprocessing (mlx-vlm 0.7.10's `Gemma4VideoProcessor`):
//! frames taken at 2 fps (at least 4, at most the processor's `num_frames`,
//! an even count, as mlx-vlm's loader settles it), each resized and
//! rescaled like an image under the video budget (70 soft tokens), each
//! encoded (and stored) on its own: the tower sees one frame at a time.
//! The prompt writes every frame as `mm:ss <|image>` + its soft tokens +
//! `<image|>`, frames joined by a space, the time being frame `j` over the
//! rate the taken frames stand for (whole seconds).

use super::audio_features::Gemma4AudioFrontend;
use super::processor::Gemma4Preprocess;
use crate::model::family::{AudioPreprocessor, MediaPreprocessor, Prepared, PreparedAudio, VideoPreprocessor};
use crate::model::video::{SampledVideo, Sampling};

/// mlx-vlm's sampling for Gemma 4: its library defaults (2 fps, at least
/// 4 frames, even counts) with the processor's `num_frames` as the cap.
pub fn sampling(num_frames: u32) -> Sampling {
    Sampling { fps: 2.0, min_frames: 4, max_frames: num_frames, frame_factor: 2 }
}

/// `processor_config.json`'s `video_processor`: how frames are taken and
/// sized.
#[derive(Debug, Clone, PartialEq)]
pub struct Gemma4VideoPreprocess {
    pub sampling: Sampling,
    /// Each frame's preprocessing (the video budget in `soft_tokens`).
    pub frames: Gemma4Preprocess,
}

/// Gemma 4's media preprocessing: images by the image processor, video by
/// the video processor when the checkpoint declares one, audio by the
/// feature extractor when it has an audio tower.
pub struct Gemma4Media {
    pub image: Gemma4Preprocess,
    pub video: Option<Gemma4VideoPreprocess>,
    /// The E models' log-mel frontend, or the unified model's raw frames.
    pub audio: Option<Box<dyn AudioPreprocessor>>,
}

impl MediaPreprocessor for Gemma4Media {
    fn describe(&self) -> String {
        self.image.describe()
    }

    fn prepare(&self, image: &image::RgbImage) -> Prepared {
        self.image.prepare(image)
    }

    fn video(&self) -> Option<&dyn VideoPreprocessor> {
        self.video.as_ref().map(|v| v as &dyn VideoPreprocessor)
    }

    fn audio(&self) -> Option<&dyn AudioPreprocessor> {
        self.audio.as_deref()
    }
}

impl AudioPreprocessor for Gemma4AudioFrontend {
    fn describe(&self) -> String {
        Gemma4AudioFrontend::describe(self)
    }

    fn prepare(&self, samples: &[f32]) -> Result<PreparedAudio, String> {
        Gemma4AudioFrontend::prepare(self, samples)
    }
}

impl VideoPreprocessor for Gemma4VideoPreprocess {
    fn sampling(&self) -> Sampling {
        self.sampling
    }

    fn describe(&self) -> String {
        format!("gemma4-video;{};{}", self.sampling.describe(), self.frames.describe())
    }

    fn temporal_patch(&self) -> usize {
        1
    }

    /// `int(j / sampled_fps)` seconds for frame `j` (the processor's
    /// `frame_timestamps`, written as whole `mm:ss`).
    fn group_seconds(&self, clip: &SampledVideo) -> Vec<f64> {
        let rate = clip.sampled_fps();
        (0..clip.frames.len()).map(|j| (j as f64 / rate).floor()).collect()
    }

    fn prepare(&self, frames: &[image::RgbImage]) -> Result<Vec<Prepared>, String> {
        let Some(first) = frames.first() else { return Err("the video has no frames".into()) };
        if frames.iter().any(|f| f.dimensions() != first.dimensions()) {
            return Err("the video's frames change size; every frame must have the same size".into());
        }
        Ok(frames.iter().map(|f| self.frames.prepare(f)).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::image::Resample;

    #[test]
    fn frame_times_are_whole_seconds_of_the_sampled_rate() {
        let frames = Gemma4Preprocess {
            patch: 16,
            pool: 3,
            soft_tokens: 70,
            rescale: 1.0,
            resample: Resample::BICUBIC,
            model_patch: None,
        };
        let pre = Gemma4VideoPreprocess { sampling: sampling(32), frames };
        // 20 frames at 4 fps, 10 taken: they stand for 2 fps.
        let clip = SampledVideo {
            frames: vec![image::RgbImage::new(1, 1); 10],
            indices: (0..10).map(|i| i * 2).collect(),
            source_fps: 4.0,
            total_frames: 20,
        };
        assert_eq!(pre.group_seconds(&clip), vec![0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0, 4.0, 4.0]);
    }
}
