//! The prompt cache through the real daemon: greedy ids with it equal ids
//! without it (a daemon whose cache is off) on every path — RAM hits,
//! disk hits after a restart, prompts that part inside a block — sessions
//! prefill only their new turn, and a daemon killed while it writes blocks
//! restarts serving only correct ones.

use crate::helper::*;
use mlxbc_client::{CacheCommand, ChatMessage, GenerateRequest, GenerationStats, Role};
use std::time::Duration;

const QWEN3: &str = "tiny-qwen3";

fn daemon(cache_on: bool) -> Daemon {
    let mut d = Daemon::prepare(&DaemonOptions {
        models: vec![(QWEN3, fixture("mlx/tiny-qwen3")), (SMOLLM2, fixture(&format!("models/{SMOLLM2}")))],
        args: vec![],
    });
    if !cache_on {
        std::fs::write(d.home.path().join("config.toml"), "prompt_cache_ram_mib = 0\nprompt_cache_mib = 0\n").unwrap();
    }
    d.spawn(&[]);
    d
}

/// A conversation: a long system prompt, then `turns` user turns with
/// the answers so far.
fn chat(model: &str, turns: &[(&str, &str)], question: &str) -> GenerateRequest {
    let mut r = greedy(Some(model), question, 12);
    let system: String = (0..12).map(|i| format!("Rule {i}: answer briefly and name the number {i}. ")).collect();
    let mut messages = vec![ChatMessage { role: Role::System, ..ChatMessage::user(&system) }];
    for (q, a) in turns {
        messages.push(ChatMessage::user(*q));
        messages.push(ChatMessage { role: Role::Assistant, ..ChatMessage::user(*a) });
    }
    messages.push(ChatMessage::user(question));
    r.messages = messages;
    r
}

async fn ask_ok(d: &Daemon, r: GenerateRequest) -> (String, GenerationStats) {
    ask(&d.socket, r).await.unwrap_or_else(|e| panic!("{e}\n{}", d.log_text()))
}

#[tokio::test(flavor = "multi_thread")]
async fn greedy_ids_with_the_prompt_cache_equal_ids_without_it_from_ram_from_disk_and_when_prompts_part() {
    let mut cached = daemon(true);
    let cold = daemon(false);
    for model in [QWEN3, SMOLLM2] {
        let (a1, _) = ask_ok(&cold, chat(model, &[], "What is rule 3?")).await;
        let turn2 = chat(model, &[("What is rule 3?", &a1)], "And rule 7?");
        // Parts from turn 2 inside its last blocks: a different question.
        let other = chat(model, &[("What is rule 3?", &a1)], "Which rule mentions the number 11?");
        let (_, first) = ask_ok(&cached, chat(model, &[], "What is rule 3?")).await;
        assert_eq!(first.prefix_tokens_reused, 0, "{model}: nothing cached yet");
        for (name, request) in [("turn 2", turn2.clone()), ("a prompt that parts", other.clone())] {
            let (_, want) = ask_ok(&cold, request.clone()).await;
            let (_, got) = ask_ok(&cached, request).await;
            assert_eq!(got.token_ids, want.token_ids, "{model}, {name}: ids with the cache differ");
            assert!(got.prefix_tokens_reused >= 128, "{model}, {name}: the system prompt is reused: {got:?}");
            assert_eq!(got.prompt_tokens_from_disk, 0, "{model}: from RAM");
            assert_eq!(got.prefill_tokens_computed + got.prefix_tokens_reused, got.prompt_tokens);
            assert_eq!(want.prefix_tokens_reused, 0, "the cold daemon caches nothing");
        }
        // The same prompt again reuses every block before its last position.
        let (_, again) = ask_ok(&cached, turn2.clone()).await;
        assert!(again.prompt_tokens - again.prefix_tokens_reused <= 64, "{model}: {again:?}");

        // After a restart the blocks come from disk.
        cached.terminate();
        cached.spawn(&[]);
        let (_, want) = ask_ok(&cold, turn2.clone()).await;
        let (_, got) = ask_ok(&cached, turn2).await;
        assert_eq!(got.token_ids, want.token_ids, "{model}: ids from disk blocks differ");
        assert!(got.prompt_tokens_from_disk >= 128, "{model}: from disk after the restart: {got:?}");
    }
    let report = cached.client().await.cache(CacheCommand::Stats).await.unwrap().prompts;
    assert!(report.disk_blocks >= 4 && report.disk_hit_tokens >= 128, "{report:?}");
    assert_eq!(report.block_tokens, 64);
    // `cache clear --prompts` empties both tiers; the next ask is cold.
    let out = cached.cli().args(["cache", "clear", "--prompts"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("prompt KV blocks"));
    let report = cached.client().await.cache(CacheCommand::Stats).await.unwrap().prompts;
    assert_eq!((report.disk_blocks, report.ram_blocks), (0, 0), "{report:?}");
    let (_, s) = ask_ok(&cached, chat(QWEN3, &[], "What is rule 3?")).await;
    assert_eq!(s.prefix_tokens_reused, 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_session_prefills_only_its_new_turn() {
    let d = daemon(true);
    let mut prefilled = Vec::new();
    for (i, q) in ["Name a colour.", "Name a fruit.", "Name a city.", "Name an animal."].iter().enumerate() {
        let mut r = chat(QWEN3, &[], q);
        if i > 0 {
            r.messages.remove(0); // the session holds the system prompt and the history
        }
        r.session = Some("work".into());
        let (_, s) = ask_ok(&d, r).await;
        prefilled.push((s.prompt_tokens, s.prefill_tokens_computed));
    }
    let (total, computed) = *prefilled.last().unwrap();
    assert!(total > 200, "{prefilled:?}");
    assert!(
        computed < 100,
        "turn 4 prefills its own turn (and the rest of its last block), not the history: {prefilled:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_daemon_killed_while_writing_blocks_restarts_serving_only_correct_ones() {
    let cold = daemon(false);
    let mut d = daemon(true);
    let request = chat(SMOLLM2, &[("What is rule 3?", "Rule 3 names the number 3.")], "And rule 9?");
    let (_, want) = ask_ok(&cold, request.clone()).await;
    for round in 0..3 {
        // SIGKILL just after the first token: the prompt's blocks are being
        // written behind it.
        {
            let mut c = d.client().await;
            let mut r = request.clone();
            r.messages.push(ChatMessage::user(format!("Round {round}.")));
            let mut stream = c.generate(r).await.unwrap();
            until_first_token(&mut stream).await;
            let child = d.child.take().unwrap();
            unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
            let mut child = child;
            child.wait().unwrap();
        }
        // Odd rounds: damage every block there (cut short, or a flipped
        // byte), so the first one the prompt needs is certainly damaged.
        let dir = d.home.path().join("cache/prompts");
        let blocks: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
        let damaged = round % 2 == 1 && !blocks.is_empty();
        for (i, b) in blocks.iter().enumerate().filter(|_| damaged) {
            let mut bytes = std::fs::read(b).unwrap();
            if i % 2 == 0 {
                bytes.truncate(bytes.len() / 2);
            } else {
                let at = bytes.len() - 7;
                bytes[at] ^= 0x40;
            }
            std::fs::write(b, bytes).unwrap();
        }
        d.spawn(&[]);
        let (_, got) = ask_ok(&d, request.clone()).await;
        assert_eq!(got.token_ids, want.token_ids, "round {round}: ids after a SIGKILL and damaged blocks");
        let report = d.client().await.cache(CacheCommand::Stats).await.unwrap().prompts;
        if damaged {
            assert!(report.corrupt >= 1, "round {round}: damaged blocks are found and counted: {report:?}");
            assert_eq!(got.prompt_tokens_from_disk, 0, "round {round}: nothing damaged is served");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn blocks_stored_from_a_batched_prefill_give_the_ids_a_cold_prefill_gives() {
    let cached = daemon(true);
    let cold = daemon(false);
    // Three new prompts at once are prefilled as one padded batch; each
    // row's blocks are stored from it.
    let firsts: Vec<GenerateRequest> =
        ["What is rule 1?", "What is rule 2? Answer in one word.", "What is rule 5 about, in short?"]
            .iter()
            .map(|q| chat(QWEN3, &[], q))
            .collect();
    let tasks: Vec<_> = firsts
        .iter()
        .cloned()
        .map(|r| {
            let socket = cached.socket.clone();
            tokio::spawn(async move { ask(&socket, r).await.unwrap() })
        })
        .collect();
    let mut answers = Vec::new();
    for t in tasks {
        answers.push(t.await.unwrap().0);
    }
    let log = cached.log_text();
    for (first, answer) in firsts.iter().zip(&answers) {
        let q = first.messages.last().unwrap().content.clone();
        let mut next = first.clone();
        next.messages.push(ChatMessage { role: Role::Assistant, ..ChatMessage::user(answer.clone()) });
        next.messages.push(ChatMessage::user("And why?"));
        let (_, want) = ask_ok(&cold, next.clone()).await;
        let (_, got) = ask_ok(&cached, next).await;
        assert!(got.prefix_tokens_reused >= 128, "{q}: blocks from the batched prefill are reused: {got:?}\n{log}");
        assert_eq!(got.token_ids, want.token_ids, "{q}: ids differ");
    }
}

/// A quantized KV cache's prefixes are cached in that form (issue 39): the
/// same 8-bit prompt again reuses its blocks from RAM, and after a restart
/// from disk, with the answer of the first (computed) ask; a prefix cached
/// at another setting (4 bits, full precision) is a miss, either way round.
#[tokio::test(flavor = "multi_thread")]
async fn a_quantized_cache_reuses_its_own_prefixes_and_no_other_forms() {
    use mlxbc_client::KvCacheSpec;
    let mut d = daemon(true);
    let with_kv = |bits: Option<u8>| {
        let mut r = chat(SMOLLM2, &[("What is rule 3?", "Rule 3 names the number 3.")], "And rule 9?");
        r.kv = KvCacheSpec { bits, ..Default::default() };
        r
    };
    let (_, first) = ask_ok(&d, with_kv(Some(8))).await;
    assert_eq!(first.prefix_tokens_reused, 0, "nothing cached yet");
    let (_, again) = ask_ok(&d, with_kv(Some(8))).await;
    assert!(again.prefix_tokens_reused >= 128, "the 8-bit prefix from RAM: {again:?}");
    assert_eq!(again.prefill_tokens_computed + again.prefix_tokens_reused, again.prompt_tokens);
    assert_eq!(again.token_ids, first.token_ids, "8-bit blocks reused answer as computed ones");
    let (_, four) = ask_ok(&d, with_kv(Some(4))).await;
    assert_eq!(four.prefix_tokens_reused, 0, "8-bit blocks are not 4-bit ones: {four:?}");
    let (_, full) = ask_ok(&d, with_kv(None)).await;
    assert_eq!(full.prefix_tokens_reused, 0, "quantized blocks are not full precision: {full:?}");
    let (_, full_again) = ask_ok(&d, with_kv(None)).await;
    assert!(full_again.prefix_tokens_reused >= 128, "{full_again:?}");
    let (_, eight) = ask_ok(&d, with_kv(Some(8))).await;
    assert!(eight.prefix_tokens_reused >= 128, "full-precision blocks did not displace 8-bit ones: {eight:?}");

    d.terminate();
    d.spawn(&[]);
    let (_, from_disk) = ask_ok(&d, with_kv(Some(8))).await;
    assert!(from_disk.prompt_tokens_from_disk >= 128, "8-bit blocks from disk after the restart: {from_disk:?}");
    assert_eq!(from_disk.token_ids, first.token_ids, "{}", d.log_text());
}
