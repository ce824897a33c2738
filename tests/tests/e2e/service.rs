//! Running as a service: a socket passed by the service manager (systemd's
//! LISTEN_FDS protocol, exactly as systemd passes it), readiness through
//! NOTIFY_SOCKET, idle exit and restart on the next connection, and the
//! peer-uid check on the socket.

use crate::helper::*;
use mlxbc_client::KeepAlive;
use std::time::Duration;

/// A request that lets its model go as soon as it is answered.
fn ask_and_unload() -> mlxbc_client::GenerateRequest {
    let mut r = greedy(None, "What is the capital of France?", 8);
    r.keep_alive = Some(KeepAlive::Seconds(0));
    r
}

#[tokio::test(flavor = "multi_thread")]
async fn a_socket_passed_the_systemd_way_is_served_then_idle_exit_and_restart_on_the_next_connection() {
    let mut d = Daemon::prepare(&DaemonOptions::default());
    // The test plays systemd: it owns the listening socket and the notify socket.
    let listener = std::os::unix::net::UnixListener::bind(&d.socket).unwrap();
    let notify_path = d.home.path().join("notify.sock");
    let notify = std::os::unix::net::UnixDatagram::bind(&notify_path).unwrap();
    notify.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let args = ["--idle-exit", "1s"];
    d.spawn_activated(&listener, &args, &[("NOTIFY_SOCKET", &notify_path)]);

    let mut buf = [0u8; 512];
    let n = notify.recv(&mut buf).expect("READY=1 on NOTIFY_SOCKET");
    let message = String::from_utf8_lossy(&buf[..n]);
    assert!(message.lines().any(|l| l == "READY=1"), "{message}");

    let (text, _) = ask(&d.socket, ask_and_unload()).await.unwrap();
    assert!(text.contains("Paris"), "{text}");
    assert!(d.log_text().contains("activated_by=\"systemd\""), "{}", d.log_text());
    assert!(d.socket.exists(), "the daemon never removes a socket it did not create");

    // No client and no model: it leaves, cleanly, within the idle period (+ slack).
    let status = d.wait_exit(Duration::from_secs(20)).unwrap_or_else(|| panic!("no idle exit:\n{}", d.log_text()));
    assert!(status.success(), "{status}");
    assert!(d.log_text().contains("idle with no model loaded"));

    // The socket still listens (in "systemd"): a new client is queued in the
    // backlog, and the restarted daemon answers it.
    let socket = d.socket.clone();
    let pending = tokio::spawn(async move { ask(&socket, ask_and_unload()).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!pending.is_finished(), "nobody should have answered yet");
    d.spawn_activated(&listener, &args, &[]);
    let (again, _) = pending.await.unwrap().unwrap();
    assert_eq!(again, text);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_daemon_that_bound_its_own_socket_never_exits_idle() {
    let d = Daemon::start_with(DaemonOptions { args: vec!["--idle-exit".into(), "1s".into()], ..Default::default() });
    tokio::time::sleep(Duration::from_secs(3)).await;
    let mut c = d.client().await;
    assert!(c.status().await.unwrap().uptime_s >= 2, "still the same process");
}

#[test]
fn another_user_is_refused_with_a_clear_error_and_a_log_line() {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    assert_eq!(
        unsafe { libc::geteuid() },
        0,
        "this test switches to uid 65534 (nobody) for the second user, which needs root; run the suite as root (CI does)"
    );
    let d = Daemon::start();
    // Open the file modes wide, so that only the daemon's uid check stands in the way.
    std::fs::set_permissions(d.home.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&d.socket, std::fs::Permissions::from_mode(0o666)).unwrap();
    let out = std::process::Command::new(binary("mlxbc"))
        .arg("status")
        .env("MLXBC_SOCKET", &d.socket)
        .env("MLXBC_HOME", "/nonexistent")
        .env("HOME", "/nonexistent")
        .uid(65534)
        .gid(65534)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("permission denied") && stderr.contains("uid 65534"), "{stderr}");
    assert!(d.log_text().contains("refused a connection from another user"), "{}", d.log_text());
    // The daemon's own user is still served.
    let ok = d.cli().arg("status").output().unwrap();
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
}

#[test]
fn service_install_dry_run_names_this_daemon_and_socket() {
    let home = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(binary("mlxbc"))
        .args(["service", "install", "--dry-run"])
        .env("MLXBC_HOME", home.path())
        .env("HOME", home.path())
        .env_remove("MLXBC_SOCKET")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    let daemon = binary("mlxbcd").canonicalize().unwrap();
    if cfg!(target_os = "macos") {
        assert!(text.contains("<string>dev.mlxbc.daemon</string>"), "{text}");
        assert!(text.contains("launchctl bootstrap gui/"), "{text}");
    } else {
        assert!(text.contains(&format!("ExecStart={}\n", daemon.display())), "{text}");
        assert!(text.contains(&format!("ListenStream={}\n", home.path().join("mlxbcd.sock").display())), "{text}");
        assert!(text.contains("systemctl --user enable --now mlxbc.socket mlxbc.service"), "{text}");
    }
    assert!(!home.path().join(".config").exists(), "a dry run writes nothing");
}
