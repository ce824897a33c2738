//! Gemma 4 (per-layer inputs, KV-shared layers, sliding windows, images
//! attending both ways) through the real daemon on a real socket, against
//! mlx-vlm 0.7.10's `generate` on the same tiny fixtures (goldens from
//! scripts/reference/mlx_vlm_gemma4.py): greedy ids exactly for text, a long
//! prompt past the window, a follow-up, an image, two images, a video (its
//! frames sampled, `mm:ss` times, every frame attending both ways) and an
//! image then a video (f32 and 4-bit); all at once through continuous
//! batching; the image and the video asked again encoder hits, also after a
//! restart (from the store on disk); and the
//! soft-token budget part of the store's key (a directory asking 140 soft
//! tokens of the same weights misses, and its image has more tokens).

use crate::helper::*;
use crate::reference::{ask_ok, assert_golden, check_weights, golden};
use mlxbc_client::{ChatMessage, GenerateRequest, MediaRef};

const FAMILIES: [&str; 2] = ["tiny-gemma4", "tiny-gemma4-4bit"];

/// The request for golden case `case` of `family`.
fn request(g: &serde_json::Value, family: &str, case: &str) -> GenerateRequest {
    let want = &g[family][case];
    let text = want["text"].as_str().unwrap();
    let mut r = greedy(Some(family), text, want["generated_ids"].as_array().unwrap().len() as u32);
    let image = || {
        MediaRef::from_bytes(
            std::fs::read(workspace().join("tests/fixtures/reference/vlm-pipeline-432x336.png")).unwrap(),
        )
    };
    let video =
        || MediaRef::video(std::fs::read(workspace().join("tests/fixtures/reference/gemma4-video.mp4")).unwrap());
    let media = match case {
        "image" => vec![image()],
        "two_images" => vec![image(), image()],
        "video" => vec![video()],
        "image_video" => vec![image(), video()],
        _ => return r,
    };
    let mut m = ChatMessage::user(text);
    m.images = media;
    r.messages = vec![m];
    r
}

/// The f32 fixture with another soft-token budget: the same weights (a
/// link), a processor config asking `budget` tokens per image.
fn with_budget(budget: u32) -> (tempfile::TempDir, std::path::PathBuf) {
    let src = fixture("mlx/tiny-gemma4");
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("tiny-gemma4-budget");
    std::fs::create_dir(&dir).unwrap();
    for entry in std::fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        std::os::unix::fs::symlink(&path, dir.join(path.file_name().unwrap())).unwrap();
    }
    let config = dir.join("processor_config.json");
    let mut p: serde_json::Value = serde_json::from_slice(&std::fs::read(&config).unwrap()).unwrap();
    std::fs::remove_file(&config).unwrap();
    p["image_processor"]["max_soft_tokens"] = budget.into();
    std::fs::write(&config, serde_json::to_vec(&p).unwrap()).unwrap();
    (tmp, dir)
}

#[tokio::test(flavor = "multi_thread")]
async fn gemma4_matches_mlx_vlm_alone_batched_and_from_the_feature_store() {
    let g = golden("gemma4");
    for family in FAMILIES {
        check_weights(&fixture(&format!("mlx/{family}")), &g[family]);
    }
    let (_tmp, budget_dir) = with_budget(140);
    let mut models: Vec<(&'static str, std::path::PathBuf)> =
        FAMILIES.iter().map(|f| (*f, fixture(&format!("mlx/{f}")))).collect();
    models.push(("tiny-gemma4-140", budget_dir));
    let mut d = Daemon::start_with(DaemonOptions { models, args: vec![] });
    let cases = ["text", "image", "two_images", "video", "image_video", "long", "follow_up"];
    let frames = g["frames_indices"].as_array().unwrap().len() as u32;
    for family in FAMILIES {
        for case in cases {
            let s = ask_ok(&d, request(&g, family, case)).await;
            assert_golden(&g, family, case, &s, "alone");
            if case == "follow_up" {
                assert!(s.prefix_tokens_reused >= 128, "{family}: the long prompt's blocks: {s:?}");
            }
        }
        // The image again: its features from the store, the same answer.
        let s = ask_ok(&d, request(&g, family, "image")).await;
        assert_golden(&g, family, "image", &s, "again");
        assert_eq!((s.encoder_hits, s.encoder_misses), (1, 0), "{family}: the image's features: {s:?}");
        let s = ask_ok(&d, request(&g, family, "video")).await;
        assert_golden(&g, family, "video", &s, "again");
        assert_eq!((s.encoder_hits, s.encoder_misses), (frames, 0), "{family}: every frame stored: {s:?}");
    }
    // All at once: prefills and decode steps share batches.
    let asks = FAMILIES.iter().flat_map(|f| cases.iter().map(move |c| (*f, *c)));
    let answers = futures::future::join_all(asks.clone().map(|(f, c)| ask(&d.socket, request(&g, f, c)))).await;
    for ((family, case), answer) in asks.zip(answers) {
        assert_golden(&g, family, case, &answer.unwrap().1, "all at once");
    }
    // Another budget over the same weights: the key differs, so a miss;
    // 140 soft tokens at most (this image then takes 130, at 70 it took 63).
    let mut r = request(&g, FAMILIES[0], "image");
    r.model = Some("tiny-gemma4-140".into());
    let s = ask_ok(&d, r).await;
    assert_eq!((s.encoder_hits, s.encoder_misses), (0, 1), "a different soft-token budget is a miss: {s:?}");
    let at_70 = g[FAMILIES[0]]["image"]["prompt_ids"].as_array().unwrap().len() as u32;
    assert!(s.prompt_tokens > at_70, "140 soft tokens make a longer prompt: {s:?}");
    // After a restart the image's features come from the store on disk.
    d.terminate();
    d.spawn(&[]);
    for family in FAMILIES {
        let s = ask_ok(&d, request(&g, family, "image")).await;
        assert_golden(&g, family, "image", &s, "after a restart");
        assert_eq!((s.encoder_hits, s.encoder_misses), (1, 0), "{family}: features from disk: {s:?}");
        let s = ask_ok(&d, request(&g, family, "video")).await;
        assert_golden(&g, family, "video", &s, "after a restart");
        assert_eq!((s.encoder_hits, s.encoder_misses), (frames, 0), "{family}: frames from disk: {s:?}");
    }
}
