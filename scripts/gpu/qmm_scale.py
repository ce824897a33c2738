#!/usr/bin/env python3
"""The projections of a decode step at real size, by batch rows: 36 layers of
a Qwen3-8B-shaped decoder's matmuls (q/k/v fused 4096->6144, o 4096->4096,
gate/up fused 4096->24576, down 12288->4096; attention itself left out),
chained as a step chains them, with the weights packed 4-bit (group 64, as
mlx-community ships 8B models) against the same weights dense f16 and bf16.
ms per step, median of 10 after 3 warm-ups; one line per (form, rows).
Run under each MLX build to compare (issue "The GPU step at real sizes").

usage: qmm_scale.py LABEL"""
import statistics, sys, time
import mlx.core as mx

label = sys.argv[1] if len(sys.argv) > 1 else mx.__version__
mx.random.seed(0)
import os
H, KV, FF, LAYERS = 4096, 1024, 12288, int(os.environ.get("QMM_LAYERS", "36"))
shapes = {"qkv": (H + 2 * KV, H), "o": (H, H), "gate_up": (2 * FF, H), "down": (H, FF)}
dense = [{k: (mx.random.normal(s) * 0.02).astype(mx.float16) for k, s in shapes.items()} for _ in range(LAYERS)]
packed = [{k: mx.quantize(w, group_size=64, bits=4) for k, w in layer.items()} for layer in dense]
bf16 = [{k: w.astype(mx.bfloat16) for k, w in layer.items()} for layer in dense]
mx.eval(dense, packed, bf16)


def proj(w, x):
    if isinstance(w, (tuple, list)):
        return mx.quantized_matmul(x, *w, transpose=True, group_size=64, bits=4)
    if isinstance(w, dict):  # packed, expanded to f16 for this step only
        return x @ mx.dequantize(*w["q"], group_size=64, bits=4).T
    return x @ w.T


def step(layers, x):
    for l in layers:
        a = proj(l["qkv"], x)[..., :H]
        x = x + proj(l["o"], a)
        gu = proj(l["gate_up"], x)
        g, u = gu[..., :FF], gu[..., FF:]
        x = x + proj(l["down"], g * mx.sigmoid(g) * u)
    return x


expanded = [{k: {"q": w} for k, w in layer.items()} for layer in packed]
forms = (("packed", "packed 4-bit g64", packed, mx.float16), ("f16", "dense f16", dense, mx.float16),
         ("bf16", "dense bf16", bf16, mx.bfloat16),
         ("dequant", "packed, dequantized per step", expanded, mx.float16))
wanted = os.environ.get("QMM_FORMS")  # e.g. "packed,dequant"
for key, form, layers, dt in forms:
    if wanted and key not in wanted.split(","):
        continue
    for rows in [int(r) for r in os.environ.get("QMM_ROWS", "1,2,4,8,16,32,64,128").split(",")]:
        x = (mx.random.normal((rows, 1, H)) * 0.1).astype(dt)
        times = []
        for i in range(13):
            mx.synchronize()
            t = time.perf_counter()
            mx.eval(step(layers, x))
            times.append(time.perf_counter() - t)
        ms = statistics.median(times[3:]) * 1e3
        print(f"| {label} | {form} | {rows} | {ms:.2f} | {rows / ms * 1e3:.0f} |", flush=True)
