//! MediaTower towers against mlx-vlm's own classes on the very same random
//! weights and pixels (tests/fixtures/reference/*-tower.safetensors, made by
//! scripts/goldens/mlx_vlm_towers.py with mlx-vlm 0.7.10 on mlx 0.32.4).
//!
//! Tolerance: the largest absolute difference must stay below 1e-4 of the
//! largest reference magnitude. Both sides compute in f32 on CPU; they differ
//! only where MLX 0.32.2 and 0.32.4 round reductions differently.

use mlx_rs::{ops, Array};
use mlxbc_daemon::families::gemma3::projector::Gemma3Projector;
use mlxbc_daemon::families::gemma3::siglip::{SiglipConfig, SiglipTower};
use mlxbc_daemon::model::family::{LanguageModel, VisionTower};
use mlxbc_daemon::model::kv_cache::KvCache;
use mlxbc_daemon::model::positions::MediaPositions;
use mlxbc_daemon::model::weights::{TensorMap, WeightForm};
use mlxbc_daemon::model::MediaLayout;

const TOLERANCE: f32 = 1e-4;

use crate::common::*;

fn reference(name: &str) -> std::collections::HashMap<String, Array> {
    let p = reference_path(name);
    Array::load_safetensors(&p)
        .unwrap_or_else(|e| panic!("reading {}: {e} (regenerate with scripts/goldens/mlx_vlm_towers.py)", p.display()))
}

/// The SigLIP shape scripts/goldens/mlx_vlm_towers.py builds (VISION there).
fn tiny_siglip() -> SiglipConfig {
    SiglipConfig {
        hidden_size: 64,
        intermediate_size: 128,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        patch_size: 8,
        image_size: 64,
        layer_norm_eps: 1e-6,
    }
}

/// What mlx-vlm recorded for a tiny model: the prompt, its greedy ids and
/// the logits of the first step.
struct Recorded {
    prompt: Vec<u32>,
    generated: Vec<u32>,
    first_logits: Array,
}

fn take_recorded(t: &mut std::collections::HashMap<String, Array>) -> Recorded {
    let ids = |a: Array| a.as_slice::<u32>().to_vec();
    Recorded {
        prompt: ids(t.remove("test.prompt").unwrap()),
        generated: ids(t.remove("test.generated").unwrap()),
        first_logits: t.remove("test.first_logits").unwrap(),
    }
}

/// Positions `[0, n-1)` and `[n-1, n)` of prompt embeddings: mlx-vlm's prefill order.
fn split_last(embeds: &Array) -> (Array, Array) {
    let n = embeds.shape()[1];
    let body = embeds.take_axis(Array::from_slice(&(0..n - 1).collect::<Vec<i32>>(), &[n - 1]), 1).unwrap();
    (body, embeds.take_axis(Array::from_slice(&[n - 1], &[1]), 1).unwrap())
}

/// Prefills the reference's way, decodes greedily, and checks the first
/// logits (within TOLERANCE) and every id against the recording. `forward`
/// maps embeddings to last-position logits, advancing its own cache.
fn assert_greedy_matches(
    label: &str,
    rec: &Recorded,
    embeds: &Array,
    mut forward: impl FnMut(&Array) -> Array,
    embed: impl Fn(u32) -> Array,
) {
    let (body, last) = split_last(embeds);
    forward(&body);
    let mut logits = forward(&last);
    let err = relative_error(&logits.reshape(&[-1]).unwrap(), &rec.first_logits);
    eprintln!("{label} first logits: relative error {err:e}");
    assert!(err < TOLERANCE, "{label}: prefill logits differ from mlx-vlm: {err:e}");
    let mut got = Vec::new();
    for _ in 0..rec.generated.len() {
        let y = mlx_rs::ops::indexing::argmax_axis(&logits, -1, None).unwrap().item_cast::<u32>();
        got.push(y);
        logits = forward(&embed(y));
    }
    assert_eq!(got, rec.generated, "{label}: greedy ids differ from mlx-vlm");
}

#[test]
fn gemma3_siglip_tower_and_projector_match_mlx_vlm() {
    let mut tensors = reference("gemma3-tower.safetensors");
    let pixels = tensors.remove("test.pixels").unwrap();
    let want_hidden = tensors.remove("test.tower_output").unwrap();
    let want_features = tensors.remove("test.features").unwrap();
    let mut t = TensorMap::from_arrays(tensors, 64, WeightForm::DenseF32);
    let config = tiny_siglip();
    let tower = SiglipTower::load(config, &mut t, "vision_tower.vision_model").unwrap();
    let projector = Gemma3Projector::load(&mut t, "multi_modal_projector", 64, 8, 16, 1e-6).unwrap();
    let hidden = tower.forward(&pixels).unwrap();
    let err = relative_error(&hidden, &want_hidden);
    eprintln!("gemma3 tower: relative error {err:e}");
    assert!(err < TOLERANCE, "tower output differs from mlx-vlm: relative error {err:e}");
    let features = projector.forward(&hidden).unwrap();
    let err = relative_error(&features, &want_features);
    eprintln!("gemma3 projected features: relative error {err:e}");
    assert!(err < TOLERANCE, "projected features differ from mlx-vlm: relative error {err:e}");
    assert_eq!(features.shape(), &[2, projector.tokens(), 96]);
    // The check can fail: a different input gives different features.
    let other = tower.forward(&pixels.multiply(Array::from_f32(0.5)).unwrap()).unwrap();
    assert!(relative_error(&other, &want_hidden) > 1e-2);
}

#[test]
fn tiny_gemma3_vlm_greedy_ids_match_mlx_vlm() {
    use mlxbc_daemon::families::gemma3::text::{Gemma3Text, Gemma3TextConfig};
    use mlxbc_daemon::families::gemma3::vision::Gemma3Tower;
    let mut tensors = reference("gemma3-vlm-tiny.safetensors");
    let pixels = tensors.remove("test.pixels").unwrap();
    let rec = take_recorded(&mut tensors);
    let prompt = rec.prompt.clone();
    let mut t = TensorMap::from_arrays(tensors, 64, WeightForm::DenseF32);
    let text: Gemma3TextConfig = serde_json::from_value(serde_json::json!({
        "hidden_size": 96, "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "query_pre_attn_scalar": 32, "vocab_size": 300,
        "sliding_window_pattern": 2, "sliding_window": 1024, "mm_tokens_per_image": 16
    }))
    .unwrap();
    let vision = tiny_siglip();
    let tower = Gemma3Tower::load(vision, text.mm_tokens_per_image, text.hidden_size, 250, &mut t).unwrap();
    let mut lm = Gemma3Text::load(text, &mut t, "language_model", None).unwrap();
    // mlx-vlm 0.7.10 attends causally over image tokens (see Gemma3Text).
    lm.bidirectional_images = false;
    let features = tower.encode_pixels(&pixels).unwrap();
    let embeds = tower.splice(&lm, &prompt, &[features]).unwrap();
    let mut cache = KvCache::new(lm.num_layers());
    let forward = |e: &Array| lm.logits(&lm.forward(e, &mut cache, &MediaPositions::default()).unwrap()).unwrap();
    let embed = |y: u32| LanguageModel::embed(&lm, &Array::from_slice(&[y], &[1, 1])).unwrap();
    assert_greedy_matches("gemma3 vlm", &rec, &embeds, forward, embed);
    // HF's mask (bidirectional within the image) changes the prefill — this
    // is where and why ids part from mlx-vlm when it is on.
    let blocks: Vec<i32> = {
        let mut block = -1;
        prompt
            .iter()
            .enumerate()
            .map(|(i, &t)| {
                if t != 250 {
                    -1
                } else {
                    if i == 0 || prompt[i - 1] != 250 {
                        block += 1
                    }
                    block
                }
            })
            .collect()
    };
    assert_eq!(blocks.iter().filter(|&&b| b == 0).count(), 16);
    let (body, last) = split_last(&embeds);
    let mut c2 = KvCache::new(lm.num_layers());
    lm.hidden(&body, &mut c2, Some(&blocks)).unwrap();
    let h2 = lm.hidden(&last, &mut c2, Some(&blocks)).unwrap();
    let bidir = lm.logits_last(&h2).unwrap();
    let moved = relative_error(&bidir.reshape(&[-1]).unwrap(), &rec.first_logits);
    eprintln!("gemma3 vlm, bidirectional image attention vs mlx-vlm's causal: relative logit change {moved:e}");
    assert!(moved > 1e-4, "bidirectional image attention must change the result");
    // Too many or too few images are errors, not silent misalignment.
    assert!(tower.splice(&lm, &prompt, &[]).is_err());
    let f = tower.encode_pixels(&pixels).unwrap();
    assert!(tower.splice(&lm, &prompt, &[f.clone(), f]).is_err());
}

#[test]
fn qwen25_vl_tower_matches_mlx_vlm() {
    use mlxbc_daemon::families::qwen2_5_vl::tower::{Qwen25VisionConfig, Qwen25VisionTower};
    let mut tensors = reference("qwen25-vl-tower.safetensors");
    let patches = tensors.remove("test.patches").unwrap();
    let want = tensors.remove("test.features").unwrap();
    let mut t = TensorMap::from_arrays(tensors, 64, WeightForm::DenseF32);
    let config: Qwen25VisionConfig = serde_json::from_value(serde_json::json!({
        "depth": 2, "hidden_size": 32, "intermediate_size": 64, "out_hidden_size": 48, "num_heads": 2,
        "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56,
        "fullatt_block_indexes": [1]
    }))
    .unwrap();
    let tower = Qwen25VisionTower::load(config, &mut t, "visual").unwrap();
    let got = tower.forward(&patches, (1, 8, 12)).unwrap();
    let err = relative_error(&got, &want);
    eprintln!("qwen2.5-vl tower: relative error {err:e}");
    assert!(err < TOLERANCE, "Qwen2.5-VL tower differs from mlx-vlm: relative error {err:e}");
}

#[test]
fn qwen25_vl_patchify_matches_the_hf_processor() {
    use mlxbc_daemon::families::qwen2_5_vl::tower::patchify;
    let mut tensors = reference("qwen25-vl-tower.safetensors");
    let pixels = tensors.remove("test.qwen_pixels").unwrap();
    let want = tensors.remove("test.qwen_patchified").unwrap();
    let got = patchify(pixels.as_slice::<f32>(), 56, 84, 14, 2, 2);
    assert_eq!(got.len(), want.size());
    assert_eq!(got.as_slice(), want.as_slice::<f32>(), "patch layout differs from transformers' Qwen2VLImageProcessor");
}

#[test]
fn qwen25_vl_language_model_with_multimodal_rope_matches_mlx_vlm() {
    use mlxbc_daemon::families::llama::model::Transformer;
    use mlxbc_daemon::families::qwen2_5_vl::mrope;
    let mut tensors = reference("qwen25-vl-language.safetensors");
    let rec = take_recorded(&mut tensors);
    let tensors = tensors.into_iter().map(|(k, v)| (k.trim_start_matches("language_model.").to_string(), v)).collect();
    let model =
        Transformer::from_tensors(tiny_qwen_text(), TensorMap::from_arrays(tensors, 64, WeightForm::DenseF32), None)
            .unwrap();
    let mut cache = KvCache::new(2);
    let positions = mrope::positions(&rec.prompt, &[250], &[(1, 4, 6)], 2);
    let media = MediaPositions { mrope: Some(&positions), ..Default::default() };
    let embeds = model.embed(&Array::from_slice(&rec.prompt, &[1, rec.prompt.len() as i32])).unwrap();
    let forward = |e: &Array| model.logits_last(&model.hidden(e, &mut cache, &media).unwrap()).unwrap();
    let embed = |y: u32| model.embed(&Array::from_slice(&[y], &[1, 1])).unwrap();
    assert_greedy_matches("qwen2.5-vl language (mrope)", &rec, &embeds, forward, embed);
}

#[test]
fn tiny_qwen25_vl_whole_model_greedy_ids_match_mlx_vlm() {
    use mlxbc_daemon::families::llama::model::Transformer;
    use mlxbc_daemon::families::qwen2_5_vl::tower::{Qwen25VisionConfig, Qwen25VisionTower};
    use mlxbc_daemon::families::qwen2_5_vl::vision::Qwen25Tower;
    let mut tensors = reference("qwen25-vl-tiny.safetensors");
    let patches = tensors.remove("test.patches").unwrap();
    let rec = take_recorded(&mut tensors);
    let mut t = TensorMap::from_arrays(tensors, 64, WeightForm::DenseF32);
    let vision: Qwen25VisionConfig = serde_json::from_value(serde_json::json!({
        "depth": 2, "hidden_size": 32, "intermediate_size": 64, "out_hidden_size": 64, "num_heads": 2,
        "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56,
        "fullatt_block_indexes": [1]
    }))
    .unwrap();
    let tower = Qwen25VisionTower::load(vision, &mut t, "vision_tower").unwrap();
    let text = Transformer::from_tensors(tiny_qwen_text(), t.strip_prefix("language_model."), None).unwrap();
    let tower = Qwen25Tower { tower, image_token_id: 250 };
    let features = tower.tower.forward(&patches, (1, 8, 12)).unwrap().reshape(&[4, 6, 64]).unwrap();
    assert_eq!(tower.grid_of(&features), (1, 8, 12));
    let embeds = tower.splice(&text, &rec.prompt, std::slice::from_ref(&features)).unwrap();
    let mut cache = KvCache::new(2);
    let positions = tower.rope_positions(&rec.prompt, &[features]);
    let media = MediaPositions { mrope: positions.as_ref(), ..Default::default() };
    let forward = |e: &Array| text.logits(&text.forward(e, &mut cache, &media).unwrap()).unwrap();
    let embed = |y: u32| text.embed(&Array::from_slice(&[y], &[1, 1])).unwrap();
    assert_greedy_matches("qwen2.5-vl whole model", &rec, &embeds, forward, embed);
}

/// The Qwen2.5-VL text shape scripts/goldens/mlx_vlm_towers.py builds (QWEN_TEXT there).
fn tiny_qwen_text() -> mlxbc_daemon::families::llama::config::TextConfig {
    mlxbc_daemon::families::llama::config::TextConfig::from_hf_json(
        &serde_json::json!({
            "model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
            "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "vocab_size": 300,
            "rope_theta": 1000000.0, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
            "tie_word_embeddings": false, "max_position_embeddings": 2048
        })
        .to_string(),
    )
    .unwrap()
}

/// The fixtures' tiny VLMs through the daemon's own front half — chat
/// template, processor (resize, rescale, normalize), tower and projector,
/// placeholder expansion, tokenizer — against mlx-vlm's whole pipeline on the
/// same directory and image (tests/fixtures/reference/vlm-pipeline.*, made by
/// scripts/goldens/mlx_vlm_pipeline.py). Greedy ids through the real daemon
/// are checked in tests/tests/e2e/reference.rs.
#[test]
fn fixture_vlms_prompt_ids_and_features_match_mlx_vlm_pipeline() {
    use mlxbc_shared::{ChatMessage, Role};
    let golden = reference_json("vlm-pipeline.json");
    let mut want_features = reference("vlm-pipeline.safetensors");
    let bytes = std::fs::read(reference_path(golden["image"].as_str().unwrap())).unwrap();
    let img = mlxbc_daemon::model::image::decode(&bytes).unwrap();
    for family in ["tiny-gemma3-vlm", "tiny-qwen25-vl"] {
        let dir = fixture(&format!("mlx/{family}"));
        let g = &golden[family];
        assert_eq!(
            sha256_hex(&dir.join("model.safetensors")),
            g["weights_sha256"].as_str().unwrap(),
            "{family}: not the fixture the reference was made from; rebuild with scripts/test-fixtures"
        );
        let model = mlxbc_daemon::families::load(&dir, WeightForm::DenseF32, None).unwrap();
        let vision = model.media_tower.as_ref().unwrap();

        let prepared = vision.preprocessor.prepare(&img);
        if prepared.grid.is_none() {
            // Fixed-size processors ([1, H, W, 3]): the resized, normalized pixels themselves.
            let nchw = want_features.remove(&format!("{family}.pixels")).unwrap();
            let (h, w) = (prepared.shape[1] as usize, prepared.shape[2] as usize);
            let nchw = nchw.as_slice::<f32>();
            let theirs = (0..h * w * 3).map(|i| nchw[(i % 3) * h * w + i / 3]); // channels last, as ours
            let pre: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(dir.join("preprocessor_config.json")).unwrap()).unwrap();
            let level = (pre["rescale_factor"].as_f64().unwrap() / pre["image_std"][0].as_f64().unwrap()) as f32;
            let levels: Vec<f32> = prepared.values.iter().zip(theirs).map(|(a, b)| ((a - b) / level).abs()).collect();
            let worst = levels.iter().copied().fold(0.0, f32::max);
            let off = levels.iter().filter(|d| **d > 0.5).count();
            let ours = &levels;
            eprintln!("{family}: pixels vs PIL: {off} of {} values differ, by at most {worst:.2} levels", ours.len());
            assert!(worst <= 1.01, "{family}: resized pixels differ from PIL's by {worst} levels");
        }
        let features = vision.tower.encode(&prepared).unwrap();
        let hidden = *features.shape().last().unwrap();
        let rows = features.size() as i32 / hidden;
        let want = want_features.remove(&format!("{family}.features")).unwrap();
        assert_eq!(want.shape(), &[rows, hidden], "{family}: feature rows (image tokens)");
        let err = relative_error(&features.reshape(&[rows, hidden]).unwrap(), &want);
        eprintln!("{family}: features vs mlx-vlm's processor + tower: relative error {err:e}");
        assert!(err < PIPELINE_TOLERANCE, "{family}: features differ from mlx-vlm's: {err:e}");

        let question = golden["question"].as_str().unwrap();
        let messages = [ChatMessage {
            role: Role::User,
            content: question.into(),
            media: vec![mlxbc_shared::MediaRef::from_bytes(bytes.clone())],
            tool_calls: vec![],
            tool_call_id: None,
        }];
        let rendered = model.prompter.template.render(&messages).unwrap();
        let prompt = vision.expand_media(&rendered, &[MediaLayout::Image], &[rows as usize]).unwrap();
        let ours = model.encode(&prompt).unwrap();
        let mut theirs: Vec<u32> = serde_json::from_value(g["prompt_ids"].clone()).unwrap();
        if family.starts_with("tiny-gemma3") {
            // mlx-vlm tokenizes the rendered template (which writes <bos>) with
            // add_special_tokens on, so its prompt starts <bos><bos>; Gemma
            // expects one, as the template, HF's chat API and llama.cpp give.
            assert_eq!(&theirs[..2], &[2, 2], "mlx-vlm's doubled BOS is gone: update this test");
            theirs.remove(0);
        }
        assert_eq!(ours, theirs, "{family}: prompt ids (template, expansion, tokenizer) differ from mlx-vlm's");
    }
}

/// Features from a whole image pipeline: both sides resize the same PNG
/// (PIL in the reference, the `image` crate here), so single pixels may land
/// one 8-bit level apart; that, not the tower, sets this bound.
const PIPELINE_TOLERANCE: f32 = 1e-2;

/// Qwen3-VL's tower (LayerNorm blocks, the interpolated position table,
/// deepstack mergers after blocks 0 and 2) against mlx-vlm's VisionModel on
/// the same random weights: an image grid (1, 8, 12) and a two-frame video
/// grid (2, 4, 6), whose frames attend within themselves.
#[test]
fn qwen3_vl_tower_and_deepstack_match_mlx_vlm() {
    use mlxbc_daemon::families::qwen3_vl::tower::{Qwen3VisionConfig, Qwen3VisionTower};
    let mut tensors = reference("qwen3-vl-tower.safetensors");
    let mut take = |k: &str| tensors.remove(k).unwrap_or_else(|| panic!("{k} missing from the reference"));
    let cases: Vec<_> = [("image", (1, 8, 12)), ("video", (2, 4, 6))]
        .into_iter()
        .map(|(name, grid)| {
            let patches = take(&format!("test.{name}.patches"));
            let features = take(&format!("test.{name}.features"));
            let deepstack = [take(&format!("test.{name}.deepstack.0")), take(&format!("test.{name}.deepstack.1"))];
            (name, grid, patches, features, deepstack)
        })
        .collect();
    let mut t = TensorMap::from_arrays(tensors, 64, WeightForm::DenseF32);
    let config: Qwen3VisionConfig = serde_json::from_value(serde_json::json!({
        "depth": 3, "hidden_size": 32, "intermediate_size": 64, "out_hidden_size": 48, "num_heads": 2,
        "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 36,
        "deepstack_visual_indexes": [0, 2]
    }))
    .unwrap();
    let tower = Qwen3VisionTower::load(config, &mut t, "vision_tower").unwrap();
    for (name, grid, patches, want, want_deep) in &cases {
        let (got, deep) = tower.forward(patches, *grid).unwrap();
        let err = relative_error(&got, want);
        eprintln!("qwen3-vl tower, {name}: relative error {err:e}");
        assert!(err < TOLERANCE, "Qwen3-VL {name} features differ from mlx-vlm: relative error {err:e}");
        assert_eq!(deep.len(), 2);
        for (j, (d, w)) in deep.iter().zip(want_deep).enumerate() {
            let err = relative_error(d, w);
            eprintln!("qwen3-vl tower, {name}, deepstack {j}: relative error {err:e}");
            assert!(err < TOLERANCE, "Qwen3-VL {name} deepstack {j} differs from mlx-vlm: {err:e}");
        }
        // The check can fail: other pixels give other features.
        let (other, _) = tower.forward(&patches.multiply(Array::from_f32(0.5)).unwrap(), *grid).unwrap();
        assert!(relative_error(&other, want) > 1e-2);
    }
}

/// A video through Qwen3-VL's whole pipeline against mlx-vlm's
/// (`scripts/goldens/mlx_vlm_video.py`, `generate(..., video=[clip])`)
/// on tiny-qwen3-vl and the same lossless clip: the frames sampled (ffmpeg
/// here, OpenCV there), the patches of each temporal group, every group's
/// features and deepstack (encoded group by group here, the clip at once
/// there) and the prompt ids with their `<t.t seconds>` markers, exactly.
#[test]
fn qwen3_vl_video_frames_patches_features_and_prompt_match_mlx_vlm() {
    use mlxbc_daemon::model::video;
    use mlxbc_shared::{ChatMessage, MediaRef};
    let golden = reference_json("vlm-video.json");
    let mut want = reference("vlm-video.safetensors");
    let clip = std::fs::read(reference_path(golden["clip"].as_str().unwrap())).unwrap();
    let dir = fixture("mlx/tiny-qwen3-vl");
    assert_eq!(
        sha256_hex(&dir.join("model.safetensors")),
        golden["weights_sha256"].as_str().unwrap(),
        "tiny-qwen3-vl: not the fixture the reference was made from; rebuild with scripts/test-fixtures"
    );
    let model = mlxbc_daemon::families::load(&dir, WeightForm::DenseF32, None).unwrap();
    let vision = model.media_tower.as_ref().unwrap();
    let pre = vision.preprocessor.video().expect("Qwen3-VL takes video");
    let sampled = video::decode(&clip, &pre.sampling())
        .unwrap_or_else(|e| panic!("{e} (scripts/install-deps --test installs ffmpeg)"));
    let indices: Vec<u32> = serde_json::from_value(golden["frames_indices"].clone()).unwrap();
    assert_eq!(sampled.indices, indices, "frames taken differ from mlx-vlm's load_video");
    assert_eq!(sampled.source_fps, golden["source_fps"].as_f64().unwrap());

    let groups = pre.prepare(&sampled.frames).unwrap();
    let grid = &golden["cases"]["video"]["video_grid_thw"][0];
    assert_eq!(groups.len() as u64, grid[0].as_u64().unwrap(), "temporal groups");
    let patches: Vec<f32> = groups.iter().flat_map(|g| g.values.iter().copied()).collect();
    let want_patches = want.remove("video.patches").unwrap();
    let ours = Array::from_slice(&patches, want_patches.shape());
    // Lossless frames, the same bicubic resize: at most a level apart.
    let err = relative_error(&ours, &want_patches);
    eprintln!("qwen3-vl video patches vs mlx-vlm: relative error {err:e}");
    assert!(err < PIPELINE_TOLERANCE, "video patches differ from mlx-vlm's: {err:e}");

    let want_features = want.remove("video.features").unwrap();
    let concat = |features: &[Array]| {
        let width = *features[0].shape().last().unwrap();
        let rows: Vec<Array> = features.iter().map(|f| f.reshape(&[-1, width]).unwrap()).collect();
        (ops::concatenate(&rows.iter().collect::<Vec<_>>(), 0).unwrap(), rows)
    };
    // The tower alone, on mlx-vlm's own patches, group by group: the
    // clip's groups encoded one at a time are the clip encoded at once.
    let per_group = want_patches.shape()[0] / groups.len() as i32;
    let theirs_by_group: Vec<Array> = (0..groups.len() as i32)
        .map(|g| {
            let rows = Array::from_slice(&(g * per_group..(g + 1) * per_group).collect::<Vec<i32>>(), &[per_group]);
            let values = want_patches.take_axis(&rows, 0).unwrap();
            let prepared = mlxbc_daemon::model::family::Prepared {
                values: values.as_slice::<f32>().to_vec(),
                shape: values.shape().to_vec(),
                grid: groups[0].grid,
            };
            vision.tower.encode(&prepared).unwrap()
        })
        .collect();
    let err = relative_error(&concat(&theirs_by_group).0, &want_features);
    eprintln!("qwen3-vl tower on mlx-vlm's video patches, group by group vs the whole clip: relative error {err:e}");
    assert!(err < TOLERANCE, "the video's groups encoded one by one differ from the whole clip: {err:e}");
    // The whole pipeline: resizing sets this bound.
    let features: Vec<Array> = groups.iter().map(|g| vision.tower.encode(g).unwrap()).collect();
    let (ours, rows) = concat(&features);
    let err = relative_error(&ours, &want_features);
    eprintln!("qwen3-vl video features + deepstack from our frames and patches: relative error {err:e}");
    assert!(err < PIPELINE_TOLERANCE, "video features differ from mlx-vlm's: {err:e}");

    let image = std::fs::read(reference_path(golden["image"].as_str().unwrap())).unwrap();
    let image_rows = {
        let img = mlxbc_daemon::model::image::decode(&image).unwrap();
        let f = vision.tower.encode(&vision.preprocessor.prepare(&img)).unwrap();
        f.size() as usize / *f.shape().last().unwrap() as usize
    };
    let tenths: Vec<u32> = sampled.group_seconds(pre.temporal_patch()).into_iter().map(video::prompt_tenths).collect();
    let group_rows: Vec<usize> = rows.iter().map(|r| r.shape()[0] as usize).collect();
    for (case, media) in [
        ("video", vec![MediaRef::video(clip.clone())]),
        ("image+video", vec![MediaRef::from_bytes(image.clone()), MediaRef::video(clip.clone())]),
    ] {
        let mut message = ChatMessage::user(golden["question"].as_str().unwrap());
        message.media = media;
        let rendered = model.prompter.template.render(&[message.clone()]).unwrap();
        let (layout, rows): (Vec<MediaLayout>, Vec<usize>) = if case == "video" {
            (vec![MediaLayout::Video { tenths: tenths.clone() }], group_rows.clone())
        } else {
            let mut rows = vec![image_rows];
            rows.extend(&group_rows);
            (vec![MediaLayout::Image, MediaLayout::Video { tenths: tenths.clone() }], rows)
        };
        let prompt = vision.expand_media(&rendered, &layout, &rows).unwrap();
        let theirs: Vec<u32> = serde_json::from_value(golden["cases"][case]["prompt_ids"].clone()).unwrap();
        assert_eq!(model.encode(&prompt).unwrap(), theirs, "{case}: prompt ids differ from mlx-vlm's\n{prompt}");
    }
}
