#!/usr/bin/env python3
"""Several warm daemons on the same model, each started with its own
environment (MLX's CUDA settings, mlxbcd's switches), measured in
interleaved rounds: N concurrent greedy `mlxbc ask --json --ignore-eos`
clients per level against each daemon in turn, the order rotating per round.
Prints aggregate tok/s per daemon and level (median over rounds, and each
round), the per-stream decode tok/s, and each daemon's last decode-step log
lines (ms a step, and how much of it was spent queueing work).

Usage: env_sweep.py MLXBC MODEL LEVELS(1,16,64) ROUNDS MAX_TOKENS OUT.jsonl LABEL=HOME...
"""
import json, os, statistics, subprocess, sys, threading, time

mlxbc, model = sys.argv[1:3]
levels = [int(x) for x in sys.argv[3].split(",")]
rounds, max_tokens, out = int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
daemons = [arg.split("=", 1) for arg in sys.argv[7:]]
TOPICS = ["a lighthouse keeper", "a robot gardener", "a lost cat", "a mountain village", "a jazz pianist",
          "an old library", "a desert caravan", "a deep-sea diver", "a clockmaker", "a snowstorm",
          "a space station", "a street market", "a wandering knight", "a coral reef", "a night train", "a beekeeper"]
# Prompts of different lengths, so batches are padded.
PROMPTS = [f"Write a short story about {t}." + " Make it vivid." * (i % 5) for i, t in enumerate(TOPICS)]


def ask(home, prompt, barrier, res, i):
    cmd = [mlxbc, "ask", "--json", "-m", model, "--temperature", "0", "--max-tokens", str(max_tokens),
           "--ignore-eos", "--keep-alive", "30m", prompt]
    barrier.wait()
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                         env=dict(os.environ, MLXBC_HOME=home))
    stats, done, first = None, None, None
    for line in p.stdout:
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if ev.get("event") == "token" and first is None:
            first = time.perf_counter()
        if ev.get("event") == "done":
            stats, done = ev["stats"], time.perf_counter()
    err = p.stderr.read()
    p.wait()
    res[i] = dict(t0=t0, done=done, first=first, stats=stats, rc=p.returncode, err=err[-300:])


def level(home, n):
    res = [None] * n
    barrier = threading.Barrier(n)
    th = [threading.Thread(target=ask, args=(home, PROMPTS[i % len(PROMPTS)], barrier, res, i)) for i in range(n)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    ok = [r for r in res if r and r["rc"] == 0 and r["stats"]]
    if len(ok) < n:
        print(f"  {n - len(ok)} clients failed: {[r['err'] for r in res if r and r['rc'] != 0][:2]}", flush=True)
    if not ok:
        return 0.0, res
    gen = sum(r["stats"]["generated_tokens"] for r in ok)
    return gen / (max(r["done"] for r in ok) - min(r["t0"] for r in res if r)), res


def main():
    log = open(out, "a")
    for label, home in daemons:  # first bursts, not counted
        for n in [1] + levels:
            level(home, n)
        print(f"{label}: warm", flush=True)
    agg, dec = {}, {}
    for rnd in range(rounds):
        for n in levels:
            k = rnd % len(daemons)
            for label, home in daemons[k:] + daemons[:k]:
                tps, res = level(home, n)
                agg.setdefault((label, n), []).append(tps)
                dec.setdefault((label, n), []).extend(
                    r["stats"]["decode_tokens_per_s"] for r in res if r and r["rc"] == 0 and r["stats"])
                log.write(json.dumps({"daemon": label, "clients": n, "round": rnd, "aggregate_tps": tps}) + "\n")
                print(f"round {rnd} clients {n} {label}: {tps:.1f} tok/s", flush=True)
    print("| daemon | " + " | ".join(f"{n} clients tok/s (rounds) | per-stream" for n in levels) + " |")
    print("|---|" + "---:|---:|" * len(levels))
    for label, _ in daemons:
        cells = []
        for n in levels:
            a = agg[(label, n)]
            cells.append(f"{statistics.median(a):.0f} ({', '.join(f'{x:.0f}' for x in a)})")
            cells.append(f"{statistics.median(dec[(label, n)]):.1f}")
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
