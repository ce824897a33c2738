//! Stored values: a fixed header (magic, format version, dtype, shape,
//! payload length, CRC-32 of the payload) followed by the raw feature bytes.

/// Identifies our values and their layout version.
const MAGIC: &[u8; 4] = b"MXF1";
const FORMAT_VERSION: u16 = 1;

/// Element type of stored features.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FeatureDtype {
    F32 = 1,
    F16 = 2,
    BF16 = 3,
    /// 16-bit words: a quantized KV block (packed values, scales and biases
    /// side by side; the daemon's prompt cache).
    U16 = 4,
}

impl FeatureDtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            FeatureDtype::F32 => 4,
            _ => 2,
        }
    }

    fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            1 => FeatureDtype::F32,
            2 => FeatureDtype::F16,
            3 => FeatureDtype::BF16,
            4 => FeatureDtype::U16,
            _ => return None,
        })
    }
}

/// A feature tensor as bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct Features {
    pub dtype: FeatureDtype,
    pub shape: Vec<u32>,
    pub data: Vec<u8>,
}

impl Features {
    /// Bytes the payload takes.
    pub fn nbytes(&self) -> usize {
        self.data.len()
    }

    /// f32 features from a slice.
    pub fn from_f32(shape: Vec<u32>, values: &[f32]) -> Self {
        Self { dtype: FeatureDtype::F32, shape, data: values.iter().flat_map(|v| v.to_le_bytes()).collect() }
    }

    /// The values as f32 (empty unless the dtype is f32).
    pub fn to_f32(&self) -> Vec<f32> {
        if self.dtype != FeatureDtype::F32 {
            return vec![];
        }
        self.data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
    }

    /// Serializes with header and checksum.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(32 + self.data.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        out.push(self.dtype as u8);
        out.push(self.shape.len() as u8);
        for d in &self.shape {
            out.extend_from_slice(&d.to_le_bytes());
        }
        out.extend_from_slice(&(self.data.len() as u64).to_le_bytes());
        out.extend_from_slice(&crc32fast::hash(&self.data).to_le_bytes());
        out.extend_from_slice(&self.data);
        out
    }

    /// Parses and verifies a stored value; `None` for anything not exactly right.
    pub fn decode(b: &[u8]) -> Option<Self> {
        let mut r = Reader(b);
        if r.take(4)? != MAGIC || u16::from_le_bytes(r.take(2)?.try_into().ok()?) != FORMAT_VERSION {
            return None;
        }
        let dtype = FeatureDtype::from_u8(r.take(1)?[0])?;
        let ndim = r.take(1)?[0] as usize;
        let shape: Vec<u32> =
            (0..ndim).map(|_| Some(u32::from_le_bytes(r.take(4)?.try_into().ok()?))).collect::<Option<_>>()?;
        let len = u64::from_le_bytes(r.take(8)?.try_into().ok()?) as usize;
        let crc = u32::from_le_bytes(r.take(4)?.try_into().ok()?);
        let data = r.take(len)?;
        let elements: usize = shape.iter().map(|&d| d as usize).product();
        if !r.0.is_empty() || elements * dtype.size() != len || crc32fast::hash(data) != crc {
            return None;
        }
        Some(Self { dtype, shape, data: data.to_vec() })
    }
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_any_damage_is_rejected() {
        let f = Features::from_f32(vec![2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        let enc = f.encode();
        assert_eq!(Features::decode(&enc), Some(f));
        for i in 0..enc.len() {
            let mut bad = enc.clone();
            bad[i] ^= 0x01;
            assert_eq!(Features::decode(&bad), None, "flipped bit in byte {i} went unnoticed");
        }
        for cut in 0..enc.len() {
            assert_eq!(Features::decode(&enc[..cut]), None, "truncation at {cut} went unnoticed");
        }
    }
}
