#!/usr/bin/env python3
"""A/B of two warm daemons on the same model, rounds interleaved: N
concurrent greedy `mlxbc ask --json --ignore-eos` clients per level against
daemon A, then against daemon B (the order alternating per round). Prints
aggregate tok/s per daemon and level (median over rounds), the per-round
values, and whether each prompt's greedy token ids are equal between A and B
(first differing position when not). Used for issue "The GPU step at real
sizes": A with the padded-batch attention kernel, B with
MLXBC_BATCH_ATTENTION=mask.

Usage: attention_ab.py MLXBC MODEL HOME_A HOME_B LEVELS(16,64) ROUNDS MAX_TOKENS OUT.jsonl"""
import json, os, statistics, subprocess, sys, threading, time

mlxbc, model, home_a, home_b = sys.argv[1:5]
levels = [int(x) for x in sys.argv[5].split(",")]
rounds, max_tokens, out = int(sys.argv[6]), int(sys.argv[7]), sys.argv[8]
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


def ids(res):
    return [((r or {}).get("stats") or {}).get("token_ids") for r in res]


def main():
    log = open(out, "a")
    names = {home_a: "A", home_b: "B"}
    for home in (home_a, home_b):  # first bursts: one stream, then each level once
        level(home, 1)
        for n in levels:
            _, res = level(home, n)
            ttft = [(r["first"] - r["t0"]) * 1000 for r in res if r and r["first"]]
            print(f"first burst of {n} on daemon {names[home]}: TTFT median {statistics.median(ttft):.0f} ms, "
                  f"max {max(ttft):.0f} ms", flush=True)
    agg, seen, dec = {}, {}, {}
    for rnd in range(rounds):
        for n in levels:
            order = (home_a, home_b) if rnd % 2 == 0 else (home_b, home_a)
            got = {}
            for home in order:
                tps, res = level(home, n)
                got[names[home]] = res
                agg.setdefault((names[home], n), []).append(tps)
                dec.setdefault((names[home], n), []).extend(
                    r["stats"]["decode_tokens_per_s"] for r in res if r and r["rc"] == 0 and r["stats"])
                log.write(json.dumps({"daemon": names[home], "clients": n, "round": rnd, "aggregate_tps": tps}) + "\n")
                print(f"round {rnd} clients {n} daemon {names[home]}: {tps:.1f} tok/s", flush=True)
            if rnd <= 1:
                seen.setdefault(n, []).append(ids(got["A"]))
            if rnd == 1:
                x0, x1 = seen[n]
                same = sum(1 for x, y in zip(x0, x1) if x is not None and x == y)
                print(f"greedy ids, {n} clients: {same} of {n} equal between two rounds on daemon A", flush=True)
            if rnd == 0:
                a, b = ids(got["A"]), ids(got["B"])
                same = sum(1 for x, y in zip(a, b) if x is not None and x == y)
                parts = []
                for x, y in zip(a, b):
                    if x and y and x != y:
                        parts.append(next(i for i, (p, q) in enumerate(zip(x, y)) if p != q))
                print(f"greedy ids, {n} clients: {same} of {n} equal between A and B; "
                      f"first differing positions {sorted(parts)}", flush=True)
    print("| clients | A tok/s median (rounds) | B tok/s median (rounds) | A/B | A / B per-stream decode tok/s (median) |")
    print("|---:|---:|---:|---:|---:|")
    for n in levels:
        a, b = agg[("A", n)], agg[("B", n)]
        print(f"| {n} | {statistics.median(a):.0f} ({', '.join(f'{x:.0f}' for x in a)}) | "
              f"{statistics.median(b):.0f} ({', '.join(f'{x:.0f}' for x in b)}) | "
              f"{statistics.median(a) / statistics.median(b):.2f}x | "
              f"{statistics.median(dec[('A', n)]):.1f} / {statistics.median(dec[('B', n)]):.1f} |")


if __name__ == "__main__":
    main()
