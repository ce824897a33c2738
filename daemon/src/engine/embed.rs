//! Embedding requests: each input is looked up in the feature store first
//! (keyed by the embedder's weights, its settings and the text's sha256),
//! and only the misses are computed, a padded batch at a time, shortest
//! first so a batch's rows are about as long as each other. A re-index of
//! unchanged chunks is answered from the store, after a restart too.

use crate::error::EngineError;
use crate::media::SharedStore;
use crate::model::family::Embedder;
use mlxbc_cache::{content_hash, FeatureKey, Features, Modality};
use mlxbc_shared::{EmbedRequest, Embeddings, MAX_EMBED_INPUTS};
use std::time::Instant;

/// Tokens (padding included) one batch may hold: bounds the attention's
/// memory (`rows × length²` per head) whatever the inputs.
const BATCH_TOKENS: usize = 16 * 1024;

/// The most inputs one batch may hold.
const BATCH_ROWS: usize = 64;

/// Embeds `request.inputs` with `model` (resident as `name`).
pub fn run(
    name: &str,
    model: &dyn Embedder,
    store: Option<&SharedStore>,
    request: &EmbedRequest,
    load_ms: f64,
    received: Instant,
) -> Result<Embeddings, EngineError> {
    let inputs = &request.inputs;
    if inputs.is_empty() {
        return Err(EngineError::BadRequest("nothing to embed: give at least one input".into()));
    }
    if inputs.len() > MAX_EMBED_INPUTS {
        return Err(EngineError::BadRequest(format!(
            "{} inputs in one request; at most {MAX_EMBED_INPUTS} (send them in several)",
            inputs.len()
        )));
    }
    let full = model.dimensions();
    let dimensions = match request.dimensions {
        None => full,
        Some(d) if d >= 1 && (d as usize) <= full => d as usize,
        Some(d) => return Err(EngineError::BadRequest(format!("dimensions {d} is not between 1 and {name}'s {full}"))),
    };
    let max = model.max_tokens();
    let mut ids = Vec::with_capacity(inputs.len());
    for (i, text) in inputs.iter().enumerate() {
        let t = model.tokenize(text).map_err(EngineError::inference)?;
        if t.len() > max && !request.truncate {
            return Err(EngineError::BadRequest(format!(
                "input {i} is {} tokens, more than the {max} {name} takes; shorten it, or let it be truncated",
                t.len()
            )));
        }
        ids.push(model.truncate(&t));
    }
    let prompt_tokens = ids.iter().map(|t| t.len() as u64).sum();
    let fingerprint = model.fingerprint();
    let settings = FeatureKey::preprocess_hash(&model.settings());
    let key = |text: &str| FeatureKey {
        modality: Modality::Text,
        tower: fingerprint.0,
        preprocess: settings,
        content: content_hash(text.as_bytes()),
    };
    let mut vectors: Vec<Option<Vec<f32>>> = match store {
        Some(s) => {
            let mut s = s.lock();
            inputs.iter().map(|t| s.get(&key(t)).map(|(f, _)| f.to_f32()).filter(|v| v.len() == full)).collect()
        }
        None => vec![None; inputs.len()],
    };
    let cached = vectors.iter().filter(|v| v.is_some()).count() as u32;
    // The misses, shortest first, in batches bounded by rows and tokens;
    // an input repeated within the request is embedded once.
    let mut misses: Vec<usize> = (0..inputs.len()).filter(|&i| vectors[i].is_none()).collect();
    misses.sort_by_key(|&i| ids[i].len());
    misses.dedup_by(|a, b| inputs[*a] == inputs[*b]);
    let mut at = 0;
    while at < misses.len() {
        let mut end = at + 1;
        while end < misses.len() && end - at < BATCH_ROWS && ids[misses[end]].len() * (end + 1 - at) <= BATCH_TOKENS {
            end += 1;
        }
        let batch: Vec<Vec<u32>> = misses[at..end].iter().map(|&i| ids[i].clone()).collect();
        let out = model.embed(&batch).map_err(EngineError::inference)?;
        for (&i, v) in misses[at..end].iter().zip(out) {
            if let Some(s) = store {
                if let Err(e) = s.lock().put(&key(&inputs[i]), &Features::from_f32(vec![full as u32], &v)) {
                    tracing::warn!(error = %e, "an embedding was not stored");
                }
            }
            vectors[i] = Some(v);
        }
        at = end;
    }
    // Repeats of an input take its vector.
    for i in 0..inputs.len() {
        if vectors[i].is_none() {
            let first = (0..i).find(|&j| inputs[j] == inputs[i] && vectors[j].is_some());
            vectors[i] = first.and_then(|j| vectors[j].clone());
        }
    }
    let vectors = vectors
        .into_iter()
        .map(|v| v.map(|v| shortened(v, dimensions)))
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| EngineError::Internal("an input was left without a vector".into()))?;
    Ok(Embeddings {
        model: name.to_string(),
        vectors,
        prompt_tokens,
        cached,
        load_ms,
        total_ms: received.elapsed().as_secs_f64() * 1000.0,
    })
}

/// `v`'s first `dimensions` values, normalized again when cut (Matryoshka
/// embeddings, as OpenAI's `dimensions` returns them).
fn shortened(mut v: Vec<f32>, dimensions: usize) -> Vec<f32> {
    if dimensions >= v.len() {
        return v;
    }
    v.truncate(dimensions);
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-12);
    v.iter_mut().for_each(|x| *x /= norm);
    v
}

#[cfg(test)]
mod tests {
    use super::shortened;

    #[test]
    fn a_shortened_vector_is_normalized_again() {
        let v = shortened(vec![3.0, 4.0, 12.0], 2);
        assert_eq!(v, vec![0.6, 0.8]);
        assert_eq!(shortened(vec![1.0, 2.0], 5), vec![1.0, 2.0]);
    }
}
