#!/usr/bin/env python3
"""Where an 8B-shaped decode step goes, part by part, per batch rows (issue
"The GPU step at real sizes"): each part of a Qwen3-8B-shaped step (36
layers, hidden 4096, 32 query / 8 KV heads of 128, MLP 12288, vocabulary
151936) timed alone on synthetic arrays, 256 cached positions per row:

  projections   q/k/v, o, gate/up, down of 36 layers: packed 4-bit (MLX),
                dense f16 copies, packed expanded per step
  attention     MLX's fused attention over 36 layers' caches, with the
                padding mask as an array (a batch of left-padded rows) and
                without one (what per-row lengths would allow)
  cache update  writing the new position's keys and values in 36 layers
  LM head       packed and dense
  sampling      argmax over the vocabulary; a sampled pick (temperature)

ms, median of 8 after 3 warm-ups. Usage: step_parts.py"""
import statistics, time
import mlx.core as mx

H, HEADS, KVH, D, FF, V, LAYERS, CTX = 4096, 32, 8, 128, 12288, 151936, 36, 256


def timed(fn):
    ts = []
    for _ in range(11):
        mx.synchronize()
        t = time.perf_counter()
        mx.eval(fn())
        ts.append(time.perf_counter() - t)
    return statistics.median(ts[3:]) * 1e3


mx.random.seed(0)
f16 = mx.float16
shapes = {"qkv": (H + 2 * KVH * D, H), "o": (H, H), "gate_up": (2 * FF, H), "down": (H, FF)}
dense = [{k: (mx.random.normal(s) * 0.02).astype(f16) for k, s in shapes.items()} for _ in range(LAYERS)]
packed = [{k: mx.quantize(w, group_size=64, bits=4) for k, w in l.items()} for l in dense]
head_d = (mx.random.normal((V, H)) * 0.02).astype(f16)
head_p = mx.quantize(head_d, group_size=64, bits=4)
mx.eval(dense, packed, head_d, head_p)


def proj(kind, w, x):
    if kind == "packed":
        return mx.quantized_matmul(x, *w, transpose=True, group_size=64, bits=4)
    if kind == "expand":
        return x @ mx.dequantize(*w, group_size=64, bits=4).T
    return x @ w.T


def projections(kind, x):
    layers = dense if kind == "dense" else packed
    for l in layers:
        a = proj(kind, l["qkv"], x)[..., :H]
        x = x + proj(kind, l["o"], a)
        gu = proj(kind, l["gate_up"], x)
        x = x + proj(kind, l["down"], gu[..., :FF] * mx.sigmoid(gu[..., FF:]))
    return x


print("| rows | projections packed | projections packed, flattened (the daemon on CUDA) | projections dense f16 | projections expanded | attention, array mask | "
      "attention, no mask | cache update | LM head packed | LM head packed, flattened | LM head dense | argmax | sampled pick |")
print("|---:|" + "---:|" * 12)
for rows in (1, 4, 16, 64):
    x = (mx.random.normal((rows, 1, H)) * 0.1).astype(f16)
    q = (mx.random.normal((rows, HEADS, 1, D))).astype(f16)
    ks = [(mx.random.normal((rows, KVH, CTX + 1, D))).astype(f16) for _ in range(LAYERS)]
    vs = [(mx.random.normal((rows, KVH, CTX + 1, D))).astype(f16) for _ in range(LAYERS)]
    # Rows left-padded by 0..rows-1 positions, as a batch of prompts of different lengths.
    pad = mx.arange(rows)[:, None] > mx.arange(CTX + 1)[None, :]
    mask = mx.where(pad, mx.array(-mx.inf, f16), mx.array(0, f16))[:, None, None, :]
    kbuf = [mx.zeros((rows, KVH, CTX + 64, D), f16) for _ in range(LAYERS)]
    newk = (mx.random.normal((rows, KVH, 1, D))).astype(f16)
    logits = (mx.random.normal((rows, V))).astype(f16)
    mx.eval(x, q, ks, vs, mask, kbuf, newk, logits)
    scale = D ** -0.5

    def attn(m):
        return [mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=m) for k, v in zip(ks, vs)]

    def cache_update():
        out = []
        for b in kbuf:
            b[..., CTX:CTX + 1, :] = newk
            out.append(b)
        return out

    def sampled():
        return mx.random.categorical(logits.astype(mx.float32) / 0.7)

    flat = x.reshape(rows, H)
    cols = [timed(lambda: projections("packed", x)), timed(lambda: projections("packed", flat)),
            timed(lambda: projections("dense", x)),
            timed(lambda: projections("expand", x)), timed(lambda: attn(mask)), timed(lambda: attn(None)),
            timed(cache_update), timed(lambda: mx.quantized_matmul(x, *head_p, transpose=True, group_size=64, bits=4)),
            timed(lambda: mx.quantized_matmul(flat, *head_p, transpose=True, group_size=64, bits=4)),
            timed(lambda: x @ head_d.T), timed(lambda: mx.argmax(logits, axis=-1)), timed(sampled)]
    print(f"| {rows} | " + " | ".join(f"{c:.2f}" for c in cols) + " |", flush=True)
