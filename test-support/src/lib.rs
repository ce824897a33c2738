//! What the daemon's numerics tests (`daemon/tests/numerics/`) and the
//! end-to-end suite (`tests/tests/e2e/`) share: where the workspace, the
//! fixtures and the committed reference outputs are, a file's checksum, and
//! the tolerance measure. A missing fixture fails with how to get it, never
//! skips.

use std::path::{Path, PathBuf};

/// The workspace root.
pub fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().expect("test-support sits in the workspace").to_path_buf()
}

/// A path under the test fixtures (`MLXBC_TEST_FIXTURES`, else
/// `target/test-fixtures`); a missing fixture fails with how to get it.
pub fn fixture(rel: &str) -> PathBuf {
    let root = std::env::var_os("MLXBC_TEST_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join("target/test-fixtures"));
    let p = root.join(rel);
    assert!(p.exists(), "missing test fixture {} — run scripts/test-fixtures (or scripts/test) first", p.display());
    p
}

/// A committed reference output (`tests/fixtures/reference`, made by the
/// generators in `scripts/goldens/`).
pub fn reference_path(name: &str) -> PathBuf {
    workspace().join("tests/fixtures/reference").join(name)
}

/// A committed JSON reference output.
pub fn reference_json(name: &str) -> serde_json::Value {
    let p = reference_path(name);
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("reading {}: {e}", p.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// sha256 of a file, hex.
pub fn sha256_hex(path: &Path) -> String {
    use sha2::Digest;
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    sha2::Sha256::digest(&bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// Fails unless `dir`'s `model.safetensors` is the file a golden was made
/// from (its `weights_sha256`).
pub fn check_weights(dir: &Path, want_sha256: &str) {
    assert_eq!(
        sha256_hex(&dir.join("model.safetensors")),
        want_sha256,
        "fixture {} is not the one the reference was made from; rebuild it with scripts/test-fixtures",
        dir.display()
    );
}

/// max |ours - want| / max |want|, the tolerance measure of the numerics tests.
pub fn relative_error(ours: &mlx_rs::Array, want: &mlx_rs::Array) -> f32 {
    assert_eq!(ours.shape(), want.shape());
    let diff = ours.subtract(want).unwrap().abs().unwrap().max(None).unwrap().item_cast::<f32>();
    diff / want.abs().unwrap().max(None).unwrap().item_cast::<f32>()
}
