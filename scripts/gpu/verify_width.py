"""Forwards of 1, 2, 4 and 9 positions over a growing KV cache (30 each,
from 600 positions), mlx-lm's model of the Qwen2.5-0.5B shape on the GPU:
what a speculative verify pass costs MLX itself; with
MLX_CUDA_USE_CUDNN_SDPA=0 without cuDNN's attention, which builds a plan
per key length (docs/measurements/h100-2026-12-07b-kv-verify.md).
Run after `real-size.sh install`."""
import time, sys
import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

model, _ = load(sys.argv[1] if len(sys.argv) > 1 else "/tmp/models/qwen2.5-0.5b-4bit")
for width in (1, 9, 1, 9, 4, 2):
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([list(range(600))]), cache=cache))
    times = []
    for i in range(30):
        x = mx.array([[5 + i] * width])
        t = time.perf_counter(); y = model(x, cache=cache); mx.eval(y); times.append(time.perf_counter() - t)
    times.sort()
    print(f"width {width}: median {times[15]*1e3:.2f} ms, min {times[0]*1e3:.2f}, max {times[-1]*1e3:.2f}", flush=True)
