#!/usr/bin/env python3
"""What a verify pass costs under several daemon settings, side by side:
warm daemons on the same weights, each started with its own environment
(scripts/gpu/real-size.sh passab), the same greedy requests against each in
turn (the order rotating per round) with the mode each names (off, auto,
ngram). Prints per task each daemon's decode tok/s (median over rounds),
its ratio to the first daemon's, the drafts accepted, and whether its ids
equal the first daemon's; then from each daemon's log the medians of its
decode profile: a plain step's queueing (launching) and waiting, and a
pass's queueing split into drafting, building and launching, and waiting
(engine/batch.rs's `Profile`).

Usage: pass_ab.py MLXBC ROUNDS LABEL=HOME:MODE ... (the first is the
baseline; TASKS=0,1,4: rows of spec_tasks.TASKS; CODE_MODEL, SMALL_MODEL
as for speculative_bench.py)"""
import os, re, statistics, sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench.d"))
from daemon_client import ask_stats, wait_warm  # noqa: E402
from spec_tasks import TASKS  # noqa: E402

mlxbc, rounds = sys.argv[1], int(sys.argv[2])
daemons = []  # (label, home, mode)
for spec in sys.argv[3:]:
    label, rest = spec.split("=", 1)
    home, mode = rest.rsplit(":", 1)
    daemons.append((label, home, mode))

PASS = re.compile(r"a pass queueing ([\d.]+) ms \(drafting ([\d.]+), launching ([\d.]+)\) and waiting ([\d.]+)")
STEP = re.compile(r"decode \(\w+\): (\d+) steps, [\d.]+ rows on average, [\d.]+ ms/step: "
                  r"queueing ([\d.]+) \(launching ([\d.]+)\), waiting ([\d.]+)")


def ask(home, mode, model, max_tokens, prompt):
    return ask_stats(mlxbc, home, ["-m", model, "--temperature", "0", "--max-tokens", str(max_tokens),
                                   "--speculate", mode, prompt])


def profile(home):
    """Medians over the log's 64-step windows: plain steps (windows without
    a pass) and passes."""
    text = open(os.path.join(home, "daemon.log"), errors="replace").read()
    passes = [tuple(map(float, m.groups())) for m in PASS.finditer(text)]
    steps = [tuple(map(float, m.groups()[1:])) for m in STEP.finditer(text)]
    med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    out = {"windows": (len(steps), len(passes))}
    if steps:
        out["step"] = (med([s[0] for s in steps]), med([s[1] for s in steps]), med([s[2] for s in steps]))
    if passes:
        out["pass"] = (med([p[0] for p in passes]), med([p[1] for p in passes]),
                       med([p[0] - p[1] - p[2] for p in passes]), med([p[2] for p in passes]),
                       med([p[3] for p in passes]))
    return out


def main():
    picked = [int(i) for i in os.environ.get("TASKS", "0,1").split(",")]
    tasks = [TASKS[i] for i in picked]
    # Every daemon loads first, then warms its batch sizes alongside the
    # others (one at a time, six 0.5B daemons on a fresh H200 spent ~8 min).
    for _, home, mode in daemons:
        for model in {t[1] for t in tasks}:
            ask(home, mode, model, 4, tasks[0][3])
    for _, home, _ in daemons:
        wait_warm(mlxbc, home)
    rows = []
    for name, model, max_tokens, prompt in tasks:
        speed = {d[0]: [] for d in daemons}
        last, differs = {}, {}
        for r in range(rounds):
            order = daemons[r % len(daemons):] + daemons[:r % len(daemons)]
            for label, home, mode in order:
                s = ask(home, mode, model, max_tokens, prompt)
                speed[label].append(s["decode_tokens_per_s"])
                last[label] = s
            base = last[daemons[0][0]]["token_ids"]
            for label, _, _ in daemons:
                if last[label]["token_ids"] != base:
                    differs.setdefault(label, r)
        print(f"{name}: " + ", ".join(f"{d} {[round(x, 1) for x in v]}" for d, v in speed.items()), flush=True)
        rows.append((name, speed, last, differs))
    first = daemons[0][0]
    print("\n| task | daemon (mode) | tok/s | / " + first + " | accepted / drafted (generated) | ids equal |")
    print("|---|---|---:|---:|---:|---|")
    for name, speed, last, differs in rows:
        base = statistics.median(speed[first])
        for label, _, mode in daemons:
            m = statistics.median(speed[label])
            s = last[label]
            print(f"| {name} | {label} ({mode}) | {m:.1f} | {m / base:.2f}x | {s['accepted_draft_tokens']} / "
                  f"{s['draft_tokens']} ({s['generated_tokens']}) | "
                  f"{'yes' if label not in differs else 'NO (round %d)' % differs[label]} |")
    print("\n| daemon | windows (plain, with passes) | plain step: queueing (launching), waiting ms "
          "| pass: queueing ms (drafting, building, launching), waiting ms |")
    print("|---|---:|---:|---:|")
    for label, home, _ in daemons:
        p = profile(home)
        step = "%.2f (%.2f), %.2f" % p["step"] if "step" in p else "-"
        pas = "%.2f (%.2f, %.2f, %.2f), %.2f" % p["pass"] if "pass" in p else "-"
        print(f"| {label} | {p['windows'][0]}, {p['windows'][1]} | {step} | {pas} |")


if __name__ == "__main__":
    main()
