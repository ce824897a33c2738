//! A structure-aware fuzzer of the wire format, on stable Rust and without
//! dependencies: it builds requests of every variant with arbitrary field
//! values, encodes them, mutates the bytes the ways a hostile peer would
//! (huge declared lengths, varint markers, flips, cuts, splices) and decodes
//! the result as both a [`Request`] and a [`Response`].
//!
//! Used by the frame fuzz test (a million executions in the suite),
//! `scripts/fuzz` (ten million and more), and the end-to-end fuzz of the
//! daemon's dispatcher, which sends [`arbitrary_request`]s to a real daemon.
//! Compiled only with the `fuzz` feature.

use crate::codec::{from_payload, to_payload};
use crate::*;

/// splitmix64: small, fast, and the same sequence for the same seed.
pub struct Rng(u64);

impl Rng {
    /// A generator that repeats for the same seed.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
    /// True with probability 1/n.
    pub fn one_in(&mut self, n: u64) -> bool {
        self.below(n) == 0
    }
    /// A number that is usually small and sometimes an edge value.
    pub fn edgy_u64(&mut self) -> u64 {
        match self.below(6) {
            0 => 0,
            1 => u64::MAX - self.below(2),
            2 => 1 << self.below(64),
            _ => self.below(64),
        }
    }
    /// An f32 that is sometimes NaN, infinite, negative or huge.
    pub fn edgy_f32(&mut self) -> f32 {
        match self.below(8) {
            0 => f32::NAN,
            1 => f32::INFINITY,
            2 => f32::NEG_INFINITY,
            3 => -(self.below(100) as f32),
            4 => f32::MAX,
            _ => self.below(300) as f32 / 100.0,
        }
    }
    /// A short string of ASCII, multi-byte characters, path parts and NULs.
    pub fn string(&mut self) -> String {
        const PIECES: &[&str] =
            &["a", "Z", " ", "\n", "\0", "é", "日本", "🦀", "../", "/", ".", "-", "<|im_end|>", "{{", "%}"];
        let n = if self.one_in(20) { self.below(300) } else { self.below(12) };
        (0..n).map(|_| PIECES[self.below(PIECES.len() as u64) as usize]).collect()
    }
}

fn media(rng: &mut Rng) -> MediaRef {
    let mut sha256 = [0u8; 32];
    sha256.iter_mut().for_each(|b| *b = rng.below(256) as u8);
    let bytes = rng.one_in(3).then(|| (0..rng.below(64)).map(|_| rng.below(256) as u8).collect());
    let kind = if rng.one_in(4) {
        MediaKind::Video
    } else if rng.one_in(8) {
        MediaKind::Audio
    } else {
        MediaKind::Image
    };
    MediaRef { sha256, bytes, kind }
}

fn message(rng: &mut Rng) -> ChatMessage {
    let role = [Role::System, Role::User, Role::Assistant, Role::Tool][rng.below(4) as usize];
    let images = if rng.one_in(6) { (0..rng.below(3)).map(|_| media(rng)).collect() } else { vec![] };
    let tool_calls =
        (0..rng.below(2)).map(|_| ToolCall { id: rng.string(), name: rng.string(), arguments: rng.string() }).collect();
    let tool_call_id = rng.one_in(4).then(|| rng.string());
    ChatMessage { role, content: rng.string(), media: images, tool_calls, tool_call_id }
}

fn keep_alive(rng: &mut Rng) -> Option<KeepAlive> {
    match rng.below(3) {
        0 => None,
        1 => Some(KeepAlive::Forever),
        _ => Some(KeepAlive::Seconds(rng.edgy_u64())),
    }
}

/// A generation request with arbitrary field values; `model` is used as is.
pub fn arbitrary_generate(rng: &mut Rng, model: Option<String>) -> GenerateRequest {
    GenerateRequest {
        model,
        messages: (0..rng.below(4)).map(|_| message(rng)).collect(),
        sampling: SamplingParams {
            temperature: rng.edgy_f32(),
            top_k: rng.edgy_u64() as u32,
            top_p: rng.edgy_f32(),
            seed: rng.one_in(2).then(|| rng.next_u64()),
        },
        max_tokens: rng.edgy_u64() as u32,
        stop: (0..rng.below(3)).map(|_| rng.string()).collect(),
        keep_alive: keep_alive(rng),
        ignore_eos: rng.one_in(4),
        session: rng.one_in(4).then(|| rng.string()),
        constraint: match rng.below(6) {
            0 => Some(Constraint::JsonObject),
            1 => Some(Constraint::JsonSchema(rng.string())),
            2 => Some(Constraint::Regex(rng.string())),
            3 => Some(Constraint::Lark(rng.string())),
            _ => None,
        },
        tools: (0..rng.below(3))
            .map(|_| Tool { name: rng.string(), description: rng.string(), parameters: rng.string() })
            .collect(),
        tool_choice: match rng.below(4) {
            0 => ToolChoice::Auto,
            1 => ToolChoice::None,
            2 => ToolChoice::Required,
            _ => ToolChoice::Function(rng.string()),
        },
        raw: rng.one_in(5).then(|| RawPrompt { prefix: rng.string(), suffix: rng.one_in(2).then(|| rng.string()) }),
        logprobs: rng.one_in(4).then(|| rng.below(40) as u8),
        speculate: match rng.below(4) {
            0 => Speculation::Auto,
            1 => Speculation::Off,
            2 => Speculation::Draft,
            _ => Speculation::Ngram,
        },
        draft: rng.one_in(4).then(|| rng.string()),
        draft_max: rng.one_in(4).then(|| rng.edgy_u64() as u8),
        adapter: rng.one_in(4).then(|| rng.string()),
        kv: KvCacheSpec {
            bits: rng.one_in(3).then(|| rng.edgy_u64() as u8),
            group_size: rng.one_in(3).then(|| rng.edgy_u64() as u16),
            start: rng.one_in(3).then(|| rng.edgy_u64() as u32),
            rotate: rng.one_in(3).then(|| rng.one_in(2)),
            key_bits: rng.one_in(3).then(|| rng.edgy_u64() as u8),
        },
    }
}

/// A request of any variant (Shutdown only when `allow_shutdown`), with
/// arbitrary field values.
pub fn arbitrary_request(rng: &mut Rng, allow_shutdown: bool) -> Request {
    let name = |rng: &mut Rng| rng.one_in(2).then(|| rng.string());
    match rng.below(if allow_shutdown { 10 } else { 9 }) {
        0 => Request::Hello { protocol: rng.edgy_u64() as u32, client_version: rng.string() },
        1 | 2 => {
            let model = name(rng);
            Request::Generate(arbitrary_generate(rng, model))
        }
        3 => Request::ListModels,
        4 => Request::Status,
        5 => Request::Load { model: rng.string(), keep_alive: keep_alive(rng), sharded: false },
        6 => Request::Unload { model: rng.string() },
        7 => Request::Prefetch { model: name(rng), media: (0..rng.below(3)).map(|_| media(rng)).collect() },
        8 => match rng.below(7) {
            6 => Request::Rerank(RerankRequest {
                model: rng.string(),
                query: rng.string(),
                documents: (0..rng.below(4)).map(|_| rng.string()).collect(),
                top_n: rng.one_in(3).then(|| rng.edgy_u64() as u32),
                keep_alive: keep_alive(rng),
                instruction: rng.one_in(3).then(|| rng.string()),
            }),
            5 => Request::Embed(EmbedRequest {
                token_inputs: (0..rng.below(3))
                    .map(|_| (0..rng.below(5)).map(|_| rng.edgy_u64() as u32).collect())
                    .collect(),
                model: rng.string(),
                inputs: (0..rng.below(4)).map(|_| rng.string()).collect(),
                truncate: rng.one_in(2),
                dimensions: rng.one_in(3).then(|| rng.edgy_u64() as u32),
                keep_alive: keep_alive(rng),
                prompt: rng.one_in(3).then(|| rng.string()),
            }),
            0 => Request::Cache([CacheCommand::Stats, CacheCommand::List, CacheCommand::Verify][rng.below(3) as usize]),
            1 => Request::Sessions(SessionCommand::List),
            2 => Request::Sessions(SessionCommand::Show { name: rng.string() }),
            3 => Request::Sessions(SessionCommand::Delete { name: rng.string() }),
            _ => Request::Cache(CacheCommand::Clear),
        },
        _ => Request::Shutdown,
    }
}

/// Bytes that make a bincode varint declare a huge length or value.
fn huge_varint(rng: &mut Rng) -> Vec<u8> {
    let value: u64 = match rng.below(4) {
        0 => 1 << 62,
        1 => u64::MAX,
        2 => (1 << 32) + rng.below(1 << 20),
        _ => (64 << 20) + rng.below(1 << 30),
    };
    let mut v = vec![0xfd];
    v.extend_from_slice(&value.to_le_bytes());
    v
}

/// Mutates an encoded payload in place, one to four times.
pub fn mutate(rng: &mut Rng, bytes: &mut Vec<u8>, other: &[u8]) {
    for _ in 0..1 + rng.below(4) {
        let at = rng.below(bytes.len() as u64 + 1) as usize;
        match rng.below(9) {
            0 if !bytes.is_empty() => {
                let i = at.min(bytes.len() - 1);
                bytes[i] ^= 1 << rng.below(8);
            }
            1 if !bytes.is_empty() => {
                let i = at.min(bytes.len() - 1);
                bytes[i] = [0x00, 0x7f, 0x80, 0xfa, 0xfb, 0xfc, 0xfd, 0xfe, 0xff][rng.below(9) as usize];
            }
            2 => {
                let tail = bytes.split_off(at);
                bytes.extend(huge_varint(rng));
                bytes.extend(tail.into_iter().skip(rng.below(3) as usize));
            }
            3 => bytes.truncate(at),
            4 => bytes.insert(at, rng.below(256) as u8),
            5 if at < bytes.len() => {
                bytes.remove(at);
            }
            6 if !other.is_empty() => {
                let from = rng.below(other.len() as u64) as usize;
                let take = rng.below((other.len() - from) as u64 + 1) as usize;
                let tail = bytes.split_off(at);
                bytes.extend_from_slice(&other[from..from + take]);
                bytes.extend(tail);
            }
            7 => bytes.extend((0..rng.below(16)).map(|_| rng.below(256) as u8)),
            _ => {
                let tail = bytes.split_off(at);
                bytes.extend(huge_varint(rng));
                bytes.extend(tail);
            }
        }
    }
}

/// What a fuzzing run saw.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Report {
    /// Decodes attempted (each mutated payload is decoded as a request and as a response).
    pub executions: u64,
    /// Payloads that decoded to a value (which then had to round-trip).
    pub decoded: u64,
    /// Payloads refused with an error.
    pub refused: u64,
    /// Panics (any is a bug), with the first payload that caused one.
    pub crashes: u64,
    pub first_crash: Option<Vec<u8>>,
    /// Decoded values that did not re-encode and decode to themselves.
    pub roundtrip_failures: u64,
}

fn check<T: serde::Serialize + serde::de::DeserializeOwned + PartialEq + std::fmt::Debug>(
    bytes: &[u8],
    report: &mut Report,
) {
    report.executions += 1;
    match std::panic::catch_unwind(|| from_payload::<T>(bytes)) {
        Err(_) => {
            report.crashes += 1;
            report.first_crash.get_or_insert_with(|| bytes.to_vec());
        }
        Ok(Err(_)) => report.refused += 1,
        Ok(Ok(value)) => {
            report.decoded += 1;
            // NaN never equals itself; compare the re-encoded bytes instead.
            let again = to_payload(&value).ok().and_then(|b| from_payload::<T>(&b).ok().map(|v| (b, v)));
            match again {
                Some((b, v)) if to_payload(&v).ok().as_deref() == Some(&b[..]) => {}
                _ => report.roundtrip_failures += 1,
            }
        }
    }
}

/// Runs `executions` decodes from `seed`.
pub fn run(executions: u64, seed: u64) -> Report {
    let mut rng = Rng::new(seed);
    let mut report = Report::default();
    let mut previous = Vec::new();
    while report.executions < executions {
        let request = arbitrary_request(&mut rng, true);
        let mut bytes = to_payload(&request).expect("any request encodes");
        // An unmutated payload must decode to itself.
        if rng.one_in(8) {
            report.executions += 1;
            match from_payload::<Request>(&bytes) {
                Ok(back) if to_payload(&back).ok() == Some(bytes.clone()) => report.decoded += 1,
                _ => report.roundtrip_failures += 1,
            }
        }
        let original = bytes.clone();
        mutate(&mut rng, &mut bytes, &previous);
        check::<Request>(&bytes, &mut report);
        check::<Response>(&bytes, &mut report);
        previous = original;
    }
    report
}
