//! Images in, encoded once ever: the real daemon, the tiny Gemma 3 VLM
//! fixture and a real sled store in the daemon's temp home.

use crate::helper::*;
use mlxbc_client::{CacheCommand, ChatMessage, ClientError, ErrorKind, GenerateRequest, GenerationStats, MediaRef};
use std::path::Path;

const VLM: &str = "tiny-gemma3-vlm";

/// A PNG whose pixels depend on `seed`.
pub fn png(w: u32, h: u32, seed: u32) -> Vec<u8> {
    use std::io::Write;
    let mut raw = Vec::new();
    for y in 0..h {
        raw.push(0u8);
        for x in 0..w {
            raw.extend_from_slice(&[
                ((x * seed + y * 3) % 256) as u8,
                ((y * seed) % 256) as u8,
                ((x + y + seed) % 256) as u8,
            ]);
        }
    }
    let mut z = flate2_like::compress(&raw);
    let mut out = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut chunk = |t: &[u8], d: &[u8]| {
        out.write_all(&(d.len() as u32).to_be_bytes()).unwrap();
        let mut td = t.to_vec();
        td.extend_from_slice(d);
        out.write_all(&td).unwrap();
        out.write_all(&crc32fast::hash(&td).to_be_bytes()).unwrap();
    };
    let mut ihdr = w.to_be_bytes().to_vec();
    ihdr.extend_from_slice(&h.to_be_bytes());
    ihdr.extend_from_slice(&[8, 2, 0, 0, 0]);
    chunk(b"IHDR", &ihdr);
    chunk(b"IDAT", &std::mem::take(&mut z));
    chunk(b"IEND", b"");
    out
}

/// zlib with stored (uncompressed) deflate blocks: enough for test images.
mod flate2_like {
    pub fn compress(data: &[u8]) -> Vec<u8> {
        let mut out = vec![0x78, 0x01];
        let chunks: Vec<&[u8]> = data.chunks(65535).collect();
        for (i, c) in chunks.iter().enumerate() {
            out.push(if i + 1 == chunks.len() { 1 } else { 0 });
            out.extend_from_slice(&(c.len() as u16).to_le_bytes());
            out.extend_from_slice(&(!(c.len() as u16)).to_le_bytes());
            out.extend_from_slice(c);
        }
        let (mut a, mut b) = (1u32, 0u32);
        for &x in data {
            a = (a + x as u32) % 65521;
            b = (b + a) % 65521;
        }
        out.extend_from_slice(&((b << 16) | a).to_be_bytes());
        out
    }
}

fn vlm_daemon() -> Daemon {
    Daemon::start_with(DaemonOptions {
        models: vec![(VLM, fixture("mlx/tiny-gemma3-vlm")), (SMOLLM2, fixture(&format!("models/{SMOLLM2}")))],
        args: vec![],
    })
}

fn ask_image(images: &[&[u8]], question: &str) -> GenerateRequest {
    let mut r = greedy(Some(VLM), question, 8);
    let mut m = ChatMessage::user(question);
    m.media = images.iter().map(|b| MediaRef::from_bytes(b.to_vec())).collect();
    r.messages = vec![m];
    r
}

async fn ask_ok(socket: &Path, req: GenerateRequest) -> (String, GenerationStats) {
    ask(socket, req).await.unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn an_image_is_encoded_once_then_hit_in_ram_and_after_restart_on_disk() {
    let mut d = vlm_daemon();
    let img = png(100, 80, 7);
    let (first, s1) = ask_ok(&d.socket, ask_image(&[&img], "What is in this picture?")).await;
    assert_eq!((s1.encoder_hits, s1.encoder_misses), (0, 1));
    assert!(s1.encode_ms > 0.0);
    let (second, s2) = ask_ok(&d.socket, ask_image(&[&img], "What is in this picture?")).await;
    assert_eq!((s2.encoder_hits, s2.encoder_misses), (1, 0), "second ask is a hit");
    assert_eq!(s2.encode_ms, 0.0);
    assert_eq!(second, first, "same answer from stored features");
    assert_eq!(s2.token_ids, s1.token_ids);
    assert!(s2.prefix_tokens_reused > 16, "the prefix through the image is reused: {}", s2.prefix_tokens_reused);
    // A different question about the same image still reuses the prefix.
    let (_, s3) = ask_ok(&d.socket, ask_image(&[&img], "Describe the colours.")).await;
    assert_eq!(s3.encoder_hits, 1);

    d.terminate();
    d.spawn(&[]);
    let (after, s4) = ask_ok(&d.socket, ask_image(&[&img], "What is in this picture?")).await;
    assert_eq!((s4.encoder_hits, s4.encoder_misses), (1, 0), "still a hit after a restart (disk)");
    assert!(s4.prompt_tokens_from_disk > 16, "the prefix through the image comes from disk blocks: {s4:?}");
    assert_eq!(s4.token_ids, s1.token_ids, "ids from disk blocks equal");
    assert_eq!(after, first);
    let report = d.client().await.cache(CacheCommand::Stats).await.unwrap();
    assert_eq!((report.entries, report.disk_hits), (1, 1));
}

#[tokio::test(flavor = "multi_thread")]
async fn one_changed_tower_byte_is_a_different_fingerprint() {
    let copy = tempfile::tempdir().unwrap();
    let src = fixture("mlx/tiny-gemma3-vlm");
    for f in ["config.json", "preprocessor_config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(src.join(f), copy.path().join(f)).unwrap();
    }
    let mut weights = std::fs::read(src.join("model.safetensors")).unwrap();
    let header_len = u64::from_le_bytes(weights[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&weights[8..8 + header_len]).unwrap();
    let start = header["vision_tower.vision_model.post_layernorm.bias"]["data_offsets"][0].as_u64().unwrap() as usize;
    weights[8 + header_len + start] ^= 0x01;
    std::fs::write(copy.path().join("model.safetensors"), weights).unwrap();
    let d = Daemon::start_with(DaemonOptions {
        models: vec![(VLM, fixture("mlx/tiny-gemma3-vlm")), ("changed-vlm", copy.path().to_path_buf())],
        args: vec![],
    });
    let img = png(64, 64, 3);
    let (_, a) = ask_ok(&d.socket, ask_image(&[&img], "What is this?")).await;
    let mut req = ask_image(&[&img], "What is this?");
    req.model = Some("changed-vlm".into());
    let (_, b) = ask_ok(&d.socket, req).await;
    assert_eq!(
        (a.encoder_misses, b.encoder_misses),
        (1, 1),
        "the changed tower does not reuse the original's features"
    );
    assert_eq!(d.client().await.cache(CacheCommand::Stats).await.unwrap().entries, 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_corrupted_stored_value_is_detected_and_re_encoded() {
    let mut d = vlm_daemon();
    let img = png(70, 50, 11);
    let (want, _) = ask_ok(&d.socket, ask_image(&[&img], "What is this?")).await;
    d.terminate();
    {
        // Damage the stored value behind the daemon's back.
        let mut store =
            mlxbc_cache::FeatureStore::open(&d.home.path().join("cache/features"), Default::default()).unwrap();
        let (key, _) = store.list()[0];
        let tree = store.raw_tree();
        let mut v = tree.get(key.to_bytes()).unwrap().unwrap().to_vec();
        let last = v.len() - 1;
        v[last] ^= 0xff;
        tree.insert(key.to_bytes(), v).unwrap();
        store.flush().unwrap();
        assert_eq!(store.shed_ram(), 0);
    }
    d.spawn(&[]);
    let (got, s) = ask_ok(&d.socket, ask_image(&[&img], "What is this?")).await;
    assert_eq!(s.encoder_misses, 1, "the damaged entry is a miss");
    assert_eq!(got, want, "and the answer is still right");
    let report = d.client().await.cache(CacheCommand::Stats).await.unwrap();
    assert_eq!(report.corrupt, 1);
    assert_eq!(report.entries, 1, "re-encoded and stored again");
}

#[tokio::test(flavor = "multi_thread")]
async fn sigkill_during_a_burst_of_writes_leaves_only_correct_entries() {
    let images: Vec<Vec<u8>> = (0..12).map(|i| png(64, 64, 20 + i)).collect();
    // Ground truth: each image's answer from a store that starts empty.
    let truth = vlm_daemon();
    let mut want = Vec::new();
    for img in &images {
        want.push(ask_ok(&truth.socket, ask_image(&[img], "What is this?")).await.0);
    }
    drop(truth);

    let mut d = vlm_daemon();
    let socket = d.socket.clone();
    let media: Vec<MediaRef> = images.iter().map(|b| MediaRef::from_bytes(b.clone())).collect();
    let burst = tokio::spawn(async move {
        let mut c = mlxbc_client::Client::connect(&socket).await.unwrap();
        for m in media {
            if c.prefetch(Some(VLM), vec![m]).await.is_err() {
                break;
            }
        }
    });
    tokio::time::sleep(std::time::Duration::from_millis(150)).await;
    let mut child = d.child.take().unwrap();
    child.kill().unwrap(); // SIGKILL, mid-burst
    child.wait().unwrap();
    let _ = burst.await;
    d.spawn(&[]);
    let verify = d.client().await.cache(CacheCommand::Verify).await.unwrap();
    assert_eq!(verify.removed, 0, "sled and the checksums leave no damaged entry");
    for (img, want) in images.iter().zip(&want) {
        let (got, _) = ask_ok(&d.socket, ask_image(&[img], "What is this?")).await;
        assert_eq!(&got, want, "features served after the kill are correct");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn two_concurrent_asks_on_one_new_image_encode_it_once() {
    let d = vlm_daemon();
    let img = png(80, 60, 5);
    let a = tokio::spawn(ask(d.socket.clone(), ask_image(&[&img], "What is this?")));
    let b = tokio::spawn(ask(d.socket.clone(), ask_image(&[&img], "What is that?")));
    let (_, sa) = a.await.unwrap().unwrap();
    let (_, sb) = b.await.unwrap().unwrap();
    assert_eq!(sa.encoder_misses + sb.encoder_misses, 1, "encoded once: {sa:?} / {sb:?}");
    assert_eq!(sa.encoder_hits + sb.encoder_hits, 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn several_images_in_order_and_prefetch() {
    let d = vlm_daemon();
    let (a, b) = (png(64, 64, 31), png(64, 64, 37));
    let mut c = d.client().await;
    let (encoded, cached) = c.prefetch(Some(VLM), vec![MediaRef::from_bytes(a.clone())]).await.unwrap();
    assert_eq!((encoded, cached), (1, 0));
    let (ab, s) = ask_ok(&d.socket, ask_image(&[&a, &b], "Compare them.")).await;
    assert_eq!((s.encoder_hits, s.encoder_misses), (1, 1), "the prefetched image is already a hit");
    let (ba, _) = ask_ok(&d.socket, ask_image(&[&b, &a], "Compare them.")).await;
    let (ab2, s2) = ask_ok(&d.socket, ask_image(&[&a, &b], "Compare them.")).await;
    assert_eq!(ab2, ab);
    assert_eq!(s2.encoder_hits, 2);
    // Order matters, so the two orders are different prompts.
    let _ = ba;
}

pub(crate) async fn expect_bad_media(socket: &Path, req: GenerateRequest, needle: &str) {
    match ask(socket, req).await {
        Err(ClientError::Daemon { kind: ErrorKind::BadMedia, message }) => {
            assert!(message.contains(needle), "error {message:?} should mention {needle:?}")
        }
        other => panic!("expected BadMedia mentioning {needle:?}, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_media_gets_clear_errors_and_nothing_is_stored() {
    let d = vlm_daemon();
    let full = png(64, 64, 9);
    let mut bomb = png(1, 1, 1);
    bomb[16..20].copy_from_slice(&100_000u32.to_be_bytes());
    bomb[20..24].copy_from_slice(&100_000u32.to_be_bytes());
    let crc = crc32fast::hash(&bomb[12..29]);
    bomb[29..33].copy_from_slice(&crc.to_be_bytes());
    let other = tokio::spawn(ask(d.socket.clone(), greedy(Some(SMOLLM2), "What is the capital of France?", 16)));
    expect_bad_media(&d.socket, ask_image(&[b"just some text, not an image"], "?"), "not an image").await;
    expect_bad_media(&d.socket, ask_image(&[&full[..full.len() / 2]], "?"), "corrupt").await;
    expect_bad_media(&d.socket, ask_image(&[b"II*\0\x08\0\0\0 tiff"], "?"), "unsupported").await;
    expect_bad_media(&d.socket, ask_image(&[&bomb], "?"), "100000x100000").await;
    expect_bad_media(&d.socket, ask_image(&[&full], "one more: <start_of_image>"), "2 image placeholders but 1").await;
    expect_bad_media(&d.socket, ask_image(&[], "none sent: <start_of_image>"), "1 image placeholders but 0").await;
    let mut text_only = ask_image(&[&full], "?");
    text_only.model = Some(SMOLLM2.into());
    expect_bad_media(&d.socket, text_only, "text-only").await;
    let (text, _) = other.await.unwrap().unwrap();
    assert!(text.contains("Paris"), "another client was served meanwhile");
    let report = d.client().await.cache(CacheCommand::Stats).await.unwrap();
    assert_eq!(report.entries, 0, "nothing was stored for any of them");
}

#[test]
fn cli_ask_image_cache_and_prefetch() {
    let d = vlm_daemon();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("x.png");
    std::fs::write(&path, png(64, 48, 17)).unwrap();
    let p = path.to_str().unwrap();
    let pre = d.cli().args(["prefetch", "-m", VLM, p]).output().unwrap();
    assert_eq!(String::from_utf8_lossy(&pre.stdout).trim(), "1 encoded, 0 already stored");
    let out = d.cli().args(["ask", "--json", "-n", "4", "-m", VLM, "--image", p, "What is this?"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let done: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&out.stdout).lines().last().unwrap()).unwrap();
    assert_eq!(done["stats"]["encoder_hits"], 1, "prefetched: the first question is already a hit");
    let ls = String::from_utf8_lossy(&d.cli().args(["cache", "ls"]).output().unwrap().stdout).to_string();
    assert_eq!(ls.lines().count(), 1, "{ls}");
    let verify = String::from_utf8_lossy(&d.cli().args(["cache", "verify"]).output().unwrap().stdout).to_string();
    assert!(verify.contains("1 entries ok, 0 damaged"), "{verify}");
    let clear = String::from_utf8_lossy(&d.cli().args(["cache", "clear"]).output().unwrap().stdout).to_string();
    assert!(clear.contains("removed 1"), "{clear}");
    let stats = String::from_utf8_lossy(&d.cli().args(["cache", "stats"]).output().unwrap().stdout).to_string();
    assert!(stats.contains("entries:   0"), "{stats}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_4bit_mlx_community_style_directory_loads_and_caches_in_every_family() {
    const FAMILIES: [&str; 3] = ["tiny-gemma3-vlm-4bit", "tiny-qwen25-vl-4bit", "tiny-qwen3-vl-4bit"];
    let d = Daemon::start_with(DaemonOptions {
        models: FAMILIES.iter().map(|name| (*name, fixture(&format!("mlx/{name}")))).collect(),
        args: vec![],
    });
    for (name, seed) in FAMILIES.iter().zip(41..) {
        let img = png(64, 64, seed);
        let mut req = ask_image(&[&img], "What is this?");
        req.model = Some(name.to_string());
        let (first, s1) = ask_ok(&d.socket, req.clone()).await;
        let (second, s2) = ask_ok(&d.socket, req).await;
        assert_eq!((s1.encoder_misses, s2.encoder_hits), (1, 1), "{name}");
        assert_eq!(first, second, "{name}");
        assert!(s1.generated_tokens > 0, "{name}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn qwen25_vl_images_are_encoded_once_with_their_own_token_counts() {
    const QWEN: &str = "tiny-qwen25-vl";
    let mut d = Daemon::start_with(DaemonOptions { models: vec![(QWEN, fixture("mlx/tiny-qwen25-vl"))], args: vec![] });
    let ask_q = |img: &[u8]| {
        let mut r = ask_image(&[img], "What is in this picture?");
        r.model = Some(QWEN.into());
        r
    };
    let (small, wide) = (png(60, 60, 3), png(112, 56, 4));
    let (a, sa) = ask_ok(&d.socket, ask_q(&small)).await;
    let (_, sw) = ask_ok(&d.socket, ask_q(&wide)).await;
    assert_eq!((sa.encoder_misses, sw.encoder_misses), (1, 1));
    assert_ne!(sa.prompt_tokens, sw.prompt_tokens, "dynamic resolution: each image has its own token count");
    let (again, s2) = ask_ok(&d.socket, ask_q(&small)).await;
    assert_eq!((s2.encoder_hits, s2.encoder_misses), (1, 0));
    assert!(s2.prefix_tokens_reused > 0);
    assert_eq!(again, a);
    d.terminate();
    d.spawn(&[]);
    let (after, s3) = ask_ok(&d.socket, ask_q(&small)).await;
    assert_eq!(s3.encoder_hits, 1, "an SSD hit after restart, grid recovered from the stored shape");
    assert_eq!(s3.prompt_tokens, sa.prompt_tokens);
    assert_eq!(after, a);
}

/// `NeedMedia` is answered before the job reaches the engine: with the
/// engine busy on another client's long generation, a request naming an
/// image the store lacks (by hash, no bytes) hears `NeedMedia` at once, and
/// the generation is still running when it does.
#[tokio::test(flavor = "multi_thread")]
async fn need_media_is_answered_while_the_engine_is_busy() {
    use mlxbc_client::{Request, Response};
    let d = vlm_daemon();
    // Load the VLM so its preprocessing is known without a load.
    ask_ok(&d.socket, greedy(Some(VLM), "hi", 1)).await;
    let mut long = greedy(Some(VLM), "Tell me a long story.", 600);
    long.ignore_eos = true;
    let mut runner = d.client().await;
    let mut stream = runner.generate(long).await.unwrap();
    while !matches!(stream.next_event().await.unwrap(), Some(Response::Token { .. })) {}
    let mut raw = crate::hostile::raw(&d).await;
    crate::hostile::hello(&mut raw).await;
    let mut req = ask_image(&[&png(90, 70, 13)], "What is this?");
    req.messages[0].media[0].bytes = None;
    let t = std::time::Instant::now();
    crate::hostile::send(&mut raw, &Request::Generate(req)).await;
    let answer = crate::hostile::recv(&mut raw).await;
    let waited = t.elapsed();
    assert!(matches!(answer, Some(Response::NeedMedia { ref missing }) if missing.len() == 1), "{answer:?}");
    // The long generation has not finished: NeedMedia did not wait for it.
    let mut more = 0;
    while let Some(ev) = stream.next_event().await.unwrap() {
        match ev {
            Response::Token { .. } => more += 1,
            Response::Done { .. } => break,
            _ => {}
        }
    }
    assert!(more > 50, "the generation was still running ({more} tokens after NeedMedia, which took {waited:?})");
}
