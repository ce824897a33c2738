#!/usr/bin/env python3
"""Writes a random-weight MLX directory of a real model's shape, 4-bit affine
(group 64) as mlx-community ships them, with the Qwen2.5/3 tokenizer.
Usage: make_big.py OUT_DIR TOKENIZER_DIR SHAPE   (SHAPE: qwen3-8b | qwen3-4b | qwen2.5-0.5b)
(From ../shared/reference/gpu-real-size/, with the Qwen2.5-0.5B shape added.)"""
import json, os, shutil, sys, time
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import qwen2, qwen3

out, tokdir, shape = sys.argv[1], sys.argv[2], sys.argv[3]
SHAPES = {
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, tie_word_embeddings=False),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, tie_word_embeddings=True),
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, tie_word_embeddings=True, model_type="qwen2"),
}
cfg = dict(model_type="qwen3", head_dim=128, rms_norm_eps=1e-6, vocab_size=151936, max_position_embeddings=40960,
           rope_theta=1000000.0, eos_token_id=151645, bos_token_id=151643)
cfg.update(SHAPES[shape])
t0 = time.time()
mx.random.seed(0)
family = qwen2 if cfg["model_type"] == "qwen2" else qwen3
if family is qwen2:
    cfg.pop("head_dim")
model = family.Model(family.ModelArgs.from_dict(cfg))
# Small weights so activations stay finite through 36 layers.
model.update({k: v for k, v in []})
params = dict(tree_flatten(model.parameters()))
params = {k: (mx.random.normal(v.shape, dtype=mx.float16) * 0.02 if v.ndim > 1 else mx.ones(v.shape, mx.float16))
          for k, v in params.items()}
from mlx.utils import tree_unflatten
model.update(tree_unflatten(list(params.items())))
nn.quantize(model, group_size=64, bits=4)
mx.eval(model.parameters())
cfg["quantization"] = {"group_size": 64, "bits": 4}
cfg["torch_dtype"] = "float16"
os.makedirs(out, exist_ok=True)
weights = dict(tree_flatten(model.parameters()))
mx.save_safetensors(os.path.join(out, "model.safetensors"), weights, metadata={"format": "mlx"})
json.dump(cfg, open(os.path.join(out, "config.json"), "w"), indent=1)
for f in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(os.path.join(tokdir, f), out)
size = os.path.getsize(os.path.join(out, "model.safetensors"))
print(f"{shape}: {len(weights)} arrays, {size / 1e9:.2f} GB in {time.time() - t0:.1f} s -> {out}")
