#!/usr/bin/env python3
"""Gemma 4's mixture-of-experts block (26B-A4B's feed-forward) through mlx-vlm
0.7.10 on tiny-gemma4-moe and its 4-bit copy (make_fixtures.py): prompt ids,
greedy ids and first logits of a text prompt and of an image prompt (the
image at the processor's size, so no resize runs; the image's ids from
mlx-vlm's forward pass, images attending both ways, as mlx_vlm_gemma4.py
records them), for daemon/tests/gemma4.rs.

Usage: mlx_vlm_gemma4_moe.py FIXTURES_MLX_DIR OUT_DIR
       (writes OUT_DIR/gemma4-moe.json and gemma4-moe.safetensors)
"""
import hashlib
import json
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mlx_vlm import load  # noqa: E402
from mlx_vlm_gemma4 import STEPS, case, greedy_forward  # noqa: E402

TEXT = "Name three colours."
QUESTION = "What is in this picture?"
KEPT = 16384


def main():
    fixtures, out = Path(sys.argv[1]), Path(sys.argv[2])
    image = out / "vlm-pipeline-432x336.png"
    golden = {"image": image.name, "reference": f"mlx-vlm {__import__('mlx_vlm').__version__}, mlx {mx.__version__}"}
    tensors = {}
    for family in ("tiny-gemma4-moe", "tiny-gemma4-moe-4bit"):
        model, processor = load(str(fixtures / family))
        g = {"weights_sha256": hashlib.sha256((fixtures / family / "model.safetensors").read_bytes()).hexdigest()}
        for name, text, images in [("text", TEXT, None), ("image", QUESTION, [str(image)])]:
            inputs, g[name] = case(model, processor, text, images)
            forward = greedy_forward(model, inputs, STEPS)
            if forward != g[name]["generated_ids"]:
                g[name]["generate_generated_ids"] = g[name]["generated_ids"]
            g[name]["generated_ids"] = forward
            media = {k: inputs[k] for k in ("pixel_values", "mm_token_type_ids") if inputs.get(k) is not None}
            logits = model(inputs["input_ids"], **media).logits[0, -1, :KEPT].astype(mx.float32)
            mx.eval(logits)
            tensors[f"{family}.{name}.logits"] = logits
            print(family, name, len(g[name]["prompt_ids"]), g[name]["generated_ids"])
        golden[family] = g
    (out / "gemma4-moe.json").write_text(json.dumps(golden, indent=1) + "\n")
    mx.save_safetensors(str(out / "gemma4-moe.safetensors"), tensors)


if __name__ == "__main__":
    main()
