//! Gemma 4's numerics against mlx-vlm 0.7.10 on the tiny fixtures
//! (tests/fixtures/reference/gemma4.*, scripts/reference/mlx_vlm_gemma4.py):
//! the tower and projector on mlx-vlm's own pixels, the first logits of a
//! text prompt and of an image prompt (per-layer inputs from the spliced
//! features, the image attending both ways) within 1e-4 relative; and a
//! prompt longer than the sliding window prefilled in pieces (KV-shared
//! layers reading the cache of the layers they share) against one pass.
//! Greedy ids through the real daemon: tests/tests/e2e/gemma4.rs.

mod common;

use common::*;
use mlx_rs::Array;
use mlxbc_daemon::model::family::Prepared;
use mlxbc_daemon::model::kv_cache::KvCache;

const TOLERANCE: f32 = 1e-4;
const FAMILIES: [&str; 2] = ["tiny-gemma4", "tiny-gemma4-4bit"];

fn ids_of(golden: &serde_json::Value, family: &str, case: &str) -> Vec<u32> {
    serde_json::from_value(golden[family][case]["prompt_ids"].clone()).unwrap()
}

/// Vocabulary entries the reference keeps logits for (the script's LOGITS).
const KEPT: i32 = 16384;

/// The last position's logits, the first `KEPT` of them.
fn last_logits(
    model: &mlxbc_daemon::model::Model,
    embeds: &Array,
    cache: &mut KvCache,
    blocks: Option<&[i32]>,
) -> Array {
    use mlx_rs::ops::indexing::IndexOp;
    let hidden = model.lm.forward(embeds, cache, blocks).unwrap();
    model.lm.logits(&hidden).unwrap().reshape(&[-1]).unwrap().index(..KEPT)
}

#[test]
fn gemma4_tower_and_first_logits_match_mlx_vlm() {
    let golden = reference_json("gemma4.json");
    let mut want = Array::load_safetensors(reference_path("gemma4.safetensors")).unwrap();
    for family in FAMILIES {
        let model = load_checked(family, &golden);
        assert_eq!(model.lm.architecture(), "gemma4");
        assert_eq!(model.lm.num_layers(), 4, "six layers, the last two reading the KV of layers 3 and 2");
        let vision = model.vision.as_ref().unwrap();
        let pixels = want.get("pixels").unwrap();
        let prepared =
            Prepared { values: pixels.as_slice::<f32>().to_vec(), shape: pixels.shape().to_vec(), grid: None };
        let features = vision.tower.encode(&prepared).unwrap();
        let theirs = want.remove(&format!("{family}.features")).unwrap();
        let err = relative_error(&features, &theirs);
        eprintln!("{family} tower + projector on mlx-vlm's pixels: relative error {err:e}");
        assert!(err < TOLERANCE, "{family}: the tower differs from mlx-vlm's: {err:e}");

        let ids = ids_of(&golden, family, "text");
        let embeds = model.lm.embed(&Array::from_slice(&ids, &[1, ids.len() as i32])).unwrap();
        let logits = last_logits(&model, &embeds, &mut KvCache::new(model.lm.num_layers()), None);
        let theirs = want.remove(&format!("{family}.text_logits")).unwrap();
        let err = relative_error(&logits, &theirs);
        eprintln!("{family} first logits, text: relative error {err:e}");
        assert!(err < TOLERANCE, "{family}: text logits differ from mlx-vlm's: {err:e}");

        // The image prompt: our features spliced into mlx-vlm's ids, the
        // image's positions attending to each other both ways.
        let ids = ids_of(&golden, family, "image");
        let embeds = vision.tower.splice(&*model.lm, &ids, &[features]).unwrap();
        let blocks = vision.image_blocks(&ids);
        let logits = last_logits(&model, &embeds, &mut KvCache::new(model.lm.num_layers()), Some(&blocks));
        let theirs = want.remove(&format!("{family}.image_logits")).unwrap();
        let causal = want.remove(&format!("{family}.image_logits_causal")).unwrap();
        let err = relative_error(&logits, &theirs);
        eprintln!("{family} first logits, image: relative error {err:e}");
        assert!(err < TOLERANCE, "{family}: image logits differ from mlx-vlm's: {err:e}");
        assert!(relative_error(&causal, &theirs) > 1e-2, "{family}: the bidirectional image block must matter");
    }
}

/// The long prompt (183 positions; sliding window 32) in pieces of 50, 50,
/// the rest but one, and one: the windows, the full layers and the shared
/// layers read what earlier pieces cached. Equal to one pass.
#[test]
fn gemma4_prefill_in_pieces_equals_one_pass() {
    use mlx_rs::ops::indexing::IndexOp;
    let golden = reference_json("gemma4.json");
    let family = FAMILIES[0];
    let model = load_checked(family, &golden);
    let ids = ids_of(&golden, family, "long");
    assert!(ids.len() > 100);
    let embeds = model.lm.embed(&Array::from_slice(&ids, &[1, ids.len() as i32])).unwrap();
    let whole = last_logits(&model, &embeds, &mut KvCache::new(model.lm.num_layers()), None);
    let mut cache = KvCache::new(model.lm.num_layers());
    let n = ids.len() as i32;
    let mut logits = None;
    for (from, to) in [(0, 50), (50, 100), (100, n - 1), (n - 1, n)] {
        let piece = embeds.index((.., from..to, ..));
        logits = Some(last_logits(&model, &piece, &mut cache, None));
    }
    let err = relative_error(&logits.unwrap(), &whole);
    eprintln!("{family} prefilled in pieces vs one pass: relative error {err:e}");
    assert!(err < 1e-5, "pieces differ from one pass: {err:e}");
    assert_eq!(cache.offset, n);
}
