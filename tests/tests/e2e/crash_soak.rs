//! Crash soak: SIGKILL at random moments while the real feature store
//! (sled) and the real session store are being written
//! (`mlxbc-soak-writer`). After every kill, every stored feature equals a
//! fresh computation of it and the session holds only whole turns.
//! 200 kills here; `scripts/soak` runs 1,000 (`MLXBC_SOAK_KILLS`).

use crate::helper::*;
use mlxbc_shared::fuzz::Rng;
use std::io::BufRead;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn check(dir: &std::path::Path) -> (u64, u64) {
    let out = Command::new(binary("mlxbc-soak-writer")).arg("--check").arg(dir).output().unwrap();
    assert!(out.status.success(), "after a kill: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    let num = |k: &str| text.split_whitespace().find_map(|w| w.strip_prefix(k)?.parse().ok()).unwrap();
    (num("entries="), num("turns="))
}

#[test]
fn sigkill_during_store_and_session_writes_leaves_only_whole_correct_data() {
    let kills: u64 = std::env::var("MLXBC_SOAK_KILLS").ok().and_then(|s| s.parse().ok()).unwrap_or(200);
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng::new(0x50a6);
    let t = Instant::now();
    let (mut entries, mut turns) = (0, 0);
    for i in 0..kills {
        let mut child = Command::new(binary("mlxbc-soak-writer"))
            .arg(dir.path())
            .arg((i * 1_000_000).to_string())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "writing", "the writer started");
        std::thread::sleep(Duration::from_micros(rng.below(40_000)));
        child.kill().unwrap();
        child.wait().unwrap();
        let (e, n) = check(dir.path());
        assert!(n >= turns, "turns never go backwards ({turns} -> {n})");
        (entries, turns) = (e, n);
    }
    println!(
        "crash soak: {kills} kills in {:.0} s, 0 wrong results; {entries} feature entries and {turns} whole turns survive",
        t.elapsed().as_secs_f64()
    );
    assert!(entries > 0 && turns > kills / 2, "the writer got work done between kills");
}
