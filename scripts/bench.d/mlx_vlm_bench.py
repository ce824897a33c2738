#!/usr/bin/env python3
"""mlx-vlm's side of the image benchmark, in process, on the same model
directory, media and messages as `mlxbc-bench --image|--video|--audio`: time
to the first token of `mlx_vlm.stream_generate` (processor, tower, prefill,
first sample) and the tower (and projector) alone on the processed inputs.
mlx-vlm keeps no features across requests here (its `vision_cache` is for
chat turns of one process, and images only), so every request pays the
encoder. Prints one JSON object.

Usage: mlx_vlm_bench.py MODEL_DIR IMAGE|CLIP|WAV [--video|--audio]
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
AUDIO_QUESTION = "What is in this clip?"


def encoder(model, family, medium, inputs):
    """The tower and projector alone on the processor's outputs, per family
    and medium (what mlxbcd's `encode_ms` counts)."""
    gemma4 = family.startswith("tiny-gemma4") or family.startswith("wide-gemma4")
    unified = "unified" in family
    if medium == "audio":
        mel, valid = inputs["input_features"], inputs["input_features_mask"]
        if unified:
            return lambda: model.get_audio_features(mel, valid)
        return lambda: model.embed_audio(model.audio_tower(mel, ~valid.astype(mx.bool_))[0])
    if medium == "video":
        pixels = inputs["pixel_values_videos"]
        if unified:
            return lambda: model.get_video_features(pixels, inputs.get("video_position_ids"))
        if gemma4:
            return lambda: model.embed_vision(model.vision_tower(pixels, inputs.get("video_position_ids")))
        return lambda: model.vision_tower(pixels, inputs["video_grid_thw"])
    if unified:
        return lambda: model.get_image_features(inputs["pixel_values"], inputs.get("image_position_ids"))
    return lambda: features(model, "tiny-gemma4" if gemma4 else family, inputs)


def main():
    model_dir, media = Path(sys.argv[1]), sys.argv[2]
    medium = {"--video": "video", "--audio": "audio"}.get(sys.argv[3] if len(sys.argv) > 3 else "", "image")
    family = model_dir.name
    model, processor = load(str(model_dir))
    messages = [{"role": "system", "content": "A"},
                {"role": "user", "content": [{"type": medium},
                                             {"type": "text", "text": AUDIO_QUESTION if medium == "audio" else QUESTION}]}]
    prompt = processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if "gemma4" in family:
        # mlx-vlm's processor adds a BOS of its own to a media prompt.
        prompt = prompt.removeprefix("<bos>")
    token = getattr(model.config, "image_token_index", None) or getattr(model.config, "image_token_id", None)
    media_kw = {medium: [media]}
    inputs = prepare_inputs(processor, images=[media] if medium == "image" else None,
                            videos=[media] if medium == "video" else None,
                            audio=[media] if medium == "audio" else None, prompts=prompt, image_token_index=token)
    encode = encoder(model, family, medium, inputs)

    def encode_ms():
        t = time.perf_counter()
        mx.eval(encode())
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
