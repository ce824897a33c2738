//! Framing and encoding, in one place so that replacing bincode (formally
//! unmaintained, RUSTSEC-2025-0141) touches one file.
//!
//! A frame is a 4-byte big-endian length and a bincode 2 payload (serde, the
//! standard config). Frames above [`MAX_FRAME_BYTES`] are refused before any
//! allocation, by tokio-util's `LengthDelimitedCodec`.
//!
//! Inside a frame, every length the peer declares (a string's, a vector's)
//! is bounded too: bincode decodes under a byte limit of the smallest tier
//! that holds what the payload may claim ([`decode_limit`]), and refuses a declared length
//! above it *before* allocating. Without the limit a 15-byte frame declaring
//! a 2^62-byte string made the decoder allocate it and abort the daemon.

use bytes::{Bytes, BytesMut};
use serde::{de::DeserializeOwned, Serialize};
use std::marker::PhantomData;
use tokio_util::codec::{Decoder, Encoder, LengthDelimitedCodec};

/// Largest frame either side accepts: room for a large image later, small
/// enough that a bad length cannot make a peer allocate gigabytes.
pub const MAX_FRAME_BYTES: usize = 64 * 1024 * 1024;

/// Why a frame could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("socket I/O: {0}")]
    Io(#[from] std::io::Error),
    #[error("frame of {len} bytes is over the {max}-byte limit")]
    TooLarge { len: usize, max: usize },
    #[error("malformed frame: {0}")]
    Malformed(String),
}

impl FrameError {
    /// True when the peer simply went away.
    pub fn is_disconnect(&self) -> bool {
        match self {
            FrameError::Io(e) => matches!(
                e.kind(),
                std::io::ErrorKind::BrokenPipe
                    | std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::UnexpectedEof
            ),
            _ => false,
        }
    }
}

fn config() -> bincode::config::Configuration {
    bincode::config::standard()
}

/// How many bytes a decoded value may claim per payload byte. bincode's
/// limit counts what containers claim in memory (`len × size_of` of their
/// elements), not the bytes read: a token id is a 1–3 byte varint but a
/// 4-byte `u32`, an empty string one byte but a 24-byte `String`. A valid
/// payload claims at most this many times its own length.
pub const DECODE_EXPANSION: usize = 32;

/// Decode limits, each 4 times the last, up to 1 GiB.
const TIERS: [usize; 10] =
    [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20, 1 << 30];

/// The byte limit a payload of `len` bytes is decoded under: the smallest
/// tier that holds [`DECODE_EXPANSION`] times its length. A valid payload
/// never claims more, so the limit only ever refuses lies; and what a lying
/// frame can make the decoder allocate is at most 4 × 32 = 128 times its own
/// size (4 KiB for a tiny one), never over 1 GiB.
pub fn decode_limit(len: usize) -> usize {
    let need = len.saturating_mul(DECODE_EXPANSION);
    TIERS.into_iter().find(|&t| need <= t).unwrap_or(TIERS[TIERS.len() - 1])
}

fn decode_with<T: DeserializeOwned, C: bincode::config::Config>(bytes: &[u8], c: C) -> Result<T, FrameError> {
    let (value, used) =
        bincode::serde::decode_from_slice(bytes, c).map_err(|e| FrameError::Malformed(e.to_string()))?;
    if used != bytes.len() {
        return Err(FrameError::Malformed(format!("{} trailing bytes", bytes.len() - used)));
    }
    Ok(value)
}

/// Encodes a value to a payload (no length prefix).
pub fn to_payload<T: Serialize>(value: &T) -> Result<Vec<u8>, FrameError> {
    bincode::serde::encode_to_vec(value, config()).map_err(|e| FrameError::Malformed(e.to_string()))
}

/// Decodes a payload; trailing bytes are an error, and so is any declared
/// length beyond [`decode_limit`] of the payload's size (refused before
/// anything is allocated for it).
pub fn from_payload<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, FrameError> {
    if bytes.len() > MAX_FRAME_BYTES {
        return Err(FrameError::TooLarge { len: bytes.len(), max: MAX_FRAME_BYTES });
    }
    match decode_limit(bytes.len()) {
        l if l == TIERS[0] => decode_with(bytes, config().with_limit::<{ TIERS[0] }>()),
        l if l == TIERS[1] => decode_with(bytes, config().with_limit::<{ TIERS[1] }>()),
        l if l == TIERS[2] => decode_with(bytes, config().with_limit::<{ TIERS[2] }>()),
        l if l == TIERS[3] => decode_with(bytes, config().with_limit::<{ TIERS[3] }>()),
        l if l == TIERS[4] => decode_with(bytes, config().with_limit::<{ TIERS[4] }>()),
        l if l == TIERS[5] => decode_with(bytes, config().with_limit::<{ TIERS[5] }>()),
        l if l == TIERS[6] => decode_with(bytes, config().with_limit::<{ TIERS[6] }>()),
        l if l == TIERS[7] => decode_with(bytes, config().with_limit::<{ TIERS[7] }>()),
        l if l == TIERS[8] => decode_with(bytes, config().with_limit::<{ TIERS[8] }>()),
        _ => decode_with(bytes, config().with_limit::<{ TIERS[9] }>()),
    }
}

/// A tokio-util codec that reads `In` frames and writes `Out` frames.
pub struct WireCodec<In, Out> {
    frames: LengthDelimitedCodec,
    _types: PhantomData<fn(Out) -> In>,
}

impl<In, Out> Default for WireCodec<In, Out> {
    fn default() -> Self {
        Self {
            frames: LengthDelimitedCodec::builder().max_frame_length(MAX_FRAME_BYTES).new_codec(),
            _types: PhantomData,
        }
    }
}

impl<In, Out> WireCodec<In, Out> {
    /// Lowers (or restores) the largest frame accepted, at most
    /// [`MAX_FRAME_BYTES`]: the daemon reads a Hello under a small cap, so a
    /// connection that has not said who it is cannot make it buffer 64 MiB.
    pub fn set_max_frame_bytes(&mut self, max: usize) {
        self.frames.set_max_frame_length(max.min(MAX_FRAME_BYTES));
    }
}

impl<In: DeserializeOwned, Out> Decoder for WireCodec<In, Out> {
    type Item = In;
    type Error = FrameError;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<In>, FrameError> {
        match self.frames.decode(src) {
            Ok(Some(frame)) => from_payload(&frame).map(Some),
            Ok(None) => Ok(None),
            Err(e) if e.kind() == std::io::ErrorKind::InvalidData => {
                Err(FrameError::TooLarge { len: peek_len(src), max: self.frames.max_frame_length() })
            }
            Err(e) => Err(e.into()),
        }
    }
}

fn peek_len(src: &BytesMut) -> usize {
    src.get(..4).map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize).unwrap_or(0)
}

impl<In, Out: Serialize> Encoder<Out> for WireCodec<In, Out> {
    type Error = FrameError;

    fn encode(&mut self, item: Out, dst: &mut BytesMut) -> Result<(), FrameError> {
        let payload = to_payload(&item)?;
        if payload.len() > MAX_FRAME_BYTES {
            return Err(FrameError::TooLarge { len: payload.len(), max: MAX_FRAME_BYTES });
        }
        self.frames.encode(Bytes::from(payload), dst).map_err(FrameError::Io)
    }
}

/// The client side: writes requests, reads responses.
pub type ClientCodec = WireCodec<crate::Response, crate::Request>;
/// The daemon side: reads requests, writes responses.
pub type DaemonCodec = WireCodec<crate::Request, crate::Response>;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{GenerateRequest, Request};

    #[test]
    fn round_trip() {
        let mut codec = ClientCodec::default();
        let mut buf = BytesMut::new();
        let req = Request::Generate(GenerateRequest::ask("hi"));
        codec.encode(req.clone(), &mut buf).unwrap();
        let mut daemon = DaemonCodec::default();
        assert_eq!(daemon.decode(&mut buf).unwrap(), Some(req));
        assert!(buf.is_empty());
    }

    #[test]
    fn oversized_length_is_refused_without_allocating() {
        let mut daemon = DaemonCodec::default();
        let mut buf = BytesMut::from(&u32::MAX.to_be_bytes()[..]);
        assert!(matches!(daemon.decode(&mut buf), Err(FrameError::TooLarge { .. })));
    }

    #[test]
    fn garbage_payload_is_malformed() {
        let mut daemon = DaemonCodec::default();
        let mut buf = BytesMut::new();
        buf.extend_from_slice(&3u32.to_be_bytes());
        buf.extend_from_slice(&[0xff, 0xff, 0xff]);
        assert!(matches!(daemon.decode(&mut buf), Err(FrameError::Malformed(_))));
    }
}
