#!/usr/bin/env python3
"""mlx-lm's side of scripts/bench: the same measurements as mlxbc-bench, in
process, on the same weights, printed as one JSON object.

Usage: mlx_lm_bench.py MODEL_DIR PROMPT_TOKENS DECODE_TOKENS [dense|packed]
  dense:  quantized layers dequantized to f32 (what mlxbcd does on CPU)
  packed: mlx-lm's default, quantized matmuls with the checkpoint's scales
"""
import json
import resource
import statistics
import sys
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.utils import dequantize_model


TTFT_PROMPT_TOKENS = 50  # as mlxbc-bench


def main():
    model_dir, n_prompt, n_decode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    form = sys.argv[4] if len(sys.argv) > 4 else "dense"
    model, tokenizer = load(model_dir)
    if form == "dense":
        model = dequantize_model(model)
        mx.eval(model.parameters())
    short = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                          add_generation_prompt=True)
    # prompts of exactly n tokens, as mlxbc-bench builds them
    filler = tokenizer.encode(" the quick brown fox jumps over the lazy dog" * 200)
    sized = lambda n: (short[:-5] + filler)[: n - 5] + short[-5:]
    long, ttft_prompt = sized(n_prompt), sized(TTFT_PROMPT_TOKENS)

    def first_token_s(prompt):
        t = time.perf_counter()
        tok, _ = next(generate_step(mx.array(prompt), model, max_tokens=1))
        int(tok)
        return time.perf_counter() - t

    first_token_s(ttft_prompt)  # warm-up
    ttft = statistics.median(first_token_s(ttft_prompt) for _ in range(5))
    # Packed 4-bit prefill runs at ~10 tok/s on CPU: one run is enough to see
    # it there. On a GPU the first run at a new shape compiles kernels: warm up.
    on_gpu = mx.default_device() == mx.gpu
    if on_gpu:
        first_token_s(long)
    prefill = statistics.median(len(long) / first_token_s(long) for _ in range(3 if form == "dense" or on_gpu else 1))

    gen = generate_step(mx.array(short), model, max_tokens=n_decode + 1)
    tok, _ = next(gen)
    int(tok)
    t = time.perf_counter()
    n = 0
    for tok, _ in gen:
        int(tok)
        n += 1
    decode = n / (time.perf_counter() - t)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"ttft_ms": ttft * 1000, "ttft_prompt_tokens": len(ttft_prompt), "prefill_tps": prefill,
                      "prompt_tokens": len(long), "device": str(mx.default_device()),
                      "decode_tps": decode, "decode_tokens": n, "peak_rss_bytes": peak_rss,
                      "mlx_peak_bytes": mx.get_peak_memory()}))


if __name__ == "__main__":
    main()
