//! mlx-community style bf16 and 4-bit directories of the late-2026 families
//! (make_fixtures.py's `-bf16` copies: every float tensor, clamps and towers
//! included, in bfloat16; unified's `-4bit`: the language model quantized,
//! the embedder left as it is, as mlx-vlm's converter does). Each loads; its
//! prompt ids are mlx-vlm's; its first text logits are mlx-vlm's on the same
//! weights in f32 arithmetic (what the daemon computes on CPU) within 1e-4,
//! and within bf16 rounding of mlx-vlm's own bf16 arithmetic
//! (tests/fixtures/reference/dtype-dirs.*, scripts/goldens/mlx_vlm_dtype_dirs.py);
//! and its tower reads the bf16 weights as the f32 fixture's within bf16
//! rounding (the f32 towers are pinned to mlx-vlm by the other tests).

use crate::common::*;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;
use mlxbc_daemon::model::kv_cache::KvCache;
use mlxbc_daemon::model::positions::MediaPositions;
use mlxbc_shared::ChatMessage;

/// Against mlx-vlm on the same weights, both in f32 arithmetic.
const TOLERANCE: f32 = 1e-4;
/// mlx-vlm computes a bf16 directory in bf16; we compute in f32 on the same
/// (bf16) weights: the two part by bf16's rounding of every activation
/// (measured 8e-3 to 4.8e-2 on these random-weight models).
const BF16_ARITHMETIC: f32 = 1e-1;
/// A tower's features from bf16 weights against the f32 fixture's.
const BF16_FEATURES: f32 = 5e-2; // measured 1.6e-3 to 2.8e-2
const KEPT: i32 = 16384;

fn load(name: &str, golden: &serde_json::Value) -> mlxbc_daemon::model::Model {
    load_checked(name, golden)
}

fn plain(name: &str) -> mlxbc_daemon::model::Model {
    let dir = fixture(&format!("mlx/{name}"));
    mlxbc_daemon::families::load(&dir, mlxbc_daemon::model::weights::WeightForm::DenseF32, None).unwrap()
}

#[test]
fn bf16_and_4bit_directories_load_and_match_mlx_vlm() {
    let golden = reference_json("dtype-dirs.json");
    let mut want = Array::load_safetensors(reference_path("dtype-dirs.safetensors")).unwrap();
    let image = std::fs::read(reference_path("vlm-pipeline-432x336.png")).unwrap();
    let image = mlxbc_daemon::model::image::decode(&image).unwrap();
    let clip = std::fs::read(reference_path("gemma4-audio.wav")).unwrap();
    let samples = mlxbc_daemon::audio::decode::decode(&clip).unwrap().samples;
    for name in [
        "tiny-qwen3-vl-bf16",
        "tiny-qwen3_5-bf16",
        "tiny-gemma4-bf16",
        "tiny-gemma4-unified-bf16",
        "tiny-gemma4-unified-4bit",
    ] {
        let model = load(name, &golden);
        let rendered = model.prompter.template.render(&[ChatMessage::user(golden["text"].as_str().unwrap())]).unwrap();
        let ids = model.encode(&rendered).unwrap();
        let theirs: Vec<u32> = serde_json::from_value(golden[name]["prompt_ids"].clone()).unwrap();
        assert_eq!(ids, theirs, "{name}: prompt ids");
        let ids = Array::from_slice(&ids, &[1, ids.len() as i32]);
        let mut cache = KvCache::new(model.lm.num_layers());
        let hidden = model.lm.forward(&model.lm.embed(&ids).unwrap(), &mut cache, &MediaPositions::default()).unwrap();
        let ours = model.lm.logits(&hidden).unwrap().reshape(&[-1]).unwrap().index(..KEPT);
        let bf16 = name.ends_with("-bf16");
        let exact = want.get(&format!("{name}.{}", if bf16 { "logits_f32" } else { "logits" })).unwrap();
        let err = relative_error(&ours, exact);
        eprintln!("{name}: first logits vs mlx-vlm on the same weights in f32: relative error {err:e}");
        assert!(err < TOLERANCE, "{name}: first logits differ from mlx-vlm's: {err:e}");
        if bf16 {
            let err = relative_error(&ours, want.get(&format!("{name}.logits")).unwrap());
            eprintln!("{name}: first logits vs mlx-vlm's bf16 arithmetic: relative error {err:e}");
            assert!(err < BF16_ARITHMETIC, "{name}: first logits far from mlx-vlm's bf16 run: {err:e}");
        }

        // The tower (and the audio tower or projector) against the f32 fixture's.
        let base = plain(name.trim_end_matches("-bf16").trim_end_matches("-4bit"));
        let (ours, f32s) = (model.media_tower.as_ref().unwrap(), base.media_tower.as_ref().unwrap());
        let prepared = ours.preprocessor.prepare(&image);
        let err = relative_error(&ours.tower.encode(&prepared).unwrap(), &f32s.tower.encode(&prepared).unwrap());
        eprintln!("{name}: image features vs the f32 fixture's: relative error {err:e}");
        let bound = if name.ends_with("-bf16") { BF16_FEATURES } else { 0.0 };
        assert!(err <= bound, "{name}: image features differ from the f32 fixture's: {err:e}");
        if let Some(audio) = ours.preprocessor.audio() {
            let prepared = audio.prepare(&samples).unwrap();
            let err = relative_error(
                &ours.tower.encode_audio(&prepared).unwrap(),
                &f32s.tower.encode_audio(&prepared).unwrap(),
            );
            eprintln!("{name}: audio features vs the f32 fixture's: relative error {err:e}");
            assert!(err <= bound, "{name}: audio features differ from the f32 fixture's: {err:e}");
        }
    }
    want.clear();
}
