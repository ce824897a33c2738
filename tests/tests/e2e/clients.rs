//! The client library's examples (async and blocking APIs) run against a
//! real daemon; `mlxbc chat` with a named session that outlives the daemon;
//! `mlxbc sessions`; shell completions.

use crate::helper::*;
use std::io::Write;
use std::process::{Command, Stdio};

/// A built example of the client crate (cargo test builds them).
fn example(name: &str) -> Command {
    let p = binary("mlxbcd").parent().unwrap().join("examples").join(name);
    assert!(
        p.is_file(),
        "{} is not built — `cargo test` builds examples; run the suite with scripts/test",
        p.display()
    );
    Command::new(p)
}

fn run_with_stdin(mut cmd: Command, input: &str) -> std::process::Output {
    let mut child = cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
    child.wait_with_output().unwrap()
}

#[test]
fn the_examples_run_against_the_daemon() {
    let d = Daemon::start_with(DaemonOptions {
        models: vec![
            (SMOLLM2, fixture(&format!("models/{SMOLLM2}"))),
            ("tiny-gemma3-vlm", fixture("mlx/tiny-gemma3-vlm")),
        ],
        args: vec![],
    });
    let mut ask = example("ask");
    d.env(&mut ask);
    let out = ask.arg("What is the capital of France?").output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("Paris"));

    let mut chat = example("chat");
    d.env(&mut chat);
    let out = run_with_stdin(chat, "What is the capital of France?\nAnd of Italy?\n");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.lines().filter(|l| !l.trim().is_empty()).count() >= 2, "two answers: {text}");

    let png = d.home.path().join("x.png");
    std::fs::write(&png, crate::vision::png(64, 64, 11)).unwrap();
    for expect in ["0 from the store, 1 encoded", "1 from the store, 0 encoded"] {
        let mut image = example("image");
        d.env(&mut image);
        let out = image.arg("tiny-gemma3-vlm").arg(&png).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        assert!(String::from_utf8_lossy(&out.stderr).contains(expect), "{}", String::from_utf8_lossy(&out.stderr));
    }
}

fn prompt_tokens(out: &std::process::Output) -> u64 {
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let done = String::from_utf8_lossy(&out.stdout).lines().last().unwrap().to_string();
    let v: serde_json::Value = serde_json::from_str(&done).unwrap();
    v["stats"]["prompt_tokens"].as_u64().unwrap()
}

#[test]
fn a_named_session_is_kept_by_the_daemon_across_restarts() {
    let mut d = Daemon::start();
    let mut chat = d.cli();
    chat.args(["chat", "--session", "trip", "-n", "12"]);
    let out = run_with_stdin(chat, "I am planning a trip to Rome.\n");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(!String::from_utf8_lossy(&out.stdout).trim().is_empty());

    d.terminate();
    d.spawn(&[]);
    let ls = d.cli().arg("sessions").output().unwrap();
    assert_eq!(String::from_utf8_lossy(&ls.stdout).split_whitespace().collect::<Vec<_>>(), ["trip", "2", "messages"]);
    let show = d.cli().args(["sessions", "show", "trip"]).output().unwrap();
    assert!(String::from_utf8_lossy(&show.stdout).starts_with("User: I am planning a trip to Rome.\nAssistant: "));

    // The next turn carries the history without the client resending it.
    let q = "Which city did I mention?";
    let fresh = prompt_tokens(&d.cli().args(["ask", "--json", "-n", "4", q]).output().unwrap());
    let continued =
        prompt_tokens(&d.cli().args(["ask", "--json", "-n", "4", "--session", "trip", q]).output().unwrap());
    assert!(continued > fresh + 10, "history went in front: {continued} vs {fresh}");
    let ls = d.cli().arg("sessions").output().unwrap();
    assert!(String::from_utf8_lossy(&ls.stdout).contains("4 messages"));

    let rm = d.cli().args(["sessions", "rm", "trip"]).output().unwrap();
    assert_eq!(String::from_utf8_lossy(&rm.stdout).trim(), "forgot trip");
    let bad = d.cli().args(["ask", "--session", "../etc", "hi"]).output().unwrap();
    assert_eq!(bad.status.code(), Some(4));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("bad session name"));
}

#[test]
fn completions_for_bash_zsh_and_fish() {
    for shell in ["bash", "zsh", "fish"] {
        let out = Command::new(binary("mlxbc")).args(["completions", shell]).output().unwrap();
        assert!(out.status.success());
        let script = String::from_utf8_lossy(&out.stdout);
        assert!(script.contains("prefetch") && script.contains("service"), "{shell}: {script}");
    }
    let bash = Command::new(binary("mlxbc")).args(["completions", "bash"]).output().unwrap().stdout;
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("c.bash"), bash).unwrap();
    let check = Command::new("bash").arg("-n").arg(dir.path().join("c.bash")).output().unwrap();
    assert!(check.status.success(), "bash -n: {}", String::from_utf8_lossy(&check.stderr));
}

#[test]
fn long_operations_show_progress_on_a_terminal_and_nothing_when_piped() {
    let d = Daemon::start_with(DaemonOptions { models: vec![("tiny-qwen2", fixture("mlx/tiny-qwen2"))], args: vec![] });
    let piped = d.cli().args(["load", "tiny-qwen2"]).output().unwrap();
    assert!(piped.status.success());
    assert_eq!(String::from_utf8_lossy(&piped.stderr), "", "quiet when piped");
    d.cli().args(["unload", "tiny-qwen2"]).output().unwrap();
    // util-linux `script` gives the command a pseudo-terminal, as a user's shell would.
    let mut on_tty = Command::new("script");
    d.env(&mut on_tty);
    let cmd = format!("{} load tiny-qwen2", binary("mlxbc").display());
    let out = on_tty.args(["-qec", &cmd, "/dev/null"]).output().expect("script (util-linux) runs the CLI on a pty");
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{shown}");
    assert!(shown.contains("loading tiny-qwen2"), "a spinner on the terminal: {shown:?}");
    assert!(shown.contains("loaded tiny-qwen2 in"), "{shown:?}");
}
