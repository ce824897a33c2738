//! One 30-second window decoded, as mlx-whisper's `DecodingTask` does it
//! with `beam_size=None`: the initial tokens (previous text, start of
//! transcript, language, task), then one token at a time through the logit
//! filters (blank suppression on the first, the non-speech symbols, the
//! timestamp rules), greedy at temperature 0, sampled above it; the
//! no-speech probability read at the start token; the average log
//! probability and compression ratio that decide a fallback.

use super::model::{CrossKv, SelfKv, WhisperNet};
use super::tokens::SpecialTokens;
use anyhow::Result;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;
use rand::Rng;

/// What to decode one window with.
#[derive(Debug, Clone)]
pub struct WindowOptions {
    /// Its language token (multilingual models), and translate instead of transcribe.
    pub language: Option<u32>,
    pub translate: bool,
    /// Earlier text (tokens) to condition on: `<|startofprev|>` + these.
    pub prompt: Vec<u32>,
    pub temperature: f32,
    pub timestamps: bool,
    /// The first timestamp may be at most this far in (seconds).
    pub max_initial_timestamp: f32,
}

/// One window's decode.
#[derive(Debug, Clone)]
pub struct WindowResult {
    /// The sampled tokens, without the initial ones and the final EOT.
    pub tokens: Vec<u32>,
    pub avg_logprob: f64,
    pub no_speech_prob: f64,
    pub temperature: f32,
    pub compression_ratio: f64,
    pub text: String,
}

/// Python's `len(text) / len(zlib.compress(text))` (level 6, the default).
pub fn compression_ratio(text: &str) -> f64 {
    use std::io::Write;
    let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::new(6));
    let _ = z.write_all(text.as_bytes());
    let compressed = z.finish().map(|v| v.len()).unwrap_or(1).max(1);
    text.len() as f64 / compressed as f64
}

fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&x| ((x - max) as f64).exp()).sum();
    let lse = max + sum.ln() as f32;
    logits.iter().map(|&x| x - lse).collect()
}

fn logsumexp(xs: &[f32]) -> f32 {
    let max = xs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return max;
    }
    max + (xs.iter().map(|&x| ((x - max) as f64).exp()).sum::<f64>().ln() as f32)
}

/// The timestamp rules (mlx-whisper's `ApplyTimestampRules`) on one row:
/// timestamps come in pairs, the first token is a timestamp no later than
/// `max_initial`, and when the timestamps together are likelier than any
/// text token a timestamp is taken.
fn apply_timestamp_rules(logits: &mut [f32], sampled: &[u32], t: &SpecialTokens, max_initial: Option<u32>) {
    let tb = t.timestamp_begin as usize;
    let ninf = f32::NEG_INFINITY;
    let mut mask = vec![0f32; logits.len()];
    mask[t.no_timestamps as usize] = ninf;
    let last_was_ts = sampled.last().is_some_and(|&x| x >= t.timestamp_begin);
    let penultimate_was_ts = sampled.len() < 2 || sampled[sampled.len() - 2] >= t.timestamp_begin;
    if last_was_ts {
        if penultimate_was_ts {
            mask[tb..].fill(ninf);
        } else {
            mask[..t.eot as usize].fill(ninf);
        }
    }
    // mlx-whisper 0.4.3 computes the "no earlier timestamp" rule from the
    // positions of the timestamps in the sequence, not their values, so the
    // range it masks (`timestamp_begin .. position`) is always empty. Kept
    // as it is: greedy ids equal the reference's (openai-whisper masks the
    // timestamps before the last one here).
    if sampled.is_empty() {
        mask[..tb].fill(ninf);
        if let Some(m) = max_initial {
            let last_allowed = tb + m as usize;
            if last_allowed + 1 < mask.len() {
                mask[last_allowed + 1..].fill(ninf);
            }
        }
    }
    let logprobs = log_softmax(logits);
    let timestamp_logprob = logsumexp(&logprobs[tb..]);
    let max_text = logprobs[..tb].iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if timestamp_logprob > max_text {
        mask[..tb].fill(ninf);
    }
    for (l, m) in logits.iter_mut().zip(&mask) {
        *l += m;
    }
}

/// Decodes one window whose cross-attention keys and values are `cross`.
pub fn decode_window(
    net: &WhisperNet,
    t: &SpecialTokens,
    tokenizer: &tokenizers::Tokenizer,
    cross: &CrossKv,
    o: &WindowOptions,
    rng: &mut impl Rng,
) -> Result<WindowResult> {
    let n_ctx = net.decoder.context;
    let sample_len = n_ctx / 2;
    let mut initial: Vec<u32> = Vec::new();
    if !o.prompt.is_empty() {
        initial.push(t.sot_prev);
        let keep = (n_ctx / 2 - 1).min(o.prompt.len());
        initial.extend_from_slice(&o.prompt[o.prompt.len() - keep..]);
    }
    let sot_index = initial.len();
    initial.push(t.sot);
    if t.is_multilingual() {
        initial.push(o.language.unwrap_or_else(|| t.language("en").unwrap_or(t.sot + 1)));
        initial.push(if o.translate { t.translate } else { t.transcribe });
    }
    if !o.timestamps {
        initial.push(t.no_timestamps);
    }
    let sample_begin = initial.len();
    // CHUNK_LENGTH / n_audio_ctx = 0.02 s per timestamp.
    let max_initial =
        (o.timestamps && o.max_initial_timestamp > 0.0).then(|| (o.max_initial_timestamp / 0.02).round() as u32);

    let mut cache = SelfKv::default();
    let mut tokens = initial.clone();
    let mut sum_logprob = 0f64;
    let mut no_speech_prob = f64::NAN;
    let mut input =
        Array::from_slice(&initial.iter().map(|&x| x as i32).collect::<Vec<_>>(), &[1, initial.len() as i32]);
    for step in 0..sample_len {
        if tokens.len() > n_ctx {
            break;
        }
        let all = net.decoder.forward(&input, cross, &mut cache)?;
        let len = all.shape()[1];
        if step == 0 {
            if let Some(ns) = t.no_speech {
                let at_sot = all.index((0, sot_index as i32));
                let probs = mlx_rs::ops::softmax_axis(&at_sot, -1, None)?;
                no_speech_prob = probs.index(ns as i32).try_item_cast::<f32>()? as f64;
            }
        }
        let last = all.index((0, len - 1));
        last.eval()?;
        let mut logits = last.as_slice::<f32>().to_vec();
        let sampled = &tokens[sample_begin..];
        if sampled.is_empty() {
            for &b in &t.blank {
                logits[b as usize] = f32::NEG_INFINITY;
            }
        }
        for &s in &t.suppress {
            if let Some(l) = logits.get_mut(s as usize) {
                *l = f32::NEG_INFINITY;
            }
        }
        if o.timestamps {
            apply_timestamp_rules(&mut logits, sampled, t, max_initial);
        }
        let next = if o.temperature == 0.0 { argmax(&logits) } else { sample(&logits, o.temperature, rng) };
        let logprobs = log_softmax(&logits);
        sum_logprob += logprobs[next as usize] as f64;
        tokens.push(next);
        if next == t.eot {
            break;
        }
        input = Array::from_slice(&[next as i32], &[1, 1]);
    }
    let mut sampled: Vec<u32> = tokens[sample_begin..].to_vec();
    if let Some(end) = sampled.iter().position(|&x| x == t.eot) {
        sampled.truncate(end);
    }
    let text_ids: Vec<u32> = sampled.iter().copied().filter(|&x| x < t.timestamp_begin).collect();
    let text = tokenizer.decode(&text_ids, false).map_err(|e| anyhow::anyhow!("{e}"))?.trim().to_string();
    Ok(WindowResult {
        avg_logprob: sum_logprob / (sampled.len() + 1) as f64,
        tokens: sampled,
        no_speech_prob,
        temperature: o.temperature,
        compression_ratio: compression_ratio(&text),
        text,
    })
}

/// The first index of the largest value (numpy's and MLX's argmax).
fn argmax(xs: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in xs.iter().enumerate() {
        if x > xs[best] {
            best = i;
        }
    }
    best as u32
}

/// A draw from `softmax(logits / temperature)`.
fn sample(logits: &[f32], temperature: f32, rng: &mut impl Rng) -> u32 {
    let scaled: Vec<f32> = logits.iter().map(|&x| x / temperature).collect();
    let p: Vec<f64> = log_softmax(&scaled).iter().map(|&x| (x as f64).exp()).collect();
    let mut u = rng.gen::<f64>();
    for (i, &pi) in p.iter().enumerate() {
        u -= pi;
        if u <= 0.0 {
            return i as u32;
        }
    }
    argmax(logits)
}

/// The probabilities of each language after `<|startoftranscript|>`
/// (mlx-whisper's `detect_language`), likeliest first.
pub fn detect_language(net: &WhisperNet, t: &SpecialTokens, cross: &CrossKv) -> Result<Vec<(String, f32)>> {
    let ids = Array::from_slice(&[t.sot as i32], &[1, 1]);
    let logits = net.decoder.forward(&ids, cross, &mut SelfKv::default())?.index((0, 0));
    logits.eval()?;
    let logits = logits.as_slice::<f32>();
    let lang: Vec<f32> = t.languages.iter().map(|(_, id)| logits[*id as usize]).collect();
    let lse = logsumexp(&lang);
    let mut probs: Vec<(String, f32)> =
        t.languages.iter().zip(&lang).map(|((code, _), &l)| (code.clone(), (l - lse).exp())).collect();
    probs.sort_by(|a, b| b.1.total_cmp(&a.1));
    Ok(probs)
}

#[cfg(test)]
mod tests {
    #[test]
    fn compression_ratio_is_zlibs() {
        // Python: len(b) / len(zlib.compress(b)) for b = b"hello hello hello hello"
        let r = super::compression_ratio("hello hello hello hello");
        assert!((r - 23.0 / 16.0).abs() < 1e-9, "{r}");
        assert!(super::compression_ratio(&"the same words again ".repeat(20)) > 2.4);
    }
}
