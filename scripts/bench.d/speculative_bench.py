#!/usr/bin/env python3
"""Speculative decoding (prompt-lookup drafts) on and off, side by side:
two warm daemons on the same weights, one started with MLXBC_SPECULATE=ngram,
the same greedy requests against each in turn (the order alternating per
round), through `mlxbc ask --json`. Prints, per task, the decode tok/s with
and without drafts (medians over rounds), the ratio, the acceptance, and
whether the token ids were equal in every round.

Usage: speculative_bench.py MLXBC HOME_ON HOME_OFF ROUNDS"""
import json, os, statistics, subprocess, sys

mlxbc, home_on, home_off = sys.argv[1:4]
rounds = int(sys.argv[4])
QWEN = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
SMOL = "SmolLM2-135M-Instruct.Q4_1.gguf"
FUNCTION = '''def summarize(values, skip_missing=True):
    total = 0
    count = 0
    smallest = None
    largest = None
    for value in values:
        if value is None:
            if skip_missing:
                continue
            raise ValueError("a missing value")
        total += value
        count += 1
        if smallest is None or value < smallest:
            smallest = value
        if largest is None or value > largest:
            largest = value
    if count == 0:
        return None
    average = total / count
    spread = largest - smallest
    return {"total": total, "count": count, "average": average, "smallest": smallest,
            "largest": largest, "spread": spread}
'''
PASSAGE = ("The lighthouse stood at the end of the harbour wall for two hundred years. Every night its keeper "
           "climbed the hundred and twelve steps, trimmed the wick, wound the clockwork and watched the beam "
           "sweep across the water until dawn. Ships that had never seen the coast knew it by that light.")
TASKS = [
    ("code edit: rename a variable (Qwen2.5-Coder 0.5B)", QWEN, 160,
     f"Rename the variable `total` to `running_sum` in this function. Answer with the whole function only.\n\n{FUNCTION}"),
    ("code edit: add type hints (Qwen2.5-Coder 0.5B)", QWEN, 160,
     f"Add type hints to this function. Answer with the whole function only.\n\n{FUNCTION}"),
    ("JSON repeating the prompt's keys (Qwen2.5-Coder 0.5B)", QWEN, 120,
     'Fill in this JSON object for the city of Lyon, keeping every key: {"name": "", "country": "", '
     '"population": 0, "river": "", "founded": "", "mayor": "", "area_km2": 0}'),
    ("quote a passage (SmolLM2 135M)", SMOL, 100, f"Quote this passage word for word:\n\n{PASSAGE}"),
    ("open-ended chat (SmolLM2 135M)", SMOL, 100, "Tell me about the history of the bicycle."),
]


def ask(home, model, max_tokens, prompt):
    cmd = [mlxbc, "ask", "--json", "-m", model, "--temperature", "0", "--max-tokens", str(max_tokens), prompt]
    out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, MLXBC_HOME=home), timeout=600)
    for line in out.stdout.splitlines():
        ev = json.loads(line)
        if ev.get("event") == "done":
            return ev["stats"]
    raise RuntimeError(f"no answer: {out.stderr[-400:]}")


def main():
    for home in (home_on, home_off):  # load both models in both daemons
        for _, model, _, prompt in TASKS[::3]:
            ask(home, model, 4, prompt)
    rows = []
    for name, model, max_tokens, prompt in TASKS:
        on, off, acc, same = [], [], [], True
        for r in range(rounds):
            order = [(home_on, on), (home_off, off)] if r % 2 == 0 else [(home_off, off), (home_on, on)]
            got = {}
            for home, into in order:
                s = ask(home, model, max_tokens, prompt)
                into.append(s["decode_tokens_per_s"])
                got[home] = s
            s = got[home_on]
            acc.append((s["accepted_draft_tokens"], s["draft_tokens"], s["generated_tokens"]))
            same &= s["token_ids"] == got[home_off]["token_ids"]
        a, d, g = acc[-1]
        rows.append((name, statistics.median(on), statistics.median(off), a, d, g, same))
        print(f"{name}: on {on} off {off}", flush=True)
    print("\n| task | decode tok/s, drafts on | off | on/off | accepted / drafted (tokens generated) | ids equal |")
    print("|---|---:|---:|---:|---:|---|")
    for name, on, off, a, d, g, same in rows:
        print(f"| {name} | {on:.1f} | {off:.1f} | {on / off:.2f}x | {a} / {d} ({g}) | {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
