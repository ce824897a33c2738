//! Qwen3.5 (the hybrid Gated DeltaNet / gated-attention decoder with
//! Qwen3-VL's tower) through the real daemon on a real socket, against
//! mlx-vlm 0.7.10's `generate` on the same tiny fixtures (goldens from
//! scripts/goldens/mlx_vlm_qwen3_5.py): greedy ids exactly for text, a
//! long prompt, a follow-up, an image, two images and a video (f32 and
//! 4-bit); the recurrent state
//! through continuous batching (all at once, the same ids); and the prompt
//! cache, which reuses a prefix only where its state was stored — from RAM,
//! and from disk after a restart — with the same ids.

use crate::helper::*;
use crate::reference::{ask_ok, assert_golden, check_weights, golden};
use mlxbc_client::{ChatMessage, GenerateRequest, MediaRef};

const FAMILIES: [&str; 2] = ["tiny-qwen3_5", "tiny-qwen3_5-4bit"];

fn daemon() -> Daemon {
    Daemon::start_with(DaemonOptions {
        models: FAMILIES.iter().map(|f| (*f, fixture(&format!("mlx/{f}")))).collect(),
        args: vec![],
    })
}

/// The request for golden case `case` of `family`.
fn request(g: &serde_json::Value, family: &str, case: &str) -> GenerateRequest {
    let want = &g[family][case];
    let text = want["text"].as_str().unwrap();
    let mut r = greedy(Some(family), text, want["generated_ids"].as_array().unwrap().len() as u32);
    let file = |name: &str| std::fs::read(workspace().join("tests/fixtures/reference").join(name)).unwrap();
    let media = match case {
        "image" => vec![MediaRef::from_bytes(file(g["image"].as_str().unwrap()))],
        "two_images" => vec![MediaRef::from_bytes(file(g["image"].as_str().unwrap())); 2],
        "video" => vec![MediaRef::video(file("vlm-video.mp4"))],
        _ => return r,
    };
    let mut m = ChatMessage::user(text);
    m.media = media;
    r.messages = vec![m];
    r
}

#[tokio::test(flavor = "multi_thread")]
async fn qwen3_5_matches_mlx_vlm_alone_batched_and_from_the_prompt_cache() {
    let g = golden("qwen3_5");
    for family in FAMILIES {
        check_weights(&fixture(&format!("mlx/{family}")), &g[family]);
    }
    let mut d = daemon();
    let cases = ["text", "image", "two_images", "video", "long", "follow_up"];
    for family in FAMILIES {
        // One at a time: `long` stores its first two blocks with the
        // states after them; `follow_up` shares them.
        for case in cases {
            let s = ask_ok(&d, request(&g, family, case)).await;
            assert_golden(&g, family, case, &s, "alone");
            if case == "follow_up" {
                assert_eq!(s.prefix_tokens_reused, 128, "{family}: the long prompt's stored prefix: {s:?}");
                assert_eq!(s.prefill_tokens_computed + s.prefix_tokens_reused, s.prompt_tokens);
            }
            if case == "long" {
                assert_eq!(s.prefix_tokens_reused, 0, "{family}: nothing stored yet");
            }
        }
        // The image asked again: its prefix up to the image's end (a tail
        // block, with the states after it) and its features are reused.
        let s = ask_ok(&d, request(&g, family, "image")).await;
        assert_golden(&g, family, "image", &s, "again");
        assert!(s.prefix_tokens_reused > 0 && s.encoder_hits == 1, "{family}: the image's prefix and features: {s:?}");
    }
    // All at once: their decode steps share batches (rows joining and
    // leaving with their recurrent states), their prefixes come from RAM.
    let asks = FAMILIES.iter().flat_map(|f| cases.iter().map(move |c| (*f, *c)));
    let answers = futures::future::join_all(asks.clone().map(|(f, c)| ask(&d.socket, request(&g, f, c)))).await;
    for ((family, case), answer) in asks.zip(answers) {
        assert_golden(&g, family, case, &answer.unwrap().1, "all at once");
    }
    // After a restart the prefix and its states come from disk.
    d.terminate();
    d.spawn(&[]);
    for family in FAMILIES {
        let s = ask_ok(&d, request(&g, family, "follow_up")).await;
        assert_golden(&g, family, "follow_up", &s, "after a restart");
        assert!(s.prompt_tokens_from_disk >= 128, "{family}: from disk: {s:?}");
    }
}
