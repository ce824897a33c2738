//! Bad input gets a clear error, and the daemon keeps serving everyone else.

use crate::helper::*;
use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use mlxbc_client::{ClientError, ErrorKind, Request, Response};
use mlxbc_shared::codec;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio_util::codec::{Framed, LengthDelimitedCodec};

/// A raw connection that writes arbitrary bytes and reads framed responses.
async fn raw(d: &Daemon) -> Framed<UnixStream, LengthDelimitedCodec> {
    Framed::new(UnixStream::connect(&d.socket).await.unwrap(), LengthDelimitedCodec::new())
}

async fn next_response(conn: &mut Framed<UnixStream, LengthDelimitedCodec>) -> Response {
    let frame = conn.next().await.expect("a response").unwrap();
    codec::from_payload(&frame).unwrap()
}

/// Runs `misbehave` while another client's generation is streaming, and
/// checks that the other client still gets its whole answer.
async fn while_another_client_is_served<F: std::future::Future<Output = ()>>(d: &Daemon, misbehave: F) {
    let other = tokio::spawn(ask(d.socket.clone(), greedy(None, "What is the capital of France?", 32)));
    misbehave.await;
    let (text, _) = other.await.unwrap().unwrap();
    assert!(text.contains("Paris"), "the other client got {text:?}");
}

fn assert_error(r: Response, want: ErrorKind, needle: &str) {
    match r {
        Response::Error { kind, message } => {
            assert_eq!(kind, want, "{message}");
            assert!(message.contains(needle), "error {message:?} should mention {needle:?}");
        }
        other => panic!("expected an error, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn wrong_protocol_version_is_refused_readably() {
    let d = Daemon::start();
    while_another_client_is_served(&d, async {
        let mut conn = raw(&d).await;
        let hello = Request::Hello { protocol: 999, client_version: "9.9.9".into() };
        conn.send(Bytes::from(codec::to_payload(&hello).unwrap())).await.unwrap();
        assert_error(next_response(&mut conn).await, ErrorKind::ProtocolMismatch, "protocol 999");
        assert!(conn.next().await.is_none(), "the daemon closes the connection");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn malformed_frame_gets_an_error() {
    let d = Daemon::start();
    while_another_client_is_served(&d, async {
        let mut conn = raw(&d).await;
        conn.send(Bytes::from_static(&[0xde, 0xad, 0xbe, 0xef, 0xff])).await.unwrap();
        assert_error(next_response(&mut conn).await, ErrorKind::BadFrame, "malformed");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn oversized_frame_is_refused_without_reading_it() {
    let d = Daemon::start();
    while_another_client_is_served(&d, async {
        let mut s = UnixStream::connect(&d.socket).await.unwrap();
        s.write_all(&u32::MAX.to_be_bytes()).await.unwrap();
        let mut len = [0u8; 4];
        s.read_exact(&mut len).await.unwrap();
        let mut payload = vec![0u8; u32::from_be_bytes(len) as usize];
        s.read_exact(&mut payload).await.unwrap();
        assert_error(codec::from_payload(&payload).unwrap(), ErrorKind::BadFrame, "over the");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_request_before_hello_is_refused() {
    let d = Daemon::start();
    let mut conn = raw(&d).await;
    conn.send(Bytes::from(codec::to_payload(&Request::Status).unwrap())).await.unwrap();
    assert_error(next_response(&mut conn).await, ErrorKind::BadRequest, "Hello");
}

#[tokio::test(flavor = "multi_thread")]
async fn unknown_model_lists_the_known_ones() {
    let d = Daemon::start();
    while_another_client_is_served(&d, async {
        match ask(&d.socket, greedy(Some("no-such-model"), "hi", 4)).await {
            Err(ClientError::Daemon { kind: ErrorKind::UnknownModel, message }) => {
                assert!(
                    message.contains("no-such-model") && message.contains("smollm2") && message.contains(SMOLLM2),
                    "{message}"
                );
            }
            other => panic!("expected UnknownModel, got {other:?}"),
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn prompt_longer_than_the_context_is_refused() {
    let d = Daemon::start();
    let huge = "hello ".repeat(9000);
    match ask(&d.socket, greedy(None, &huge, 4)).await {
        Err(ClientError::Daemon { kind: ErrorKind::ContextOverflow, message }) => {
            assert!(message.contains("8192"), "{message}");
        }
        other => panic!("expected ContextOverflow, got {other:?}"),
    }
    let (text, _) = ask(&d.socket, greedy(None, "What is the capital of France?", 32)).await.unwrap();
    assert!(text.contains("Paris"));
}

#[tokio::test(flavor = "multi_thread")]
async fn corrupt_and_truncated_model_files_are_load_errors() {
    let dir = tempfile::tempdir().unwrap();
    let garbage = dir.path().join("garbage.gguf");
    std::fs::write(&garbage, b"this is not a gguf file at all").unwrap();
    let truncated = dir.path().join("truncated.gguf");
    let real = std::fs::read(fixture(&format!("models/{SMOLLM2}"))).unwrap();
    std::fs::write(&truncated, &real[..real.len() / 3]).unwrap();
    let bad_dir = dir.path().join("bad-dir");
    std::fs::create_dir(&bad_dir).unwrap();
    std::fs::write(bad_dir.join("config.json"), b"{\"model_type\": \"llama\"").unwrap();
    let d = Daemon::start_with(DaemonOptions {
        models: vec![
            (SMOLLM2, fixture(&format!("models/{SMOLLM2}"))),
            ("garbage.gguf", garbage),
            ("truncated.gguf", truncated),
            ("bad-dir", bad_dir),
        ],
        args: vec![],
    });
    for name in ["garbage.gguf", "truncated.gguf", "bad-dir"] {
        while_another_client_is_served(&d, async {
            match ask(&d.socket, greedy(Some(name), "hi", 4)).await {
                Err(ClientError::Daemon { kind: ErrorKind::ModelLoad, message }) => {
                    assert!(message.contains(name), "{message}")
                }
                other => panic!("{name}: expected ModelLoad, got {other:?}"),
            }
        })
        .await;
    }
}
