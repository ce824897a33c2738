#!/usr/bin/env python3
"""The pause between a long prompt's first and second tokens, and decode
speed, on two daemons side by side (A and B: two builds), KV at full
precision and 8 bits, rounds interleaved (each round alternates which
daemon goes first), medians. Streams ollama's /api/chat and times the
chunks as they arrive: TTFT, the first-to-second-token gap (where the
prompt's blocks are stored in the prompt cache), and decode tok/s from the
daemon's own eval_count / eval_duration.
    kv_stall_ab.py MODEL TOKENS ROUNDS NAME=URL NAME=URL"""
import json, statistics, sys, time, urllib.request
from pathlib import Path

model, tokens, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
daemons = [a.split("=", 1) for a in sys.argv[4:6]]
SETTINGS = [("full precision", None), ("8-bit", 8)]
GENERATE = 32

words = []
for f in sorted(Path(".").glob("daemon/src/**/*.rs")):
    words += f.read_text(errors="replace").split()
    if len(words) > tokens:
        break


def chat(url, content, options, stream=True):
    body = {"model": model, "stream": stream, "options": options, "messages": [{"role": "user", "content": content}]}
    req = urllib.request.Request(url + "/api/chat", json.dumps(body).encode(), {"Content-Type": "application/json"})
    start, arrivals, last = time.perf_counter(), [], None
    with urllib.request.urlopen(req, timeout=3600) as r:
        for line in r:
            msg = json.loads(line)
            if msg.get("message", {}).get("content"):
                arrivals.append(time.perf_counter() - start)
            last = msg
    return arrivals, last


probe = chat(daemons[0][1], "[probe] " + " ".join(words[:2000]), {"num_predict": 1}, stream=False)[1]
per_word = max(probe["prompt_eval_count"] / 2000, 1.0)
text = " ".join(words[: int(tokens / per_word)])
rows = {(d, s): {"ttft": [], "gap": [], "decode": []} for d, _ in daemons for s, _ in SETTINGS}
for r in range(rounds):
    order = daemons if r % 2 == 0 else daemons[::-1]
    for setting, bits in SETTINGS:
        for name, url in order:
            options = {"temperature": 0, "num_predict": GENERATE}
            if bits:
                options["kv_bits"] = bits
            arrivals, done = chat(url, f"[{name} round {r} {setting}] Summarize this code:\n{text}", options)
            row = rows[(name, setting)]
            row["ttft"].append(arrivals[0])
            row["gap"].append(arrivals[1] - arrivals[0])
            row["decode"].append(done["eval_count"] / (done["eval_duration"] / 1e9))
            print(f"round {r} {name} {setting}: {done['prompt_eval_count']} prompt tokens, TTFT {arrivals[0]:.2f} s, "
                  f"second token after {1000 * row['gap'][-1]:.0f} ms, decode {row['decode'][-1]:.1f} tok/s", flush=True)

print(f"\n| {model}, ~{tokens} tokens | daemon | TTFT, s | first-to-second token, ms | decode tok/s |")
print("|---|---|---:|---:|---:|")
for setting, _ in SETTINGS:
    for name, _ in daemons:
        row = rows[(name, setting)]
        print(f"| {setting} | {name} | {statistics.median(row['ttft']):.2f} | {1000 * statistics.median(row['gap']):.0f} | "
              f"{statistics.median(row['decode']):.1f} |")
print(f"\nrounds: {rounds} (medians); {GENERATE} tokens generated each")
