//! Media → features: each image is looked up in the feature store by
//! (tower fingerprint, preprocessing, content hash); only misses are decoded,
//! preprocessed and run through the tower, and their features stored. The
//! engine is one thread, so two requests for the same new image encode it
//! once: the second finds the first one's entry.

use super::error::EngineError;
use crate::model::TextModel;
use crate::vision::image;
use mlx_rs::{Array, Dtype};
use mlxbc_cache::{FeatureKey, FeatureStore, Features, Modality};
use mlxbc_shared::MediaRef;
use std::time::Instant;

/// Outcome of resolving a request's media.
pub enum Resolved {
    /// Features per image, in order.
    Ready(Vec<Array>, MediaStats),
    /// The store lacks these and the client did not send their bytes.
    Missing(Vec<[u8; 32]>),
}

/// What the store and tower did.
#[derive(Debug, Default, Clone)]
pub struct MediaStats {
    pub hits: u32,
    pub misses: u32,
    pub encode_ms: f64,
    pub lookup_ms: f64,
}

type Failure = EngineError;

fn bad(msg: impl Into<String>) -> Failure {
    EngineError::BadMedia(msg.into())
}

/// The store key of `media` for `model`.
pub fn key_for(model: &TextModel, media: &MediaRef) -> Option<FeatureKey> {
    let v = model.vision.as_ref()?;
    Some(FeatureKey {
        modality: Modality::Image,
        tower: v.fingerprint.0,
        preprocess: FeatureKey::preprocess_hash(&v.preprocess_key),
        content: media.sha256,
    })
}

/// Finds or computes features for every item of `media`.
pub fn resolve(
    model: &TextModel,
    name: &str,
    media: &[&MediaRef],
    store: Option<&mut FeatureStore>,
) -> Result<Resolved, Failure> {
    if model.vision.is_none() {
        return Err(bad(format!("model {name} is text-only and cannot take images; use a vision-language model")));
    }
    let mut store = store;
    let mut stats = MediaStats::default();
    let mut found: Vec<Option<Array>> = Vec::new();
    let mut missing = Vec::new();
    let t = Instant::now();
    for m in media {
        let key = key_for(model, m).expect("vision model");
        let hit = store.as_deref_mut().and_then(|s| s.get(&key)).and_then(|(f, _)| to_array(&f));
        if hit.is_none() && m.bytes.is_none() && !missing.contains(&m.sha256) {
            missing.push(m.sha256);
        }
        found.push(hit);
    }
    stats.lookup_ms = t.elapsed().as_secs_f64() * 1000.0;
    if !missing.is_empty() {
        return Ok(Resolved::Missing(missing));
    }
    let mut out = Vec::new();
    // The same image twice in one request is encoded once.
    let mut encoded_now: Vec<([u8; 32], Array)> = Vec::new();
    for (m, hit) in media.iter().zip(found) {
        if let Some(f) = hit {
            stats.hits += 1;
            out.push(f);
            continue;
        }
        if let Some((_, f)) = encoded_now.iter().find(|(h, _)| *h == m.sha256) {
            stats.hits += 1;
            out.push(f.clone());
            continue;
        }
        let key = key_for(model, m).expect("vision model");
        let bytes = m.bytes.as_ref().expect("bytes present for misses");
        if mlxbc_cache::content_hash(bytes) != m.sha256 {
            return Err(bad(format!("image {} does not match its sha256", m.hex())));
        }
        let t = Instant::now();
        let img = image::decode(bytes).map_err(|e| bad(format!("image {}: {e}", &m.hex()[..12])))?;
        let features =
            model.encode_image(&img).map_err(|e| EngineError::Inference(format!("encoding image: {e:#}")))?;
        let features = features.as_dtype(Dtype::Float32).map_err(|e| EngineError::Inference(e.to_string()))?;
        features.eval().map_err(|e| EngineError::Inference(e.to_string()))?;
        stats.encode_ms += t.elapsed().as_secs_f64() * 1000.0;
        stats.misses += 1;
        if let Some(s) = store.as_deref_mut() {
            let shape = features.shape().iter().map(|&d| d as u32).collect();
            if let Err(e) = s.put(&key, &Features::from_f32(shape, features.as_slice::<f32>())) {
                // A full disk costs the cache, not the answer.
                tracing::warn!(error = %e, "could not store image features");
            }
        }
        encoded_now.push((m.sha256, features.clone()));
        out.push(features);
    }
    Ok(Resolved::Ready(out, stats))
}

fn to_array(f: &Features) -> Option<Array> {
    if f.dtype != mlxbc_cache::FeatureDtype::F32 {
        return None;
    }
    let values: Vec<f32> = f.data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    let shape: Vec<i32> = f.shape.iter().map(|&d| d as i32).collect();
    Some(Array::from_slice(&values, &shape))
}
