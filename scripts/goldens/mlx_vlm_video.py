#!/usr/bin/env python3
"""mlx-vlm's whole video pipeline on tiny-qwen3-vl, for the daemon to match.

Draws a test clip (16 frames, 100 x 70, 4 fps: a disc moving over a
gradient) and encodes it losslessly (H.264 RGB, `-qp 0`), so every decoder
hands over the same pixels: OpenCV here (mlx-vlm's `load_video`), ffmpeg in
the daemon. Then, as `mlx_vlm.generate(..., video=[clip])` does: frame
sampling (fps, min/max frames from video_preprocessor_config.json), the
Qwen3-VL video processor (one size for the clip, pairs of frames as temporal
groups), `<t.t seconds>` markers per group in the prompt, the tower with its
deepstack, multimodal rope, greedy decoding. Two prompts: the clip alone,
and an image then the clip in one message.

Writes tests/fixtures/reference/vlm-video.json (frame indices, prompt ids,
generated ids, grids) and vlm-video.safetensors (the processed patches and
the tower's features + deepstack, concatenated on the last axis as the
daemon stores them), beside the clip vlm-video.mp4.

Usage: mlx_vlm_video.py FIXTURES_MLX_DIR REFERENCE_DIR
       (venv with mlx[cpu]==0.32.4 mlx-vlm==0.7.10 opencv-python-headless)
"""
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_vlm import generate, load
from mlx_vlm.utils import load_video, prepare_inputs, resolve_video_sampling

FAMILY = "tiny-qwen3-vl"
QUESTION = "What happens in this video?"
STEPS = 8


def test_clip(path: Path):
    """16 frames of 100 x 70 at 4 fps, lossless."""
    y, x = np.mgrid[0:70, 0:100].astype(np.float32)
    frames = []
    for t in range(16):
        disc = ((x - 10 - 5 * t) ** 2 + (y - 35) ** 2) < 12 ** 2
        rgb = np.stack([x / 99 * 255, y / 69 * 255, np.where(disc, 230.0, 40.0 + 8 * t)], axis=-1)
        frames.append(rgb.round().astype(np.uint8))
    raw = np.stack(frames).tobytes()
    subprocess.run(["ffmpeg", "-v", "error", "-y", "-f", "rawvideo", "-pix_fmt", "rgb24", "-s", "100x70",
                    "-r", "4", "-i", "pipe:0", "-c:v", "libx264rgb", "-qp", "0", "-preset", "veryslow",
                    "-movflags", "+faststart", str(path)], input=raw, check=True)


def features(model, inputs):
    feats, deepstack = model.vision_tower(inputs["pixel_values_videos"], inputs["video_grid_thw"])
    return mx.concatenate([feats] + list(deepstack), axis=-1)


def main():
    fixtures, out = Path(sys.argv[1]), Path(sys.argv[2])
    clip, image = out / "vlm-video.mp4", out / "vlm-pipeline.png"
    test_clip(clip)
    model_dir = fixtures / FAMILY
    model, processor = load(str(model_dir))
    sampling = resolve_video_sampling(processor, {})
    _, metadata = load_video(str(clip), sampling)
    golden = {"clip": clip.name, "image": image.name, "question": QUESTION,
              "clip_sha256": hashlib.sha256(clip.read_bytes()).hexdigest(),
              "reference": f"mlx-vlm {__import__('mlx_vlm').__version__}, mlx {mx.__version__}",
              "weights_sha256": hashlib.sha256((model_dir / "model.safetensors").read_bytes()).hexdigest(),
              "frames_indices": list(map(int, metadata.frames_indices)), "source_fps": metadata.fps,
              "cases": {}}
    tensors = {}
    for case, content, images in [("video", [{"type": "video"}], None),
                                  ("image+video", [{"type": "image"}, {"type": "video"}], [str(image)])]:
        messages = [{"role": "user", "content": content + [{"type": "text", "text": QUESTION}]}]
        prompt = processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        inputs = prepare_inputs(processor, images=images, videos=[str(clip)], prompts=prompt,
                                image_token_index=model.config.image_token_id)
        result = generate(model, processor, prompt, image=images, video=[str(clip)], max_tokens=STEPS,
                          temperature=0.0, verbose=False)
        if case == "video":
            feats = features(model, inputs)
            mx.eval(feats)
            tensors["video.patches"] = inputs["pixel_values_videos"]
            tensors["video.features"] = feats
        golden["cases"][case] = {
            "prompt": processor.tokenizer.decode(inputs["input_ids"].tolist()[0]),
            "prompt_ids": inputs["input_ids"].tolist()[0],
            "generated_ids": list(result.token_ids),
            "video_grid_thw": np.array(inputs["video_grid_thw"]).tolist(),
        }
        print(case, len(golden["cases"][case]["prompt_ids"]), golden["cases"][case]["generated_ids"])
    (out / "vlm-video.json").write_text(json.dumps(golden, indent=1) + "\n")
    mx.save_safetensors(str(out / "vlm-video.safetensors"), tensors)


if __name__ == "__main__":
    main()
