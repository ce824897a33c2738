"""mlx-lm's BatchGenerator at the batch sizes `scripts/bench concurrency`
gives mlxbcd, on the same weights: total tok/s and first-token p50/p99
(time from insertion to each sequence's first token). Each size is warmed up
first (a GPU compiles kernels per new shape), then measured ROUNDS times
(argv[4], default 3), sizes interleaved; medians. Prints JSON."""
import json
import statistics
import sys
import time

import mlx_lm
from mlx_lm.generate import BatchGenerator

model_dir, sizes, tokens = sys.argv[1], [int(n) for n in sys.argv[2].split(",")], int(sys.argv[3])
rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 3
model, tokenizer = mlx_lm.load(model_dir)


def prompt(i):
    messages = [{"role": "user", "content": f"Tell me about the number {i}."}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def pct(values, p):
    values = sorted(values)
    return values[round((len(values) - 1) * p)]


gen = BatchGenerator(model, max_tokens=tokens, stop_tokens=[], completion_batch_size=max(sizes), prefill_batch_size=max(sizes))


def measure(n, max_tokens):
    t = time.perf_counter()
    uids = gen.insert([prompt(i + 1) for i in range(n)], [max_tokens] * n)
    first, count = {}, 0
    while responses := gen.next_generated():
        now = time.perf_counter()
        for r in responses:
            first.setdefault(r.uid, now - t)
            count += 1
    wall = time.perf_counter() - t
    ttft = [first[u] * 1000 for u in uids]
    return {"total_tps": count / wall, "ttft_p50_ms": pct(ttft, 0.5), "ttft_p99_ms": pct(ttft, 0.99)}


for n in sizes:
    measure(n, 8)
results = {n: [] for n in sizes}
for _ in range(rounds):
    for n in sizes:
        results[n].append(measure(n, tokens))
rows = [{"clients": n, "rounds": rounds, "total_tps_rounds": [round(x["total_tps"], 1) for x in results[n]],
         **{k: statistics.median(x[k] for x in results[n]) for k in ("total_tps", "ttft_p50_ms", "ttft_p99_ms")}}
        for n in sizes]
gen.close()
print(json.dumps(rows))
