"""Prints `scripts/bench prompts` tables from mlxbc-bench --prompts JSON.
   prompts_table.py RESULT.json [MLX_LM_SERVER.json]"""
import json
import pathlib
import sys

r = json.loads(pathlib.Path(sys.argv[1]).read_text())
ref = json.loads(pathlib.Path(sys.argv[2]).read_text()) if len(sys.argv) > 2 else {}
ref_turns = {t["turn"]: t["ttft_ms"] for t in ref.get("turns", [])}


def num(v):
    return "-" if v is None else f"{v:.0f}"


def ids(t):
    v = t["ids_equal"]
    if v is None:
        return "-"
    return "yes" if v else f"NO (part at token {t.get('ids_part_at')})"


def median(v):
    v = sorted(v)
    return v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2

print(f"\nAgent loop: {r['model']}, system prompt ~{r['system_tokens']} tokens, each turn appends ~{r['turn_tokens']} "
      f"tokens and an answer of ~{r['answer_tokens']}; time to first token (client), the prompt cache on and off\n")
print("| turn | prompt tokens | reused | prefilled | TTFT with cache (ms) | TTFT without (ms) | mlx-lm server TTFT (ms) | ids equal |")
print("|---:|---:|---:|---:|---:|---:|---:|:---:|")
for t in r["turns"]:
    print(f"| {t['turn']} | {t['prompt_tokens']} | {t['reused']} | {t['prefilled']} | {t['ttft_cached_ms']:.0f} | "
          f"{num(t['ttft_cold_ms'])} | {num(ref_turns.get(t['turn']))} | {ids(t)} |")
turns = r["turns"]
if len(turns) >= 2:
    last, second = turns[-1], turns[1]
    cold = (f"{last['ttft_cold_ms'] / second['ttft_cold_ms']:.2f}x" if last["ttft_cold_ms"] and second["ttft_cold_ms"]
            else "not run (MLXBC_BENCH_COLD_TURNS=0)")
    print(f"\nturn {last['turn']} / turn 2 time to first token, with the cache: "
          f"{last['ttft_cached_ms'] / second['ttft_cached_ms']:.2f}x (target <= 1.5x); without: {cold}"
          + (f"; mlx-lm's server: {ref_turns[last['turn']] / ref_turns[2]:.2f}x" if ref_turns.get(2) and ref_turns.get(last['turn']) else ""))
    if len(turns) >= 10:
        # Single turns are noisy where a new prompt length costs a first use
        # (the GPU's run-time kernel compiles): five turns at each end.
        head = [t["turn"] for t in turns[1:6]]
        tail = [t["turn"] for t in turns[-5:]]
        def ratio(get):
            a = [get(t) for t in turns if t["turn"] in tail]
            b = [get(t) for t in turns if t["turn"] in head]
            return f"{median(a) / median(b):.2f}x" if all(x is not None for x in a + b) else "-"
        print(f"median of turns {tail[0]}-{tail[-1]} / median of turns {head[0]}-{head[-1]}: with the cache "
              f"{ratio(lambda t: t['ttft_cached_ms'])}; without: {ratio(lambda t: t['ttft_cold_ms'])}"
              + (f"; mlx-lm's server: {ratio(lambda t: ref_turns.get(t['turn']))}" if ref_turns else ""))
d = r["disk"]
print(f"\nafter a restart, a {d['prompt_tokens']}-token prompt whose prefix is on disk ({d['from_disk']} tokens read): "
      f"{d['ttft_disk_ms']:.0f} ms against a cold prefill of {d['ttft_cold_ms']:.0f} ms = "
      f"{100 * d['ttft_disk_ms'] / d['ttft_cold_ms']:.0f}% (target <= 20%); ids equal: {d['ids_equal']}"
      + (f"; medians of {len(d['rounds_disk_ms'])} rounds, each restarting both daemons (rounds: "
         f"{', '.join(f'{a:.0f}/{b:.0f}' for a, b in zip(d['rounds_disk_ms'], d['rounds_cold_ms']))} ms)" if 'rounds_disk_ms' in d else ""))
m = r["miss"]
pairs = len(m.get("pairs_cached_ms", [0] * 5))
print(f"a miss (300-token prompt never seen; medians of {pairs}, order alternating): {m['ttft_cached_ms']:.0f} ms with the cache, "
      f"{m['ttft_cold_ms']:.0f} ms without ({100 * (m['ttft_cached_ms'] / m['ttft_cold_ms'] - 1):+.1f}%; target <= +2%)")
