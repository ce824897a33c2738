"""mlx-lm's BatchGenerator at the batch sizes `scripts/bench concurrency`
gives mlxbcd, on the same weights: total tok/s and first-token p50/p99
(time from insertion to each sequence's first token). Prints JSON."""
import json
import sys
import time

import mlx_lm
from mlx_lm.generate import BatchGenerator

model_dir, sizes, tokens = sys.argv[1], [int(n) for n in sys.argv[2].split(",")], int(sys.argv[3])
model, tokenizer = mlx_lm.load(model_dir)


def prompt(i):
    messages = [{"role": "user", "content": f"Tell me about the number {i}."}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def pct(values, p):
    values = sorted(values)
    return values[round((len(values) - 1) * p)]


rows = []
gen = BatchGenerator(model, max_tokens=tokens, stop_tokens=[], completion_batch_size=max(sizes), prefill_batch_size=max(sizes))
gen.insert([prompt(0)], [4])
while gen.next_generated():
    pass
for n in sizes:
    t = time.perf_counter()
    uids = gen.insert([prompt(i + 1) for i in range(n)], [tokens] * n)
    first, count = {}, 0
    while responses := gen.next_generated():
        now = time.perf_counter()
        for r in responses:
            first.setdefault(r.uid, now - t)
            count += 1
    wall = time.perf_counter() - t
    ttft = [first[u] * 1000 for u in uids]
    rows.append({"clients": n, "total_tps": count / wall, "ttft_p50_ms": pct(ttft, 0.5), "ttft_p99_ms": pct(ttft, 0.99)})
gen.close()
print(json.dumps(rows))
