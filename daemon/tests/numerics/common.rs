//! Helpers of the daemon's numerics tests: the shared ones
//! (`mlxbc_test_support`), and loading a fixture checked against its golden.

pub use mlxbc_test_support::*;

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
