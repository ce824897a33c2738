#!/usr/bin/env python3
"""Where a BERT layer's time goes on MLX's CPU backend: one layer's pieces
for a batch of 64 texts of 240 tokens (MiniLM's shape: hidden 384, 12
heads, FFN 1536), each timed alone (medians of 3), and the element-wise
ones again on two streams at once. Explains `scripts/bench embed`'s gap
to torch: MLX's CPU transcendental functions (erf, exp) are scalar and run
on one thread per stream.
    LD_PRELOAD=libopenblas.so.0 python mlx_cpu_ops.py"""
import statistics, time

import mlx.core as mx
import mlx.nn as nn

B, L, H, I, HEADS = 64, 240, 384, 1536, 12


def t(name, f, n=3):
    mx.eval(f())
    times = []
    for _ in range(n):
        s = time.perf_counter()
        mx.eval(f())
        times.append(time.perf_counter() - s)
    print(f"| {name} | {statistics.median(times) * 1000:.0f} ms |")


x = mx.random.normal((B, L, H))
w_attn, w_up, w_down = mx.random.normal((H, H)), mx.random.normal((I, H)), mx.random.normal((H, I))
h = mx.random.normal((B, L, I))
q = mx.random.normal((B, HEADS, L, H // HEADS))
scores = mx.random.normal((B, HEADS, L, L))
mask = mx.ones((B, 1, 1, L), dtype=mx.bool_)
mx.eval(x, w_attn, w_up, w_down, h, q, scores)
s1, s2 = mx.new_stream(mx.cpu), mx.new_stream(mx.cpu)
print(f"| one BERT layer's piece, {B} x {L} tokens | time |\n|---|---:|")
t("q, k, v and output projections (4 matmuls)", lambda: [x @ w_attn.T for _ in range(4)])
t("FFN matmuls (384 -> 1536 -> 384)", lambda: (x @ w_up.T) @ w_down.T)
t("GELU (erf) over the FFN's 1536", lambda: nn.gelu(h))
t("erf alone", lambda: mx.erf(h))
t("exp alone (same size)", lambda: mx.exp(h))
t("multiply alone (same size)", lambda: h * 0.5)
t("attention (fast SDPA, padding mask)", lambda: mx.fast.scaled_dot_product_attention(q, q, q, scale=0.17, mask=mask))
t("softmax of the attention scores", lambda: mx.softmax(scores, axis=-1))
t("erf on two streams, half each", lambda: [mx.erf(h[: B // 2], stream=s1), mx.erf(h[B // 2:], stream=s2)])
