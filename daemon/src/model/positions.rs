//! What one request's prompt adds to a forward pass beyond its embeddings
//! and its KV cache: which image block each position belongs to (families
//! whose image positions attend both ways), its multimodal rope positions,
//! and its deepstack features. They belong to the request (the engine's
//! `Sequence` owns them), not to the cache, which holds keys, values and
//! recurrent states only.

use anyhow::Result;
use mlx_rs::Array;

/// Multimodal rope positions of a prompt (`[t, h, w]` per position), and
/// the delta later (decoded) positions add to their offset: for models
/// whose rope follows an image's grid (the tower's `rope_positions`).
pub type MropePositions = (Vec<[i64; 3]>, i64);

/// A forward pass's per-request inputs; `MediaPositions::default()` for a
/// text prompt or a batch of plain rows.
#[derive(Default, Clone, Copy)]
pub struct MediaPositions<'a> {
    /// Per prompt position, its image block (`-1`: text), for a family
    /// whose image positions see each other during prefill.
    pub image_blocks: Option<&'a [i32]>,
    pub mrope: Option<&'a MropePositions>,
    pub deepstack: Option<&'a Deepstack>,
}

/// Per-layer additions at a prompt's visual positions (Qwen3-VL's deepstack).
pub struct Deepstack {
    /// For each prompt position, its row in `layers[i]`, or -1 for text.
    pub row_of: Vec<i32>,
    /// Per injected layer `[visual positions + 1, hidden]`; the last row is
    /// zeros (what text positions add).
    pub layers: Vec<Array>,
}

impl Deepstack {
    /// What layer `layer` adds to positions `offset..offset + len` of one
    /// row (`[1, len, hidden]`); `None` past the injected layers or where
    /// the span holds no visual position.
    pub fn addend(&self, layer: usize, offset: i32, len: i32) -> Result<Option<Array>> {
        let Some(table) = self.layers.get(layer) else { return Ok(None) };
        let zero = table.shape()[0] - 1;
        let rows: Vec<i32> =
            (offset..offset + len).map(|p| self.row_of.get(p as usize).copied().unwrap_or(-1)).collect();
        if rows.iter().all(|&r| r < 0) {
            return Ok(None);
        }
        let rows: Vec<i32> = rows.into_iter().map(|r| if r < 0 { zero } else { r }).collect();
        let added = table.take_axis(Array::from_slice(&rows, &[len]), 0)?;
        Ok(Some(added.reshape(&[1, len, -1])?))
    }
}
