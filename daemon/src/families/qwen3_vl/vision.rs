//! Qwen3-VL's vision side: Qwen2.5-VL's preprocessing with 16-pixel patches
//! (`Qwen25Preprocess`), the tower, the splice, and the deepstack. One
//! image's stored features are `[grid_h / 2, grid_w / 2, hidden * (1 + D)]`:
//! the merged features, then the D deepstack tensors side by side on the
//! last axis — one store entry (with its checksum) holds all D + 1, and
//! the leading axes still say the grid.

use super::tower::Qwen3VisionTower;
use crate::model::family::{LanguageModel, Prepared, VisionTower};
use crate::model::positions::Deepstack;
use anyhow::{bail, ensure, Result};
use mlx_rs::{ops, Array};

/// The tower of a Qwen3-VL checkpoint.
pub struct Qwen3Tower {
    pub tower: Qwen3VisionTower,
    pub image_token_id: u32,
    /// A video's temporal groups take these positions, group by group.
    pub video_token_id: u32,
}

impl Qwen3Tower {
    fn is_media(&self, id: u32) -> bool {
        id == self.image_token_id || id == self.video_token_id
    }

    fn width(&self) -> i32 {
        self.tower.config.out_hidden_size
    }

    /// Columns `part * width .. (part + 1) * width` of an image's features
    /// as rows `[n, width]` (part 0: the merged features, 1..: deepstack).
    fn part(&self, features: &Array, part: i32) -> Result<Array> {
        let w = self.width();
        let d = features.shape()[features.ndim() - 1];
        ensure!(d == w * (1 + self.tower.deepstack_count() as i32), "stored features are {d} wide, not this tower's");
        let rows = features.reshape(&[-1, d])?;
        let cols = Array::from_slice(&(part * w..(part + 1) * w).collect::<Vec<i32>>(), &[w]);
        Ok(rows.take_axis(&cols, 1)?)
    }

    /// The `(t, h, w)` patch grid a stored feature array came from.
    fn grid_of(&self, features: &Array) -> (u32, u32, u32) {
        let m = self.tower.config.spatial_merge_size as u32;
        (1, features.shape()[0] as u32 * m, features.shape()[1] as u32 * m)
    }
}

impl VisionTower for Qwen3Tower {
    fn encode(&self, prepared: &Prepared) -> Result<Array> {
        let Some((t, gh, gw)) = prepared.grid else { bail!("Qwen3-VL patches come with their grid") };
        let merge = self.tower.config.spatial_merge_size;
        let patches = Array::from_slice(&prepared.values, &prepared.shape);
        let (features, deepstack) = self.tower.forward(&patches, (t as i32, gh as i32, gw as i32))?;
        let mut parts = vec![&features];
        parts.extend(deepstack.iter());
        Ok(ops::concatenate(&parts, -1)?.reshape(&[gh as i32 / merge, gw as i32 / merge, -1])?)
    }

    fn splice(&self, lm: &dyn LanguageModel, ids: &[u32], images: &[Array]) -> Result<Array> {
        let text = |seg: &[u32]| lm.embed(&Array::from_slice(seg, &[1, seg.len() as i32]));
        let image = |f: &Array, run: usize| -> Result<Array> {
            let rows = self.part(f, 0)?;
            if rows.shape()[0] as usize != run {
                bail!("an image has {} feature rows but the prompt holds {run} placeholders", rows.shape()[0]);
            }
            Ok(rows.reshape(&[1, run as i32, -1])?)
        };
        crate::model::splice::splice_tokens(ids, &[self.image_token_id, self.video_token_id], images, text, image)
    }

    fn rope_positions(&self, ids: &[u32], features: &[Array]) -> Option<(Vec<[i64; 3]>, i64)> {
        let grids: Vec<_> = features.iter().map(|f| self.grid_of(f)).collect();
        let merge = self.tower.config.spatial_merge_size as u32;
        let tokens = [self.image_token_id, self.video_token_id];
        Some(crate::families::qwen2_5_vl::mrope::positions(ids, &tokens, &grids, merge))
    }

    /// Image- and video-token positions in order take the features'
    /// deepstack rows in order (as mlx-vlm's `_merge_deepstack_features`
    /// and `_deepstack_process` do).
    fn deepstack(&self, ids: &[u32], features: &[Array]) -> Result<Option<Deepstack>> {
        let layers = self.tower.deepstack_count();
        if layers == 0 || features.is_empty() {
            return Ok(None);
        }
        let mut row_of = Vec::with_capacity(ids.len());
        let mut next = 0;
        for &id in ids {
            row_of.push(if self.is_media(id) { next } else { -1 });
            if self.is_media(id) {
                next += 1;
            }
        }
        let mut tables = Vec::with_capacity(layers);
        for j in 0..layers {
            let mut rows = features.iter().map(|f| self.part(f, 1 + j as i32)).collect::<Result<Vec<_>>>()?;
            ensure!(
                rows.iter().map(|r| r.shape()[0]).sum::<i32>() == next,
                "the prompt holds {next} image positions but the images have other counts"
            );
            rows.push(ops::zeros::<f32>(&[1, self.width()])?);
            tables.push(ops::concatenate(&rows.iter().collect::<Vec<_>>(), 0)?);
        }
        Ok(Some(Deepstack { row_of, layers: tables }))
    }
}
