//! Gemma 4 unified's numerics against mlx-vlm 0.7.10 on the tiny fixture
//! (tests/fixtures/reference/gemma4-unified.*,
//! scripts/goldens/mlx_vlm_gemma4_unified.py): the image's model patches
//! exactly, the patch embedder's soft tokens and the audio projector's
//! within 1e-4 relative, the prompt ids exactly, and the first logits of
//! the text, image (attending both ways) and audio prompts. Greedy ids
//! through the real daemon: tests/tests/e2e/gemma4.rs.

use crate::common::*;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;
use mlxbc_daemon::model::kv_cache::KvCache;
use mlxbc_daemon::model::positions::MediaPositions;
use mlxbc_daemon::model::MediaLayout;
use mlxbc_shared::{ChatMessage, MediaRef};

const TOLERANCE: f32 = 1e-4;
const FAMILY: &str = "tiny-gemma4-unified";
/// Vocabulary entries the reference keeps logits for.
const KEPT: i32 = 16384;

#[test]
fn gemma4_unified_matches_mlx_vlm() {
    let golden = reference_json("gemma4-unified.json");
    let mut want = Array::load_safetensors(reference_path("gemma4-unified.safetensors")).unwrap();
    let model = load_checked(FAMILY, &golden);
    assert_eq!(model.lm.architecture(), "gemma4");
    let vision = model.media_tower.as_ref().unwrap();
    let ids_of =
        |case: &str| -> Vec<u32> { serde_json::from_value(golden[FAMILY][case]["prompt_ids"].clone()).unwrap() };
    let first_logits = |ids: &[u32], features: &[Array], case: &str| {
        let embeds = vision.tower.splice(&*model.lm, ids, features).unwrap();
        let blocks = vision.image_blocks(ids);
        let mut cache = KvCache::new(model.lm.num_layers());
        let hidden = model
            .lm
            .forward(&embeds, &mut cache, &MediaPositions { image_blocks: Some(&blocks), ..Default::default() })
            .unwrap();
        let ours = model.lm.logits(&hidden).unwrap().reshape(&[-1]).unwrap().index(..KEPT);
        let err = relative_error(&ours, &want.get(&format!("{case}.logits")).unwrap().clone());
        eprintln!("{FAMILY} first logits, {case}: relative error {err:e}");
        assert!(err < TOLERANCE, "{case} logits differ from mlx-vlm's: {err:e}");
    };

    // The image: our patches are mlx-vlm's (no resize on either side).
    let image = std::fs::read(reference_path(golden["image"].as_str().unwrap())).unwrap();
    let prepared = vision.preprocessor.prepare(&mlxbc_daemon::model::image::decode(&image).unwrap());
    let patches = Array::from_slice(&prepared.values, &prepared.shape);
    assert_eq!(relative_error(&patches, want.get("image.patches").unwrap()), 0.0, "model patches");
    let features = vision.tower.encode(&prepared).unwrap();
    let err = relative_error(&features, want.get("image.features").unwrap());
    eprintln!("{FAMILY} patch embedder + projector: relative error {err:e}");
    assert!(err < TOLERANCE, "image soft tokens differ from mlx-vlm's: {err:e}");

    // The clip: raw frames through the projector.
    let clip = std::fs::read(reference_path("gemma4-audio.wav")).unwrap();
    let samples = mlxbc_daemon::audio::decode::decode(&clip).unwrap().samples;
    let audio = vision.preprocessor.audio().unwrap().prepare(&samples).unwrap();
    let sound = vision.tower.encode_audio(&audio).unwrap();
    let err = relative_error(&sound, want.get("audio.features").unwrap());
    eprintln!("{FAMILY} audio projector: relative error {err:e}");
    assert!(err < TOLERANCE, "audio soft tokens differ from mlx-vlm's: {err:e}");

    let (image_rows, audio_rows) = (features.shape()[0] as usize, sound.shape()[0] as usize);
    for (case, media, layout, rows) in [
        ("image", vec![MediaRef::from_bytes(image.clone())], vec![MediaLayout::Image], vec![image_rows]),
        ("audio", vec![MediaRef::audio(clip.clone())], vec![MediaLayout::Audio], vec![audio_rows]),
        (
            "image_audio",
            vec![MediaRef::from_bytes(image.clone()), MediaRef::audio(clip.clone())],
            vec![MediaLayout::Image, MediaLayout::Audio],
            vec![image_rows, audio_rows],
        ),
    ] {
        let mut message = ChatMessage::user(golden[FAMILY][case]["text"].as_str().unwrap());
        message.media = media;
        let rendered = model.prompter.template.render(&[message]).unwrap();
        let prompt = vision.expand_media(&rendered, &layout, &rows).unwrap();
        assert_eq!(model.encode(&prompt).unwrap(), ids_of(case), "{case}: prompt ids");
    }
    first_logits(&ids_of("text"), &[], "text");
    first_logits(&ids_of("image"), &[features], "image");
    first_logits(&ids_of("audio"), &[sound], "audio");
    want.clear();
}
