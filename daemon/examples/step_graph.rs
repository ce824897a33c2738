//! Writes one decode step's MLX graph (Graphviz dot) for a model: what a
//! step asks the host to build and launch, operation by operation. On a
//! GPU a one-row step is bound by that host work per operation (issue "The
//! GPU step at real sizes"), so the count is the number to cut;
//! `scripts/step_ops.py` counts it beside mlx-lm's step on the same weights.
//!
//!     cargo run --release -p mlxbc-daemon --example step_graph -- MODEL OUT.dot [ROWS] [packed]
//!
//! MODEL: a model directory or GGUF file; ROWS: a batch of that many rows
//! (padded as the engine pads prompts of two lengths), 1 by default;
//! `packed`: quantized weights kept packed, as a GPU keeps them (else the
//! CPU's dense f32).

use mlx_rs::ops::indexing::argmax_axis;
use mlx_rs::Array;
use mlxbc_daemon::model::kv_cache::KvCache;
use mlxbc_daemon::model::positions::MediaPositions;
use mlxbc_daemon::model::weights::WeightForm;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let (Some(model), Some(out)) = (args.get(1), args.get(2)) else {
        anyhow::bail!("usage: step_graph MODEL OUT.dot [ROWS] [packed]");
    };
    let rows: i32 = args.get(3).map_or(Ok(1), |r| r.parse())?;
    let form = match args.get(4).map(String::as_str) {
        Some("packed") => WeightForm::Packed(mlx_rs::Dtype::Float16),
        _ => WeightForm::DenseF32,
    };
    let model = mlxbc_daemon::families::load(std::path::Path::new(model), form, None)?;
    let lm = &model.lm;
    let plain = MediaPositions::default();
    let mut cache = if rows == 1 {
        KvCache::new(lm.num_layers())
    } else {
        KvCache::batch(lm.num_layers(), (0..rows).map(|i| i % 2).collect())
    };
    // A short prompt, evaluated: the step's graph starts from its cache.
    let prompt = Array::from_slice(&vec![1u32; rows as usize * 4], &[rows, 4]);
    let h = lm.forward(&lm.embed(&prompt)?, &mut cache, &plain)?;
    let first = argmax_axis(&lm.logits(&h)?, -1, None)?.reshape(&[-1, 1])?;
    first.eval()?;
    mlx_rs::transforms::eval(cache.arrays())?;
    // One greedy step, as the engine queues it, left lazy.
    let logits = lm.logits(&lm.forward(&lm.embed(&first)?, &mut cache, &plain)?)?;
    let next = argmax_axis(&logits, -1, None)?;
    let path = std::ffi::CString::new(out.as_str())?;
    // SAFETY: a file opened and closed here; the vector and namer are freed.
    unsafe {
        let file = libc::fopen(path.as_ptr(), c"w".as_ptr());
        anyhow::ensure!(!file.is_null(), "cannot write {out}");
        let outputs = mlx_sys::mlx_vector_array_new_value(next.as_ptr());
        let namer = mlx_sys::mlx_node_namer_new();
        let status = mlx_sys::mlx_export_to_dot(file.cast(), namer, outputs);
        mlx_sys::mlx_node_namer_free(namer);
        mlx_sys::mlx_vector_array_free(outputs);
        libc::fclose(file);
        anyhow::ensure!(status == 0, "mlx_export_to_dot failed");
    }
    println!("{out}: one decode step of {rows} row(s)");
    // The host's time to build steps (not run them): 64 more, lazily, each
    // from the last one's pick, as a pipelined decode queues them.
    let (steps, mut pick) = (64, next.reshape(&[-1, 1])?);
    let t = std::time::Instant::now();
    for _ in 0..steps {
        let logits = lm.logits(&lm.forward(&lm.embed(&pick)?, &mut cache, &plain)?)?;
        pick = argmax_axis(&logits, -1, None)?.reshape(&[-1, 1])?;
    }
    let built = t.elapsed().as_secs_f64();
    pick.eval()?;
    println!("building a step: {:.1} us (mean of {steps}, not evaluated)", built * 1e6 / steps as f64);
    Ok(())
}
