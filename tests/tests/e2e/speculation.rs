//! Speculative decoding with prompt-lookup drafts (`MLXBC_SPECULATE=ngram`):
//! a daemon that drafts and one that does not answer the same greedy
//! requests with the same token ids on real weights (SmolLM2, Qwen2.5-Coder
//! 0.5B), through a stop string and a token limit that fall inside an
//! accepted run; the drafting daemon reports what it drafted and accepted.
//! A request may turn drafts on or off for itself (`speculate`).

use crate::helper::{fixture, greedy, Daemon, DaemonOptions, SMOLLM2};
use crate::reference::ask_ok;
use mlxbc_client::Speculation;

const QWEN25: &str = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";

/// A function to edit: the answer copies most of it from the prompt.
const FUNCTION: &str = "def summarize(values):
    total = 0
    count = 0
    for value in values:
        if value is None:
            continue
        total += value
        count += 1
    if count == 0:
        return None
    average = total / count
    return {\"total\": total, \"count\": count, \"average\": average}";

fn daemon(speculate: bool) -> Daemon {
    let opts = DaemonOptions {
        models: vec![(SMOLLM2, fixture(&format!("models/{SMOLLM2}"))), (QWEN25, fixture(&format!("models/{QWEN25}")))],
        args: vec![],
    };
    let mut d = Daemon::prepare(&opts);
    if speculate {
        d.extra_env.push(("MLXBC_SPECULATE".into(), "ngram".into()));
    }
    d.spawn(&opts.args);
    d
}

#[tokio::test(flavor = "multi_thread")]
async fn drafted_greedy_ids_equal_plain_decoding_on_real_weights() {
    let (drafting, plain) = (daemon(true), daemon(false));
    let edit =
        format!("Rename the variable `total` to `acc` in this function. Answer with the code only.\n\n{FUNCTION}");
    let quote = "Repeat this sentence exactly, twice: The quick brown fox jumps over the lazy dog near the river bank.";
    let mut stopped = greedy(Some(QWEN25), &edit, 64);
    stopped.stop = vec!["count == 0".into()];
    let cases = [
        ("qwen code edit", greedy(Some(QWEN25), &edit, 72)),
        ("qwen code edit, a stop string", stopped),
        ("qwen code edit, 9 tokens", greedy(Some(QWEN25), &edit, 9)),
        ("smollm2 quote", greedy(Some(SMOLLM2), quote, 48)),
    ];
    let mut accepted = 0;
    for (what, request) in cases {
        let (with, without) = tokio::join!(ask_ok(&drafting, request.clone()), ask_ok(&plain, request));
        assert_eq!(with.token_ids, without.token_ids, "{what}: ids with drafts differ from plain decoding");
        assert_eq!((with.stop_reason, &with.stop_string), (without.stop_reason, &without.stop_string), "{what}");
        assert_eq!(with.generated_tokens, without.generated_tokens, "{what}");
        assert_eq!((without.draft_tokens, without.accepted_draft_tokens), (0, 0), "{what}: the plain daemon drafted");
        assert!(with.accepted_draft_tokens <= with.draft_tokens, "{what}: {with:?}");
        eprintln!(
            "{what}: {} tokens, {} of {} drafted accepted; decode {:.1} tok/s with drafts, {:.1} without",
            with.generated_tokens,
            with.accepted_draft_tokens,
            with.draft_tokens,
            with.decode_tokens_per_s,
            without.decode_tokens_per_s
        );
        accepted += with.accepted_draft_tokens;
    }
    assert!(accepted >= 20, "a code edit copies its prompt: drafts should be accepted ({accepted} were)");

    // A request chooses for itself: on where the daemon's default is off,
    // off where it is on.
    let mut asks = greedy(Some(QWEN25), &edit, 24);
    asks.speculate = Speculation::Ngram;
    let (with, without) = tokio::join!(ask_ok(&plain, asks.clone()), ask_ok(&drafting, asks.clone()));
    assert!(with.accepted_draft_tokens > 0, "the request asked for drafts: {with:?}");
    assert_eq!(with.token_ids, without.token_ids);
    asks.speculate = Speculation::Off;
    let off = ask_ok(&drafting, asks).await;
    assert_eq!((off.draft_tokens, off.token_ids), (0, with.token_ids), "the request turned drafts off");
}

/// A model that cannot verify drafts refuses a request that insists, with
/// a sentence, and answers the same request without it.
#[tokio::test(flavor = "multi_thread")]
async fn a_family_without_draft_verification_refuses_a_request_that_insists() {
    const VLM: &str = "tiny-gemma3-vlm";
    let d = Daemon::start_with(DaemonOptions { models: vec![(VLM, fixture("mlx/tiny-gemma3-vlm"))], args: vec![] });
    let mut r = greedy(Some(VLM), "Say something twice, twice.", 8);
    r.speculate = Speculation::Ngram;
    let e = crate::helper::ask(&d.socket, r.clone()).await.expect_err("gemma3 cannot verify drafts yet");
    let text = e.to_string();
    assert!(text.contains("speculative decoding") && text.contains("gemma3"), "{text}");
    r.speculate = Speculation::Auto;
    let ok = ask_ok(&d, r).await;
    assert_eq!(ok.draft_tokens, 0);
}
