//! Multimodal rotary positions for Qwen2-VL / Qwen2.5-VL (HF and mlx-vlm's
//! `get_rope_index`, images only): text advances all three axes (time,
//! height, width) together; an image's tokens share one time index and take
//! their row and column in the merged patch grid. The Qwen2 decoder of
//! Qwen2.5-VL rotates with these (`Qwen25Tower::rope_positions` gives them to the engine, which sets them on the cache).

/// Positions `[len][t, h, w]` for `ids`, and the delta that decode steps add
/// to their plain offset (`max position + 1 - len`).
/// `grids[i]` is image i's `(t, h, w)` patch grid before merging; a run of
/// any of `media_tokens` is the next grid's (Qwen3-VL: a video's temporal
/// groups are grids `(1, h, w)` of their own, between their timestamps).
pub fn positions(ids: &[u32], media_tokens: &[u32], grids: &[(u32, u32, u32)], merge: u32) -> (Vec<[i64; 3]>, i64) {
    let mut out: Vec<[i64; 3]> = Vec::with_capacity(ids.len());
    let next_start = |out: &Vec<[i64; 3]>| out.iter().flat_map(|p| p.iter()).max().map_or(0, |m| m + 1);
    let mut st = 0usize;
    for &(t, h, w) in grids {
        let Some(ed) = ids[st..].iter().position(|x| media_tokens.contains(x)).map(|p| p + st) else {
            break;
        };
        let start = next_start(&out);
        for i in 0..(ed - st) as i64 {
            out.push([start + i; 3]);
        }
        let base = start + (ed - st) as i64;
        let (gt, gh, gw) = (t as i64, (h / merge) as i64, (w / merge) as i64);
        for ti in 0..gt {
            for hi in 0..gh {
                for wi in 0..gw {
                    out.push([base + ti, base + hi, base + wi]);
                }
            }
        }
        st = ed + (gt * gh * gw) as usize;
    }
    let start = next_start(&out);
    for i in 0..(ids.len().saturating_sub(st)) as i64 {
        out.push([start + i; 3]);
    }
    let max = out.iter().flat_map(|p| p.iter()).max().copied().unwrap_or(-1);
    (out, max + 1 - ids.len() as i64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_image_text() {
        // 3 text tokens, one image on a 4 x 6 patch grid (2 x 3 merged), 2 text tokens.
        // Expected values are what mlx-vlm 0.7.10's get_rope_index returns for this prompt.
        let img = 9;
        let ids = [1, 2, 3, img, img, img, img, img, img, 4, 5];
        let (pos, delta) = positions(&ids, &[img], &[(1, 4, 6)], 2);
        assert_eq!(&pos[..3], &[[0; 3], [1; 3], [2; 3]]);
        assert_eq!(&pos[3..9], &[[3, 3, 3], [3, 3, 4], [3, 3, 5], [3, 4, 3], [3, 4, 4], [3, 4, 5]]);
        // Text resumes after the largest image position (5).
        assert_eq!(&pos[9..], &[[6; 3], [7; 3]]);
        assert_eq!(delta, 8 - 11);
    }

    #[test]
    fn text_only_is_plain_positions() {
        let (pos, delta) = positions(&[5, 6, 7], &[9], &[], 2);
        assert_eq!(pos, vec![[0; 3], [1; 3], [2; 3]]);
        assert_eq!(delta, 0);
    }
}
