//! What rank 0 sends the other ranks, through the group itself: per call
//! of a sharded model, the cache operations since the last call and the
//! call (which model, which cache, which rows and positions), each a
//! [`Op`]; and what the ranks answer when an answer is due ([`Reply`]).

use crate::model::kv_cache::CacheOp;
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

/// One thing every rank does, in the order rank 0 sends them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Op {
    /// A new group: every rank answers whether it runs the same daemon.
    Hello { version: String },
    /// Load `name` from this rank's own store into `slot`, unless its
    /// weights' fingerprint differs from rank 0's; every rank answers.
    Load { slot: u32, name: String, fingerprint: String },
    /// Forget the model in `slot`.
    Unload { slot: u32 },
    /// Replay rank 0's cache journal.
    Caches { slot: u32, ops: Vec<CacheOp> },
    /// Look up token ids `[shape]` (the embedding may be split by vocabulary).
    Embed { slot: u32, shape: Vec<i32>, ids: Vec<i32> },
    /// Rank 0's embeddings of `shape`/`dtype` follow as a broadcast (then
    /// the deepstack tables `media` names); run them through the layers at
    /// cache `cache`'s next positions with the per-position `media` inputs.
    Forward {
        slot: u32,
        cache: u64,
        shape: Vec<i32>,
        dtype: String,
        #[serde(default)]
        media: MediaPlan,
    },
    /// The logits of the last forward pass's last positions.
    Logits { slot: u32 },
    /// The logits of every position of the last forward pass (a verify
    /// pass of drafted tokens).
    LogitsAll { slot: u32 },
    /// Make cache `cache` of the prefix `keys` (the prompt cache's encoding)
    /// names, `positions` long, from this rank's own prompt cache; every
    /// rank answers whether it holds all of it.
    Restore { slot: u32, cache: u64, keys: Vec<u8>, positions: u32 },
    /// Every rank answers with its memory and host (for `mlxbc status`).
    Report,
}

/// A forward pass's per-position media inputs (the engine's
/// `MediaPositions`), cut to what the call's positions read: image blocks
/// only for a prefill chunk (a one-position step never reads them), the
/// prompt's rope positions up to the chunk's end, deepstack rows likewise.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct MediaPlan {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_blocks: Option<Vec<i32>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mrope: Option<(Vec<[i64; 3]>, i64)>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deepstack: Option<DeepstackPlan>,
}

/// Deepstack's row per position, and its per-layer tables' shapes and
/// dtypes (the tables follow the embeddings as broadcasts, in order).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeepstackPlan {
    pub row_of: Vec<i32>,
    pub tables: Vec<(Vec<i32>, String)>,
}

/// A rank's answer to [`Op::Hello`], [`Op::Load`] or [`Op::Report`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Reply {
    Ok {
        rss_bytes: u64,
        host: String,
        /// Mean milliseconds a forward pass takes on the rank (once it ran one).
        #[serde(default)]
        step_ms: Option<f64>,
    },
    Refused(String),
}

/// Bytes each rank's reply takes in the gather (longer text is cut).
pub const REPLY_BYTES: usize = 768;

/// The wire form of a message (JSON: small, and readable in a log).
pub fn encode(ops: &[Op]) -> Vec<u8> {
    serde_json::to_vec(ops).expect("plan ops serialize")
}

pub fn decode(bytes: &[u8]) -> Result<Vec<Op>> {
    serde_json::from_slice(bytes).context("a plan message from rank 0 that is not one")
}

/// A reply in its fixed-size slot (zero-padded JSON).
pub fn reply_bytes(reply: &Reply) -> [u8; REPLY_BYTES] {
    let mut reply = reply.clone();
    let mut text = serde_json::to_vec(&reply).expect("replies serialize");
    if text.len() > REPLY_BYTES {
        if let Reply::Refused(why) = &mut reply {
            why.truncate(REPLY_BYTES / 2);
        }
        text = serde_json::to_vec(&reply).expect("replies serialize");
    }
    let mut out = [0u8; REPLY_BYTES];
    out[..text.len().min(REPLY_BYTES)].copy_from_slice(&text[..text.len().min(REPLY_BYTES)]);
    out
}

pub fn parse_reply(slot: &[u8]) -> Result<Reply> {
    let end = slot.iter().position(|&b| b == 0).unwrap_or(slot.len());
    if end == 0 {
        bail!("an empty reply");
    }
    serde_json::from_slice(&slot[..end]).context("a reply that is not one")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_and_replies_round_trip_and_long_refusals_are_cut() {
        let ops = vec![
            Op::Caches {
                slot: 1,
                ops: vec![CacheOp::New { id: 3, paddings: vec![0, 2], quantization: None }, CacheOp::Drop { id: 1 }],
            },
            Op::Embed { slot: 1, shape: vec![1, 2], ids: vec![5, 6] },
        ];
        assert_eq!(decode(&encode(&ops)).unwrap(), ops);
        let long = Reply::Refused("x".repeat(5000));
        let back = parse_reply(&reply_bytes(&long)).unwrap();
        assert!(matches!(back, Reply::Refused(s) if s.len() == REPLY_BYTES / 2));
        assert!(parse_reply(&[0u8; 8]).is_err());
    }
}
