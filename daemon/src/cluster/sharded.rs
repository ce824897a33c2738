//! Rank 0's face of a model split over the group: a [`LanguageModel`] like
//! any other to the engine, whose every call first tells the other ranks
//! what to do (the cache operations since the last call, then the call),
//! then does its own part; the collectives inside the layers meet theirs.

use super::coordinator::{own_reply, Coordinator};
use super::plan::{DeepstackPlan, MediaPlan, Op, Reply};
use crate::error::RankStoppedError;
use crate::model::family::{LanguageModel, MediaAttention};
use crate::model::kv_cache::{Journal, KvCache};
use crate::model::positions::MediaPositions;
use anyhow::{anyhow, bail, Result};
use mlx_rs::{Array, Dtype};
use std::cell::RefCell;

/// A sharded model's rank-0 part and its place in the group.
pub struct ShardedLm {
    inner: Box<dyn LanguageModel>,
    slot: u32,
    name: String,
    fingerprint: String,
    coordinator: Coordinator,
    /// The group generation the other ranks hold this model in, and the
    /// journal of the caches made since.
    attached: RefCell<(u64, Journal)>,
}

impl ShardedLm {
    /// Wraps rank 0's shard, loaded in `slot` on every rank in the
    /// current generation of the group.
    pub fn new(
        inner: Box<dyn LanguageModel>,
        slot: u32,
        name: &str,
        fingerprint: &str,
        coordinator: Coordinator,
    ) -> Self {
        let generation = coordinator.generation();
        coordinator.note_model(name, inner.split_description());
        Self {
            inner,
            slot,
            name: name.to_string(),
            fingerprint: fingerprint.to_string(),
            coordinator,
            attached: RefCell::new((generation, Journal::default())),
        }
    }

    /// The journal of the current generation; after the group re-formed,
    /// the other ranks are asked to load their shards again first.
    fn journal(&self) -> Result<Journal> {
        let generation = self.coordinator.generation();
        if self.attached.borrow().0 != generation {
            tracing::info!(model = %self.name, "the group re-formed: its ranks load their shards again");
            self.coordinator.begin_load(self.slot, &self.name, &self.fingerprint)?;
            self.coordinator.finish_load(own_reply(None))?;
            *self.attached.borrow_mut() = (self.coordinator.generation(), Journal::default());
        }
        Ok(self.attached.borrow().1.clone())
    }

    /// The cache operations to send before a call.
    fn pending(&self, journal: &Journal) -> Op {
        Op::Caches { slot: self.slot, ops: journal.take() }
    }
}

impl Drop for ShardedLm {
    fn drop(&mut self) {
        self.coordinator.post(Op::Unload { slot: self.slot });
        self.coordinator.note_model(&self.name, None);
    }
}

fn dtype_name(d: Dtype) -> Result<&'static str> {
    Ok(match d {
        Dtype::Float32 => "f32",
        Dtype::Float16 => "f16",
        Dtype::Bfloat16 => "bf16",
        other => bail!("embeddings of dtype {other:?} cannot be sent to the group"),
    })
}

/// What the other ranks need of `media` for positions `offset..offset + len`.
fn media_plan(media: &MediaPositions, offset: i32, len: i32) -> Result<MediaPlan> {
    let end = (offset + len).max(0) as usize;
    let upto = |n: usize| n.min(end);
    let image_blocks = media.image_blocks.filter(|_| len > 1).map(|b| b[..upto(b.len())].to_vec());
    let mrope = media.mrope.map(|(prompt, delta)| (prompt[..upto(prompt.len())].to_vec(), *delta));
    let deepstack = match media.deepstack {
        Some(d) => {
            let rows = d.row_of[..upto(d.row_of.len())].to_vec();
            let reads = rows.iter().skip(offset.max(0) as usize).any(|&r| r >= 0);
            let tables = d
                .layers
                .iter()
                .map(|t| Ok((t.shape().to_vec(), dtype_name(t.dtype())?.to_string())))
                .collect::<Result<Vec<_>>>()?;
            reads.then_some(DeepstackPlan { row_of: rows, tables })
        }
        None => None,
    };
    Ok(MediaPlan { image_blocks, mrope, deepstack })
}

/// The dtype a [`Op::Forward`] names.
pub fn dtype_of(name: &str) -> Result<Dtype> {
    Ok(match name {
        "f32" => Dtype::Float32,
        "f16" => Dtype::Float16,
        "bf16" => Dtype::Bfloat16,
        other => bail!("unknown dtype {other}"),
    })
}

impl LanguageModel for ShardedLm {
    fn architecture(&self) -> &'static str {
        self.inner.architecture()
    }

    fn num_layers(&self) -> usize {
        self.inner.num_layers()
    }

    fn context_length(&self) -> u32 {
        self.inner.context_length()
    }

    fn embed(&self, ids: &Array) -> Result<Array> {
        let journal = self.journal()?;
        let ids32 = ids.as_dtype(Dtype::Int32)?;
        ids32.eval()?;
        let op = Op::Embed { slot: self.slot, shape: ids32.shape().to_vec(), ids: ids32.as_slice::<i32>().to_vec() };
        self.coordinator.call(None, |g| {
            self.coordinator.send(g, vec![self.pending(&journal), op])?;
            let x = self.inner.embed(&ids32)?;
            x.eval()?;
            Ok(x)
        })
    }

    fn forward(&self, embeds: &Array, cache: &mut KvCache, media: &MediaPositions) -> Result<Array> {
        let plan = media_plan(media, cache.offset, embeds.shape()[1])?;
        let journal = self.journal()?;
        if cache.is_journaled() && !cache.is_in(&journal) {
            return Err(anyhow!(RankStoppedError(
                "the group re-formed while this request ran; send it again".to_string()
            )));
        }
        let id = cache.journaled(&journal)?;
        let op = Op::Forward {
            slot: self.slot,
            cache: id,
            shape: embeds.shape().to_vec(),
            dtype: dtype_name(embeds.dtype())?.to_string(),
            media: plan,
        };
        let sends_deepstack = matches!(&op, Op::Forward { media, .. } if media.deepstack.is_some());
        let positions = (embeds.shape()[0] * embeds.shape()[1]).max(1) as usize;
        self.coordinator.call_sized(positions, |g| {
            self.coordinator.send(g, vec![self.pending(&journal), op])?;
            let shared = g.broadcast(embeds)?;
            if let Some(d) = media.deepstack.filter(|_| sends_deepstack) {
                for table in &d.layers {
                    g.broadcast(table)?;
                }
            }
            let h = self.inner.forward(&shared, cache, media)?;
            h.eval()?;
            Ok(h)
        })
    }

    fn logits(&self, hidden: &Array) -> Result<Array> {
        let journal = self.journal()?;
        self.coordinator.call(None, |g| {
            self.coordinator.send(g, vec![self.pending(&journal), Op::Logits { slot: self.slot }])?;
            let l = self.inner.logits(hidden)?;
            l.eval()?;
            Ok(l)
        })
    }

    fn verifies_drafts(&self) -> bool {
        self.inner.verifies_drafts()
    }

    fn logits_all(&self, hidden: &Array) -> Result<Array> {
        let journal = self.journal()?;
        self.coordinator.call(None, |g| {
            self.coordinator.send(g, vec![self.pending(&journal), Op::LogitsAll { slot: self.slot }])?;
            let l = self.inner.logits_all(hidden)?;
            l.eval()?;
            Ok(l)
        })
    }

    fn media_attention(&self) -> MediaAttention {
        self.inner.media_attention()
    }

    /// Every other rank restores the prefix from its own prompt cache; a
    /// rank that lacks part of it makes the prefix be computed again (the
    /// caches that were made are dropped with `cache`).
    fn adopt_prefix(&self, cache: &mut KvCache, keys: &dyn Fn() -> Vec<u8>) -> Result<bool> {
        let journal = self.journal()?;
        let id = cache.adopt(&journal);
        let op = Op::Restore { slot: self.slot, cache: id, keys: keys(), positions: cache.offset as u32 };
        let replies = self.coordinator.call(None, |g| {
            self.coordinator.send(g, vec![self.pending(&journal), op])?;
            self.coordinator.gather(g, &own_reply(None))
        })?;
        let missing: Vec<String> = replies
            .iter()
            .enumerate()
            .filter_map(|(rank, r)| match r {
                Reply::Refused(why) => Some(format!("rank {rank}: {why}")),
                Reply::Ok { .. } => None,
            })
            .collect();
        if !missing.is_empty() {
            tracing::info!(model = %self.name, "a cached prefix is computed again: {}", missing.join("; "));
        }
        Ok(missing.is_empty())
    }

    fn split_description(&self) -> Option<String> {
        self.inner.split_description()
    }

    fn recurrent(&self) -> bool {
        self.inner.recurrent()
    }

    /// As its shard's family: every rank quantizes its own heads (the
    /// journal's new caches carry the quantization).
    fn reads_quantized_kv(&self) -> bool {
        self.inner.reads_quantized_kv()
    }
}
