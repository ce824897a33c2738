//! The socket and the process: one daemon per socket, stale sockets replaced,
//! private permissions, clean stops.

use crate::helper::*;
use std::os::unix::fs::PermissionsExt;
use std::process::Stdio;

#[test]
fn socket_is_private_to_the_user() {
    let d = Daemon::start();
    let mode = std::fs::metadata(&d.socket).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "socket mode {mode:o}");
}

#[test]
fn a_second_daemon_on_the_same_socket_refuses_to_start() {
    let d = Daemon::start();
    let mut cmd = std::process::Command::new(binary("mlxbcd"));
    d.env(&mut cmd);
    let out = cmd.stdin(Stdio::null()).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("already serving"), "stderr: {err}");
    assert!(std::os::unix::net::UnixStream::connect(&d.socket).is_ok(), "the first daemon still serves");
}

#[test]
fn a_second_daemon_on_the_same_data_directory_through_another_socket_refuses_to_start() {
    // It would run without the feature store the first one holds, and
    // encode every image again with nothing but a log line to say so.
    let d = Daemon::start();
    let other = d.home.path().join("other.sock");
    let mut cmd = std::process::Command::new(binary("mlxbcd"));
    d.env(&mut cmd);
    let out = cmd.env("MLXBC_SOCKET", &other).stdin(Stdio::null()).output().unwrap();
    assert!(!out.status.success(), "a second daemon started beside the first");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("another mlxbcd is using the data directory") && err.contains("MLXBC_HOME"), "stderr: {err}");
    assert!(std::os::unix::net::UnixStream::connect(&d.socket).is_ok(), "the first daemon still serves");
}

#[test]
fn a_stale_socket_file_is_replaced() {
    let mut d = Daemon::start();
    let status = d.terminate();
    assert!(status.success(), "clean exit on SIGTERM: {status}");
    assert!(!d.socket.exists(), "the socket file is removed on exit");
    // A daemon killed hard leaves its socket file behind.
    drop(std::os::unix::net::UnixListener::bind(&d.socket).unwrap());
    assert!(d.socket.exists());
    d.spawn(&[]);
    assert!(d.log_text().contains("replacing stale socket"));
}

#[tokio::test(flavor = "multi_thread")]
async fn shutdown_request_stops_the_daemon_even_with_clients_connected() {
    let mut d = Daemon::start();
    let _idle = d.client().await; // an editor that keeps its connection open
    d.client().await.shutdown().await.unwrap();
    let mut child = d.child.take().unwrap();
    let status = tokio::task::spawn_blocking(move || child.wait()).await.unwrap().unwrap();
    assert!(status.success());
    assert!(!d.socket.exists());
}
