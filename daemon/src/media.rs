//! Media → features. Each image is looked up in the feature store by
//! (tower fingerprint, preprocessing, content hash); only misses go through
//! the tower, and their features are stored. A video is sampled into
//! frames and cut into temporal groups, each stored like an image (the
//! group's number in the preprocessing part of its key), beside an entry
//! holding the groups' times: a clip asked about again needs neither its
//! bytes nor ffmpeg. An audio clip for a model that hears (Gemma 4) is
//! decoded, turned into the family's features and stored like an image,
//! keyed by the audio tower's own fingerprint and frontend.
//!
//! The CPU half — hashing, decoding, EXIF, resizing, patchifying, the store
//! lookup — runs off the engine thread, before the job is queued
//! ([`prepare`], called from `requests::prepare` on tokio's blocking
//! pool); the engine only runs the tower on what was prepared
//! ([`finish`]). Two requests for the same new image still encode it
//! once: the engine looks the store up again before encoding, and the
//! first request's features are there by then.

use crate::error::EngineError;
use crate::model::family::{MediaPreprocessor, Prepared, PreparedAudio};
use crate::model::{image, video, MediaLayout, Model};
use mlx_rs::{Array, Dtype};
use mlxbc_cache::{FeatureKey, FeatureStore, Features, Modality};
use mlxbc_shared::sync::lock;
use mlxbc_shared::{MediaKind, MediaRef};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// The feature store, shared by the engine and the connections' blocking
/// tasks; each holds it only for one lookup or one write (a whole-store
/// scan, `cache verify`, reads without holding it: `cache_report`).
#[derive(Clone)]
pub struct SharedStore(Arc<Mutex<FeatureStore>>);

/// The store's state (`mlxbc cache stats`, `/metrics`), beside the prompt
/// cache's (`prompts`).
pub fn report(
    store: &FeatureStore,
    path: &std::path::Path,
    prompts: mlxbc_shared::PromptCacheReport,
) -> mlxbc_shared::CacheReport {
    let s = store.stats();
    mlxbc_shared::CacheReport {
        path: path.display().to_string(),
        entries: s.entries,
        disk_bytes: s.disk_bytes,
        disk_budget_bytes: store.config().disk_bytes,
        ram_entries: s.ram_entries,
        ram_bytes: s.ram_bytes,
        ram_hits: s.ram_hits,
        disk_hits: s.disk_hits,
        misses: s.misses,
        evictions: s.evictions,
        corrupt: s.corrupt,
        removed: 0,
        skipped_for_space: s.skipped_for_space,
        listing: Vec::new(),
        prompts,
    }
}

impl SharedStore {
    /// Shares an opened store.
    pub fn new(store: FeatureStore) -> Self {
        Self(Arc::new(Mutex::new(store)))
    }

    /// The store, for one short operation.
    pub fn lock(&self) -> std::sync::MutexGuard<'_, FeatureStore> {
        lock(&self.0)
    }
}

/// What a model's media needs off the engine thread: its preprocessing and
/// the parts of its store keys.
#[derive(Clone)]
pub struct MediaRoute {
    pub preprocessor: Arc<dyn MediaPreprocessor>,
    pub preprocess_key: String,
    pub fingerprint: [u8; 32],
    /// The video preprocessing's description, for a tower that takes video.
    pub video_key: Option<String>,
    /// The audio frontend's description and the audio tower's
    /// fingerprint, for a model that hears.
    pub audio_key: Option<(String, [u8; 32])>,
}

impl MediaRoute {
    /// The route of a vision model; `None` for a text-only one.
    pub fn of(model: &Model) -> Option<Self> {
        let v = model.media_tower.as_ref()?;
        Some(Self {
            preprocessor: v.preprocessor.clone(),
            preprocess_key: v.preprocess_key.clone(),
            fingerprint: v.fingerprint.0,
            video_key: v.preprocessor.video().map(|p| p.describe()),
            audio_key: v.audio.as_ref().map(|a| (a.frontend_key.clone(), a.fingerprint.0)),
        })
    }

    /// The store key of an audio clip; `None` when the model does not hear.
    fn audio_key(&self, media: &MediaRef) -> Option<FeatureKey> {
        let (frontend, tower) = self.audio_key.as_ref()?;
        Some(FeatureKey {
            modality: Modality::Audio,
            tower: *tower,
            preprocess: FeatureKey::preprocess_hash(&format!("chat;{frontend}")),
            content: media.sha256,
        })
    }

    /// The store key of part of a video: `"times"` (its groups' times) or
    /// `"group {i}"`.
    fn video_part(&self, media: &MediaRef, video_key: &str, part: &str) -> FeatureKey {
        FeatureKey {
            modality: Modality::Video,
            tower: self.fingerprint,
            preprocess: FeatureKey::preprocess_hash(&format!("{video_key};{part}")),
            content: media.sha256,
        }
    }

    /// The store key of `media`.
    pub fn key(&self, media: &MediaRef) -> FeatureKey {
        FeatureKey {
            modality: Modality::Image,
            tower: self.fingerprint,
            preprocess: FeatureKey::preprocess_hash(&self.preprocess_key),
            content: media.sha256,
        }
    }

    /// Made for `model`'s tower and preprocessing.
    fn is_for(&self, model: &Model) -> bool {
        model.media_tower.as_ref().is_some_and(|v| {
            v.fingerprint.0 == self.fingerprint
                && v.preprocess_key == self.preprocess_key
                && v.audio.as_ref().map(|a| (a.frontend_key.clone(), a.fingerprint.0)) == self.audio_key
        })
    }
}

/// One feature array made ready before the engine sees it (an image, or
/// one temporal group of a video).
pub enum MediaInput {
    /// Found in the store.
    Stored(Features),
    /// Not stored: decoded and preprocessed for the tower.
    Prepared(Prepared),
    /// Not stored: an audio clip's features for the audio tower.
    Audio(PreparedAudio),
}

/// A request's media, in order, made ready off the engine thread.
pub struct PreparedMedia {
    pub route: MediaRoute,
    /// Every feature array the prompt takes, in prompt order.
    pub items: Vec<(FeatureKey, MediaInput)>,
    /// What each medium became (an image: one item; a video: one per group).
    pub layout: Vec<MediaLayout>,
    pub stats: MediaStats,
}

/// Features made for a request's media, in prompt order.
pub struct Encoded {
    pub features: Vec<Array>,
    pub layout: Vec<MediaLayout>,
    /// Per feature array, the identity its prompt span has in the prompt
    /// cache's keys (an image's: its content hash).
    pub spans: Vec<[u8; 32]>,
    pub stats: MediaStats,
}

/// Outcome of preparing or resolving a request's media.
pub enum Resolved<T> {
    Ready(T),
    /// The store lacks these and the client did not send their bytes.
    Missing(Vec<[u8; 32]>),
}

/// What the store, the preprocessing and the tower did.
#[derive(Debug, Default, Clone)]
pub struct MediaStats {
    pub hits: u32,
    pub misses: u32,
    /// In the tower, on the engine.
    pub encode_ms: f64,
    /// Looking features up in the store.
    pub lookup_ms: f64,
    /// Hashing, decoding and preprocessing new media.
    pub preprocess_ms: f64,
}

fn bad(msg: impl Into<String>) -> EngineError {
    EngineError::BadMedia(msg.into())
}

/// A medium's layout and its entries in the store.
type StoredMedia = (MediaLayout, Vec<(FeatureKey, Features)>);

/// One medium's entries as the store has them; `None` when any is missing.
fn lookup(route: &MediaRoute, store: Option<&SharedStore>, m: &MediaRef) -> Result<Option<StoredMedia>, EngineError> {
    let Some(store) = store else { return Ok(None) };
    let get = |key: &FeatureKey| store.lock().get(key).map(|(f, _)| f);
    match m.kind {
        MediaKind::Image => {
            let key = route.key(m);
            Ok(get(&key).map(|f| (MediaLayout::Image, vec![(key, f)])))
        }
        MediaKind::Video => {
            let video_key = route.video_key.as_deref().ok_or_else(no_video)?;
            let Some(times) = get(&route.video_part(m, video_key, "times")) else { return Ok(None) };
            // Whole tenths, exact in f32.
            let tenths: Vec<u32> =
                times.data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as u32).collect();
            let mut items = Vec::with_capacity(tenths.len());
            for i in 0..tenths.len() {
                let key = route.video_part(m, video_key, &format!("group {i}"));
                let Some(f) = get(&key) else { return Ok(None) };
                items.push((key, f));
            }
            Ok(Some((MediaLayout::Video { tenths }, items)))
        }
        MediaKind::Audio => {
            let key = route.audio_key(m).ok_or_else(no_audio)?;
            Ok(get(&key).map(|f| (MediaLayout::Audio, vec![(key, f)])))
        }
    }
}

fn no_audio() -> EngineError {
    bad("this model has no audio tower and cannot hear audio; use one that does (Gemma 4 E2B/E4B), or `mlxbc transcribe` with a speech model")
}

fn no_video() -> EngineError {
    bad("this model takes images but not video; use a video-language model (Qwen3-VL)")
}

/// The CPU half, for any thread: looks every medium up, and decodes and
/// preprocesses the misses (the same image twice in one request once).
pub fn prepare(
    route: &MediaRoute,
    store: Option<&SharedStore>,
    media: &[&MediaRef],
) -> Result<Resolved<PreparedMedia>, EngineError> {
    let mut stats = MediaStats::default();
    let t = Instant::now();
    let found: Vec<_> = media.iter().map(|m| lookup(route, store, m)).collect::<Result<_, _>>()?;
    stats.lookup_ms = t.elapsed().as_secs_f64() * 1000.0;
    let mut missing = Vec::new();
    for (m, hit) in media.iter().zip(&found) {
        if hit.is_none() && m.bytes.is_none() && !missing.contains(&m.sha256) {
            missing.push(m.sha256);
        }
    }
    if !missing.is_empty() {
        return Ok(Resolved::Missing(missing));
    }
    let t = Instant::now();
    let mut items: Vec<(FeatureKey, MediaInput)> = Vec::with_capacity(media.len());
    let mut layout = Vec::with_capacity(media.len());
    for (m, hit) in media.iter().zip(found) {
        if let Some((shape, stored)) = hit {
            stats.hits += stored.len() as u32;
            items.extend(stored.into_iter().map(|(k, f)| (k, MediaInput::Stored(f))));
            layout.push(shape);
            continue;
        }
        // `bytes` is present: a miss without bytes returned Missing above.
        let bytes = m.bytes.as_deref().unwrap_or_default();
        if mlxbc_cache::content_hash(bytes) != m.sha256 {
            return Err(bad(format!("media {} does not match its sha256", m.hex())));
        }
        match m.kind {
            MediaKind::Image => {
                let key = route.key(m);
                let input = match items.iter().find(|(k, _)| *k == key) {
                    Some((_, MediaInput::Prepared(p))) => MediaInput::Prepared(p.clone()),
                    _ => {
                        let img = image::decode(bytes).map_err(|e| bad(format!("image {}: {e}", &m.hex()[..12])))?;
                        MediaInput::Prepared(route.preprocessor.prepare(&img))
                    }
                };
                items.push((key, input));
                layout.push(MediaLayout::Image);
            }
            MediaKind::Video => {
                let (shape, groups) = prepare_video(route, store, m, bytes)?;
                items.extend(groups);
                layout.push(shape);
            }
            MediaKind::Audio => {
                let key = route.audio_key(m).ok_or_else(no_audio)?;
                let frontend = route.preprocessor.audio().ok_or_else(no_audio)?;
                let short = &m.hex()[..12];
                let input = match items.iter().find(|(k, _)| *k == key) {
                    Some((_, MediaInput::Audio(a))) => MediaInput::Audio(a.clone()),
                    _ => {
                        let clip =
                            crate::audio::decode::decode(bytes).map_err(|e| bad(format!("audio {short}: {e}")))?;
                        MediaInput::Audio(
                            frontend.prepare(&clip.samples).map_err(|e| bad(format!("audio {short}: {e}")))?,
                        )
                    }
                };
                items.push((key, input));
                layout.push(MediaLayout::Audio);
            }
        }
    }
    stats.preprocess_ms = t.elapsed().as_secs_f64() * 1000.0;
    Ok(Resolved::Ready(PreparedMedia { route: route.clone(), items, layout, stats }))
}

/// A video's frames sampled and cut into groups (stored ones not prepared
/// again), and its groups' times stored.
fn prepare_video(
    route: &MediaRoute,
    store: Option<&SharedStore>,
    m: &MediaRef,
    bytes: &[u8],
) -> Result<(MediaLayout, Vec<(FeatureKey, MediaInput)>), EngineError> {
    let (Some(pre), Some(video_key)) = (route.preprocessor.video(), route.video_key.as_deref()) else {
        return Err(no_video());
    };
    let short = &m.hex()[..12];
    let clip = video::decode(bytes, &pre.sampling()).map_err(|e| bad(format!("video {short}: {e}")))?;
    let groups = pre.prepare(&clip.frames).map_err(|e| bad(format!("video {short}: {e}")))?;
    let tenths: Vec<u32> = pre.group_seconds(&clip).into_iter().map(video::prompt_tenths).collect();
    if tenths.len() != groups.len() {
        return Err(EngineError::Internal(format!(
            "video {short}: {} groups but {} times",
            groups.len(),
            tenths.len()
        )));
    }
    let mut items = Vec::with_capacity(groups.len());
    for (i, group) in groups.into_iter().enumerate() {
        let key = route.video_part(m, video_key, &format!("group {i}"));
        let stored = store.and_then(|s| s.lock().get(&key)).map(|(f, _)| f);
        items.push((key, stored.map_or(MediaInput::Prepared(group), MediaInput::Stored)));
    }
    if let Some(s) = store {
        let times: Vec<f32> = tenths.iter().map(|&t| t as f32).collect();
        let entry = Features::from_f32(vec![tenths.len() as u32], &times);
        if let Err(e) = s.lock().put(&route.video_part(m, video_key, "times"), &entry) {
            tracing::warn!(error = %e, "could not store a video's group times");
        }
    }
    Ok((MediaLayout::Video { tenths }, items))
}

/// The engine's half: features per image and video group, in order — stored ones as they
/// are, prepared ones through `model`'s tower (and into the store). Media
/// prepared for another tower (the model changed meanwhile) is prepared
/// again here.
pub fn finish(
    model: &Model,
    name: &str,
    store: Option<&SharedStore>,
    prepared: PreparedMedia,
    media: &[&MediaRef],
) -> Result<Resolved<Encoded>, EngineError> {
    if !prepared.route.is_for(model) {
        return resolve(model, name, store, media);
    }
    encode(model, store, prepared)
}

/// Both halves on the calling thread (the engine, when nothing was prepared).
pub fn resolve(
    model: &Model,
    name: &str,
    store: Option<&SharedStore>,
    media: &[&MediaRef],
) -> Result<Resolved<Encoded>, EngineError> {
    let Some(route) = MediaRoute::of(model) else {
        return Err(bad(format!(
            "model {name} is text-only and cannot take images, video or audio; use a vision-language model"
        )));
    };
    match prepare(&route, store, media)? {
        Resolved::Missing(m) => Ok(Resolved::Missing(m)),
        Resolved::Ready(p) => encode(model, store, p),
    }
}

fn encode(
    model: &Model,
    store: Option<&SharedStore>,
    prepared: PreparedMedia,
) -> Result<Resolved<Encoded>, EngineError> {
    let Some(vision) = &model.media_tower else { return Err(bad("this model has no vision tower")) };
    let mut stats = prepared.stats;
    let mut out = Vec::with_capacity(prepared.items.len());
    let spans = prepared.items.iter().map(|(key, _)| span_identity(key)).collect();
    // The same image twice in one request is encoded once.
    let mut encoded_now: Vec<(FeatureKey, Array)> = Vec::new();
    let inference = |e: &dyn std::fmt::Display| EngineError::Inference(format!("encoding image: {e:#}"));
    for (key, input) in prepared.items {
        let prepared = match input {
            MediaInput::Stored(f) => {
                out.push(to_array(&f).ok_or_else(|| inference(&"a stored entry is not f32"))?);
                continue;
            }
            input => input,
        };
        if let Some((_, f)) = encoded_now.iter().find(|(k, _)| *k == key) {
            stats.hits += 1;
            out.push(f.clone());
            continue;
        }
        // Another request may have encoded it since this one was prepared.
        if let Some(f) = store.map(|s| s.lock()).and_then(|mut s| s.get(&key)).and_then(|(f, _)| to_array(&f)) {
            stats.hits += 1;
            encoded_now.push((key, f.clone()));
            out.push(f);
            continue;
        }
        let t = Instant::now();
        let features = match &prepared {
            MediaInput::Audio(a) => vision.tower.encode_audio(a),
            MediaInput::Prepared(p) => vision.tower.encode(p),
            MediaInput::Stored(_) => Err(anyhow::anyhow!("a stored entry reached the tower")),
        };
        let features = features.map_err(|e| inference(&e))?;
        let features = features.as_dtype(Dtype::Float32).map_err(|e| inference(&e))?;
        features.eval().map_err(|e| inference(&e))?;
        stats.encode_ms += t.elapsed().as_secs_f64() * 1000.0;
        stats.misses += 1;
        if let Some(mut s) = store.map(|s| s.lock()) {
            let shape = features.shape().iter().map(|&d| d as u32).collect();
            if let Err(e) = s.put(&key, &Features::from_f32(shape, features.as_slice::<f32>())) {
                // A full disk costs the cache, not the answer.
                tracing::warn!(error = %e, "could not store image features");
            }
        }
        encoded_now.push((key, features.clone()));
        out.push(features);
    }
    Ok(Resolved::Ready(Encoded { features: out, layout: prepared.layout, spans, stats }))
}

/// What names a feature array's prompt span in the prompt cache's keys: an
/// image's content hash (as before videos), a video group's whole key.
fn span_identity(key: &FeatureKey) -> [u8; 32] {
    match key.modality {
        Modality::Image => key.content,
        _ => mlxbc_cache::content_hash(&key.to_bytes()),
    }
}

fn to_array(f: &Features) -> Option<Array> {
    if f.dtype != mlxbc_cache::FeatureDtype::F32 {
        return None;
    }
    let values: Vec<f32> = f.data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    let shape: Vec<i32> = f.shape.iter().map(|&d| d as i32).collect();
    Some(Array::from_slice(&values, &shape))
}
