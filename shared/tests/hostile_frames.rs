//! Frames a hostile local user could send: every declared length is bounded
//! before it is trusted, so none can make a peer allocate more than the
//! frame's own tier (issue "Hostile input cannot hurt it").
//!
//! Before the fix, the 15-byte frame below made `mlxbcd` try to allocate
//! 4 EiB and abort (SIGABRT) inside `WireCodec::decode`.

use bytes::BytesMut;
use mlxbc_shared::codec::{decode_limit, from_payload, to_payload, DaemonCodec};
use mlxbc_shared::*;
use tokio_util::codec::Decoder;

/// bincode's varint marker for "a u64 follows".
const U64_MARKER: u8 = 0xfd;

fn huge(len: u64) -> Vec<u8> {
    let mut v = vec![U64_MARKER];
    v.extend_from_slice(&len.to_le_bytes());
    v
}

fn framed(payload: &[u8]) -> BytesMut {
    let mut b = BytesMut::new();
    b.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    b.extend_from_slice(payload);
    b
}

#[test]
fn the_15_byte_frame_is_refused_not_allocated() {
    // Hello (variant 0), protocol 2, client_version declaring 2^62 bytes.
    let mut payload = vec![0x00, 0x02];
    payload.extend(huge(1 << 62));
    let mut frame = framed(&payload);
    assert_eq!(frame.len(), 15);
    let err = DaemonCodec::default().decode(&mut frame).unwrap_err();
    assert!(matches!(err, FrameError::Malformed(_)), "{err:?}");
    assert!(err.to_string().to_lowercase().contains("limit"), "the error says a limit refused it: {err}");
}

/// Replaces the 8-byte marker value's length prefix with a huge one and
/// drops the marker bytes, so the field declares far more than the frame holds.
fn with_huge_length(payload: &[u8], marker: &[u8], declared: u64) -> Vec<u8> {
    let mut needle = vec![marker.len() as u8];
    needle.extend_from_slice(marker);
    let at = payload.windows(needle.len()).position(|w| w == needle).expect("marker in payload");
    let mut out = payload[..at].to_vec();
    out.extend(huge(declared));
    out.extend_from_slice(&payload[at + needle.len()..]);
    out
}

const M: &str = "ZZZZZZZZ";

/// Every string and byte field of every request, and of the responses a
/// client decodes, declaring 2^62, 2^32 and 65 MiB.
#[test]
fn a_huge_length_in_any_field_is_refused() {
    let with_marker = GenerateRequest::ask(M);
    let image = MediaRef { sha256: [7; 32], bytes: Some(M.as_bytes().to_vec()), kind: MediaKind::Image };
    let mut with_image = GenerateRequest::ask("x");
    with_image.messages[0].media.push(image.clone());
    let requests: Vec<(&str, Request)> = vec![
        ("hello version", Request::Hello { protocol: PROTOCOL_VERSION, client_version: M.into() }),
        ("message text", Request::Generate(with_marker.clone())),
        ("model name", Request::Generate(GenerateRequest { model: Some(M.into()), ..GenerateRequest::ask("x") })),
        ("stop string", Request::Generate(GenerateRequest { stop: vec![M.into()], ..GenerateRequest::ask("x") })),
        ("session name", Request::Generate(GenerateRequest { session: Some(M.into()), ..GenerateRequest::ask("x") })),
        ("image bytes", Request::Generate(with_image)),
        ("load name", Request::Load { model: M.into(), keep_alive: None, sharded: false }),
        ("unload name", Request::Unload { model: M.into() }),
        ("prefetch model", Request::Prefetch { model: Some(M.into()), media: vec![] }),
        ("prefetch bytes", Request::Prefetch { model: None, media: vec![image] }),
        ("session show", Request::Sessions(SessionCommand::Show { name: M.into() })),
        ("session delete", Request::Sessions(SessionCommand::Delete { name: M.into() })),
    ];
    for (what, request) in requests {
        let payload = to_payload(&request).unwrap();
        for declared in [1u64 << 62, 1 << 32, 65 << 20] {
            let bad = with_huge_length(&payload, M.as_bytes(), declared);
            let err = from_payload::<Request>(&bad).expect_err(what);
            assert!(matches!(err, FrameError::Malformed(_)), "{what}: {err:?}");
            let mut frame = framed(&bad);
            assert!(DaemonCodec::default().decode(&mut frame).is_err(), "{what} through the codec");
        }
    }
    let responses = vec![
        ("token", Response::Token { text: M.into() }),
        ("error", Response::Error { kind: ErrorKind::Internal, message: M.into() }),
        ("started", Response::Started { model: M.into(), prompt_tokens: 1 }),
    ];
    for (what, response) in responses {
        let payload = to_payload(&response).unwrap();
        let bad = with_huge_length(&payload, M.as_bytes(), 1 << 62);
        assert!(from_payload::<Response>(&bad).is_err(), "{what}");
    }
}

/// A vector of structures (messages, images) declaring 2^62 elements.
#[test]
fn a_huge_element_count_is_refused() {
    // Generate (variant 1), model None (0), messages: 2^62 of them.
    let mut payload = vec![0x01, 0x00];
    payload.extend(huge(1 << 62));
    payload.extend_from_slice(&[0x01, 0x00]);
    assert!(from_payload::<Request>(&payload).is_err());
    // Prefetch (variant 7), model None, media: 2^62 of them.
    let mut payload = vec![0x07, 0x00];
    payload.extend(huge(1 << 62));
    assert!(from_payload::<Request>(&payload).is_err());
}

/// A genuine payload of every size tier still decodes (the limit refuses lies only).
#[test]
fn honest_payloads_of_every_tier_decode() {
    for len in [10usize, 5_000, 70_000, 2 << 20, 60 << 20] {
        let request = Request::Generate(GenerateRequest::ask("x".repeat(len)));
        let payload = to_payload(&request).unwrap();
        assert!(decode_limit(payload.len()) >= payload.len());
        assert_eq!(from_payload::<Request>(&payload).unwrap(), request, "{len}");
    }
}

/// Honest payloads that claim more memory than they have bytes decode: a
/// long answer's `Done` (each token id a 1-3 byte varint, a 4-byte `u32`
/// decoded; before, a 1,000-token answer's statistics were refused as
/// `LimitExceeded`, found on the H200), a request of many empty messages
/// (one byte each, a whole `ChatMessage` decoded), and a status with many
/// sequences.
#[test]
fn honest_payloads_that_expand_when_decoded_still_decode() {
    for n in [300usize, 1_000, 4_000, 100_000] {
        let stats = mlxbc_shared::GenerationStats {
            model: "m".into(),
            prompt_tokens: 40,
            generated_tokens: n as u32,
            time_to_first_token_ms: 1.0,
            load_ms: 0.0,
            prefill_tokens_per_s: 1.0,
            decode_tokens_per_s: 1.0,
            stop_reason: mlxbc_shared::StopReason::MaxTokens,
            token_ids: (0..n as u32).map(|i| i % 200).collect(),
            encoder_hits: 0,
            encoder_misses: 0,
            encode_ms: 0.0,
            lookup_ms: 0.0,
            preprocess_ms: 0.0,
            prefix_tokens_reused: 0,
            prompt_tokens_from_disk: 0,
            prefill_tokens_computed: 0,
            prefill_ms: 0.0,
            warnings: vec![],
            tool_calls: vec![],
            stop_string: None,
            logprobs: vec![],
            draft_tokens: 0,
            accepted_draft_tokens: 0,
        };
        let done = Response::Done { stats };
        let payload = to_payload(&done).unwrap();
        assert_eq!(from_payload::<Response>(&payload).unwrap(), done, "{n} token ids");
    }
    let mut request = GenerateRequest::ask("");
    request.messages = vec![mlxbc_shared::ChatMessage::user(""); 2_000];
    let request = Request::Generate(request);
    let payload = to_payload(&request).unwrap();
    assert_eq!(from_payload::<Request>(&payload).unwrap(), request, "2,000 empty messages");
}

/// The structure-aware fuzzer: a million decodes (requests and responses)
/// in the suite; `scripts/fuzz` runs ten million and more
/// (`MLXBC_FUZZ_EXECS`, `MLXBC_FUZZ_SEED`).
#[test]
fn fuzzed_frames_never_crash_the_decoder() {
    let executions = std::env::var("MLXBC_FUZZ_EXECS").ok().and_then(|s| s.parse().ok()).unwrap_or(1_000_000);
    let seed = std::env::var("MLXBC_FUZZ_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x6d6c_7862);
    let t = std::time::Instant::now();
    let report = fuzz::run(executions, seed);
    println!(
        "fuzz: {} executions in {:.1} s (seed {seed}): {} decoded, {} refused, {} crashes, {} round-trip failures",
        report.executions,
        t.elapsed().as_secs_f64(),
        report.decoded,
        report.refused,
        report.crashes,
        report.roundtrip_failures
    );
    assert!(report.executions >= executions);
    assert_eq!(report.crashes, 0, "first crashing payload: {:02x?}", report.first_crash);
    assert_eq!(report.roundtrip_failures, 0);
    assert!(report.decoded > executions / 20, "the fuzzer reaches valid values too: {report:?}");
    assert!(report.refused > executions / 20, "and invalid ones: {report:?}");
}
