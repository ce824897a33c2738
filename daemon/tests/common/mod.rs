//! Paths shared by the daemon's integration tests.
#![allow(dead_code)] // each test binary uses its own subset

use std::path::PathBuf;

/// The workspace root.
pub fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// A path under the test fixtures; a missing fixture fails with how to get it.
pub fn fixture(rel: &str) -> PathBuf {
    let root = std::env::var_os("MLXBC_TEST_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join("target/test-fixtures"));
    let p = root.join(rel);
    assert!(p.exists(), "missing test fixture {} — run scripts/test-fixtures (or scripts/test) first", p.display());
    p
}

/// A committed reference output (tests/fixtures/reference).
pub fn reference_path(name: &str) -> PathBuf {
    workspace().join("tests/fixtures/reference").join(name)
}

/// A committed JSON reference output.
pub fn reference_json(name: &str) -> serde_json::Value {
    let p = reference_path(name);
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("reading {}: {e}", p.display()));
    serde_json::from_str(&text).unwrap()
}

/// sha256 of a file, hex.
pub fn sha256_hex(path: &std::path::Path) -> String {
    use sha2::Digest;
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    sha2::Sha256::digest(&bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// max |ours - want| / max |want|, the tolerance measure of the numerics tests.
pub fn relative_error(ours: &mlx_rs::Array, want: &mlx_rs::Array) -> f32 {
    assert_eq!(ours.shape(), want.shape());
    let diff = ours.subtract(want).unwrap().abs().unwrap().max(None).unwrap().item_cast::<f32>();
    diff / want.abs().unwrap().max(None).unwrap().item_cast::<f32>()
}

/// Loads fixture `mlx/{family}` in float32, after checking it is the one
/// `golden` was made from (its `weights_sha256`).
pub fn load_checked(family: &str, golden: &serde_json::Value) -> mlxbc_daemon::model::Model {
    let dir = fixture(&format!("mlx/{family}"));
    assert_eq!(
        sha256_hex(&dir.join("model.safetensors")),
        golden[family]["weights_sha256"].as_str().unwrap(),
        "{family}: not the fixture the reference was made from; rebuild with scripts/test-fixtures"
    );
    mlxbc_daemon::families::load(&dir, mlxbc_daemon::model::weights::WeightForm::DenseF32, None).unwrap()
}
