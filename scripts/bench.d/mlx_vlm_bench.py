#!/usr/bin/env python3
"""mlx-vlm's side of the image benchmark, in process, on the same model
directory, image and messages as `mlxbc-bench --image`: time to the first
token of `mlx_vlm.stream_generate` (processor, tower, prefill, first sample)
and the tower alone on the processed pixels. mlx-vlm keeps no features across
requests, so every request pays the encoder. Prints one JSON object.

Usage: mlx_vlm_bench.py MODEL_DIR IMAGE   (venv with mlx[cpu]==0.32.4 mlx-vlm==0.7.10)
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
    model_dir, image = Path(sys.argv[1]), sys.argv[2]
    family = model_dir.name
    model, processor = load(str(model_dir))
    messages = [{"role": "system", "content": "A"},
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    prompt = processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    token = getattr(model.config, "image_token_index", None) or getattr(model.config, "image_token_id", None)
    inputs = prepare_inputs(processor, images=[image], prompts=prompt, image_token_index=token)

    def encode_ms():
        t = time.perf_counter()
        mx.eval(features(model, family, inputs))
        return (time.perf_counter() - t) * 1000

    def ttft_ms():
        t = time.perf_counter()
        for _ in stream_generate(model, processor, prompt, image=[image], max_tokens=1, temperature=0.0):
            break
        return (time.perf_counter() - t) * 1000

    encode_ms(); ttft_ms()  # warm-up
    print(json.dumps({"encode_ms": statistics.median(encode_ms() for _ in range(5)),
                      "ttft_ms": statistics.median(ttft_ms() for _ in range(5))}))


if __name__ == "__main__":
    main()
