#!/usr/bin/env python3
"""mlx-community style bf16 and 4-bit directories of the late-2026 families
(make_fixtures.py's -bf16 and -4bit copies) through mlx-vlm 0.7.10: that
`mlx_vlm.load()` runs each, and the first logits of a text prompt in mlx-vlm's
own arithmetic (bf16 for the bf16 copies), and in f32 arithmetic on the very
same weights (the model's bf16 parameters cast up after loading: what the
daemon computes on CPU), for daemon/tests/dtype_dirs.rs.

Usage: mlx_vlm_dtype_dirs.py FIXTURES_MLX_DIR OUT_DIR
       (writes OUT_DIR/dtype-dirs.json and dtype-dirs.safetensors)
"""
import hashlib
import json
import sys
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_map
from mlx_vlm import load

DIRS = ["tiny-qwen3-vl-bf16", "tiny-qwen3_5-bf16", "tiny-gemma4-bf16", "tiny-gemma4-unified-bf16",
        "tiny-gemma4-unified-4bit"]
TEXT = "Name three colours."
KEPT = 16384


def main():
    fixtures, out = Path(sys.argv[1]), Path(sys.argv[2])
    golden, tensors = {"text": TEXT, "reference": f"mlx-vlm {__import__('mlx_vlm').__version__}, mlx {mx.__version__}"}, {}
    for name in DIRS:
        model, processor = load(str(fixtures / name))
        messages = [{"role": "user", "content": [{"type": "text", "text": TEXT}]}]
        prompt = processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = processor.tokenizer.encode(prompt, add_special_tokens=False)
        dtype = str(model.language_model.model.embed_tokens.weight.dtype)
        logits = model.language_model(mx.array([ids])).logits[0, -1, :KEPT].astype(mx.float32)
        mx.eval(logits)
        tensors[f"{name}.logits"] = logits
        if name.endswith("-bf16"):
            model.update(tree_map(lambda a: a.astype(mx.float32) if a.dtype == mx.bfloat16 else a, model.parameters()))
            up = model.language_model(mx.array([ids])).logits[0, -1, :KEPT].astype(mx.float32)
            mx.eval(up)
            tensors[f"{name}.logits_f32"] = up
        golden[name] = {"weights_sha256": hashlib.sha256((fixtures / name / "model.safetensors").read_bytes()).hexdigest(),
                        "prompt_ids": ids, "dtype": dtype}
        print(name, len(ids), golden[name]["dtype"], int(mx.argmax(logits).item()))
    (out / "dtype-dirs.json").write_text(json.dumps(golden, indent=1) + "\n")
    mx.save_safetensors(str(out / "dtype-dirs.safetensors"), tensors)


if __name__ == "__main__":
    main()
