//! The language-model seam's batch axis: prompts of different lengths,
//! left-padded into one `[B, L, hidden]` batch with per-row cache offsets,
//! give each row what it gives alone (logits within a tolerance, greedy ids
//! exactly), through prefill and decode steps; and rows that join a
//! running batch and leave it mid-way, as continuous batching moves them.

use mlx_rs::ops::indexing::{argmax_axis, IndexOp};
use mlx_rs::Array;
use mlxbc_daemon::model::kv_cache::KvCache;
use mlxbc_daemon::model::positions::MediaPositions;
use mlxbc_daemon::model::weights::WeightForm;
use mlxbc_daemon::model::Model;

use crate::common::*;

/// Row results may differ from single-row ones only by reduction order.
const TOLERANCE: f32 = 1e-4;

const PROMPTS: [&[u32]; 3] = [&[5, 17, 42, 99, 7, 3, 64, 12, 8], &[11, 23, 31], &[2, 4, 6, 8, 10, 12]];
const STEPS: usize = 6;

fn load(rel: &str) -> Model {
    mlxbc_daemon::families::load(&fixture(rel), WeightForm::DenseF32, None)
        .unwrap_or_else(|e| panic!("loading {rel}: {e:#} (build the fixtures with scripts/test-fixtures)"))
}

/// Last-position logits after the prompt, then greedy ids for STEPS steps, one row alone.
fn alone(model: &Model, prompt: &[u32]) -> (Array, Vec<u32>) {
    let lm = &model.lm;
    let mut cache = KvCache::new(lm.num_layers());
    let ids = Array::from_slice(prompt, &[1, prompt.len() as i32]);
    let first =
        lm.logits(&lm.forward(&lm.embed(&ids).unwrap(), &mut cache, &MediaPositions::default()).unwrap()).unwrap();
    let mut logits = first.clone();
    let mut out = Vec::new();
    for _ in 0..STEPS {
        let y = argmax_axis(&logits, -1, None).unwrap().item_cast::<u32>();
        out.push(y);
        let ids = Array::from_slice(&[y], &[1, 1]);
        logits =
            lm.logits(&lm.forward(&lm.embed(&ids).unwrap(), &mut cache, &MediaPositions::default()).unwrap()).unwrap();
    }
    (first, out)
}

/// The same prompts as one left-padded batch.
fn batched(model: &Model, prompts: &[&[u32]]) -> anyhow::Result<(Array, Vec<Vec<u32>>)> {
    let lm = &model.lm;
    let longest = prompts.iter().map(|p| p.len()).max().unwrap();
    let pads: Vec<i32> = prompts.iter().map(|p| (longest - p.len()) as i32).collect();
    let mut ids = Vec::new();
    for p in prompts {
        ids.extend(std::iter::repeat_n(0u32, longest - p.len()));
        ids.extend_from_slice(p);
    }
    let b = prompts.len() as i32;
    let mut cache = KvCache::batch(lm.num_layers(), pads);
    let ids = Array::from_slice(&ids, &[b, longest as i32]);
    let first = lm.logits(&lm.forward(&lm.embed(&ids)?, &mut cache, &MediaPositions::default())?)?;
    assert_eq!(first.shape()[0], b, "logits are [B, vocab]");
    let mut logits = first.clone();
    let mut out = vec![Vec::new(); prompts.len()];
    for _ in 0..STEPS {
        let picks = argmax_axis(&logits, -1, None)?;
        let picks: Vec<u32> = picks.as_dtype(mlx_rs::Dtype::Uint32)?.as_slice::<u32>().to_vec();
        for (row, &y) in picks.iter().enumerate() {
            out[row].push(y);
        }
        let ids = Array::from_slice(&picks, &[b, 1]);
        logits = lm.logits(&lm.forward(&lm.embed(&ids)?, &mut cache, &MediaPositions::default())?)?;
    }
    Ok((first, out))
}

fn assert_rows_match_alone(rel: &str) {
    let model = load(rel);
    let (first, ids) = batched(&model, &PROMPTS).unwrap();
    for (row, prompt) in PROMPTS.iter().enumerate() {
        let (want_first, want_ids) = alone(&model, prompt);
        let got = first.index(row as i32..row as i32 + 1);
        let err = relative_error(&got, &want_first);
        eprintln!("{rel}, row {row} (padding {}): relative error {err:e}", 9 - prompt.len());
        assert!(err < TOLERANCE, "{rel}: row {row}'s logits differ from the row alone: {err:e}");
        assert_eq!(ids[row], want_ids, "{rel}: row {row}'s greedy ids differ from the row alone");
    }
    // The check can fail: without the padding mask the short rows would
    // attend to the padding and come out different.
    let lm = &model.lm;
    let mut unmasked = KvCache::new(lm.num_layers());
    let mut padded = vec![0u32; 6];
    padded.extend_from_slice(PROMPTS[1]);
    let ids = Array::from_slice(&padded, &[1, 9]);
    let wrong =
        lm.logits(&lm.forward(&lm.embed(&ids).unwrap(), &mut unmasked, &MediaPositions::default()).unwrap()).unwrap();
    assert!(relative_error(&wrong, &alone(&model, PROMPTS[1]).0) > 1e-3, "{rel}: padding must matter unmasked");
}

#[test]
fn qwen3_padded_rows_equal_each_row_alone() {
    assert_rows_match_alone("mlx/tiny-qwen3");
}

#[test]
fn llama_padded_rows_equal_each_row_alone() {
    assert_rows_match_alone("mlx/smollm2-mlx");
}

#[test]
fn gemma3_padded_rows_equal_each_row_alone() {
    assert_rows_match_alone("mlx/tiny-gemma3-vlm");
}

/// Multimodal rope positions are per prompt; a padded batch of them is
/// refused rather than computed wrongly.
#[test]
fn qwen25_vl_refuses_padded_rows_with_multimodal_rope() {
    let model = load("mlx/tiny-qwen25-vl");
    let err = batched(&model, &PROMPTS).unwrap_err();
    assert!(err.to_string().contains("multimodal rope"), "{err:#}");
}

/// Greedy ids of `prompt` alone for `steps` tokens after its first.
fn alone_ids(model: &Model, prompt: &[u32], steps: usize) -> Vec<u32> {
    let lm = &model.lm;
    let mut cache = KvCache::new(lm.num_layers());
    let ids = Array::from_slice(prompt, &[1, prompt.len() as i32]);
    let mut logits =
        lm.logits(&lm.forward(&lm.embed(&ids).unwrap(), &mut cache, &MediaPositions::default()).unwrap()).unwrap();
    let mut out = Vec::new();
    for _ in 0..=steps {
        let y = argmax_axis(&logits, -1, None).unwrap().item_cast::<u32>();
        out.push(y);
        let ids = Array::from_slice(&[y], &[1, 1]);
        logits =
            lm.logits(&lm.forward(&lm.embed(&ids).unwrap(), &mut cache, &MediaPositions::default()).unwrap()).unwrap();
    }
    out
}

/// Continuous batching's cache moves, as the scheduler makes them: each
/// prompt is prefilled alone, then joins the running batch at a different
/// step (`KvCache::join`, which left-pads the shorter side), and rows leave
/// mid-way (`KvCache::keep_rows`, which drops the padding the rest share).
/// Every row's greedy ids equal its ids alone, and the last row left
/// computes unpadded, exactly as a cache that was never batched.
fn assert_joins_and_leaves_match_alone(rel: &str) {
    let model = load(rel);
    let lm = &model.lm;
    const TOTAL: usize = 12;
    // Prompt, the batch step it joins at, the step it leaves after.
    let plan: [(&[u32], usize, usize); 3] = [(PROMPTS[1], 0, TOTAL), (PROMPTS[0], 3, 8), (PROMPTS[2], 5, 10)];
    let mut batch: Option<KvCache> = None;
    let mut rows: Vec<usize> = Vec::new(); // plan indices, in batch order
    let mut next: Vec<u32> = Vec::new(); // per batch row, the token to feed
    let mut got: Vec<Vec<u32>> = vec![Vec::new(); plan.len()];
    for step in 0..TOTAL {
        for (i, (prompt, join, _)) in plan.iter().enumerate() {
            if *join != step {
                continue;
            }
            let mut cache = KvCache::new(lm.num_layers());
            let ids = Array::from_slice(prompt, &[1, prompt.len() as i32]);
            let logits = lm
                .logits(&lm.forward(&lm.embed(&ids).unwrap(), &mut cache, &MediaPositions::default()).unwrap())
                .unwrap();
            let y = argmax_axis(&logits, -1, None).unwrap().item_cast::<u32>();
            got[i].push(y);
            match batch.as_mut() {
                Some(b) => b.join(cache).unwrap(),
                None => batch = Some(cache),
            }
            rows.push(i);
            next.push(y);
        }
        let cache = batch.as_mut().unwrap();
        let b = rows.len() as i32;
        let ids = Array::from_slice(&next, &[b, 1]);
        let logits =
            lm.logits(&lm.forward(&lm.embed(&ids).unwrap(), cache, &MediaPositions::default()).unwrap()).unwrap();
        let picks = argmax_axis(&logits, -1, None).unwrap().as_dtype(mlx_rs::Dtype::Uint32).unwrap();
        next = picks.as_slice::<u32>().to_vec();
        for (r, &i) in rows.iter().enumerate() {
            got[i].push(next[r]);
        }
        let keep: Vec<usize> = (0..rows.len()).filter(|&r| plan[rows[r]].2 > step + 1 || step + 1 == TOTAL).collect();
        if keep.len() < rows.len() {
            cache.keep_rows(&keep).unwrap();
            rows = keep.iter().map(|&r| rows[r]).collect();
            next = keep.iter().map(|&r| next[r]).collect();
        }
    }
    assert_eq!(rows, vec![0], "the first row is the last one left");
    assert!(!batch.unwrap().is_padded(), "a single row left computes unpadded");
    for (i, (prompt, join, leave)) in plan.iter().enumerate() {
        let want = alone_ids(&model, prompt, leave - join);
        assert_eq!(got[i], want, "{rel}: row {i} (joined at step {join}) differs from the prompt alone");
    }
}

#[test]
fn qwen3_rows_joining_and_leaving_a_batch_equal_each_alone() {
    assert_joins_and_leaves_match_alone("mlx/tiny-qwen3");
}

#[test]
fn llama_rows_joining_and_leaving_a_batch_equal_each_alone() {
    assert_joins_and_leaves_match_alone("mlx/smollm2-mlx");
}

#[test]
fn gemma3_rows_joining_and_leaving_a_batch_equal_each_alone() {
    assert_joins_and_leaves_match_alone("mlx/tiny-gemma3-vlm");
}

/// The load-time warming of batch sizes (what a first burst would
/// otherwise build on a GPU) realigns rows that forget different numbers
/// of positions, as a batched verify pass does, and a cache quantized at 8
/// bits likewise, on a tiny model of each family that verifies drafts.
#[test]
fn the_load_time_warming_realigns_rows_as_a_verify_pass_does() {
    for rel in ["mlx/tiny-qwen3", "mlx/smollm2-mlx"] {
        let mut model = load(rel);
        model.warm_up().unwrap();
        assert!(model.lm.verifies_drafts(), "{rel} verifies drafts");
        // The load-time warming of batch sizes realigns rows as a verify
        // pass does.
        let pick = |row: &Array| Ok(argmax_axis(row, -1, None)?);
        for rows in [2, 8] {
            model.warm_batches(rows, &pick).unwrap_or_else(|e| panic!("{rel} warming {rows} rows: {e:#}"));
        }
        // And a quantized cache's (a request's kv_bits), which it tries once.
        let warmed = model.warm_quantized_realignment().unwrap_or_else(|e| panic!("{rel} quantized: {e:#}"));
        assert!(warmed, "{rel} reads a quantized cache: its realignment is warmed");
    }
}
