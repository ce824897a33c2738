#!/usr/bin/env python3
"""Greedy ids on CUDA with the daemon's default weights there (f16 copies of
the packed matrices, `batch_weights = "dense"`), against mlx-lm 0.32.2 on
the same directory twice: as loaded (packed, `quantized_matmul`) and with
`mlx_lm.utils.dequantize_model` (the same f16 copies, `x @ W.T`), on the
CPU suite's prompts (scripts/goldens/mlx_lm_reference.py). The dense
reference is the one the daemon should equal exactly; the packed one
shows how far the forms part.

Usage: check_ids_dense.py MLXBC MODEL_NAME MODEL_DIR   (a daemon serving
MODEL_NAME must be reachable through MLXBC_HOME)"""
import sys
from pathlib import Path
import mlx.core as mx
from mlx_lm import load
from mlx_lm.utils import dequantize_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "goldens"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_ids import daemon_ids  # noqa: E402
from mlx_lm_reference import PROMPTS, greedy_ids, long_prompt  # noqa: E402


def first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


mlxbc, name, path = sys.argv[1:4]
packed, tok = load(path)
dense, _ = load(path)
dequantize_model(dense)
mx.eval(dense.parameters())
print(f"device {mx.default_device()}; {name}")
equal = 0
prompts = PROMPTS + [long_prompt(tok)]
for messages in prompts:
    _, ref_dense = greedy_ids(dense, tok, messages)
    _, ref_packed = greedy_ids(packed, tok, messages)
    _, ours = daemon_ids(mlxbc, name, messages)
    d, p = first_diff(ours, ref_dense), first_diff(ours, ref_packed)
    equal += d is None
    print(f"{len(ours)} ids | vs mlx-lm dequantized: {'equal' if d is None else f'differ at {d}'} | "
          f"vs mlx-lm packed: {'equal' if p is None else f'differ at {p}'}", flush=True)
print(f"{equal} of {len(prompts)} equal to mlx-lm on the dequantized weights")
sys.exit(0 if equal == len(prompts) else 1)
