#!/usr/bin/env python3
"""mlx-vlm's side of the image benchmark, in process, on the same Gemma 3
weights and image as mlxbc-bench --image: time in the vision tower and time to
the first token. mlx-vlm keeps no features across requests, so every request
pays the encoder. Prints one JSON object.

Usage: mlx_vlm_bench.py MODEL_DIR IMAGE   (venv with mlx[cpu]==0.32.4 mlx-vlm==0.7.10)
"""
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from PIL import Image
from mlx_vlm.models.gemma3 import gemma3 as g3
from mlx_vlm.models.gemma3.config import ModelConfig, TextConfig, VisionConfig


def main():
    model_dir, image = Path(sys.argv[1]), sys.argv[2]
    cfg = json.loads((model_dir / "config.json").read_text())
    tc = TextConfig.from_dict(dict(cfg["text_config"], model_type="gemma3_text"))
    vc = VisionConfig.from_dict(dict(cfg["vision_config"], model_type="siglip_vision_model"))
    mc = ModelConfig(text_config=tc, vision_config=vc, model_type="gemma3", image_token_index=cfg["image_token_index"],
                     hidden_size=tc.hidden_size, vocab_size=tc.vocab_size)
    model = g3.Model(mc)
    model.load_weights(list(mx.load(str(model_dir / "model.safetensors")).items()), strict=False)
    mx.eval(model.parameters())
    side = vc.image_size
    px = np.asarray(Image.open(image).convert("RGB").resize((side, side), Image.BICUBIC), dtype=np.float32)
    pixels = mx.array(((px / 255.0 - 0.5) / 0.5)[None].transpose(0, 3, 1, 2))
    n = tc.mm_tokens_per_image
    ids = mx.array([[2, 17, 42] + [cfg["image_token_index"]] * n + [99, 7, 123] * 3])

    def encode_ms():
        t = time.perf_counter()
        h, _, _ = model.vision_tower(pixels.transpose(0, 2, 3, 1), output_hidden_states=True)
        mx.eval(model.multi_modal_projector(h))
        return (time.perf_counter() - t) * 1000

    def ttft_ms():
        t = time.perf_counter()
        emb = model.get_input_embeddings(ids, pixels, mask=mx.ones(ids.shape)).inputs_embeds
        cache = model.language_model.make_cache()
        logits = model.language_model(inputs=ids, inputs_embeds=emb, cache=cache).logits[:, -1]
        int(mx.argmax(logits, axis=-1).item())
        return (time.perf_counter() - t) * 1000

    encode_ms(); ttft_ms()  # warm-up
    print(json.dumps({"encode_ms": statistics.median(encode_ms() for _ in range(5)),
                      "ttft_ms": statistics.median(ttft_ms() for _ in range(5))}))


if __name__ == "__main__":
    main()
