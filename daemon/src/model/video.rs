//! Video files → sampled RGB frames, before anything is stored or encoded.
//!
//! Animated GIF and WebP decode in-process (the `image` crate); everything
//! else goes through `ffmpeg`/`ffprobe` when they are installed (found on
//! `PATH`, or `MLXBC_FFMPEG` naming the ffmpeg binary with ffprobe beside
//! it), with a clear error naming what to install when they are not. Which
//! frames are taken follows mlx-vlm 0.7.10's `load_video` (the count from
//! the clip's length and the model's fps, clamped to its min/max frames and
//! rounded down to whole temporal patches, spread evenly with
//! `linspace(0, total - 1, n).round()`), so a prompt's timestamps and the
//! frames behind them are the reference's.
//!
//! A peer chooses these bytes: dimensions, frame counts and the memory the
//! sampled frames take are bounded before anything is allocated, and every
//! external process runs under a timeout.

use image::{AnimationDecoder, ImageFormat, RgbImage};
use std::io::{Cursor, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Largest width or height of a video frame.
pub const MAX_SIDE: u32 = 8192;
/// Most bytes the sampled frames may take (RGB8, before resizing).
pub const MAX_SAMPLED_BYTES: u64 = 1 << 30;
/// Most frames a clip may declare (counting, not keeping).
pub const MAX_SOURCE_FRAMES: u64 = 1_000_000;
/// Most canvas pixels an animated GIF/WebP may make its decoder composite,
/// over all its frames (each frame is drawn onto the whole canvas): bounds
/// the in-process decoder's work as the timeout bounds ffmpeg's (a second
/// or two here).
pub const MAX_ANIMATED_PIXELS: u64 = 1 << 31;
/// How long ffprobe and ffmpeg may take for one clip.
const DECODE_TIMEOUT: Duration = Duration::from_secs(120);

/// How a family samples a clip (mlx-vlm's `VideoSampling`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// Frames per second of the clip to take.
    pub fps: f64,
    pub min_frames: u32,
    pub max_frames: u32,
    /// Frame counts are multiples of this (the tower's temporal patch).
    pub frame_factor: u32,
}

impl Sampling {
    /// Every parameter that changes which frames are taken (store-key part).
    pub fn describe(&self) -> String {
        format!("fps={};frames={}..{};factor={}", self.fps, self.min_frames, self.max_frames, self.frame_factor)
    }
}

/// The frames taken from a clip, with where they came from.
#[derive(Debug, Clone)]
pub struct SampledVideo {
    pub frames: Vec<RgbImage>,
    /// Each frame's index in the clip.
    pub indices: Vec<u32>,
    /// The clip's own frame rate.
    pub source_fps: f64,
    /// Frames the clip holds (declared).
    pub total_frames: u64,
}

impl SampledVideo {
    /// The rate the taken frames stand for (mlx-vlm's
    /// `VideoMetadata.sampled_fps`: taken / total × the clip's rate).
    pub fn sampled_fps(&self) -> f64 {
        self.indices.len() as f64 / (self.total_frames as f64).max(1e-6) * self.source_fps
    }

    /// Seconds of each group of `temporal` frames: the mean of its first and
    /// last frame's time (the last frame repeats to fill the final group),
    /// as the Hugging Face Qwen3-VL processor computes them.
    pub fn group_seconds(&self, temporal: usize) -> Vec<f64> {
        let temporal = temporal.max(1);
        let mut indices = self.indices.clone();
        while !indices.len().is_multiple_of(temporal) {
            indices.push(*indices.last().unwrap_or(&0));
        }
        let time = |i: u32| i as f64 / self.source_fps;
        indices.chunks(temporal).map(|g| (time(g[0]) + time(g[g.len() - 1])) / 2.0).collect()
    }
}

/// Seconds as a prompt writes them (`{:.1}`, as Python's `f"{s:.1f}"`:
/// the exact value rounded, ties to even), in tenths.
pub fn prompt_tenths(seconds: f64) -> u32 {
    let text = format!("{seconds:.1}");
    let (whole, tenth) = text.split_once('.').unwrap_or((&text, "0"));
    whole.parse::<u32>().unwrap_or(0) * 10 + tenth.parse::<u32>().unwrap_or(0)
}

/// Why a video was refused.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum VideoError {
    #[error(
        "decoding this video needs ffmpeg, which is not installed where the daemon runs: \
         install it (`apt install ffmpeg` on Debian/Ubuntu, `brew install ffmpeg` on macOS) \
         or send an animated GIF or WebP, which need nothing"
    )]
    FfmpegMissing,
    #[error("the video has no frames")]
    NoFrames,
    #[error("the video has {0} frame(s); at least {1} are needed (send a still as an image)")]
    TooFewFrames(u64, u32),
    #[error("video frames are {width}x{height}: over the limit of {MAX_SIDE} per side")]
    TooLarge { width: u32, height: u32 },
    #[error("the sampled frames would take {0} MB; at most {max} MB", max = MAX_SAMPLED_BYTES >> 20)]
    TooMuch(u64),
    #[error("the video declares {0} frames; at most {MAX_SOURCE_FRAMES}")]
    TooLong(u64),
    #[error("the animation has {0} frames of {1}x{2}: over the limit of {MAX_ANIMATED_PIXELS} pixels to decode")]
    TooManyPixels(u64, u32, u32),
    #[error("decoding the video took longer than {} s", DECODE_TIMEOUT.as_secs())]
    Timeout,
    #[error("not a readable video: {0}")]
    Unreadable(String),
}

/// The indices mlx-vlm's `load_video` takes from a clip of `total` frames
/// at `source_fps`.
pub fn sample_indices(total: u64, source_fps: f64, s: &Sampling) -> Result<Vec<u32>, VideoError> {
    let f = s.frame_factor.max(1) as f64;
    let ceil = |n: f64| (n / f).ceil() * f;
    let floor = |n: f64| (n / f).floor() * f;
    let (lo, hi) = (ceil(s.min_frames as f64), floor((s.max_frames as f64).min(total as f64)));
    let mut n = total as f64 / source_fps * s.fps;
    n = n.max(lo).min(hi).min(total as f64);
    let n = floor(n);
    if n < f || n > total as f64 {
        return Err(VideoError::TooFewFrames(total, s.frame_factor.max(1)));
    }
    let n = n as u64;
    let last = (total - 1) as f64;
    // numpy's linspace (start + i * step, the end exact), rounded half to even.
    let step = if n > 1 { last / (n - 1) as f64 } else { 0.0 };
    Ok((0..n)
        .map(|i| if i + 1 == n && n > 1 { last } else { i as f64 * step })
        .map(|x| x.round_ties_even() as u32)
        .collect())
}

/// Decodes `bytes` and takes the frames `sampling` asks for.
pub fn decode(bytes: &[u8], sampling: &Sampling) -> Result<SampledVideo, VideoError> {
    match image::guess_format(bytes) {
        Ok(ImageFormat::Gif) => animated(bytes, sampling, ImageFormat::Gif),
        Ok(ImageFormat::WebP) => animated(bytes, sampling, ImageFormat::WebP),
        _ => with_ffmpeg(bytes, sampling),
    }
}

/// An animated GIF or WebP: its frames' delays give its frame rate.
fn animated(bytes: &[u8], sampling: &Sampling, format: ImageFormat) -> Result<SampledVideo, VideoError> {
    let (width, height) = image::ImageReader::with_format(Cursor::new(bytes), format)
        .into_dimensions()
        .map_err(|e| VideoError::Unreadable(e.to_string()))?;
    check_side(width, height)?;
    let frames = || -> Result<image::Frames<'_>, VideoError> {
        let unreadable = |e: image::ImageError| VideoError::Unreadable(e.to_string());
        Ok(match format {
            ImageFormat::Gif => {
                image::codecs::gif::GifDecoder::new(Cursor::new(bytes)).map_err(unreadable)?.into_frames()
            }
            _ => image::codecs::webp::WebPDecoder::new(Cursor::new(bytes)).map_err(unreadable)?.into_frames(),
        })
    };
    // First pass: count frames and their time, keeping none.
    let (mut total, mut millis) = (0u64, 0f64);
    for frame in frames()? {
        let frame = frame.map_err(|e| VideoError::Unreadable(e.to_string()))?;
        let (n, d) = frame.delay().numer_denom_ms();
        millis += n as f64 / d.max(1) as f64;
        total += 1;
        if total > MAX_SOURCE_FRAMES {
            return Err(VideoError::TooLong(total));
        }
        if total * width as u64 * height as u64 > MAX_ANIMATED_PIXELS {
            return Err(VideoError::TooManyPixels(total, width, height));
        }
    }
    if total == 0 {
        return Err(VideoError::NoFrames);
    }
    // Browsers show delay-less frames at 10 per second.
    let source_fps = if millis > 0.0 { total as f64 / (millis / 1000.0) } else { 10.0 };
    let indices = sample_indices(total, source_fps, sampling)?;
    check_bytes(indices.len() as u64, width, height)?;
    let mut kept = Vec::with_capacity(indices.len());
    let mut wanted = indices.iter().peekable();
    for (i, frame) in frames()?.enumerate() {
        let Some(&&next) = wanted.peek() else { break };
        if i as u32 == next {
            let frame = frame.map_err(|e| VideoError::Unreadable(e.to_string()))?;
            kept.push(image::DynamicImage::ImageRgba8(frame.into_buffer()).to_rgb8());
            wanted.next();
        }
    }
    Ok(SampledVideo { frames: kept, indices, source_fps, total_frames: total })
}

fn check_side(width: u32, height: u32) -> Result<(), VideoError> {
    if width == 0 || height == 0 {
        return Err(VideoError::NoFrames);
    }
    if width > MAX_SIDE || height > MAX_SIDE {
        return Err(VideoError::TooLarge { width, height });
    }
    Ok(())
}

fn check_bytes(frames: u64, width: u32, height: u32) -> Result<(), VideoError> {
    let bytes = frames * width as u64 * height as u64 * 3;
    if bytes > MAX_SAMPLED_BYTES {
        return Err(VideoError::TooMuch(bytes >> 20));
    }
    Ok(())
}

/// The ffmpeg and ffprobe to run.
fn tools() -> (PathBuf, PathBuf) {
    match std::env::var_os("MLXBC_FFMPEG") {
        Some(ffmpeg) => {
            let ffmpeg = PathBuf::from(ffmpeg);
            let probe = ffmpeg.with_file_name("ffprobe");
            (ffmpeg, probe)
        }
        None => ("ffmpeg".into(), "ffprobe".into()),
    }
}

/// Any other container: ffprobe says its size, rate and length, ffmpeg
/// hands over the chosen frames as raw RGB.
fn with_ffmpeg(bytes: &[u8], sampling: &Sampling) -> Result<SampledVideo, VideoError> {
    let (ffmpeg, ffprobe) = tools();
    // ffmpeg seeks in its input (an MP4's index may sit at its end), so the
    // clip goes to a private temporary file rather than a pipe.
    let mut file =
        tempfile::NamedTempFile::new().map_err(|e| VideoError::Unreadable(format!("a temporary file: {e}")))?;
    file.write_all(bytes).map_err(|e| VideoError::Unreadable(format!("a temporary file: {e}")))?;
    let path = file.path();
    let probe = probe(&ffprobe, path)?;
    check_side(probe.width, probe.height)?;
    if probe.frames == 0 {
        return Err(VideoError::NoFrames);
    }
    if probe.frames > MAX_SOURCE_FRAMES {
        return Err(VideoError::TooLong(probe.frames));
    }
    let indices = sample_indices(probe.frames, probe.fps, sampling)?;
    check_bytes(indices.len() as u64, probe.width, probe.height)?;
    let select: Vec<String> = indices.iter().map(|i| format!("eq(n\\,{i})")).collect();
    let mut command = Command::new(&ffmpeg);
    command.args(["-nostdin", "-v", "error", "-i"]).arg(path).args([
        "-map",
        "0:v:0",
        "-vf",
        &format!("select={}", select.join("+")),
        "-fps_mode",
        "passthrough",
        "-f",
        "rawvideo",
        "-pix_fmt",
        "rgb24",
        "pipe:1",
    ]);
    let frame_bytes = probe.width as usize * probe.height as usize * 3;
    let out = run(command, &ffmpeg, (indices.len() * frame_bytes) as u64)?;
    let frames: Vec<RgbImage> = out
        .chunks_exact(frame_bytes)
        .filter_map(|c| RgbImage::from_raw(probe.width, probe.height, c.to_vec()))
        .collect();
    if frames.is_empty() {
        return Err(VideoError::NoFrames);
    }
    // A clip that declared more frames than it holds: the frames read, as
    // mlx-vlm truncates its indices where a read fails.
    let indices = indices[..frames.len()].to_vec();
    if frames.len() < sampling.frame_factor.max(1) as usize {
        return Err(VideoError::TooFewFrames(frames.len() as u64, sampling.frame_factor.max(1)));
    }
    Ok(SampledVideo { frames, indices, source_fps: probe.fps, total_frames: probe.frames })
}

struct Probe {
    width: u32,
    height: u32,
    frames: u64,
    fps: f64,
}

fn probe(ffprobe: &Path, path: &Path) -> Result<Probe, VideoError> {
    let ask = |count: bool| -> Result<serde_json::Value, VideoError> {
        let mut command = Command::new(ffprobe);
        command.args(["-v", "error", "-select_streams", "v:0", "-of", "json", "-show_entries"]);
        command.arg(if count {
            "stream=width,height,avg_frame_rate,r_frame_rate,nb_read_frames"
        } else {
            "stream=width,height,avg_frame_rate,r_frame_rate,nb_frames"
        });
        if count {
            command.arg("-count_frames");
        }
        command.arg(path);
        let out = run(command, ffprobe, 1 << 20)?;
        serde_json::from_slice(&out).map_err(|e| VideoError::Unreadable(format!("ffprobe: {e}")))
    };
    let json = ask(false)?;
    let Some(stream) = json["streams"].get(0).cloned() else {
        return Err(VideoError::Unreadable("it has no video stream".into()));
    };
    let number = |v: &serde_json::Value| v.as_u64().or_else(|| v.as_str().and_then(|s| s.parse().ok()));
    let rate = |v: &serde_json::Value| -> Option<f64> {
        let (n, d) = v.as_str()?.split_once('/')?;
        let (n, d): (f64, f64) = (n.parse().ok()?, d.parse().ok()?);
        (n > 0.0 && d > 0.0).then(|| n / d)
    };
    let fps = rate(&stream["avg_frame_rate"]).or_else(|| rate(&stream["r_frame_rate"])).unwrap_or(1.0);
    let (width, height) = (number(&stream["width"]).unwrap_or(0) as u32, number(&stream["height"]).unwrap_or(0) as u32);
    // Containers without a frame count (WebM, MKV): count by decoding.
    let frames = match number(&stream["nb_frames"]) {
        Some(n) if n > 0 => n,
        _ => ask(true)?["streams"].get(0).and_then(|s| number(&s["nb_read_frames"])).unwrap_or(0),
    };
    Ok(Probe { width, height, frames, fps })
}

/// Runs `command` to its end under [`DECODE_TIMEOUT`], reading at most
/// `limit` bytes of its output.
fn run(mut command: Command, program: &Path, limit: u64) -> Result<Vec<u8>, VideoError> {
    let mut child =
        command.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                VideoError::FfmpegMissing
            } else {
                VideoError::Unreadable(format!("running {}: {e}", program.display()))
            }
        })?;
    let mut stdout = child.stdout.take().expect("piped");
    let mut stderr = child.stderr.take().expect("piped");
    let reader = std::thread::spawn(move || {
        let mut out = Vec::new();
        let _ = (&mut stdout).take(limit).read_to_end(&mut out);
        out
    });
    let errors = std::thread::spawn(move || {
        let mut err = Vec::new();
        let _ = (&mut stderr).take(64 * 1024).read_to_end(&mut err);
        err
    });
    let started = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if started.elapsed() > DECODE_TIMEOUT => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(VideoError::Timeout);
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(5)),
            Err(e) => return Err(VideoError::Unreadable(e.to_string())),
        }
    };
    let out = reader.join().unwrap_or_default();
    let err = errors.join().unwrap_or_default();
    if !status.success() {
        let err = String::from_utf8_lossy(&err);
        let last = err.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("it exited with an error");
        return Err(VideoError::Unreadable(last.trim().to_string()));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const QWEN3_VL: Sampling = Sampling { fps: 2.0, min_frames: 4, max_frames: 768, frame_factor: 2 };

    #[test]
    fn indices_follow_mlx_vlm_load_video() {
        // Values from mlx-vlm 0.7.10's load_video arithmetic
        // (np.linspace(0, total - 1, n).round()).
        // 10 s at 30 fps: 20 frames.
        let idx = sample_indices(300, 30.0, &QWEN3_VL).unwrap();
        assert_eq!(idx.len(), 20);
        assert_eq!(&idx[..4], &[0, 16, 31, 47]);
        assert_eq!(*idx.last().unwrap(), 299);
        // A 1 s clip is raised to min_frames.
        assert_eq!(sample_indices(24, 24.0, &QWEN3_VL).unwrap(), vec![0, 8, 15, 23]);
        // 3 frames: at most floor2(3) = 2.
        assert_eq!(sample_indices(3, 30.0, &QWEN3_VL).unwrap(), vec![0, 2]);
        assert_eq!(sample_indices(1, 30.0, &QWEN3_VL), Err(VideoError::TooFewFrames(1, 2)));
    }

    #[test]
    fn group_seconds_average_each_pair() {
        let v = SampledVideo { frames: vec![], indices: vec![0, 15, 30, 45, 60], source_fps: 30.0, total_frames: 61 };
        // The fifth frame repeats to fill the last pair.
        assert_eq!(v.group_seconds(2), vec![0.25, 1.25, 2.0]);
        // As Python writes them: 0.25 and 1.25 are exact ties, to even.
        let tenths: Vec<u32> = v.group_seconds(2).into_iter().map(prompt_tenths).collect();
        assert_eq!(tenths, vec![2, 12, 20]);
        assert_eq!(prompt_tenths(0.35), 3, "0.35 is stored just below");
    }
}
