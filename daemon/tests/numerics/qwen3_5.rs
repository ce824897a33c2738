//! Qwen3.5's numerics against mlx-vlm 0.7.10 on the tiny fixtures
//! (tests/fixtures/reference/qwen3_5.*, scripts/goldens/mlx_vlm_qwen3_5.py):
//! the tower on mlx-vlm's own pixels and the first logits of a prompt within
//! 1e-4 relative; and the gated delta rule's two forms (the chunked scan of
//! a prefill, the step of a decode) against each other, with a prompt
//! prefilled in pieces (the convolution window and the recurrent state
//! carried in the cache) against one pass. Greedy ids through the real
//! daemon: tests/tests/e2e/qwen3_5.rs.

use crate::common::*;
use mlx_rs::Array;
use mlxbc_daemon::families::qwen3_5::gated_delta;
use mlxbc_daemon::model::family::Prepared;
use mlxbc_daemon::model::kv_cache::KvCache;
use mlxbc_daemon::model::positions::MediaPositions;

const TOLERANCE: f32 = 1e-4;
const FAMILIES: [&str; 2] = ["tiny-qwen3_5", "tiny-qwen3_5-4bit"];

#[test]
fn qwen3_5_tower_and_first_logits_match_mlx_vlm() {
    let golden = reference_json("qwen3_5.json");
    let mut want = Array::load_safetensors(reference_path("qwen3_5.safetensors")).unwrap();
    for family in FAMILIES {
        let model = load_checked(family, &golden);
        assert_eq!(model.lm.architecture(), "qwen3_5");
        assert_eq!(model.lm.num_layers(), 1, "one attention layer (its KV slot); three DeltaNet layers");
        let pixels = want.remove(&format!("{family}.pixels")).unwrap();
        let grid = want.remove(&format!("{family}.grid")).unwrap();
        let g = grid.as_slice::<i64>().to_vec();
        let prepared = Prepared {
            values: pixels.as_slice::<f32>().to_vec(),
            shape: pixels.shape().to_vec(),
            grid: Some((g[0] as u32, g[1] as u32, g[2] as u32)),
        };
        let features = model.media_tower.as_ref().unwrap().tower.encode(&prepared).unwrap();
        let theirs = want.remove(&format!("{family}.features")).unwrap();
        let err = relative_error(&features.reshape(theirs.shape()).unwrap(), &theirs);
        eprintln!("{family} tower on mlx-vlm's pixels: relative error {err:e}");
        assert!(err < TOLERANCE, "{family}: the tower differs from mlx-vlm's: {err:e}");

        let ids: Vec<u32> = serde_json::from_value(golden[family]["text"]["prompt_ids"].clone()).unwrap();
        let ids = Array::from_slice(&ids, &[1, ids.len() as i32]);
        let mut cache = KvCache::new(model.lm.num_layers());
        let hidden = model.lm.forward(&model.lm.embed(&ids).unwrap(), &mut cache, &MediaPositions::default()).unwrap();
        let logits = model.lm.logits(&hidden).unwrap().reshape(&[-1]).unwrap();
        let theirs = want.remove(&format!("{family}.text_logits")).unwrap();
        let err = relative_error(&logits, &theirs);
        eprintln!("{family} first logits: relative error {err:e}");
        assert!(err < TOLERANCE, "{family}: first logits differ from mlx-vlm's: {err:e}");
        assert!(cache.has_states(), "the DeltaNet layers keep their states in the cache");
    }
}

/// A prefill's chunked scan (150 positions: three chunks, the last padded)
/// equals the per-token recurrence from the same state, output and state.
#[test]
fn the_chunked_scan_equals_the_recurrence_token_by_token() {
    use mlx_rs::ops::indexing::IndexOp;
    let (b, t, hk, hv, dk, dv) = (2, 150, 2, 4, 32, 16);
    let normal = |shape: &[i32]| mlx_rs::random::normal::<f32>(shape, None, None, None).unwrap();
    let unit = |x: Array| {
        mlx_rs::fast::rms_norm(&x, None, 1e-6).unwrap().multiply(Array::from_f32((dk as f32).powf(-0.5))).unwrap()
    };
    let (q, k, v) = (unit(normal(&[b, t, hk, dk])), unit(normal(&[b, t, hk, dk])), normal(&[b, t, hv, dv]));
    let (g, beta) = gated_delta::gates(
        &normal(&[hv]).abs().unwrap(),
        &normal(&[b, t, hv]),
        &normal(&[b, t, hv]),
        &Array::from_slice(&[1.0f32; 4], &[4]),
    )
    .unwrap();
    let state0 = normal(&[b, hv, dv, dk]).multiply(Array::from_f32(0.1)).unwrap();
    let (y, state) = gated_delta::chunked(&q, &k, &v, &g, &beta, &state0).unwrap();
    let mut s = state0.clone();
    let mut ys = Vec::new();
    for i in 0..t {
        let at = |x: &Array| x.index((.., i..i + 1));
        let (yi, si) = gated_delta::step(&at(&q), &at(&k), &at(&v), &at(&g), &at(&beta), &s).unwrap();
        ys.push(yi);
        s = si;
    }
    let stepped = mlx_rs::ops::concatenate(&ys, 1).unwrap();
    let (ey, es) = (relative_error(&y, &stepped), relative_error(&state, &s));
    eprintln!("chunked scan vs token by token: output {ey:e}, state {es:e}");
    assert!(ey < TOLERANCE && es < TOLERANCE, "output {ey:e}, state {es:e}");
    // And it is not trivially so: another start state changes both.
    let (y2, _) = gated_delta::chunked(&q, &k, &v, &g, &beta, &state0.multiply(Array::from_f32(2.0)).unwrap()).unwrap();
    assert!(relative_error(&y2, &y) > 1e-3);
}

/// The long prompt prefilled as the engine does (chunks of 64, then the
/// last position alone: the window and the state carried by the cache)
/// gives the logits of one pass over it.
#[test]
fn a_prompt_prefilled_in_pieces_equals_one_pass() {
    use mlx_rs::ops::indexing::IndexOp;
    let golden = reference_json("qwen3_5.json");
    let model = load_checked("tiny-qwen3_5", &golden);
    let ids: Vec<u32> = serde_json::from_value(golden["tiny-qwen3_5"]["long"]["prompt_ids"].clone()).unwrap();
    let n = ids.len() as i32;
    let embeds = model.lm.embed(&Array::from_slice(&ids, &[1, n])).unwrap();
    let mut whole = KvCache::new(model.lm.num_layers());
    let one_pass =
        model.lm.logits(&model.lm.forward(&embeds, &mut whole, &MediaPositions::default()).unwrap()).unwrap();
    let mut cache = KvCache::new(model.lm.num_layers());
    let mut last = None;
    for (from, to) in [(0, 64), (64, 128), (128, n - 1), (n - 1, n)] {
        last =
            Some(model.lm.forward(&embeds.index((.., from..to, ..)), &mut cache, &MediaPositions::default()).unwrap());
    }
    let pieces = model.lm.logits(&last.unwrap()).unwrap();
    let err = relative_error(&pieces, &one_pass);
    eprintln!("prefill in pieces vs one pass: relative logit error {err:e}");
    assert!(err < TOLERANCE, "{err:e}");
    assert_eq!(cache.offset, n);
}
