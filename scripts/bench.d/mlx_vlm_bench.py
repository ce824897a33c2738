#!/usr/bin/env python3
"""mlx-vlm's side of the image benchmark, in process, on the same model
directory, image and messages as `mlxbc-bench --image`: time to the first
token of `mlx_vlm.stream_generate` (processor, tower, prefill, first sample)
and the tower alone on the processed pixels. mlx-vlm keeps no features across
requests, so every request pays the encoder. Prints one JSON object.
With --video the file is a clip (`stream_generate(..., video=[clip])`).

Usage: mlx_vlm_bench.py MODEL_DIR IMAGE|CLIP [--video]
       (venv with mlx[cpu]==0.32.4 mlx-vlm==0.7.10, opencv-python-headless for --video)
"""
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_vlm import load, stream_generate
from mlx_vlm.utils import prepare_inputs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reference"))
from mlx_vlm_pipeline import features  # noqa: E402

QUESTION = "What is in this picture?"


def main():
    model_dir, media = Path(sys.argv[1]), sys.argv[2]
    video = "--video" in sys.argv[3:]
    family = model_dir.name
    model, processor = load(str(model_dir))
    messages = [{"role": "system", "content": "A"},
                {"role": "user", "content": [{"type": "video" if video else "image"},
                                             {"type": "text", "text": QUESTION}]}]
    prompt = processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    token = getattr(model.config, "image_token_index", None) or getattr(model.config, "image_token_id", None)
    media_kw = {"video": [media]} if video else {"image": [media]}
    inputs = prepare_inputs(processor, images=None if video else [media], videos=[media] if video else None,
                            prompts=prompt, image_token_index=token)

    def encode_ms():
        t = time.perf_counter()
        if video:
            mx.eval(model.vision_tower(inputs["pixel_values_videos"], inputs["video_grid_thw"]))
        else:
            mx.eval(features(model, family, inputs))
        return (time.perf_counter() - t) * 1000

    def ttft_ms():
        t = time.perf_counter()
        for _ in stream_generate(model, processor, prompt, max_tokens=1, temperature=0.0, **media_kw):
            break
        return (time.perf_counter() - t) * 1000

    encode_ms(); ttft_ms()  # warm-up
    print(json.dumps({"encode_ms": statistics.median(encode_ms() for _ in range(5)),
                      "ttft_ms": statistics.median(ttft_ms() for _ in range(5))}))


if __name__ == "__main__":
    main()
