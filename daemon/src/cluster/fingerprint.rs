//! The identity of a model's weights across hosts: what every rank checks
//! against rank 0's before it loads its shard.

use sha2::{Digest, Sha256};
use std::path::Path;

/// A hash of the model's files as they are on any host: names, sizes and
/// 16 samples of 64 KiB from each (as the prompt cache's model root reads them) (no inode or mtime, which differ per
/// copy). Two copies of the same download agree; another quantization,
/// another checkpoint or a truncated file do not.
pub fn weights_fingerprint(path: &Path) -> std::io::Result<String> {
    let mut h = Sha256::new();
    h.update(b"mlxbc-shard-weights-v1\0");
    for f in crate::prompt_cache::weight_files(path)? {
        let size = std::fs::metadata(&f)?.len();
        h.update(f.file_name().map(|n| n.as_encoded_bytes()).unwrap_or_default());
        h.update(size.to_le_bytes());
        crate::prompt_cache::hash_samples(&mut h, &f, size)?;
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_agree_and_other_bytes_differ() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b, c) = (dir.path().join("a"), dir.path().join("b"), dir.path().join("c"));
        for d in [&a, &b, &c] {
            std::fs::create_dir(d).unwrap();
        }
        let data = vec![7u8; 1 << 20];
        std::fs::write(a.join("model.safetensors"), &data).unwrap();
        std::fs::write(b.join("model.safetensors"), &data).unwrap();
        let mut other = data.clone();
        other[1 << 19] = 8;
        std::fs::write(c.join("model.safetensors"), &other).unwrap();
        let f = |p: &Path| weights_fingerprint(p).unwrap();
        assert_eq!(f(&a), f(&b));
        assert_ne!(f(&a), f(&c));
    }
}
