//! Perplexity of a fixed text under a model with its KV cache in full
//! precision and quantized (8 and 4 bits, groups of 64; 4 bits in groups
//! of 32), computed as the
//! daemon computes on the CPU: the model loaded as mlxbcd loads it there
//! (dense f32), the text fed in
//! chunks of 64 positions through the KV cache (quantized from the second
//! chunk on, as a quantized cache is after its first prefill chunk), every
//! position's log-probability of the next token. Prints a table.
//!
//! Usage: mlxbc-perplexity MODEL TEXT_FILE [TOKENS=2048]

use anyhow::{bail, Context, Result};
use mlx_rs::Array;
use mlxbc_daemon::families::{self, LoadedModel};
use mlxbc_daemon::model::kv_cache::{KvCache, KvQuantization};
use mlxbc_daemon::model::positions::MediaPositions;
use mlxbc_daemon::model::weights::WeightForm;

const CHUNK: usize = 64;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        bail!("usage: mlxbc-perplexity MODEL TEXT_FILE [TOKENS=2048]");
    }
    let tokens: usize = args.get(3).map_or(Ok(2048), |t| t.parse()).context("TOKENS")?;
    let text = std::fs::read_to_string(&args[2]).with_context(|| format!("reading {}", args[2]))?;
    let LoadedModel::Chat(model) = families::load_any(args[1].as_ref(), WeightForm::DenseF32, None)? else {
        bail!("{} is not a language model", args[1]);
    };
    let ids = model.prompter.tokenizer.encode(text.as_str(), false).map_err(|e| anyhow::anyhow!("{e}"))?;
    let ids: Vec<u32> = ids.get_ids().iter().copied().take(tokens + 1).collect();
    anyhow::ensure!(ids.len() > CHUNK + 1, "the text is too short");
    let settings = [
        None,
        Some((8, 64, false)),
        Some((4, 64, false)),
        Some((4, 32, false)),
        Some((8, 64, true)),
        Some((4, 64, true)),
        // 8-bit keys, 4-bit values (llama.cpp's -ctk q8_0 -ctv q4_0), rotated and not.
        Some((-4, 64, false)),
        Some((-4, 64, true)),
    ];
    println!("| KV cache | perplexity | against full precision |\n|---|---:|---:|");
    let mut full = None;
    for s in settings {
        // A negative count: 8-bit keys with that many bits for the values.
        let q = s.map(|(bits, group_size, rotate): (i32, i32, bool)| {
            let key_bits = if bits < 0 { 8 } else { bits };
            KvQuantization { bits: bits.abs(), key_bits, group_size, start: 0, rotate }
        });
        let p = perplexity(&model, &ids, q)?;
        let name = s.map_or("full precision".to_string(), |(b, g, r)| {
            let bits = if b < 0 { format!("8-bit keys, {}-bit values", -b) } else { format!("{b}-bit") };
            format!("{bits}, groups of {g}{}", if r { ", rotated" } else { "" })
        });
        let base = *full.get_or_insert(p);
        println!("| {name} | {p:.4} | {:+.2}% |", 100.0 * (p / base - 1.0));
    }
    println!("\n{} tokens of {}, chunks of {CHUNK}", ids.len() - 1, args[2]);
    Ok(())
}

fn perplexity(model: &mlxbc_daemon::model::Model, ids: &[u32], q: Option<KvQuantization>) -> Result<f64> {
    let lm = &model.lm;
    let mut cache = KvCache::new(lm.num_layers());
    cache.quantization = q;
    let (mut nll, mut n) = (0.0f64, 0usize);
    let inputs = &ids[..ids.len() - 1];
    for (c, chunk) in inputs.chunks(CHUNK).enumerate() {
        let x = Array::from_slice(chunk, &[1, chunk.len() as i32]);
        let h = lm.forward(&lm.embed(&x)?, &mut cache, &MediaPositions::default())?;
        let logits = lm.logits_all(&h)?.as_dtype(mlx_rs::Dtype::Float32)?;
        let lse = mlx_rs::ops::logsumexp_axis(&logits, -1, true)?;
        let logprobs = logits.subtract(&lse)?;
        let from = c * CHUNK + 1;
        let targets: Vec<u32> = ids[from..from + chunk.len()].to_vec();
        let targets = Array::from_slice(&targets, &[1, chunk.len() as i32, 1]);
        let picked = logprobs.take_along_axis(&targets, -1)?.sum(None)?;
        nll -= f64::from(picked.try_item_cast::<f32>()?);
        n += chunk.len();
    }
    Ok((nll / n as f64).exp())
}
