//! Splicing media features into a prompt's embeddings: the shared part of
//! every tower's [`super::family::VisionTower::splice`].

use anyhow::{bail, Result};
use mlx_rs::Array;

/// Prompt embeddings `[1, L, hidden]`: runs of `image_token` in `ids` take
/// the next image (in order) through `image(features, run_length)`, other
/// runs go through `text(ids)`. More or fewer images than runs is an error,
/// never a silent misalignment.
pub fn splice(
    ids: &[u32],
    image_token: u32,
    images: &[Array],
    text: impl Fn(&[u32]) -> Result<Array>,
    image: impl Fn(&Array, usize) -> Result<Array>,
) -> Result<Array> {
    splice_tokens(ids, &[image_token], images, text, image)
}

/// [`splice`] where runs of any of `media_tokens` (an image's, a video
/// group's) take the next feature array; a run is one token repeated.
pub fn splice_tokens(
    ids: &[u32],
    media_tokens: &[u32],
    images: &[Array],
    text: impl Fn(&[u32]) -> Result<Array>,
    image: impl Fn(&Array, usize) -> Result<Array>,
) -> Result<Array> {
    let mut parts = Vec::new();
    let mut images = images.iter();
    let mut i = 0;
    while i < ids.len() {
        let is_image = media_tokens.contains(&ids[i]);
        let first = ids[i];
        let run = if is_image {
            ids[i..].iter().take_while(|&&t| t == first).count()
        } else {
            ids[i..].iter().take_while(|&&t| !media_tokens.contains(&t)).count()
        };
        if is_image {
            let Some(f) = images.next() else { bail!("the prompt has more image placeholders than images") };
            parts.push(image(f, run)?);
        } else {
            parts.push(text(&ids[i..i + run])?);
        }
        i += run;
    }
    if images.next().is_some() {
        bail!("more images than image placeholders in the prompt");
    }
    Ok(mlx_rs::ops::concatenate(&parts, 1)?)
}
