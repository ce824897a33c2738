//! Decoding and checking media before anything is stored or encoded: PNG,
//! JPEG, WebP and GIF (first frame), EXIF orientation applied, dimensions and
//! pixel count limited *before* decoding so a decompression bomb costs
//! nothing but its header.

use image::{DynamicImage, ImageDecoder, ImageFormat, ImageReader, Limits};
use std::io::Cursor;

/// Largest width or height accepted.
pub const MAX_SIDE: u32 = 16_384;
/// Largest pixel count accepted (about 64 megapixels).
pub const MAX_PIXELS: u64 = 64 * 1024 * 1024;
/// Largest decoder allocation.
const MAX_ALLOC: u64 = 512 * 1024 * 1024;

/// Why media was refused.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum MediaError {
    #[error("not an image (unrecognised file header)")]
    NotAnImage,
    #[error("unsupported image format {0}: use PNG, JPEG, WebP or GIF")]
    Unsupported(String),
    #[error("image is {width}x{height}: over the limit of {MAX_SIDE} per side and {MAX_PIXELS} pixels")]
    TooLarge { width: u32, height: u32 },
    #[error("image is {width}x{height}: it has no pixels")]
    Empty { width: u32, height: u32 },
    #[error("image needs more than {} MiB to decode, the limit", MAX_ALLOC >> 20)]
    TooLargeToDecode,
    #[error("corrupt or truncated image: {0}")]
    Corrupt(String),
}

/// Decodes `bytes` to RGB8 with its EXIF orientation applied.
pub fn decode(bytes: &[u8]) -> Result<image::RgbImage, MediaError> {
    let format = image::guess_format(bytes).map_err(|_| MediaError::NotAnImage)?;
    if !matches!(format, ImageFormat::Png | ImageFormat::Jpeg | ImageFormat::WebP | ImageFormat::Gif) {
        return Err(MediaError::Unsupported(format!("{format:?}")));
    }
    // The header alone says how big the image claims to be.
    let (width, height) = ImageReader::with_format(Cursor::new(bytes), format).into_dimensions().map_err(classify)?;
    if width == 0 || height == 0 {
        return Err(MediaError::Empty { width, height });
    }
    if width > MAX_SIDE || height > MAX_SIDE || width as u64 * height as u64 > MAX_PIXELS {
        return Err(MediaError::TooLarge { width, height });
    }
    let mut reader = ImageReader::with_format(Cursor::new(bytes), format);
    let mut limits = Limits::default();
    limits.max_image_width = Some(MAX_SIDE);
    limits.max_image_height = Some(MAX_SIDE);
    limits.max_alloc = Some(MAX_ALLOC);
    reader.limits(limits);
    let mut decoder = reader.into_decoder().map_err(classify)?;
    let orientation = decoder.orientation().unwrap_or(image::metadata::Orientation::NoTransforms);
    let mut img = DynamicImage::from_decoder(decoder).map_err(classify)?;
    img.apply_orientation(orientation);
    Ok(img.to_rgb8())
}

fn classify(e: image::ImageError) -> MediaError {
    match e {
        image::ImageError::Limits(_) => MediaError::TooLargeToDecode,
        image::ImageError::Unsupported(u) => MediaError::Unsupported(u.to_string()),
        other => MediaError::Corrupt(other.to_string()),
    }
}

/// The resize filter a processor config names with PIL's `resample` codes
/// (0 nearest, 1 Lanczos, 2 bilinear, 3 bicubic; anything else: bicubic).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resample(pub u8);

impl Resample {
    /// PIL's bicubic, the default of most image processors.
    pub const BICUBIC: Resample = Resample(3);

    /// From a processor config's `resample` value (absent: `default`).
    pub fn from_config(v: Option<&serde_json::Value>, default: Resample) -> Resample {
        v.and_then(|v| v.as_u64()).map(|n| Resample(n.min(255) as u8)).unwrap_or(default)
    }

    fn filter(self) -> image::imageops::FilterType {
        use image::imageops::FilterType;
        match self.0 {
            0 => FilterType::Nearest,
            1 => FilterType::Lanczos3,
            2 => FilterType::Triangle,
            _ => FilterType::CatmullRom,
        }
    }

    /// Resizes with this filter (scaled support when shrinking, as PIL does).
    pub fn resize(self, img: &image::RgbImage, width: u32, height: u32) -> image::RgbImage {
        image::imageops::resize(img, width, height, self.filter())
    }

    /// Name for feature-store keys.
    pub fn name(self) -> &'static str {
        match self.0 {
            0 => "nearest",
            1 => "lanczos3",
            2 => "bilinear",
            _ => "catmullrom",
        }
    }
}

/// A model's image preprocessing: resize to a fixed size, rescale, normalize.
#[derive(Debug, Clone, PartialEq)]
pub struct Preprocess {
    pub height: u32,
    pub width: u32,
    pub resample: Resample,
    pub rescale: f32,
    pub mean: [f32; 3],
    pub std: [f32; 3],
}

impl Preprocess {
    /// A stable description, hashed into feature-store keys.
    pub fn describe(&self) -> String {
        format!(
            "resize={}x{}:{};rescale={};mean={:?};std={:?}",
            self.height,
            self.width,
            self.resample.name(),
            self.rescale,
            self.mean,
            self.std
        )
    }

    /// Pixels as f32, channels last (`[height, width, 3]`, row major), as MLX
    /// convolutions expect them.
    pub fn apply(&self, img: &image::RgbImage) -> Vec<f32> {
        let resized = self.resample.resize(img, self.width, self.height);
        resized
            .pixels()
            .flat_map(|p| (0..3).map(move |c| (p.0[c] as f32 * self.rescale - self.mean[c]) / self.std[c]))
            .collect()
    }
}

impl super::family::MediaPreprocessor for Preprocess {
    fn describe(&self) -> String {
        Preprocess::describe(self)
    }

    /// `[1, height, width, 3]`: one image, channels last.
    fn prepare(&self, image: &image::RgbImage) -> super::family::Prepared {
        super::family::Prepared {
            values: self.apply(image),
            shape: vec![1, self.height as i32, self.width as i32, 3],
            grid: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn png(w: u32, h: u32) -> Vec<u8> {
        let img = image::RgbImage::from_fn(w, h, |x, y| image::Rgb([x as u8, y as u8, 128]));
        let mut out = Vec::new();
        img.write_to(&mut Cursor::new(&mut out), ImageFormat::Png).unwrap();
        out
    }

    #[test]
    fn decodes_and_refuses_what_it_should() {
        assert_eq!(decode(&png(4, 3)).unwrap().dimensions(), (4, 3));
        assert_eq!(decode(b"hello, not an image"), Err(MediaError::NotAnImage));
        let full = png(64, 64);
        assert!(matches!(decode(&full[..full.len() / 2]), Err(MediaError::Corrupt(_))));
        let tiff = b"II*\0\x08\0\0\0 the rest of a TIFF file";
        assert!(matches!(decode(tiff), Err(MediaError::Unsupported(_))), "{:?}", decode(tiff));
    }

    #[test]
    fn a_decompression_bomb_is_refused_from_its_header() {
        // A valid PNG header claiming 100000 x 100000 pixels, and no data.
        let mut bomb = png(1, 1);
        bomb[16..20].copy_from_slice(&100_000u32.to_be_bytes());
        bomb[20..24].copy_from_slice(&100_000u32.to_be_bytes());
        let crc = crc32fast::hash(&bomb[12..29]);
        bomb[29..33].copy_from_slice(&crc.to_be_bytes());
        assert!(matches!(decode(&bomb), Err(MediaError::TooLarge { .. })), "{:?}", decode(&bomb));
    }

    #[test]
    fn an_empty_gif_is_called_empty_not_too_large() {
        // GIF89a, a 0x0 logical screen, no frames, the trailer.
        let gif = b"GIF89a\0\0\0\0\0\0\0;";
        let err = decode(gif).unwrap_err();
        assert!(matches!(err, MediaError::Empty { .. } | MediaError::Corrupt(_)), "{err:?}");
        assert!(!err.to_string().contains("over the limit"), "{err}");
    }

    fn encode(img: &image::RgbImage, format: ImageFormat) -> Vec<u8> {
        let mut out = Vec::new();
        DynamicImage::ImageRgb8(img.clone()).write_to(&mut Cursor::new(&mut out), format).unwrap();
        out
    }

    #[test]
    fn jpeg_webp_and_gif_decode() {
        let img = image::RgbImage::from_fn(6, 4, |x, _| image::Rgb([x as u8 * 40, 0, 0]));
        for format in [ImageFormat::Jpeg, ImageFormat::WebP, ImageFormat::Gif] {
            assert_eq!(decode(&encode(&img, format)).unwrap().dimensions(), (6, 4), "{format:?}");
        }
    }

    #[test]
    fn exif_orientation_is_applied() {
        let img = image::RgbImage::from_fn(6, 4, |x, _| image::Rgb([x as u8 * 40, 0, 0]));
        let jpeg = encode(&img, ImageFormat::Jpeg);
        // APP1 "Exif" with one IFD entry: Orientation (0x0112) = 6, "rotate 90 CW".
        let mut tiff = b"II*\0\x08\0\0\0".to_vec();
        tiff.extend_from_slice(&1u16.to_le_bytes());
        tiff.extend_from_slice(&[0x12, 0x01, 3, 0, 1, 0, 0, 0, 6, 0, 0, 0]);
        tiff.extend_from_slice(&0u32.to_le_bytes());
        let mut app1 = b"Exif\0\0".to_vec();
        app1.extend_from_slice(&tiff);
        let mut out = jpeg[..2].to_vec();
        out.extend_from_slice(&[0xFF, 0xE1]);
        out.extend_from_slice(&((app1.len() + 2) as u16).to_be_bytes());
        out.extend_from_slice(&app1);
        out.extend_from_slice(&jpeg[2..]);
        assert_eq!(decode(&out).unwrap().dimensions(), (4, 6), "rotated by its EXIF orientation");
    }

    #[test]
    fn normalizes_channels_last() {
        let img = image::RgbImage::from_pixel(2, 2, image::Rgb([255, 0, 127]));
        let p = Preprocess {
            height: 2,
            width: 2,
            resample: Resample::BICUBIC,
            rescale: 1.0 / 255.0,
            mean: [0.5; 3],
            std: [0.5; 3],
        };
        let px = p.apply(&img);
        assert_eq!(px.len(), 12);
        assert!((px[0] - 1.0).abs() < 1e-6 && (px[1] + 1.0).abs() < 1e-6);
    }
}
