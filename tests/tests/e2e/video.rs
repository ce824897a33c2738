//! Qwen3-VL video through the real daemon on a real socket: greedy ids equal
//! to mlx-vlm's `generate(..., video=[clip])` (goldens from
//! scripts/goldens/mlx_vlm_video.py), every temporal group encoded once
//! and then served from the store (RAM, and disk after a restart, with
//! neither the bytes nor ffmpeg needed), `mlxbc ask --video`, an animated
//! GIF decoded in-process, and bad video refused with a sentence while
//! other clients are served.

use crate::helper::*;
use crate::reference::{check_weights, golden};
use crate::vision::expect_bad_media;
use mlxbc_client::{CacheCommand, ChatMessage, ClientError, ErrorKind, GenerateRequest, GenerationStats, MediaRef};
use std::path::Path;
use std::process::Command;

const QWEN3_VL: &str = "tiny-qwen3-vl";
const QWEN25_VL: &str = "tiny-qwen25-vl";

fn reference_file(name: &str) -> Vec<u8> {
    std::fs::read(workspace().join("tests/fixtures/reference").join(name)).unwrap()
}

fn daemon() -> Daemon {
    Daemon::start_with(DaemonOptions {
        models: vec![
            (QWEN3_VL, fixture("mlx/tiny-qwen3-vl")),
            (QWEN25_VL, fixture("mlx/tiny-qwen25-vl")),
            (SMOLLM2, fixture(&format!("models/{SMOLLM2}"))),
        ],
        args: vec![],
    })
}

fn ask_media(model: &str, media: Vec<MediaRef>, question: &str, steps: u32) -> GenerateRequest {
    let mut r = greedy(Some(model), question, steps);
    let mut m = ChatMessage::user(question);
    m.media = media;
    r.messages = vec![m];
    r
}

async fn ask_ok(socket: &Path, req: GenerateRequest) -> (String, GenerationStats) {
    ask(socket, req).await.unwrap()
}

/// A clip made by ffmpeg here (H.264 in MP4, yuv420p: what phones and
/// screen recorders write).
fn ffmpeg_clip(dir: &Path, name: &str, seconds: u32, extra: &[&str]) -> Vec<u8> {
    let path = dir.join(name);
    let status = Command::new("ffmpeg")
        .args(["-v", "error", "-y", "-f", "lavfi", "-i"])
        .arg(format!("testsrc2=size=96x64:rate=8:duration={seconds}"))
        .args(extra)
        .arg(&path)
        .status()
        .expect("ffmpeg is missing: scripts/install-deps --test installs it (apt install ffmpeg)");
    assert!(status.success());
    std::fs::read(path).unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_video_matches_mlx_vlm_and_is_encoded_once_then_hit_in_ram_and_after_restart() {
    let g = golden("vlm-video");
    let clip = reference_file(g["clip"].as_str().unwrap());
    let image = reference_file(g["image"].as_str().unwrap());
    let question = g["question"].as_str().unwrap();
    check_weights(&fixture("mlx/tiny-qwen3-vl"), &g);
    let mut d = daemon();
    let want = |case: &str| -> (usize, Vec<u32>) {
        let c = &g["cases"][case];
        (c["prompt_ids"].as_array().unwrap().len(), serde_json::from_value(c["generated_ids"].clone()).unwrap())
    };
    let groups = g["cases"]["video"]["video_grid_thw"][0][0].as_u64().unwrap() as u32;

    let (len, ids) = want("video");
    let video_only = ask_media(QWEN3_VL, vec![MediaRef::video(clip.clone())], question, ids.len() as u32);
    let (first, s1) = ask_ok(&d.socket, video_only.clone()).await;
    assert_eq!(s1.prompt_tokens as usize, len, "prompt length (timestamps, groups) as mlx-vlm's processor");
    assert_eq!(s1.token_ids, ids, "greedy ids differ from mlx-vlm generate on the same clip");
    assert_eq!((s1.encoder_hits, s1.encoder_misses), (0, groups), "each temporal group encoded once");

    let (again, s2) = ask_ok(&d.socket, video_only.clone()).await;
    assert_eq!((s2.encoder_hits, s2.encoder_misses), (groups, 0), "the second ask is an encoder hit");
    assert_eq!((again, &s2.token_ids), (first.clone(), &s1.token_ids));
    assert!(s2.prefix_tokens_reused > 0, "the prompt through the clip is reused: {s2:?}");

    // An image and the clip in one message: the image is new, the groups are stored.
    let (len, ids) = want("image+video");
    let mixed = vec![MediaRef::from_bytes(image), MediaRef::video(clip.clone())];
    let (_, s3) = ask_ok(&d.socket, ask_media(QWEN3_VL, mixed, question, ids.len() as u32)).await;
    assert_eq!(s3.prompt_tokens as usize, len);
    assert_eq!(s3.token_ids, ids, "image + video: greedy ids differ from mlx-vlm generate");
    assert_eq!((s3.encoder_hits, s3.encoder_misses), (groups, 1));

    d.terminate();
    d.spawn(&[]);
    let (after, s4) = ask_ok(&d.socket, video_only).await;
    assert_eq!((s4.encoder_hits, s4.encoder_misses), (groups, 0), "still hits after a restart (disk)");
    assert_eq!((after, &s4.token_ids), (first, &s1.token_ids));
    // (The client asks by hash first: a stored clip's bytes are never sent again.)
    let report = d.client().await.cache(CacheCommand::Stats).await.unwrap();
    assert_eq!(report.entries as u32, groups + 1 + 1, "one entry per group, the group times, the image");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_yuv_mp4_a_webm_and_an_animated_gif_are_sampled_and_answered() {
    let d = daemon();
    let dir = tempfile::tempdir().unwrap();
    let mp4 = ffmpeg_clip(dir.path(), "clip.mp4", 3, &["-pix_fmt", "yuv420p", "-c:v", "libx264"]);
    let webm = ffmpeg_clip(dir.path(), "clip.webm", 3, &["-c:v", "libvpx-vp9"]);
    let gif = ffmpeg_clip(dir.path(), "clip.gif", 3, &[]);
    for (name, clip) in [("mp4", mp4), ("webm", webm), ("gif", gif)] {
        let req = ask_media(QWEN3_VL, vec![MediaRef::video(clip)], "What happens?", 3);
        let (_, s1) = ask_ok(&d.socket, req.clone()).await;
        // 3 s at 2 fps: 6 frames, 3 groups.
        assert_eq!(s1.encoder_misses, 3, "{name}: three temporal groups");
        let (_, s2) = ask_ok(&d.socket, req).await;
        assert_eq!((s2.encoder_hits, s2.encoder_misses), (3, 0), "{name}");
        assert_eq!(s2.token_ids, s1.token_ids, "{name}");
    }
}

#[test]
fn cli_ask_video() {
    let d = daemon();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("clip.mp4");
    std::fs::write(&path, reference_file("vlm-video.mp4")).unwrap();
    let p = path.to_str().unwrap();
    let run =
        || d.cli().args(["ask", "--json", "-n", "4", "-m", QWEN3_VL, "--video", p, "What happens?"]).output().unwrap();
    let stats = |out: &std::process::Output| -> serde_json::Value {
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let done: serde_json::Value =
            serde_json::from_str(String::from_utf8_lossy(&out.stdout).lines().last().unwrap()).unwrap();
        done["stats"].clone()
    };
    let first = stats(&run());
    assert_eq!(first["encoder_misses"], 4);
    let second = stats(&run());
    assert_eq!((second["encoder_hits"].as_u64(), second["encoder_misses"].as_u64()), (Some(4), Some(0)));
    assert_eq!(first["token_ids"], second["token_ids"]);
}

/// A copy of tiny-qwen3-vl with a context of 48 positions.
fn short_context_copy(dir: &Path) -> std::path::PathBuf {
    let src = fixture("mlx/tiny-qwen3-vl");
    let out = dir.join("tiny-qwen3-vl-short");
    std::fs::create_dir_all(&out).unwrap();
    for entry in std::fs::read_dir(&src).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), out.join(entry.file_name())).unwrap();
    }
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
    config["text_config"]["max_position_embeddings"] = 48.into();
    std::fs::write(out.join("config.json"), config.to_string()).unwrap();
    out
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_video_gets_clear_errors_and_the_daemon_keeps_serving() {
    let dir = tempfile::tempdir().unwrap();
    let mut d = Daemon::start_with(DaemonOptions {
        models: vec![
            (QWEN3_VL, fixture("mlx/tiny-qwen3-vl")),
            ("tiny-qwen3-vl-short", short_context_copy(dir.path())),
            (QWEN25_VL, fixture("mlx/tiny-qwen25-vl")),
            (SMOLLM2, fixture(&format!("models/{SMOLLM2}"))),
        ],
        args: vec![],
    });
    let clip = reference_file("vlm-video.mp4");
    let one_frame = ffmpeg_clip(dir.path(), "one.mp4", 1, &["-frames:v", "1", "-pix_fmt", "yuv420p"]);
    let still_gif = ffmpeg_clip(dir.path(), "still.gif", 1, &["-frames:v", "1"]);
    let other = tokio::spawn(ask(d.socket.clone(), greedy(Some(SMOLLM2), "What is the capital of France?", 16)));
    let video = |bytes: &[u8]| vec![MediaRef::video(bytes.to_vec())];
    let ask_v = |media| ask_media(QWEN3_VL, media, "?", 4);
    expect_bad_media(&d.socket, ask_v(video(b"not a video at all")), "not a readable video").await;
    expect_bad_media(&d.socket, ask_v(video(&clip[..300])), "video").await;
    expect_bad_media(&d.socket, ask_v(video(&one_frame)), "1 frame(s); at least 2").await;
    expect_bad_media(&d.socket, ask_v(video(&still_gif)), "send a still as an image").await;
    let mut qwen25 = ask_v(video(&clip));
    qwen25.model = Some(QWEN25_VL.into());
    expect_bad_media(&d.socket, qwen25, "takes images but not video").await;
    let mut text_only = ask_v(video(&clip));
    text_only.model = Some(SMOLLM2.into());
    expect_bad_media(&d.socket, text_only, "text-only").await;
    let (text, _) = other.await.unwrap().unwrap();
    assert!(text.contains("Paris"), "another client was served meanwhile");
    let report = d.client().await.cache(CacheCommand::Stats).await.unwrap();
    assert_eq!(report.entries, 0, "nothing was stored for any of them");

    // A clip too long for the context: the daemon says so.
    let mut short = ask_v(video(&clip));
    short.model = Some("tiny-qwen3-vl-short".into());
    match ask(&d.socket, short).await {
        Err(ClientError::Daemon { kind: ErrorKind::ContextOverflow, message }) => {
            assert!(message.contains("context of 48"), "{message}")
        }
        other => panic!("a clip longer than the context must be refused: {other:?}"),
    }

    // Stored now; then without ffmpeg: the stored clip is still answered,
    // a new one gets a sentence naming what to install, GIFs still work.
    let (_, stored) = ask_ok(&d.socket, ask_v(video(&clip))).await;
    d.terminate();
    d.extra_env = vec![("MLXBC_FFMPEG".into(), dir.path().join("no-such-ffmpeg"))];
    d.spawn(&[]);
    let (_, hit) = ask_ok(&d.socket, ask_v(video(&clip))).await;
    assert_eq!((hit.encoder_misses, hit.token_ids), (0, stored.token_ids), "a stored clip needs no ffmpeg");
    expect_bad_media(&d.socket, ask_v(video(&one_frame)), "apt install ffmpeg").await;
    let gif = ffmpeg_clip(dir.path(), "ok.gif", 2, &[]);
    let (_, s) = ask_ok(&d.socket, ask_v(video(&gif))).await;
    assert_eq!(s.encoder_misses, 2, "animated GIFs decode in-process");
    let (text, _) = ask_ok(&d.socket, greedy(Some(SMOLLM2), "What is the capital of France?", 16)).await;
    assert!(text.contains("Paris"));
}
