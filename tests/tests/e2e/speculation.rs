//! Speculative decoding with prompt-lookup drafts (`MLXBC_SPECULATE=ngram`):
//! a daemon that drafts and one that does not answer the same greedy
//! requests with the same token ids on real weights (SmolLM2, Qwen2.5-Coder
//! 0.5B), through a stop string and a token limit that fall inside an
//! accepted run; the drafting daemon reports what it drafted and accepted.
//! A request may turn drafts on or off for itself (`speculate`). Rows that
//! draft (greedy, constrained, with log-probabilities, sampled) share a
//! continuous batch with rows that do not (drafts off, seeded sampling), and every
//! greedy or seeded row's answer is what it is without drafts.

use crate::helper::{fixture, greedy, together, Daemon, DaemonOptions, SMOLLM2};
use crate::reference::ask_ok;
use mlxbc_client::{Constraint, SamplingParams, Speculation};

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

/// A daemon whose sequences draft as `speculate` (`MLXBC_SPECULATE`) says.
fn daemon(speculate: &str) -> Daemon {
    let opts = DaemonOptions {
        models: vec![(SMOLLM2, fixture(&format!("models/{SMOLLM2}"))), (QWEN25, fixture(&format!("models/{QWEN25}")))],
        args: vec![],
    };
    let mut d = Daemon::prepare(&opts);
    d.extra_env.push(("MLXBC_SPECULATE".into(), speculate.into()));
    d.spawn(&opts.args);
    d
}

#[tokio::test(flavor = "multi_thread")]
async fn drafted_greedy_ids_equal_plain_decoding_on_real_weights() {
    let (drafting, plain) = (daemon("ngram"), daemon("off"));
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

    // Every draft width, 1 to 8 tokens a step (`draft_max`), answers as
    // plain decoding: SmolLM2 quoting, Qwen2.5-Coder editing.
    for k in 1..=8u8 {
        for (what, mut request) in
            [("smollm2 quote", greedy(Some(SMOLLM2), quote, 40)), ("qwen code edit", greedy(Some(QWEN25), &edit, 24))]
        {
            request.draft_max = Some(k);
            let (with, without) = tokio::join!(ask_ok(&drafting, request.clone()), ask_ok(&plain, request));
            assert_eq!(with.token_ids, without.token_ids, "{what}, drafts of at most {k}: ids differ");
            assert!(with.accepted_draft_tokens > 0, "{what}, drafts of at most {k}: none accepted: {with:?}");
            if k == 1 {
                assert!(with.draft_tokens < with.generated_tokens, "{what}: one token a step at most: {with:?}");
            }
        }
    }
    // A width outside 1 to 8 is refused with a sentence.
    for k in [0, 9] {
        let mut bad = greedy(Some(SMOLLM2), quote, 4);
        bad.draft_max = Some(k);
        let e = crate::helper::ask(&drafting.socket, bad).await.expect_err("refused");
        assert!(e.to_string().contains(&format!("draft_max {k}")), "{e}");
    }

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

/// Drafting rows in one continuous batch — greedy, constrained (JSON),
/// with log-probabilities, sampled — with rows that do not draft (drafts
/// off, seeded sampling) and with each other (different draft lengths,
/// accepted runs and stops, so rows forget different numbers of
/// positions): every answer but the drafting sampled one has the plain
/// daemon's ids (and log-probabilities) for the same requests sent the
/// same way.
#[tokio::test(flavor = "multi_thread")]
async fn drafting_rows_share_a_batch_with_rows_that_do_not_draft() {
    let (drafting, plain) = (daemon("ngram"), daemon("off"));
    let edit = |what: &str| format!("{what} Answer with the code only.\n\n{FUNCTION}");
    let rename = greedy(Some(QWEN25), &edit("Rename the variable `count` to `n` in this function."), 64);
    let hints = greedy(Some(QWEN25), &edit("Add type hints to this function."), 48);
    let mut off = greedy(Some(QWEN25), &edit("Rename `values` to `items` in this function."), 40);
    off.speculate = Speculation::Off;
    // A seeded sampled row that does not draft keeps its draw exactly.
    let mut sampled = greedy(Some(QWEN25), "Describe a rainy afternoon in two sentences.", 24);
    sampled.sampling = SamplingParams { temperature: 0.8, top_k: 40, top_p: 0.95, seed: Some(7) };
    sampled.speculate = Speculation::Off;
    // One that drafts (its request insists) accepts by the speculative
    // sampling rule: another draw from the same distribution, not compared.
    let mut sampled_edit = greedy(Some(QWEN25), &edit("Rename `count` to `k` in this function."), 48);
    sampled_edit.sampling = SamplingParams { temperature: 0.3, top_k: 0, top_p: 1.0, seed: Some(11) };
    sampled_edit.speculate = Speculation::Ngram;
    // A constrained row drafts too: its drafts stand up to the first one
    // its grammar forbids, and its picks are masked per position.
    let keys = r#"{"name": "", "country": "", "population": 0, "river": "", "founded": "", "mayor": ""}"#;
    let mut json = greedy(Some(QWEN25), &format!("Fill in this JSON object for Lyon, keeping every key: {keys}"), 48);
    json.constraint = Some(Constraint::JsonObject);
    let mut logprobs = greedy(Some(QWEN25), &edit("Rename `average` to `mean` in this function."), 24);
    logprobs.logprobs = Some(2);
    let mut stopped = greedy(Some(QWEN25), &edit("Rename the variable `total` to `acc` in this function."), 64);
    stopped.stop = vec!["count += 1".into()];
    let requests = [rename, hints, off, sampled, json, logprobs, stopped, sampled_edit];
    let names =
        ["rename", "type hints", "drafts off", "sampled", "json object", "logprobs", "stop string", "sampled edit"];
    let delays = [0, 0, 60, 120, 120, 200, 250, 250];
    let (with, without) = tokio::join!(together(&drafting, &requests, &delays), together(&plain, &requests, &delays));
    let stats =
        |answers: Vec<(String, mlxbc_client::GenerationStats)>| answers.into_iter().map(|(_, s)| s).collect::<Vec<_>>();
    let (with, without) = (stats(with), stats(without));
    let drafted = &with[7];
    eprintln!(
        "sampled edit: {} tokens, {} of {} drafted accepted",
        drafted.generated_tokens, drafted.accepted_draft_tokens, drafted.draft_tokens
    );
    assert!(drafted.accepted_draft_tokens > 0, "a sampled code edit at temperature 0.3 accepts drafts: {drafted:?}");
    for ((name, w), p) in names.iter().zip(&with).zip(&without).take(7) {
        assert_eq!(w.token_ids, p.token_ids, "{name}: ids in a drafting batch differ from plain decoding");
        assert_eq!((w.stop_reason, &w.stop_string), (p.stop_reason, &p.stop_string), "{name}");
        assert_eq!(w.logprobs.len(), p.logprobs.len(), "{name}: log-probabilities per token");
        for (a, b) in w.logprobs.iter().zip(&p.logprobs) {
            assert!((a.logprob - b.logprob).abs() < 0.05, "{name}: logprob {} against {}", a.logprob, b.logprob);
        }
        eprintln!(
            "{name}: {} tokens, {} of {} drafted accepted",
            w.generated_tokens, w.accepted_draft_tokens, w.draft_tokens
        );
    }
    for i in [2, 3] {
        assert_eq!(with[i].draft_tokens, 0, "{} does not draft", names[i]);
    }
    for i in [0, 1, 4, 5] {
        assert!(with[i].accepted_draft_tokens > 0, "{} accepts drafts: {:?}", names[i], with[i]);
    }
}

/// The default (`auto`): a lone code edit, whose drafts are accepted
/// often, drafts where the measured costs say it pays, with the ids of
/// plain decoding; drafts off for a request means none.
#[tokio::test(flavor = "multi_thread")]
async fn by_default_drafts_are_verified_where_the_cost_model_expects_them_to_pay() {
    let (auto, plain) = (daemon("auto"), daemon("off"));
    let edit = format!("Rename the variable `value` to `v` in this function. Answer with the code only.\n\n{FUNCTION}");
    let request = greedy(Some(QWEN25), &edit, 64);
    let (with, without) = tokio::join!(ask_ok(&auto, request.clone()), ask_ok(&plain, request.clone()));
    assert_eq!(with.token_ids, without.token_ids, "ids with the cost model's drafts differ from plain decoding");
    assert!(with.accepted_draft_tokens >= 10, "a code edit's drafts pay on one row: {with:?}");
    eprintln!(
        "auto: {} of {} drafted accepted; decode {:.1} tok/s, plain {:.1}",
        with.accepted_draft_tokens, with.draft_tokens, with.decode_tokens_per_s, without.decode_tokens_per_s
    );
    let mut off = request;
    off.speculate = Speculation::Off;
    assert_eq!(ask_ok(&auto, off).await.draft_tokens, 0);
    // The model's totals (`mlxbc ps`).
    let status = auto.client().await.status().await.unwrap();
    let qwen = status.loaded.iter().find(|m| m.name == QWEN25).expect("qwen is loaded");
    assert_eq!(qwen.speculation, "auto");
    assert_eq!(
        (qwen.draft_tokens, qwen.accepted_draft_tokens),
        (with.draft_tokens as u64, with.accepted_draft_tokens as u64)
    );
    let ps = auto.cli().arg("ps").output().unwrap();
    let ps = String::from_utf8_lossy(&ps.stdout);
    assert!(ps.contains("SPECULATION") && ps.contains("auto, "), "{ps}");
}

/// Draft models: SmolLM2 (GGUF) drafted for by the same weights in MLX's
/// form (`smollm2-mlx`: nearly every draft accepted) and by a random
/// two-layer model with SmolLM2's tokenizer (`tiny-qwen3`: nearly none),
/// named per request (`--draft`) or in config.toml (`[models."NAME"]
/// draft`). Either way the ids equal plain decoding's; the drafts are
/// loaded beside their model, once each however requests alternate between
/// them, shown by `mlxbc ps`, and a draft that cannot serve
/// (another tokenizer, the model itself, none at all) is refused with a
/// sentence while the daemon keeps answering.
#[tokio::test(flavor = "multi_thread")]
async fn draft_models_draft_and_the_answer_is_the_same() {
    const SAME: &str = "smollm2-mlx";
    const TINY: &str = "tiny-qwen3";
    let opts = DaemonOptions {
        models: vec![
            (SMOLLM2, fixture(&format!("models/{SMOLLM2}"))),
            (QWEN25, fixture(&format!("models/{QWEN25}"))),
            (SAME, fixture("mlx/smollm2-mlx")),
            (TINY, fixture("mlx/tiny-qwen3")),
        ],
        args: vec![],
    };
    let mut d = Daemon::prepare(&opts);
    std::fs::write(d.home.path().join("config.toml"), format!("[models.{SMOLLM2:?}]\ndraft = {TINY:?}\n")).unwrap();
    d.spawn(&opts.args);
    let quote = "Repeat this sentence exactly, twice: The quick brown fox jumps over the lazy dog near the river bank.";
    let mut plain = greedy(Some(SMOLLM2), quote, 40);
    plain.speculate = Speculation::Off;
    let plain = ask_ok(&d, plain).await;
    assert_eq!(plain.draft_tokens, 0);

    // The same weights draft: (nearly) every drafted token is accepted.
    let mut same = greedy(Some(SMOLLM2), quote, 40);
    (same.speculate, same.draft) = (Speculation::Draft, Some(SAME.into()));
    let same = ask_ok(&d, same).await;
    assert_eq!(same.token_ids, plain.token_ids, "drafting with {SAME} changed the answer");
    assert!(
        same.draft_tokens > 0 && same.accepted_draft_tokens * 10 >= same.draft_tokens * 8,
        "the same weights' drafts should be accepted: {} of {}",
        same.accepted_draft_tokens,
        same.draft_tokens
    );
    // A random draft (the configured one, forced): drafts rejected, same answer.
    let mut tiny = greedy(Some(SMOLLM2), quote, 40);
    tiny.speculate = Speculation::Draft;
    let tiny = ask_ok(&d, tiny).await;
    assert_eq!(tiny.token_ids, plain.token_ids, "drafting with {TINY} changed the answer");
    assert!(tiny.draft_tokens > 0, "the configured draft model should have drafted: {tiny:?}");
    // Requests naming the two drafts in turn: both stay loaded beside
    // SmolLM2, each loaded once.
    for _ in 0..2 {
        let mut again = greedy(Some(SMOLLM2), quote, 8);
        (again.speculate, again.draft) = (Speculation::Draft, Some(SAME.into()));
        assert_eq!(ask_ok(&d, again).await.token_ids[..], plain.token_ids[..8]);
        let mut configured = greedy(Some(SMOLLM2), quote, 8);
        configured.speculate = Speculation::Draft;
        assert_eq!(ask_ok(&d, configured).await.token_ids[..], plain.token_ids[..8]);
    }
    let log = d.log_text();
    for draft in [SAME, TINY] {
        let loads = log.lines().filter(|l| l.contains("draft model loaded") && l.contains(draft)).count();
        assert_eq!(loads, 1, "{draft} should have been loaded once, not again in turn with the other:\n{log}");
    }
    let ps = String::from_utf8_lossy(&d.cli().arg("ps").output().unwrap().stdout).to_string();
    assert!(
        ps.contains(&format!("drafts {SAME}, {TINY}")),
        "mlxbc ps should name both draft models, the most recently used last:\n{ps}"
    );

    // Refusals, each a sentence, and the daemon answers afterwards.
    let refused = |model: &str, draft: Option<&str>| {
        let mut r = greedy(Some(model), quote, 4);
        (r.speculate, r.draft) = (Speculation::Draft, draft.map(String::from));
        r
    };
    for (r, says) in [
        (refused(QWEN25, Some(SMOLLM2)), "same tokenizer"),
        (refused(SMOLLM2, Some(SMOLLM2)), "cannot draft for itself"),
        (refused(QWEN25, None), "needs a draft model"),
    ] {
        let e = crate::helper::ask(&d.socket, r).await.expect_err("refused");
        assert!(e.to_string().contains(says), "{e}");
    }
    let after = ask_ok(&d, greedy(Some(SMOLLM2), quote, 40)).await;
    assert_eq!(after.token_ids, plain.token_ids);
}

/// Rows of one batch that draft with a draft model are drafted together,
/// one batched pass of the draft model per drafted position (the daemon's
/// decode profile says how many rows a proposal drafted, on average): rows drafting
/// with the target's own weights (`smollm2-mlx`: nearly every draft
/// accepted, so rows fall two tokens behind), a sampled row (drafts
/// accepted by chance: it rests and sits proposals out), beside rows that
/// draft by prompt lookup or not at all, with a stop string, a grammar and
/// prompts of different lengths arriving at different times. Every greedy
/// answer has the ids of the same requests with drafts off.
#[tokio::test(flavor = "multi_thread")]
async fn rows_with_a_draft_model_draft_together_and_answer_as_without_drafts() {
    const SAME: &str = "smollm2-mlx";
    let opts = DaemonOptions {
        models: vec![(SMOLLM2, fixture(&format!("models/{SMOLLM2}"))), (SAME, fixture("mlx/smollm2-mlx"))],
        args: vec![],
    };
    let d = Daemon::start_with(opts);
    let drafted = |prompt: &str, tokens: u32, draft: bool| {
        let mut r = greedy(Some(SMOLLM2), prompt, tokens);
        (r.speculate, r.draft) = match draft {
            true => (Speculation::Draft, Some(SAME.to_string())),
            false => (Speculation::Ngram, None),
        };
        // Past the end of an answer too: rows that draft live long together.
        r.ignore_eos = true;
        r
    };
    let fox = "Repeat this sentence exactly, twice: The quick brown fox jumps over the lazy dog near the river bank.";
    let list = "List the days of the week, one per line, then list them again in reverse order.";
    let mut stopped = drafted(fox, 48, true);
    stopped.stop = vec!["lazy dog near the river bank".into()];
    stopped.ignore_eos = false;
    let mut json = drafted("Describe Paris as a JSON object with the keys name, country and river.", 40, true);
    (json.constraint, json.ignore_eos) = (Some(Constraint::JsonObject), false);
    let mut sampled = drafted("Write a short story about a lighthouse keeper.", 40, true);
    sampled.sampling = SamplingParams { temperature: 1.0, top_k: 0, top_p: 1.0, seed: Some(5) };
    let mut off = drafted(list, 32, false);
    off.speculate = Speculation::Off;
    let requests = [
        drafted(fox, 48, true),
        drafted(list, 40, true),
        drafted(&format!("{fox} {list}"), 32, true),
        drafted(fox, 40, false),
        stopped,
        json,
        off,
        sampled,
    ];
    let names = ["fox", "days", "both", "fox (prompt lookup)", "stop string", "json", "drafts off", "sampled"];
    let delays = [0, 0, 40, 80, 80, 150, 150, 0];
    let with = together(&d, &requests, &delays).await;
    let plain: Vec<_> = requests
        .iter()
        .cloned()
        .map(|mut r| {
            (r.speculate, r.draft) = (Speculation::Off, None);
            r
        })
        .collect();
    let without = together(&d, &plain, &delays).await;
    for ((name, (_, w)), (_, p)) in names.iter().zip(&with).zip(&without).take(7) {
        eprintln!(
            "{name}: {} tokens, {} of {} drafted accepted",
            w.generated_tokens, w.accepted_draft_tokens, w.draft_tokens
        );
        assert_eq!(w.token_ids, p.token_ids, "{name}: ids drafted in a batch differ from plain decoding");
        assert_eq!((w.stop_reason, &w.stop_string), (p.stop_reason, &p.stop_string), "{name}");
        assert_eq!(p.draft_tokens, 0, "{name}: drafts off");
    }
    for i in [0, 1, 2, 4, 5] {
        let s = &with[i].1;
        assert!(s.accepted_draft_tokens * 10 >= s.draft_tokens * 7 && s.draft_tokens > 0, "{}: {s:?}", names[i]);
    }
    let s = &with[7].1;
    eprintln!(
        "sampled: {} tokens, {} of {} drafted accepted",
        s.generated_tokens, s.accepted_draft_tokens, s.draft_tokens
    );
    assert!(s.draft_tokens > 0 && s.generated_tokens == 40, "the sampled row drafted and answered whole: {s:?}");
    let log = d.log_text();
    let rows: Vec<f64> = log
        .lines()
        .filter_map(|l| l.split("draft models drafted ").nth(1))
        .filter_map(|rest| rest.split(' ').next()?.parse().ok())
        .collect();
    eprintln!("rows a proposal, per profile line: {rows:?}");
    // Drafting apart reads 1.0 (one row a proposal); seen together: 2.2.
    assert!(rows.iter().any(|&r| r > 1.5), "the draft model drafted rows one by one: {rows:?}\n{log}");
}

/// A model keeps its three most recently used draft models: a fourth
/// unloads the least recently used (logged, gone from `mlxbc ps`), and
/// asking for that one again loads it again; the answers stay plain
/// decoding's throughout. (The drafts are one random two-layer model with
/// SmolLM2's tokenizer under four names.)
#[tokio::test(flavor = "multi_thread")]
async fn a_fourth_draft_model_unloads_the_least_recently_used() {
    const DRAFTS: [&str; 4] = ["draft-a", "draft-b", "draft-c", "draft-d"];
    let mut models = vec![(SMOLLM2, fixture(&format!("models/{SMOLLM2}")))];
    models.extend(DRAFTS.iter().map(|&name| (name, fixture("mlx/tiny-qwen3"))));
    let d = Daemon::start_with(DaemonOptions { models, args: vec![] });
    let prompt = "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog.";
    let mut plain = greedy(Some(SMOLLM2), prompt, 8);
    plain.speculate = Speculation::Off;
    let plain = ask_ok(&d, plain).await.token_ids;
    let drafted = |draft: &str| {
        let mut r = greedy(Some(SMOLLM2), prompt, 8);
        (r.speculate, r.draft) = (Speculation::Draft, Some(draft.to_string()));
        r
    };
    // a, b, c, then a again (now the most recent): d unloads b.
    for draft in ["draft-a", "draft-b", "draft-c", "draft-a", "draft-d", "draft-b"] {
        let answer = ask_ok(&d, drafted(draft)).await;
        assert_eq!(answer.token_ids, plain, "drafting with {draft} changed the answer");
        assert!(answer.draft_tokens > 0, "{draft} should have drafted: {answer:?}");
    }
    let log = d.log_text();
    let count = |what: &str, draft: &str| log.lines().filter(|l| l.contains(what) && l.contains(draft)).count();
    for (draft, loads, unloads) in [("draft-a", 1, 0), ("draft-b", 2, 1), ("draft-c", 1, 1), ("draft-d", 1, 0)] {
        assert_eq!(
            (count("draft model loaded", draft), count("draft model unloaded", draft)),
            (loads, unloads),
            "{draft}: loads and unloads\n{log}"
        );
    }
    let ps = String::from_utf8_lossy(&d.cli().arg("ps").output().unwrap().stdout).to_string();
    assert!(ps.contains("drafts draft-a, draft-d, draft-b"), "the three most recently used, the newest last:\n{ps}");
}
