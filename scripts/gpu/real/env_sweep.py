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
import json, os, statistics, sys

mlxbc, model = sys.argv[1:3]
levels = [int(x) for x in sys.argv[3].split(",")]
rounds, max_tokens, out = int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
daemons = [arg.split("=", 1) for arg in sys.argv[7:]]
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import burst  # noqa: E402


def level(home, n):
    return burst.level(mlxbc, model, max_tokens, home, n)


def main():
    log = open(out, "a")
    alone = {}
    for label, home in daemons:  # first bursts, not counted
        for n in [1] + levels:
            _, res = level(home, n)
            if n == 1 and res[0]:
                alone[label] = res[0].get("text", "")
        print(f"{label}: warm", flush=True)
        # The whole text, for finding where two daemons part.
        log.write(json.dumps({"daemon": label, "alone_text": alone.get(label, "")}) + "\n")
    # One stream is deterministic (a batch's rows change with arrival), so
    # its greedy answer must be the same whatever the switches.
    base = daemons[0][0]
    for label, _ in daemons[1:]:
        same = alone.get(label) == alone.get(base)
        print(f"one stream's greedy text, {label} against {base}: {'equal' if same else 'DIFFERS'}", flush=True)
        if not same:
            print(f"  {base}: {alone.get(base, '')[:160]!r}\n  {label}: {alone.get(label, '')[:160]!r}", flush=True)
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
