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

    let (tokens, sum_logprob, no_speech_prob) = match o.temperature == 0.0 {
        true => greedy_on_device(net, t, cross, &initial, sot_index, o.timestamps.then_some(max_initial))?,
        false => sampled_on_host(net, t, cross, &initial, sot_index, o, max_initial, rng)?,
    };
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

/// Tokens after `initial` sampled at `o.temperature` one at a time, the
/// logit filters applied on the host (a fallback temperature's path; greedy
/// windows take [`greedy_on_device`]). Returns every token (the initial
/// ones first), the sum of the sampled tokens' log probabilities, and the
/// no-speech probability.
#[allow(clippy::too_many_arguments)]
fn sampled_on_host(
    net: &WhisperNet,
    t: &SpecialTokens,
    cross: &CrossKv,
    initial: &[u32],
    sot_index: usize,
    o: &WindowOptions,
    max_initial: Option<u32>,
    rng: &mut impl Rng,
) -> Result<(Vec<u32>, f64, f64)> {
    let (n_ctx, sample_begin) = (net.decoder.context, initial.len());
    let mut cache = SelfKv::default();
    let mut tokens = initial.to_vec();
    let mut sum_logprob = 0f64;
    let mut no_speech_prob = f64::NAN;
    let mut input =
        Array::from_slice(&initial.iter().map(|&x| x as i32).collect::<Vec<_>>(), &[1, initial.len() as i32]);
    for step in 0..n_ctx / 2 {
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
        let next = sample(&logits, o.temperature, rng);
        let logprobs = log_softmax(&logits);
        sum_logprob += logprobs[next as usize] as f64;
        tokens.push(next);
        if next == t.eot {
            break;
        }
        input = Array::from_slice(&[next as i32], &[1, 1]);
    }
    Ok((tokens, sum_logprob, no_speech_prob))
}

/// The logit filters of a greedy window as arrays, so a step's token is
/// chosen on the device and the next step can be queued before the host
/// reads it (mlx-whisper's `DecodingTask` does the same). They equal the
/// host's filters ([`apply_timestamp_rules`] and the suppressions), which
/// a unit test checks.
struct DeviceFilters {
    /// Added at the first sampled position: blank and suppressed tokens.
    first: Array,
    /// Added at every later position: suppressed tokens.
    rest: Array,
    timestamps: Option<TimestampMasks>,
}

/// The timestamp rules' masks (-inf where a rule forbids, 0 elsewhere).
struct TimestampMasks {
    begin: i32,
    /// `<|notimestamps|>` at every position.
    always: Array,
    /// At the first position: also every text token, and timestamps past the
    /// latest allowed initial one.
    first: Array,
    /// After a pair of timestamps: every timestamp.
    no_timestamp: Array,
    /// After a lone timestamp: every text token before EOT.
    no_text_before_eot: Array,
    /// When the timestamps together are likelier than any text token: every text token.
    no_text: Array,
}

/// A `[vocab]` mask, -inf at `forbidden`.
fn forbid(vocab: usize, forbidden: impl IntoIterator<Item = usize>) -> Array {
    let mut m = vec![0f32; vocab];
    for i in forbidden {
        if let Some(x) = m.get_mut(i) {
            *x = f32::NEG_INFINITY;
        }
    }
    Array::from_slice(&m, &[vocab as i32])
}

impl DeviceFilters {
    /// `timestamps`: `Some(max_initial)` when the window predicts timestamps.
    fn new(t: &SpecialTokens, vocab: usize, timestamps: Option<Option<u32>>) -> Self {
        let suppress = || t.suppress.iter().map(|&s| s as usize);
        let tb = t.timestamp_begin as usize;
        Self {
            first: forbid(vocab, suppress().chain(t.blank.iter().map(|&b| b as usize))),
            rest: forbid(vocab, suppress()),
            timestamps: timestamps.map(|max_initial| {
                let late = max_initial.map_or(vocab, |m| tb + m as usize + 1);
                TimestampMasks {
                    begin: tb as i32,
                    always: forbid(vocab, [t.no_timestamps as usize]),
                    first: forbid(vocab, std::iter::once(t.no_timestamps as usize).chain(0..tb).chain(late..vocab)),
                    no_timestamp: forbid(vocab, tb..vocab),
                    no_text_before_eot: forbid(vocab, 0..t.eot as usize),
                    no_text: forbid(vocab, 0..tb),
                }
            }),
        }
    }

    /// `logits` `[vocab]` (f32) filtered for the position after `sampled`
    /// sampled tokens, the last two of which are `last` and `penultimate`
    /// (device scalars, possibly not computed yet).
    fn apply(
        &self,
        logits: &Array,
        sampled: usize,
        last: Option<&Array>,
        penultimate: Option<&Array>,
    ) -> Result<Array> {
        use mlx_rs::ops::select;
        let pre = logits.add(if sampled == 0 { &self.first } else { &self.rest })?;
        let Some(ts) = &self.timestamps else {
            return Ok(pre);
        };
        let zero = Array::from_f32(0.0);
        let mut mask = if sampled == 0 { ts.first.clone() } else { ts.always.clone() };
        if let Some(last) = last {
            let last_ts = last.ge(Array::from_int(ts.begin))?;
            let penultimate_ts = match penultimate {
                Some(p) => p.ge(Array::from_int(ts.begin))?,
                None => Array::from_bool(true),
            };
            let pair = last_ts.logical_and(&penultimate_ts)?;
            let lone = last_ts.logical_and(&penultimate_ts.logical_not()?)?;
            mask = mask.add(select(&pair, &ts.no_timestamp, &zero)?)?;
            mask = mask.add(select(&lone, &ts.no_text_before_eot, &zero)?)?;
        }
        let logprobs = pre.subtract(pre.logsumexp(None)?)?;
        let timestamp_logprob = logprobs.index(ts.begin..).logsumexp(None)?;
        let max_text = logprobs.index(..ts.begin).max(None)?;
        mask = mask.add(select(&timestamp_logprob.gt(&max_text)?, &ts.no_text, &zero)?)?;
        Ok(pre.add(&mask)?)
    }
}

/// Greedy tokens after `initial`, chosen on the device with
/// [`DeviceFilters`], each step queued before the previous step's token is
/// read (`timestamps`: `Some(max_initial)` when the window predicts them).
/// Returns what [`sampled_on_host`] returns.
fn greedy_on_device(
    net: &WhisperNet,
    t: &SpecialTokens,
    cross: &CrossKv,
    initial: &[u32],
    sot_index: usize,
    timestamps: Option<Option<u32>>,
) -> Result<(Vec<u32>, f64, f64)> {
    use mlx_rs::ops::{indexing::argmax, stack};
    let n_ctx = net.decoder.context;
    let mut cache = SelfKv::default();
    let mut tokens = initial.to_vec();
    let mut sum_logprob = 0f64;
    let mut no_speech = None;
    let mut filters: Option<DeviceFilters> = None;
    // The last two sampled tokens as device scalars (what the rules read).
    let mut history: Vec<Array> = Vec::new();
    // The previous step's [token, log probability], queued, not yet read.
    let mut pending: Option<Array> = None;
    let mut input =
        Array::from_slice(&initial.iter().map(|&x| x as i32).collect::<Vec<_>>(), &[1, initial.len() as i32]);
    for step in 0..n_ctx / 2 {
        if initial.len() + step > n_ctx {
            break;
        }
        let all = net.decoder.forward(&input, cross, &mut cache)?;
        let len = all.shape()[1];
        let logits = all.index((0, len - 1)).as_dtype(mlx_rs::Dtype::Float32)?;
        let vocab = logits.shape()[0] as usize;
        let f = filters.get_or_insert_with(|| DeviceFilters::new(t, vocab, timestamps));
        let penultimate = (history.len() == 2).then(|| &history[0]);
        let filtered = f.apply(&logits, step, history.last(), penultimate)?;
        let next = argmax(&filtered, None)?;
        // The chosen token is the largest: its log probability is max - logsumexp.
        let logprob = filtered.max(None)?.subtract(filtered.logsumexp(None)?)?;
        let packed = stack(&[next.as_dtype(mlx_rs::Dtype::Float32)?, logprob], 0)?;
        if let (0, Some(ns)) = (step, t.no_speech) {
            let at_sot = all.index((0, sot_index as i32)).as_dtype(mlx_rs::Dtype::Float32)?;
            let p = mlx_rs::ops::softmax_axis(&at_sot, -1, None)?.index(ns as i32);
            mlx_rs::transforms::async_eval([&p, &packed])?;
            no_speech = Some(p);
        } else {
            mlx_rs::transforms::async_eval([&packed])?;
        }
        if let Some(prev) = pending.take() {
            let (token, logprob) = read_token(&prev)?;
            sum_logprob += logprob;
            tokens.push(token);
            if token == t.eot {
                // This step's token follows the end and is not used, but it
                // is waited for: work left running on MLX's stream outlives
                // the arrays' owners, and a process that exits meanwhile
                // (a test binary after its last transcription) corrupted
                // its heap tearing MLX down under the running step.
                packed.eval()?;
                return Ok((tokens, sum_logprob, no_speech_prob(&no_speech)?));
            }
        }
        input = next.reshape(&[1, 1])?;
        history.push(next);
        if history.len() > 2 {
            history.remove(0);
        }
        pending = Some(packed);
    }
    if let Some(prev) = pending {
        let (token, logprob) = read_token(&prev)?;
        sum_logprob += logprob;
        tokens.push(token);
    }
    Ok((tokens, sum_logprob, no_speech_prob(&no_speech)?))
}

/// A queued step's token and log probability.
fn read_token(packed: &Array) -> Result<(u32, f64)> {
    packed.eval()?;
    let v = packed.as_slice::<f32>();
    Ok((v[0] as u32, v[1] as f64))
}

fn no_speech_prob(p: &Option<Array>) -> Result<f64> {
    Ok(match p {
        Some(p) => p.try_item_cast::<f32>()? as f64,
        None => f64::NAN,
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
    use super::*;

    /// A small vocabulary laid out as Whisper's: text, EOT, specials, timestamps.
    fn tokens() -> SpecialTokens {
        SpecialTokens {
            eot: 40,
            sot: 41,
            sot_prev: 42,
            sot_lm: 43,
            transcribe: 44,
            translate: 45,
            no_speech: Some(46),
            no_timestamps: 47,
            timestamp_begin: 50,
            languages: Vec::new(),
            blank: vec![3, 40],
            suppress: vec![5, 7, 44, 45],
        }
    }

    /// The device's filters choose what the host's choose, with the same
    /// logits where finite, for every state the timestamp rules tell apart:
    /// the first position (with and without a latest initial timestamp), a
    /// lone timestamp, a pair, text after text, and timestamps likelier
    /// than any text token.
    #[test]
    fn device_filters_equal_the_hosts() {
        let t = tokens();
        let vocab = 80;
        let mut checked = 0;
        for seed in 0..12u64 {
            let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(seed);
            let mut logits: Vec<f32> = (0..vocab).map(|_| rng.gen_range(-4.0f32..4.0)).collect();
            if seed % 3 == 0 {
                // Timestamps together likelier than any text token.
                for l in &mut logits[50..] {
                    *l += 3.0;
                }
            }
            let histories: [&[u32]; 6] = [&[], &[12], &[55], &[12, 55], &[55, 60], &[55, 9]];
            for sampled in histories {
                for max_initial in [None, Some(3)] {
                    for timestamps in [true, false] {
                        let mut host = logits.clone();
                        let blank: &[u32] = if sampled.is_empty() { &t.blank } else { &[] };
                        for &s in blank.iter().chain(&t.suppress) {
                            host[s as usize] = f32::NEG_INFINITY;
                        }
                        if timestamps {
                            apply_timestamp_rules(&mut host, sampled, &t, max_initial);
                        }
                        let f = DeviceFilters::new(&t, vocab, timestamps.then_some(max_initial));
                        let ids: Vec<Array> = sampled.iter().map(|&x| Array::from_slice(&[x], &[])).collect();
                        let last = ids.last();
                        let penultimate = (ids.len() >= 2).then(|| &ids[ids.len() - 2]);
                        let device = f
                            .apply(&Array::from_slice(&logits, &[vocab as i32]), sampled.len(), last, penultimate)
                            .unwrap();
                        let device = device.as_slice::<f32>();
                        for (i, (h, d)) in host.iter().zip(device).enumerate() {
                            let same = (h.is_infinite() && d.is_infinite()) || (h - d).abs() < 1e-5;
                            assert!(
                                same,
                                "seed {seed}, sampled {sampled:?}, ts {timestamps}: logit {i} host {h} device {d}"
                            );
                        }
                        assert_eq!(argmax(&host), argmax(device));
                        checked += 1;
                    }
                }
            }
        }
        assert_eq!(checked, 12 * 6 * 2 * 2);
    }

    #[test]
    fn compression_ratio_is_zlibs() {
        // Python: len(b) / len(zlib.compress(b)) for b = b"hello hello hello hello"
        let r = super::compression_ratio("hello hello hello hello");
        assert!((r - 23.0 / 16.0).abs() < 1e-9, "{r}");
        assert!(super::compression_ratio(&"the same words again ".repeat(20)) > 2.4);
    }
}
