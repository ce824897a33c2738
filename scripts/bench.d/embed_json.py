#!/usr/bin/env python3
"""The store's answer through ollama's /api/embed: the bytes and the
client's parse time of the vectors as mlxbcd writes them (f32's shortest
form) against as it wrote them before 2026-12-06 (the same f32 values as
f64, 17 digits: serde_json's `Value`), in the same rounds, and the whole
request from the store. 1,000 chunks of 40 words of README.md, computed
once first. Usage (a daemon serving all-MiniLM-L6-v2 over HTTP; run from
the repository root): embed_json.py BASE_URL"""
import json, statistics, sys, time, urllib.request
import numpy as np
base = sys.argv[1]
words = open("README.md").read().split()
texts = [" ".join(words[i:i + 40]) + f" #{i}" for i in range(0, 40 * 1000, 40)][:1000]
def post(body):
    req = urllib.request.Request(base + "/api/embed", json.dumps(body).encode(), {"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=600).read()
t = time.perf_counter(); post({"model": "all-MiniLM-L6-v2", "input": texts}); first = time.perf_counter() - t
print(f"computed 1000 texts in {first:.1f} s")
rows = {"request from the store + json.loads (as written now)": [], "json.loads, f32 shortest (now)": [],
        "json.loads, 17-digit f64 (before)": []}
for r in range(5):
    t = time.perf_counter(); raw = post({"model": "all-MiniLM-L6-v2", "input": texts}); v = json.loads(raw)
    rows["request from the store + json.loads (as written now)"].append(time.perf_counter() - t)
    old = json.dumps({**v, "embeddings": [[float(np.float32(x)) for x in e] for e in v["embeddings"]]}).encode()
    # float(np.float32(x)) is the f64 of the f32 value: what serde_json's Value wrote (17 digits).
    for label, text in [("json.loads, f32 shortest (now)", raw), ("json.loads, 17-digit f64 (before)", old)]:
        t = time.perf_counter(); json.loads(text); rows[label].append(time.perf_counter() - t)
    if r == 0:
        print(f"answer bytes: now {len(raw):,}, before {len(old):,}")
        same = all(np.float32(a) == np.float32(b) for e1, e2 in zip(json.loads(raw)["embeddings"], json.loads(old)["embeddings"]) for a, b in zip(e1, e2))
        print(f"the same f32 values either way: {same}")
print("| | median ms (rounds) |\n|---|---:|")
for k, xs in rows.items():
    print(f"| {k} | {statistics.median(xs)*1e3:.0f} ({', '.join(f'{x*1e3:.0f}' for x in xs)}) |")
