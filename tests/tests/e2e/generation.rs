//! Answers, concurrency, cancellation and residency.

use crate::helper::*;
use mlxbc_client::{KeepAlive, StopReason};
use std::time::Duration;

#[tokio::test(flavor = "multi_thread")]
async fn ask_answers_the_capital_of_france() {
    let d = Daemon::start();
    let (text, stats) = ask(&d.socket, greedy(None, "What is the capital of France?", 64)).await.unwrap();
    assert!(text.contains("Paris"), "answer was {text:?}");
    assert_eq!(stats.stop_reason, StopReason::Eos);
    assert!(stats.prompt_tokens > 10 && stats.generated_tokens > 0);
    assert!(stats.load_ms > 0.0, "the first request loads the model");
    let (_, again) = ask(&d.socket, greedy(Some("smollm2"), "What is the capital of France?", 64)).await.unwrap();
    assert_eq!(again.load_ms, 0.0, "the model stays resident between requests");
    assert_eq!(again.token_ids, stats.token_ids, "greedy answers repeat");
}

#[tokio::test(flavor = "multi_thread")]
async fn four_concurrent_clients_all_get_complete_answers() {
    let d = Daemon::start();
    let prompts = ["What is the capital of France?", "What is 2 + 2?", "Name a primary color.", "Say hello."];
    // What each prompt gives alone, one after another...
    let mut alone = Vec::new();
    for p in prompts {
        alone.push(ask(&d.socket, greedy(None, p, 24)).await.unwrap());
    }
    // ...is exactly what it gives when all four arrive at once.
    let tasks: Vec<_> = prompts.iter().map(|p| tokio::spawn(ask(d.socket.clone(), greedy(None, p, 24)))).collect();
    for (task, (text, stats)) in tasks.into_iter().zip(alone) {
        let (t, s) = task.await.unwrap().unwrap();
        assert_eq!(t, text);
        assert_eq!(s.token_ids, stats.token_ids);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_that_disconnects_mid_stream_frees_the_engine() {
    let d = Daemon::start();
    {
        let mut c = d.client().await;
        let mut stream = c.generate(greedy(None, "Write a very long story about a dragon.", 2000)).await.unwrap();
        until_first_token(&mut stream).await;
    } // connection dropped here
    let (text, _) = ask(&d.socket, greedy(None, "What is the capital of France?", 32)).await.unwrap();
    assert!(text.contains("Paris"));
    let status = d.client().await.status().await.unwrap();
    assert_eq!(status.generations_cancelled, 1, "the abandoned generation was cancelled, not run to 2000 tokens");
    assert_eq!(status.queued_jobs, 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn keep_alive_unloads_an_idle_model() {
    let d = Daemon::start();
    let mut req = greedy(None, "Hi", 4);
    req.keep_alive = Some(KeepAlive::Seconds(1));
    ask(&d.socket, req).await.unwrap();
    let mut c = d.client().await;
    for _ in 0..100 {
        if c.status().await.unwrap().loaded.is_empty() {
            assert!(d.log_text().contains("keep-alive expired"), "the unload is logged");
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("model still loaded 10 s after a 1 s keep-alive");
}

#[tokio::test(flavor = "multi_thread")]
async fn load_ps_and_unload() {
    let d = Daemon::start();
    let mut c = d.client().await;
    let (name, _, bytes) = c.load("smollm2", Some(KeepAlive::Forever)).await.unwrap();
    assert_eq!(name, SMOLLM2);
    assert!(bytes > 100_000_000);
    let status = c.status().await.unwrap();
    assert_eq!(status.loaded.len(), 1);
    assert_eq!(status.loaded[0].keep_alive, KeepAlive::Forever);
    assert_eq!(status.loaded[0].expires_in_s, None);
    assert!(c
        .list_models()
        .await
        .unwrap()
        .iter()
        .any(|m| m.name == SMOLLM2 && m.loaded && m.aliases.contains(&"smollm2".into())));
    assert!(c.unload("smollm2").await.unwrap());
    assert!(!c.unload("smollm2").await.unwrap());
    assert!(c.status().await.unwrap().loaded.is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn stop_strings_end_the_answer_before_the_match() {
    let d = Daemon::start();
    let (full, _) = ask(&d.socket, greedy(None, "What is the capital of France?", 32)).await.unwrap();
    let mut req = greedy(None, "What is the capital of France?", 32);
    req.stop = vec!["Paris".into()];
    let (text, stats) = ask(&d.socket, req).await.unwrap();
    assert_eq!(stats.stop_reason, StopReason::StopString);
    assert_eq!(text, full[..full.find("Paris").unwrap()]);
}

/// A stream dropped before `Done` cancels its generation at once, and the
/// same `Client` answers the next call (it reconnects; before, it read the
/// old stream's tokens and the daemon closed the connection).
#[tokio::test(flavor = "multi_thread")]
async fn a_stream_dropped_early_cancels_and_the_client_stays_usable() {
    let d = Daemon::start();
    let mut client = d.client().await;
    let mut long = greedy(None, "Write a long story about a dragon.", 400);
    long.ignore_eos = true;
    let mut stream = client.generate(long).await.unwrap();
    until_first_token(&mut stream).await;
    drop(stream);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while client.status().await.unwrap().generations_cancelled == 0 {
        assert!(std::time::Instant::now() < deadline, "the dropped stream's generation was not cancelled");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let (text, _) = client.ask(greedy(None, "What is the capital of France?", 24)).await.unwrap();
    assert!(text.contains("Paris"), "{text:?}");
}

/// `sessions rm` while a turn of that session is being answered: the file is
/// never left half-written and is not resurrected by the late turn, which
/// comes back with a warning instead.
#[tokio::test(flavor = "multi_thread")]
async fn deleting_a_session_during_its_turn_neither_corrupts_nor_resurrects_it() {
    use mlxbc_client::SessionCommand;
    let d = Daemon::start();
    let mut first = greedy(None, "hi", 4);
    first.session = Some("race".into());
    ask(&d.socket, first).await.unwrap();
    let mut long = greedy(None, "Tell me a long story.", 120);
    long.ignore_eos = true;
    long.session = Some("race".into());
    let mut c = d.client().await;
    let mut stream = c.generate(long).await.unwrap();
    until_first_token(&mut stream).await;
    let mut other = d.client().await;
    let deleted = other.sessions(SessionCommand::Delete { name: "race".into() }).await.unwrap();
    assert_eq!(deleted.len(), 1, "it existed");
    let (_, stats) = stream.collect_text().await.unwrap();
    assert!(stats.warnings.iter().any(|w| w.contains("deleted")), "{:?}", stats.warnings);
    assert!(!d.home.path().join("sessions/race.json").exists(), "the late turn did not resurrect it");
    let listed = other.sessions(SessionCommand::List).await.unwrap();
    assert!(listed.iter().all(|s| s.name != "race"), "{listed:?}");
}
