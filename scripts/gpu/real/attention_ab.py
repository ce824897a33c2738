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
import json, os, statistics, sys

mlxbc, model, home_a, home_b = sys.argv[1:5]
levels = [int(x) for x in sys.argv[5].split(",")]
rounds, max_tokens, out = int(sys.argv[6]), int(sys.argv[7]), sys.argv[8]
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import burst  # noqa: E402


def level(home, n):
    return burst.level(mlxbc, model, max_tokens, home, n)


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
