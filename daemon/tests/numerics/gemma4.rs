//! Gemma 4's numerics against mlx-vlm 0.7.10 on the tiny fixtures
//! (tests/fixtures/reference/gemma4.*, scripts/goldens/mlx_vlm_gemma4.py):
//! the tower and projector on mlx-vlm's own pixels, the first logits of a
//! text prompt and of an image prompt (per-layer inputs from the spliced
//! features, the image attending both ways) within 1e-4 relative; a video:
//! the frames taken, each frame's features, the prompt ids (`mm:ss` times)
//! exactly and the first logits (every frame attending both ways); an audio
//! clip: the log-mel (padding masked), the audio tower's soft tokens, the
//! prompt ids and the first logits; and a
//! prompt longer than the sliding window prefilled in pieces (KV-shared
//! layers reading the cache of the layers they share) against one pass;
//! and the mixture-of-experts block (26B-A4B's): prompt ids, first logits and
//! greedy ids, dense and packed.
//! Greedy ids through the real daemon: tests/tests/e2e/gemma4.rs.

use crate::common::*;
use mlx_rs::Array;
use mlxbc_daemon::model::family::Prepared;
use mlxbc_daemon::model::kv_cache::KvCache;
use mlxbc_daemon::model::positions::MediaPositions;

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
    let hidden =
        model.lm.forward(embeds, cache, &MediaPositions { image_blocks: blocks, ..Default::default() }).unwrap();
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
        let vision = model.media_tower.as_ref().unwrap();
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

/// The golden clip through our decoder, sampling and preprocessing: the
/// frames mlx-vlm takes, the first frame's features, the prompt ids exactly
/// (alone and after an image), and the first logits with every frame's
/// positions attending to each other both ways.
#[test]
fn gemma4_video_matches_mlx_vlm() {
    use mlxbc_daemon::model::{video, MediaLayout};
    use mlxbc_shared::{ChatMessage, MediaRef};
    let golden = reference_json("gemma4.json");
    let mut want = Array::load_safetensors(reference_path("gemma4.safetensors")).unwrap();
    let clip = std::fs::read(reference_path(golden["clip"].as_str().unwrap())).unwrap();
    let image = std::fs::read(reference_path(golden["image"].as_str().unwrap())).unwrap();
    for family in FAMILIES {
        let model = load_checked(family, &golden);
        let vision = model.media_tower.as_ref().unwrap();
        let pre = vision.preprocessor.video().expect("Gemma 4 takes video");
        let sampled = video::decode(&clip, &pre.sampling())
            .unwrap_or_else(|e| panic!("{e} (scripts/install-deps --test installs ffmpeg)"));
        let indices: Vec<u32> = serde_json::from_value(golden["frames_indices"].clone()).unwrap();
        assert_eq!(sampled.indices, indices, "frames taken differ from mlx-vlm's load_video");
        let frames = pre.prepare(&sampled.frames).unwrap();
        let features: Vec<Array> = frames.iter().map(|f| vision.tower.encode(f).unwrap()).collect();
        let err = relative_error(&features[0], &want.remove(&format!("{family}.video_frame0")).unwrap());
        eprintln!("{family} first frame's features: relative error {err:e}");
        assert!(err < TOLERANCE, "{family}: a frame's features differ from mlx-vlm's: {err:e}");

        let tenths: Vec<u32> = pre.group_seconds(&sampled).into_iter().map(video::prompt_tenths).collect();
        let rows: Vec<usize> = features.iter().map(|f| f.shape()[0] as usize).collect();
        let image_rows = {
            let img = mlxbc_daemon::model::image::decode(&image).unwrap();
            vision.tower.encode(&vision.preprocessor.prepare(&img)).unwrap().shape()[0] as usize
        };
        for (case, media) in [
            ("video", vec![MediaRef::video(clip.clone())]),
            ("image_video", vec![MediaRef::from_bytes(image.clone()), MediaRef::video(clip.clone())]),
        ] {
            let mut message = ChatMessage::user(golden[family][case]["text"].as_str().unwrap());
            let images = media.len() > 1;
            message.media = media;
            let rendered = model.prompter.template.render(&[message]).unwrap();
            let mut layout = vec![MediaLayout::Video { tenths: tenths.clone() }];
            let mut all_rows = rows.clone();
            if images {
                layout.insert(0, MediaLayout::Image);
                all_rows.insert(0, image_rows);
            }
            let prompt = vision.expand_media(&rendered, &layout, &all_rows).unwrap();
            assert_eq!(
                model.encode(&prompt).unwrap(),
                ids_of(&golden, family, case),
                "{family} {case}: prompt ids\n{prompt}"
            );
        }
        let ids = ids_of(&golden, family, "video");
        let embeds = vision.tower.splice(&*model.lm, &ids, &features).unwrap();
        let blocks = vision.image_blocks(&ids);
        assert_eq!(blocks.iter().max().copied(), Some(features.len() as i32 - 1), "one block per frame");
        let logits = last_logits(&model, &embeds, &mut KvCache::new(model.lm.num_layers()), Some(&blocks));
        let err = relative_error(&logits, &want.remove(&format!("{family}.video_logits")).unwrap());
        eprintln!("{family} first logits, video: relative error {err:e}");
        assert!(err < TOLERANCE, "{family}: video logits differ from mlx-vlm's: {err:e}");
    }
}

/// The golden clip through our decoder, frontend and audio tower: the
/// log-mel and its valid frames, the soft tokens, the prompt ids (alone and
/// after an image) and the first logits of the audio prompt.
#[test]
fn gemma4_audio_matches_mlx_vlm() {
    use mlxbc_daemon::model::MediaLayout;
    use mlxbc_shared::{ChatMessage, MediaRef};
    let golden = reference_json("gemma4.json");
    let mut want = Array::load_safetensors(reference_path("gemma4.safetensors")).unwrap();
    let clip = std::fs::read(reference_path(golden["audio"].as_str().unwrap())).unwrap();
    let image = std::fs::read(reference_path(golden["image"].as_str().unwrap())).unwrap();
    let samples = mlxbc_daemon::audio::decode::decode(&clip).unwrap().samples;
    let their_mel = want.remove("audio.mel").unwrap();
    let their_valid = want.remove("audio.valid").unwrap();
    for family in FAMILIES {
        let model = load_checked(family, &golden);
        let vision = model.media_tower.as_ref().unwrap();
        let frontend = vision.preprocessor.audio().expect("the fixture has an audio tower");
        let prepared = frontend.prepare(&samples).unwrap();
        assert_eq!(prepared.frames as i32, their_mel.shape()[0], "mel frames");
        let valid: i32 = their_valid.as_slice::<i32>().iter().sum();
        assert_eq!(prepared.valid_frames as i32, valid, "valid mel frames");
        let mel = Array::from_slice(&prepared.values, their_mel.shape());
        let err = relative_error(&mel, &their_mel);
        eprintln!("{family} log-mel: relative error {err:e}");
        assert!(err < TOLERANCE, "{family}: the log-mel differs from mlx-vlm's: {err:e}");
        let features = vision.tower.encode_audio(&prepared).unwrap();
        let err = relative_error(&features, &want.remove(&format!("{family}.audio_features")).unwrap());
        eprintln!("{family} audio tower + projector: relative error {err:e}");
        assert!(err < TOLERANCE, "{family}: the audio soft tokens differ from mlx-vlm's: {err:e}");

        let rows = features.shape()[0] as usize;
        let image_rows = {
            let img = mlxbc_daemon::model::image::decode(&image).unwrap();
            vision.tower.encode(&vision.preprocessor.prepare(&img)).unwrap().shape()[0] as usize
        };
        for (case, media) in [
            ("audio", vec![MediaRef::audio(clip.clone())]),
            ("image_audio", vec![MediaRef::from_bytes(image.clone()), MediaRef::audio(clip.clone())]),
        ] {
            let mut message = ChatMessage::user(golden[family][case]["text"].as_str().unwrap());
            let (layout, all_rows) = if media.len() > 1 {
                (vec![MediaLayout::Image, MediaLayout::Audio], vec![image_rows, rows])
            } else {
                (vec![MediaLayout::Audio], vec![rows])
            };
            message.media = media;
            let rendered = model.prompter.template.render(&[message]).unwrap();
            let prompt = vision.expand_media(&rendered, &layout, &all_rows).unwrap();
            assert_eq!(model.encode(&prompt).unwrap(), ids_of(&golden, family, case), "{family} {case}: prompt ids");
        }
        let ids = ids_of(&golden, family, "audio");
        let embeds = vision.tower.splice(&*model.lm, &ids, &[features]).unwrap();
        let blocks = vision.image_blocks(&ids);
        assert!(blocks.iter().all(|&b| b == -1), "audio attends causally");
        let logits = last_logits(&model, &embeds, &mut KvCache::new(model.lm.num_layers()), Some(&blocks));
        let err = relative_error(&logits, &want.remove(&format!("{family}.audio_logits")).unwrap());
        eprintln!("{family} first logits, audio: relative error {err:e}");
        assert!(err < TOLERANCE, "{family}: audio logits differ from mlx-vlm's: {err:e}");
    }
}

/// Gemma 4's mixture-of-experts block (26B-A4B's feed-forward) on
/// tiny-gemma4-moe and its 4-bit copy (experts quantized too), against
/// mlx-vlm (tests/fixtures/reference/gemma4-moe.*,
/// scripts/goldens/mlx_vlm_gemma4_moe.py): the prompt ids of a text and an
/// image prompt exactly, their first logits within 1e-4, and eight greedy ids
/// exactly (the image attending both ways, as mlx-vlm's forward pass).
#[test]
fn gemma4_moe_matches_mlx_vlm() {
    use mlx_rs::ops::indexing::{argmax_axis, IndexOp};
    use mlxbc_daemon::model::MediaLayout;
    use mlxbc_shared::{ChatMessage, MediaRef};
    let golden = reference_json("gemma4-moe.json");
    let mut want = Array::load_safetensors(reference_path("gemma4-moe.safetensors")).unwrap();
    let image = std::fs::read(reference_path(golden["image"].as_str().unwrap())).unwrap();
    for family in ["tiny-gemma4-moe", "tiny-gemma4-moe-4bit"] {
        let model = load_checked(family, &golden);
        let vision = model.media_tower.as_ref().unwrap();
        let prepared = vision.preprocessor.prepare(&mlxbc_daemon::model::image::decode(&image).unwrap());
        let features = vision.tower.encode(&prepared).unwrap();
        for case in ["text", "image"] {
            let g = &golden[family][case];
            let mut message = ChatMessage::user(g["text"].as_str().unwrap());
            let (layout, rows, media) = if case == "image" {
                message.media = vec![MediaRef::from_bytes(image.clone())];
                (vec![MediaLayout::Image], vec![features.shape()[0] as usize], vec![features.clone()])
            } else {
                (vec![], vec![], vec![])
            };
            let rendered = model.prompter.template.render(&[message]).unwrap();
            let prompt = vision.expand_media(&rendered, &layout, &rows).unwrap();
            let ids = model.encode(&prompt).unwrap();
            assert_eq!(ids, ids_of(&golden, family, case), "{family} {case}: prompt ids");

            let embeds = vision.tower.splice(&*model.lm, &ids, &media).unwrap();
            let blocks = vision.image_blocks(&ids);
            let mut cache = KvCache::new(model.lm.num_layers());
            let mut logits = model
                .lm
                .logits(
                    &model
                        .lm
                        .forward(
                            &embeds,
                            &mut cache,
                            &MediaPositions { image_blocks: Some(&blocks), ..Default::default() },
                        )
                        .unwrap(),
                )
                .unwrap();
            let first = logits.reshape(&[-1]).unwrap().index(..KEPT);
            let err = relative_error(&first, &want.remove(&format!("{family}.{case}.logits")).unwrap());
            eprintln!("{family} first logits, {case}: relative error {err:e}");
            assert!(err < TOLERANCE, "{family} {case}: first logits differ from mlx-vlm's: {err:e}");
            let mut greedy = Vec::new();
            for _ in 0..g["generated_ids"].as_array().unwrap().len() {
                let next = argmax_axis(&logits, -1, None).unwrap().item_cast::<u32>();
                greedy.push(next);
                let embeds = model.lm.embed(&Array::from_slice(&[next], &[1, 1])).unwrap();
                logits = model
                    .lm
                    .logits(&model.lm.forward(&embeds, &mut cache, &MediaPositions::default()).unwrap())
                    .unwrap();
            }
            let theirs: Vec<u32> = serde_json::from_value(g["generated_ids"].clone()).unwrap();
            assert_eq!(greedy, theirs, "{family} {case}: greedy ids");
        }
    }
    // The packed form (the GPU's: experts through gather_qmm on the 4-bit
    // weights, not dequantized first) on the text prompt.
    let family = "tiny-gemma4-moe-4bit";
    let form = mlxbc_daemon::model::weights::WeightForm::Packed(mlx_rs::Dtype::Float32);
    let model = mlxbc_daemon::families::load(&fixture(&format!("mlx/{family}")), form, None).unwrap();
    let ids = ids_of(&golden, family, "text");
    let embeds = model.lm.embed(&Array::from_slice(&ids, &[1, ids.len() as i32])).unwrap();
    let logits = last_logits(&model, &embeds, &mut KvCache::new(model.lm.num_layers()), None);
    let want = Array::load_safetensors(reference_path("gemma4-moe.safetensors")).unwrap();
    let err = relative_error(&logits, &want[&format!("{family}.text.logits")]);
    eprintln!("{family}, packed (gather_qmm), first logits, text: relative error {err:e}");
    assert!(err < TOLERANCE, "{family} packed: first logits differ from mlx-vlm's: {err:e}");
}

/// A MoE directory whose config names more experts than its weights hold is
/// refused at load with a sentence, not run (the router's picks would index
/// past the stacks: MLX's gathers do not bound-check).
#[test]
fn gemma4_moe_with_a_wrong_expert_count_is_refused() {
    let src = fixture("mlx/tiny-gemma4-moe");
    let tmp = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        if path.file_name().unwrap() != "config.json" {
            std::os::unix::fs::symlink(&path, tmp.path().join(path.file_name().unwrap())).unwrap();
        }
    }
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    config["text_config"]["num_experts"] = 8.into();
    std::fs::write(tmp.path().join("config.json"), config.to_string()).unwrap();
    let form = mlxbc_daemon::model::weights::WeightForm::DenseF32;
    let err = mlxbc_daemon::families::load(tmp.path(), form, None).err().expect("a wrong expert count must not load");
    let text = format!("{err:#}");
    assert!(text.contains("MoE weights hold [4, 4, 4, 4, 4] experts") && text.contains("config 8"), "{text}");
}
