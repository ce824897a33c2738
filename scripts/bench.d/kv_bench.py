#!/usr/bin/env python3
"""A long prompt with the KV cache in full precision and quantized (8 and 4
bits, groups of 64), side by side on one warm daemon, through ollama's
/api/chat (`options.kv_bits`): time to the first token (the prompt's
prefill, ollama's `prompt_eval_duration`) and decode tokens per second
(`eval_count / eval_duration`), and from the stream as it arrives the
pause between the first and second tokens (where the prompt's blocks go
to the prompt cache) and the decode rate after the second token; rounds
interleaved (each round starts with
another setting), medians; every prompt new to the prompt cache (a round
tag leads it). KV bytes per position and how many such sequences a memory
budget admits are the daemon's own arithmetic (`Model::kv_bytes_per_position_as`),
printed for the model's shape.
    kv_bench.py BASE_URL MODEL TOKENS ROUNDS KV_VALUES_PER_POSITION BYTES_PER_VALUE BUDGET_BYTES"""
import json, statistics, subprocess, sys, time, urllib.request

base, model, tokens, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
values, full_bytes, budget = int(sys.argv[5]), float(sys.argv[6]), int(sys.argv[7])
SETTINGS = [("full precision", None), ("8-bit", 8), ("4-bit", 4)]
GENERATE = 64


def post(path, body):
    req = urllib.request.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as r:
        return json.loads(r.read())


def streamed(body):
    """The final message (the daemon's counts) and the arrival times of the
    tokens, in seconds from the request."""
    req = urllib.request.Request(base + "/api/chat", json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})
    start, arrivals, last = time.perf_counter(), [], None
    with urllib.request.urlopen(req, timeout=3600) as r:
        for line in r:
            last = json.loads(line)
            if last.get("message", {}).get("content"):
                arrivals.append(time.perf_counter() - start)
    return last, arrivals


try:
    files = subprocess.run(["git", "ls-files", "*.rs"], capture_output=True, text=True, check=True).stdout.split()
except (OSError, subprocess.CalledProcessError):  # the device's copy of the tree has no .git
    from pathlib import Path
    files = [str(p) for p in Path(".").rglob("*.rs") if not p.parts[0].startswith((".", "target", "dist"))]
words = []
for f in sorted(files):
    words += open(f, encoding="utf-8", errors="replace").read().split()
    if len(words) > tokens:
        break
# Tokens per word differ with the files found (the device's copy walks the
# tree in another order) and the tokenizer: measured on the first 2,000
# words by the daemon's own prompt count, the prompt cut to TOKENS.
PROBE = 2000
probe = post("/api/chat", {"model": model, "stream": False, "options": {"temperature": 0, "num_predict": 1},
                           "messages": [{"role": "user", "content": "[probe] " + " ".join(words[:PROBE])}]})
per_word = max(probe["prompt_eval_count"] / PROBE, 1.0)
text = " ".join(words[: int(tokens / per_word)])
rows = {name: {"ttft": [], "decode": [], "prompt": [], "gap": [], "steady": []} for name, _ in SETTINGS}
for r in range(rounds):
    order = SETTINGS[r % len(SETTINGS):] + SETTINGS[: r % len(SETTINGS)]
    for name, bits in order:
        options = {"temperature": 0, "num_predict": GENERATE}
        if bits:
            options["kv_bits"] = bits
        prompt = f"[round {r}, {name}] Summarize this code:\n{text}"
        a, arrivals = streamed({"model": model, "options": options, "messages": [{"role": "user", "content": prompt}]})
        rows[name]["ttft"].append(a["prompt_eval_duration"] / 1e9)
        rows[name]["decode"].append(a["eval_count"] / (a["eval_duration"] / 1e9))
        rows[name]["prompt"].append(a["prompt_eval_count"])
        if len(arrivals) < 3:
            sys.exit(f"{name}: the answer stopped after {len(arrivals)} tokens; the stream's rates need 3 or more")
        rows[name]["gap"].append(arrivals[1] - arrivals[0])
        rows[name]["steady"].append((len(arrivals) - 2) / (arrivals[-1] - arrivals[1]))
        print(f"round {r}, {name}: {a['prompt_eval_count']} prompt tokens, TTFT {rows[name]['ttft'][-1]:.1f} s, "
              f"decode {rows[name]['decode'][-1]:.1f} tok/s, second token after {1000 * rows[name]['gap'][-1]:.0f} ms, "
              f"then {rows[name]['steady'][-1]:.1f} tok/s", flush=True)

n = statistics.median(rows["full precision"]["prompt"])
print(f"\n| {model}, {n:.0f}-token prompt | KV bytes / position | KV of this prompt | KV at 32,768 | "
      f"32k sequences in {budget / 2**30:.0f} GiB | TTFT, s | decode tok/s | first-to-second token, ms | "
      f"after the second, tok/s |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
for name, bits in SETTINGS:
    per_value = full_bytes if not bits else bits / 8 + 2 * full_bytes / 64
    per_position = values * per_value
    print(f"| {name} | {per_position:,.0f} | {per_position * n / 2**20:,.0f} MiB | {per_position * 32768 / 2**20:,.0f} MiB | "
          f"{int(budget // (per_position * 32768))} | {statistics.median(rows[name]['ttft']):.1f} | "
          f"{statistics.median(rows[name]['decode']):.1f} | {1000 * statistics.median(rows[name]['gap']):.0f} | "
          f"{statistics.median(rows[name]['steady']):.1f} |")
print(f"\nrounds: {rounds}; {GENERATE} tokens generated each")
