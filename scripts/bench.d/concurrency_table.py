"""Prints the concurrency table from mlxbc-bench --concurrency's JSON and
scripts/bench.d/mlx_lm_batch.py's JSON (same weights, same batch sizes).
   concurrency_table.py OURS.json MLXLM.json TOKENS [MODEL]"""
import json
import pathlib
import sys

ours = json.loads(pathlib.Path(sys.argv[1]).read_text())
ref = {x["clients"]: x for x in json.loads(pathlib.Path(sys.argv[2]).read_text())}
model = sys.argv[4] if len(sys.argv) > 4 else "SmolLM2-135M Q4_1"
rounds = ours.get("rounds", 1)
print(f"\nConcurrency: {model}, {sys.argv[3]} tokens per client, EOS ignored"
      + (f", medians of {rounds} rounds (the engines interleaved)" if rounds > 1 else "") + "\n")
print("| clients | mlxbcd total tok/s | per stream tok/s | first token p50 / p99 (ms) | mlx-lm BatchGenerator total tok/s | its first token p50 / p99 (ms) | mlxbcd / mlx-lm |")
print("|---:|---:|---:|---:|---:|---:|---:|")
for x in ours["rows"]:
    m = ref.get(x["clients"], {})
    ratio = x["total_tps"] / m["total_tps"] if m.get("total_tps") else 0
    print(f"| {x['clients']} | {x['total_tps']:.1f} | {x['per_stream_tps']:.1f} | {x['ttft_p50_ms']:.0f} / {x['ttft_p99_ms']:.0f} "
          f"| {m.get('total_tps', 0):.1f} | {m.get('ttft_p50_ms', 0):.0f} / {m.get('ttft_p99_ms', 0):.0f} | {ratio:.2f}x |")
one = ours["rows"][0]["total_tps"]
for x in ours["rows"][1:]:
    print(f"{x['clients']} clients / 1 client total: {x['total_tps'] / one:.2f}x")
for x in ours["rows"]:
    if "total_tps_rounds" in x:
        m = ref.get(x["clients"], {})
        print(f"{x['clients']} clients, total tok/s per round: mlxbcd {x['total_tps_rounds']}, mlx-lm {m.get('total_tps_rounds')}")
for x in ours["rows"]:
    if x.get("ids_equal_alone") is not None:
        diffs = x.get("first_differing_token", [])
        print(f"{x['clients']} clients: {x['ids_equal_alone']} of {x['clients']} answers equal their prompt alone, token for token"
              + (f"; the others first differ at tokens {sorted(diffs)}" if diffs else ""))
s = ours["short_during_long"]
print(f"\nshort question during a {int(s['long_tokens'])}-token answer: first token {s['short_ttft_ms']:.0f} ms; its own prefill "
      f"{s['short_prefill_ms']:.0f} ms, the long stream's decode step {s['long_decode_step_ms']:.1f} ms "
      f"(target: prefill + 2 steps = {s['short_prefill_ms'] + 2 * s['long_decode_step_ms']:.0f} ms)")
