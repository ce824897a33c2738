//! Cache keys: everything that changes a tower's output.

use sha2::{Digest, Sha256};

/// Bumped when the key or value layout changes; older entries become misses.
pub const SCHEMA_VERSION: u16 = 1;

/// What kind of media was encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Modality {
    Image = 1,
    /// Audio: an audio tower's output for one window of a recording (the
    /// window named in the preprocessing part), or a recording's length.
    Audio = 2,
    /// Video: a vision tower's output for one temporal group of a clip's
    /// sampled frames (the group named in the preprocessing part), or the
    /// clip's group times.
    Video = 3,
    /// Text: a sentence embedder's vector for one input (the content hash
    /// is the text's; the preprocessing part, the embedder's settings).
    Text = 4,
}

impl Modality {
    fn from_u8(b: u8) -> Option<Self> {
        match b {
            1 => Some(Modality::Image),
            2 => Some(Modality::Audio),
            3 => Some(Modality::Video),
            4 => Some(Modality::Text),
            _ => None,
        }
    }
}

/// The sha256 of some bytes.
pub fn content_hash(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

/// The identity of one stored feature tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FeatureKey {
    pub modality: Modality,
    /// [`crate::TowerFingerprint`] of the tower that made the features.
    pub tower: [u8; 32],
    /// Hash of the preprocessing parameters (size, mean, std, patching...).
    pub preprocess: [u8; 32],
    /// sha256 of the media file's bytes.
    pub content: [u8; 32],
}

impl FeatureKey {
    /// Serialized key: schema version first, so a schema bump misses cleanly.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(2 + 1 + 96);
        out.extend_from_slice(&SCHEMA_VERSION.to_be_bytes());
        out.push(self.modality as u8);
        out.extend_from_slice(&self.tower);
        out.extend_from_slice(&self.preprocess);
        out.extend_from_slice(&self.content);
        out
    }

    /// Parses a serialized key of the current schema.
    pub fn from_bytes(b: &[u8]) -> Option<Self> {
        if b.len() != 99 || u16::from_be_bytes([b[0], b[1]]) != SCHEMA_VERSION {
            return None;
        }
        let modality = Modality::from_u8(b[2])?;
        let arr = |r: std::ops::Range<usize>| -> [u8; 32] { b[r].try_into().unwrap() };
        Some(Self { modality, tower: arr(3..35), preprocess: arr(35..67), content: arr(67..99) })
    }

    /// Hash of a preprocessing description (any stable text, e.g. JSON).
    pub fn preprocess_hash(description: &str) -> [u8; 32] {
        content_hash(description.as_bytes())
    }

    /// Short hex of the content hash, for listings and logs.
    pub fn short(&self) -> String {
        hex(&self.content[..8])
    }
}

/// Lower-case hex.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_every_part_matters() {
        let k = FeatureKey { modality: Modality::Image, tower: [1; 32], preprocess: [2; 32], content: [3; 32] };
        assert_eq!(FeatureKey::from_bytes(&k.to_bytes()), Some(k));
        let audio = FeatureKey { modality: Modality::Audio, ..k };
        assert_eq!(FeatureKey::from_bytes(&audio.to_bytes()), Some(audio));
        assert_ne!(audio.to_bytes(), k.to_bytes());
        let mut other = k;
        other.tower[0] = 9;
        assert_ne!(other.to_bytes(), k.to_bytes());
        let mut old = k.to_bytes();
        old[1] ^= 0xff;
        assert_eq!(FeatureKey::from_bytes(&old), None, "another schema version is not this schema's key");
    }
}
