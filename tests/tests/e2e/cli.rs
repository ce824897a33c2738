//! The `mlxbc` command line, as a shell user runs it.

use crate::helper::*;
use std::io::Write;
use std::process::Stdio;

#[test]
fn ask_starts_the_daemon_on_first_use_and_streams_the_answer() {
    let home = tempfile::Builder::new().prefix("mlxbc-cli").tempdir_in("/tmp").unwrap();
    std::fs::create_dir(home.path().join("models")).unwrap();
    std::os::unix::fs::symlink(fixture(&format!("models/{SMOLLM2}")), home.path().join("models").join(SMOLLM2))
        .unwrap();
    let run = |args: &[&str]| {
        std::process::Command::new(binary("mlxbc"))
            .env("MLXBC_HOME", home.path())
            .env("MLXBC_DAEMON", binary("mlxbcd"))
            .env_remove("MLXBC_SOCKET")
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    };
    let out = run(&["ask", "-v", "What is the capital of France?"]);
    let stop = run(&["stop"]);
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("Paris"));
    assert!(String::from_utf8_lossy(&out.stderr).contains("decode"), "-v prints statistics to stderr");
    assert!(stop.status.success());
    assert!(home.path().join("logs/mlxbcd.log").exists(), "the spawned daemon logs to the data dir");
}

#[test]
fn json_output_is_one_object_per_event_ending_with_done() {
    let d = Daemon::start();
    let out = d
        .cli()
        .args(["ask", "--json", "-n", "8", "What is the capital of France?"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(out.status.success());
    let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("each line is JSON"))
        .collect();
    assert_eq!(lines.first().unwrap()["event"], "start");
    assert!(lines.iter().any(|l| l["event"] == "token"));
    let done = lines.last().unwrap();
    assert_eq!(done["event"], "done");
    assert!(done["stats"]["generated_tokens"].as_u64().unwrap() > 0);
}

#[test]
fn piped_stdin_is_appended_to_the_prompt() {
    let d = Daemon::start();
    let mut child = d
        .cli()
        .args(["ask", "--json", "-n", "1", "Summarize:"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all("a long text about cats ".repeat(20).as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    let first: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&out.stdout).lines().next().unwrap()).unwrap();
    assert!(first["prompt_tokens"].as_u64().unwrap() > 100, "stdin made the prompt longer: {first}");
}

#[test]
fn errors_have_documented_exit_codes() {
    let d = Daemon::start();
    let out = d.cli().args(["ask", "-m", "nope", "hi"]).stdin(Stdio::null()).output().unwrap();
    assert_eq!(out.status.code(), Some(4), "refused request");
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown model \"nope\""));
    let out = d
        .cli()
        .args(["status", "--socket", "/tmp/definitely-not-here/x.sock"])
        .env("MLXBC_DAEMON", "/bin/false")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3), "unreachable daemon: {}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn a_closed_stdout_exits_zero() {
    let d = Daemon::start();
    // `| head -c 1`: the reader goes away after the first byte.
    let mut child = d
        .cli()
        .args(["ask", "-n", "64", "Write a long poem about the sea."])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut byte = [0u8; 1];
    std::io::Read::read_exact(&mut stdout, &mut byte).unwrap();
    drop(stdout);
    assert_eq!(child.wait().unwrap().code(), Some(0));
}

#[test]
fn models_ps_and_status_show_the_store() {
    let d = Daemon::start();
    let models = d.cli().arg("models").output().unwrap();
    assert!(String::from_utf8_lossy(&models.stdout).contains(SMOLLM2));
    assert!(d.cli().args(["load", "smollm2"]).output().unwrap().status.success());
    let ps = String::from_utf8_lossy(&d.cli().arg("ps").output().unwrap().stdout).to_string();
    assert!(ps.contains(SMOLLM2) && ps.contains("llama"), "{ps}");
    let status = String::from_utf8_lossy(&d.cli().arg("status").output().unwrap().stdout).to_string();
    assert!(status.contains("BLAS"), "{status}");
}
