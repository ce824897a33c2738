//! Tower fingerprints: a hash over a vision tower's configuration and its
//! weights (tensor names, dtypes, shapes and bytes), read from safetensors.
//! Hashing gigabytes at every daemon start would be slow, so a fingerprint is
//! remembered per weight-file identity (device, inode, size, mtime).

use crate::key::hex;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// What identifies a file's content cheaply: if none of these changed, the
/// bytes are taken to be the same.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct WeightFileIdentity {
    pub dev: u64,
    pub ino: u64,
    pub size: u64,
    pub mtime_ns: i128,
}

impl WeightFileIdentity {
    /// Reads a file's identity.
    pub fn of(path: &Path) -> std::io::Result<Self> {
        let m = std::fs::metadata(path)?;
        Ok(Self {
            dev: m.dev(),
            ino: m.ino(),
            size: m.size(),
            mtime_ns: m.mtime() as i128 * 1_000_000_000 + m.mtime_nsec() as i128,
        })
    }

    fn as_text(&self) -> String {
        format!("{}:{}:{}:{}", self.dev, self.ino, self.size, self.mtime_ns)
    }
}

/// A vision tower's fingerprint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TowerFingerprint(pub [u8; 32]);

impl TowerFingerprint {
    /// Hashes `config` and every tensor whose name starts with one of
    /// `prefixes` in the safetensors `files`, in name order. `memo` (a sled
    /// tree) remembers results per file identity.
    pub fn compute(
        files: &[&Path],
        prefixes: &[&str],
        config: &str,
        memo: Option<&sled::Tree>,
    ) -> std::io::Result<Self> {
        let mut idents = Vec::new();
        for f in files {
            idents.push(WeightFileIdentity::of(f)?.as_text());
        }
        let memo_key =
            format!("{}|{}|{}", idents.join(","), prefixes.join(","), hex(&crate::content_hash(config.as_bytes())));
        remembered(memo, &memo_key, || Self::hash_tensors(files, prefixes, config))
    }

    fn hash_tensors(files: &[&Path], prefixes: &[&str], config: &str) -> std::io::Result<Self> {
        let mut hasher = Sha256::new();
        hasher.update(b"mlxbc-tower-v1\0");
        hasher.update(config.as_bytes());
        let mut tensors: BTreeMap<String, (usize, serde_json::Value)> = BTreeMap::new();
        for (i, f) in files.iter().enumerate() {
            for (name, info) in safetensors_header(f)? {
                if prefixes.iter().any(|p| name.starts_with(p)) {
                    tensors.insert(name, (i, info));
                }
            }
        }
        let mut buf = Vec::new();
        for (name, (file, info)) in &tensors {
            hasher.update(name.as_bytes());
            hasher.update(info["dtype"].to_string().as_bytes());
            hasher.update(info["shape"].to_string().as_bytes());
            let offs = info["data_offsets"].as_array().ok_or_else(|| bad(files[*file], "data_offsets"))?;
            let (start, end) = (offs[0].as_u64().unwrap_or(0), offs[1].as_u64().unwrap_or(0));
            let mut fh = std::fs::File::open(files[*file])?;
            let header_len = header_len(&mut fh)?;
            fh.seek(SeekFrom::Start(8 + header_len + start))?;
            buf.resize((end - start) as usize, 0);
            fh.read_exact(&mut buf)?;
            hasher.update(&buf);
        }
        Ok(Self(hasher.finalize().into()))
    }

    /// Hashes `config` and every byte of one weight file (a GGUF file, whose
    /// metadata and tensors all describe the model), remembered in `memo`
    /// per file identity as [`Self::compute`] does.
    pub fn of_file(file: &Path, config: &str, memo: Option<&sled::Tree>) -> std::io::Result<Self> {
        let memo_key = format!(
            "{}|whole|{}",
            WeightFileIdentity::of(file)?.as_text(),
            hex(&crate::content_hash(config.as_bytes()))
        );
        remembered(memo, &memo_key, || {
            let mut hasher = Sha256::new();
            hasher.update(b"mlxbc-file-v1\0");
            hasher.update(config.as_bytes());
            hasher.update(b"\0");
            std::io::copy(&mut std::fs::File::open(file)?, &mut hasher)?;
            Ok(Self(hasher.finalize().into()))
        })
    }

    /// Short hex for logs.
    pub fn short(&self) -> String {
        hex(&self.0[..6])
    }
}

/// The fingerprint `memo` holds under `key`, or `compute`'s, then kept there.
fn remembered(
    memo: Option<&sled::Tree>,
    key: &str,
    compute: impl FnOnce() -> std::io::Result<TowerFingerprint>,
) -> std::io::Result<TowerFingerprint> {
    if let Some(Ok(Some(v))) = memo.map(|m| m.get(key.as_bytes())) {
        if let Ok(arr) = <[u8; 32]>::try_from(v.as_ref()) {
            return Ok(TowerFingerprint(arr));
        }
    }
    let fp = compute()?;
    if let Some(m) = memo {
        let _ = m.insert(key.as_bytes(), &fp.0);
    }
    Ok(fp)
}

fn bad(path: &Path, what: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, format!("{}: bad safetensors header ({what})", path.display()))
}

fn header_len(f: &mut std::fs::File) -> std::io::Result<u64> {
    let mut len = [0u8; 8];
    f.seek(SeekFrom::Start(0))?;
    f.read_exact(&mut len)?;
    Ok(u64::from_le_bytes(len))
}

/// The tensor table of a safetensors file.
fn safetensors_header(path: &Path) -> std::io::Result<Vec<(String, serde_json::Value)>> {
    let mut f = std::fs::File::open(path)?;
    let len = header_len(&mut f)?;
    if len > 100 << 20 {
        return Err(bad(path, "header too large"));
    }
    let mut header = vec![0u8; len as usize];
    f.read_exact(&mut header)?;
    let table: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&header).map_err(|_| bad(path, "json"))?;
    Ok(table.into_iter().filter(|(k, _)| k != "__metadata__").collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_safetensors(path: &Path, tensors: &[(&str, &[u8])]) {
        let mut header = serde_json::Map::new();
        let mut data = Vec::new();
        for (name, bytes) in tensors {
            let start = data.len();
            data.extend_from_slice(bytes);
            header.insert(
                name.to_string(),
                serde_json::json!({"dtype": "U8", "shape": [bytes.len()], "data_offsets": [start, data.len()]}),
            );
        }
        let h = serde_json::Value::Object(header).to_string();
        let mut out = (h.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(h.as_bytes());
        out.extend_from_slice(&data);
        std::fs::write(path, out).unwrap();
    }

    #[test]
    fn only_tower_tensors_and_config_matter() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("model.safetensors");
        let fp = |tower: &[u8], lm: &[u8], cfg: &str| {
            write_safetensors(&p, &[("vision_tower.w", tower), ("language_model.w", lm)]);
            TowerFingerprint::compute(&[&p], &["vision_tower."], cfg, None).unwrap()
        };
        let base = fp(&[1, 2, 3], &[9, 9], "{}");
        assert_eq!(fp(&[1, 2, 3], &[8, 8], "{}"), base, "language-model bytes do not change the tower");
        assert_ne!(fp(&[1, 2, 4], &[9, 9], "{}"), base, "one tower byte changes it");
        assert_ne!(fp(&[1, 2, 3], &[9, 9], "{\"x\":1}"), base, "the config changes it");
    }

    #[test]
    fn remembered_per_file_identity() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("model.safetensors");
        write_safetensors(&p, &[("vision_tower.w", &[1, 2, 3])]);
        let db = sled::Config::new().temporary(true).open().unwrap();
        let memo = db.open_tree("fp").unwrap();
        let a = TowerFingerprint::compute(&[&p], &["vision_tower."], "", Some(&memo)).unwrap();
        assert_eq!(memo.len(), 1);
        assert_eq!(TowerFingerprint::compute(&[&p], &["vision_tower."], "", Some(&memo)).unwrap(), a);
        std::thread::sleep(std::time::Duration::from_millis(10));
        write_safetensors(&p, &[("vision_tower.w", &[1, 2, 4])]);
        assert_ne!(
            TowerFingerprint::compute(&[&p], &["vision_tower."], "", Some(&memo)).unwrap(),
            a,
            "a rewritten file is re-hashed"
        );
    }
}
