//! Faults of the machine, not of the client: a full disk, a read-only data
//! directory, a model file truncated or replaced while it is loaded. The
//! daemon says what was lost, loses nothing it claims to have kept, and
//! keeps serving. Filesystems are small tmpfs mounts the test makes (root,
//! as CI runs); a failed mount is a failure that says so.

use crate::helper::*;
use mlxbc_client::{ClientError, ErrorKind};
use std::path::Path;

fn fill(dir: &Path) {
    let mut f = std::fs::File::create(dir.join("filler")).unwrap();
    let block = vec![0u8; 4096];
    use std::io::Write;
    while f.write_all(&block).is_ok() {}
    let _ = f.sync_all();
}

/// On a full disk a session turn is still answered, but `Done` says it was
/// not saved, `mlxbc` prints that and exits 5, and the session keeps only
/// the turns that were saved.
#[test]
fn a_full_disk_is_reported_and_loses_no_saved_turn() {
    let d = Daemon::start();
    let sessions = d.home.path().join("sessions");
    let _m = Mount::tmpfs(&sessions, "size=64k,mode=0700");
    let ask = |q: &str| d.cli().args(["ask", "-n", "8", "--session", "full", q]).output().unwrap();
    let first = ask("What is the capital of France?");
    assert!(first.status.success(), "{}", String::from_utf8_lossy(&first.stderr));
    fill(&sessions);
    let second = ask("And of Italy?");
    let stderr = String::from_utf8_lossy(&second.stderr);
    assert_eq!(second.status.code(), Some(5), "{stderr}");
    assert!(stderr.contains("not saved") && stderr.contains("full"), "{stderr}");
    assert!(!second.stdout.is_empty(), "the answer itself was printed");
    let _ = std::fs::remove_file(sessions.join("filler"));
    let shown = d.cli().args(["sessions", "show", "full"]).output().unwrap();
    let text = String::from_utf8_lossy(&shown.stdout);
    assert!(text.contains("capital of France") && !text.contains("Italy"), "only the saved turn: {text}");
    assert!(ask("One more?").status.success(), "served again once there is room");
}

/// A read-only feature store and sessions directory: the daemon starts,
/// answers, and reports the session that cannot be written.
#[test]
fn a_read_only_data_dir_still_serves() {
    let opts = DaemonOptions::default();
    let mut d = Daemon::prepare(&opts);
    let _cache = Mount::tmpfs(&d.home.path().join("cache"), "size=1m,ro");
    let _sessions = Mount::tmpfs(&d.home.path().join("sessions"), "size=1m,ro");
    d.spawn(&opts.args);
    let plain = d.cli().args(["ask", "-n", "8", "What is the capital of France?"]).output().unwrap();
    assert!(plain.status.success(), "{}", String::from_utf8_lossy(&plain.stderr));
    assert!(String::from_utf8_lossy(&plain.stdout).contains("Paris"));
    let saved = d.cli().args(["ask", "-n", "4", "--session", "ro", "hi"]).output().unwrap();
    assert_eq!(saved.status.code(), Some(5), "{}", String::from_utf8_lossy(&saved.stderr));
    assert!(d.log_text().contains("encoded every time"), "the store's absence is logged:\n{}", d.log_text());
}

/// A loaded model's file truncated, then replaced by garbage: the resident
/// copy keeps answering; loading it again is a clear `ModelLoad` error.
#[tokio::test(flavor = "multi_thread")]
async fn a_model_file_truncated_or_replaced_while_loaded() {
    let dir = tempfile::tempdir().unwrap();
    let copy = dir.path().join("victim.gguf");
    std::fs::copy(fixture(&format!("models/{SMOLLM2}")), &copy).unwrap();
    let d = Daemon::start_with(DaemonOptions { models: vec![("victim.gguf", copy.clone())], args: vec![] });
    let q = || greedy(Some("victim.gguf"), "What is the capital of France?", 16);
    let (before, _) = ask(&d.socket, q()).await.unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(&copy).unwrap();
    f.set_len(f.metadata().unwrap().len() / 3).unwrap();
    drop(f);
    let (after, _) = ask(&d.socket, q()).await.expect("the resident model answers");
    assert_eq!(before, after);
    let mut c = d.client().await;
    c.unload("victim.gguf").await.unwrap();
    match ask(&d.socket, q()).await {
        Err(ClientError::Daemon { kind: ErrorKind::ModelLoad, message }) => {
            assert!(message.contains("victim.gguf"), "{message}")
        }
        other => panic!("expected ModelLoad, got {other:?}"),
    }
    std::fs::write(&copy, b"GGUF\x03\x00\x00\x00 this is not a model").unwrap();
    assert!(matches!(ask(&d.socket, q()).await, Err(ClientError::Daemon { kind: ErrorKind::ModelLoad, .. })));
    assert!(c.status().await.is_ok(), "still serving");
}
