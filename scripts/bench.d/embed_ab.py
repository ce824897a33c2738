#!/usr/bin/env python3
"""Daemons side by side on all-MiniLM-L6-v2 embeddings: each config a warm
mlxbcd of its own (own home, own environment, optionally its own binary),
N new chunks of ~90 words per round through /api/embed, rounds
interleaved (the order alternating), texts/s per round and medians; the
smallest cosine between the first daemon's vectors and each other's.
    target/test-fixtures/venv/bin/python scripts/bench.d/embed_ab.py ROUNDS \\
        "native|" "polynomial|MLXBC_CPU_MATH=polynomial" "old|VAR=1|/path/to/mlxbcd"
N (default 200) chunks a round."""
import json, math, os, random, signal, socket, statistics, subprocess, sys, tempfile, time, urllib.request

repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
fx = os.environ.get("MLXBC_TEST_FIXTURES", os.path.join(repo, "target/test-fixtures"))
rounds, n = int(sys.argv[1]), int(os.environ.get("N", "200"))
configs = [(c.split("|") + [os.path.join(repo, "target/release/mlxbcd")])[:3] for c in sys.argv[2:]]
words = open(os.path.join(repo, "daemon/src/model/cpu_native.rs")).read().split()
work = tempfile.mkdtemp(prefix="embed-ab-")
procs, urls = [], {}
for label, env, binary in configs:
    home = os.path.join(work, label)
    os.makedirs(home + "/models")
    os.symlink(fx + "/models/all-MiniLM-L6-v2", home + "/models/all-MiniLM-L6-v2")
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    e = dict(os.environ, MLXBC_HOME=home)
    e.update(kv.split("=", 1) for kv in env.split() if kv)
    procs.append(subprocess.Popen([binary, "--http", f"127.0.0.1:{port}"], env=e, stderr=open(home + "/log", "w")))
    urls[label] = f"http://127.0.0.1:{port}"
for _ in range(100):
    if all(os.path.exists(os.path.join(work, l, "mlxbcd.sock")) for l in urls):
        break
    time.sleep(0.1)


def embed(url, inputs):
    req = urllib.request.Request(url + "/api/embed", json.dumps({"model": "all-MiniLM-L6-v2", "input": inputs}).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as r:
        return json.loads(r.read())["embeddings"]


try:
    for u in urls.values():
        embed(u, ["warm up"])
    rng, got, vectors = random.Random(1), {l: [] for l in urls}, {}
    for r in range(rounds):
        chunks = [" ".join(rng.choice(words) for _ in range(90)) + f" #{r}-{i}" for i in range(n)]
        for label in (list(urls) if r % 2 == 0 else list(urls)[::-1]):
            t = time.perf_counter()
            vectors[label] = embed(urls[label], chunks)
            got[label].append(n / (time.perf_counter() - t))
        print(f"round {r}: " + ", ".join(f"{l} {got[l][-1]:.2f}" for l in urls), flush=True)
    first = list(urls)[0]
    for label in list(urls)[1:]:
        worst = min(sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))
                    for a, b in zip(vectors[first], vectors[label]))
        print(f"smallest cosine, {first} against {label}: {worst:.7f}")
    print(f"\n| daemon ({n} new chunks a round) | texts/s (rounds) | median |\n|---|---|---:|")
    for label in urls:
        print(f"| {label} | {', '.join(f'{x:.2f}' for x in got[label])} | {statistics.median(got[label]):.2f} |")
finally:
    for p in procs:
        p.send_signal(signal.SIGTERM)
