#!/usr/bin/env python3
"""An 8B step's projections by row count, three ways: MLX's quantized
matmul with the activations as a decode batch gives them (`[rows, 1,
in]`), the same with them flattened to a matrix (`[rows, in]`), and dense
f16 copies (`[rows, in]`, cuBLAS). The launch-cost table
(launch_costs.py) found a 16-row `quantized_matmul` over a 2-D input
costing what a one-row one does, where a decode batch's 3-D input has
cost linear in rows (docs/measurements/gpu-2026-12-04-quantized-matmul-by-rows.md):
this says whether that holds at real sizes, with weights that do not sit
in L2 (36 layers of distinct matrices, 4.6 GB packed).

Prints per rows: ms per step (all 36 layers' q/k/v, o, gate/up, down
projections, evaluated once; median of 5) for each way.
Usage: qmm_rows.py [ROWS,...]
"""
import statistics, sys, time

import mlx.core as mx

ROWS = [int(r) for r in (sys.argv[1] if len(sys.argv) > 1 else "1,2,4,8,16,32,64").split(",")]
H, Q, KV, FF, LAYERS = 4096, 4096, 1024, 12288, 36
SHAPES = [(Q + 2 * KV, H), (H, Q), (2 * FF, H), (H, FF)]  # fused q/k/v, o, fused gate/up, down
dt = mx.float16


def main():
    mx.random.seed(0)
    layers = []
    for _ in range(LAYERS):
        mats = []
        for out, inp in SHAPES:
            w = (mx.random.normal((out, inp)) * 0.02).astype(dt)
            q = mx.quantize(w, group_size=64, bits=4)
            mx.eval(q)
            mats.append(q)
        layers.append(mats)
    print(f"mlx {mx.__version__}, {mx.default_device()}; {LAYERS} layers of 4-bit g64 weights; ms per step, median of 5")
    # Dense copies of the first 18 layers only (8 GB; their time is doubled).
    dense = [[mx.dequantize(*q, group_size=64, bits=4) for q in mats] for mats in layers[:18]]
    mx.eval(dense)
    print("| rows | packed, [rows, 1, in] | packed, [rows, in] | dense f16 (x2 of 18 layers) |")
    print("|---:|---:|---:|---:|")

    # Distinct rows, made and evaluated before timing. (Until 2026-12-05c
    # this used mx.ones: a broadcast array whose rows all share one
    # buffer, which MLX's 2-D quantized matmul computed as if it were one
    # row; the "4.6 ms at 16 rows" in h100-2026-12-05b-batched-host.md came
    # from that. With real rows: step_parts.py, 14.8 ms.)
    inputs = {}

    def x_of(rows, inp, flat):
        key = (rows, inp, flat)
        if key not in inputs:
            inputs[key] = (mx.random.normal((rows, inp) if flat else (rows, 1, inp)) * 0.5).astype(dt)
            mx.eval(inputs[key])
        return inputs[key]

    def step(rows, flat):
        outs = []
        for mats in layers:
            for (w, s, b), (_, inp) in zip(mats, SHAPES):
                outs.append(mx.quantized_matmul(x_of(rows, inp, flat), w, s, b, transpose=True, group_size=64, bits=4))
        return outs

    def dense_step(rows):
        outs = []
        for mats in dense:
            for w, (_, inp) in zip(mats, SHAPES):
                outs.append(x_of(rows, inp, True) @ w.T)
        return outs

    def timed(make):
        mx.eval(make())
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            mx.eval(make())
            ts.append((time.perf_counter() - t0) * 1000)
        return statistics.median(ts)

    for rows in ROWS:
        a = timed(lambda: step(rows, False))
        b = timed(lambda: step(rows, True))
        c = 2 * timed(lambda: dense_step(rows))
        print(f"| {rows} | {a:.2f} | {b:.2f} | {c:.2f} |", flush=True)
    # The flattened product equals the batched one.
    (w, s, b) = layers[0][0]
    x = (mx.random.normal((16, 1, H)) * 0.5).astype(dt)
    one = mx.quantized_matmul(x, w, s, b, transpose=True, group_size=64, bits=4)
    two = mx.quantized_matmul(x.reshape(16, H), w, s, b, transpose=True, group_size=64, bits=4).reshape(16, 1, -1)
    print(f"max |[rows,1,in] - [rows,in]| at 16 rows: {mx.abs(one - two).max().item():.3g}")


if __name__ == "__main__":
    main()
