#!/usr/bin/env python3
"""Rows of one batch drafting with a draft model, drafted together (one
batched pass of the draft model per drafted position, the default) or
apart (each row alone, `MLXBC_DRAFT_ROWS=apart`): two warm daemons on the
same models, CLIENTS greedy clients at once (`mlxbc ask --json`, the draft
forced per request: `--speculate draft --draft D`), and the same burst with
drafts off as the baseline; total decode tok/s (each answer's tokens after
its first over the span from the first token to the last answer), rounds
rotated, medians; acceptance, and whether every configuration's ids were
equal. The draft models: the target's own weights in MLX form (nearly
every draft accepted) and a random model with its tokenizer (none).

Usage: draft_rows_bench.py MLXBC HOME_TOGETHER HOME_APART ROUNDS
(TARGET: the target model, default SmolLM2's GGUF; DRAFTS, default
smollm2-mlx,tiny-qwen3; CLIENTS, default 16; TOKENS, default 48)"""
import os, statistics, sys, threading

from daemon_client import ask_stats, wait_warm

mlxbc, together, apart, rounds = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
TARGET = os.environ.get("TARGET", "SmolLM2-135M-Instruct.Q4_1.gguf")
DRAFTS = os.environ.get("DRAFTS", "smollm2-mlx,tiny-qwen3").split(",")
CLIENTS = int(os.environ.get("CLIENTS", "16"))
TOKENS = int(os.environ.get("TOKENS", "48"))
PASSAGE = ("The lighthouse stood on the northern cliff for two hundred years, and every night its keeper climbed "
           "the spiral stair, trimmed the wick, polished the great lens and watched the ships pass the reef.")
PROMPTS = [f"[{i}] Repeat this passage word for word, then once more: {PASSAGE}" for i in range(CLIENTS)]


def ask(home, prompt, extra):
    args = ["-m", TARGET, "--temperature", "0", "--max-tokens", str(TOKENS), "--ignore-eos", *extra, prompt]
    return ask_stats(mlxbc, home, args, timeout=900)


def burst(home, extra):
    out = [None] * CLIENTS

    def one(i):
        out[i] = ask(home, PROMPTS[i], extra)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(CLIENTS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    decode = sum(s["generated_tokens"] - 1 for s in out)
    span = max(s["generated_tokens"] / max(s["decode_tokens_per_s"], 1e-9) for s in out)
    return decode / span, out


CONFIGS = {"off": (together, lambda d: ["--speculate", "off"]),
           "apart": (apart, lambda d: ["--speculate", "draft", "--draft", d]),
           "together": (together, lambda d: ["--speculate", "draft", "--draft", d])}
print(f"{CLIENTS} clients at once, {TOKENS} tokens each, target {TARGET}", flush=True)
table = []
for draft in DRAFTS:
    for name, (home, extra) in CONFIGS.items():  # loads the draft, warms the shapes
        burst(home, extra(draft))
        wait_warm(mlxbc, home)
        burst(home, extra(draft))
    speeds = {n: [] for n in CONFIGS}
    stats = {}
    ids = {}
    for r in range(rounds):
        order = list(CONFIGS)[r % 3:] + list(CONFIGS)[:r % 3]
        for name in order:
            home, extra = CONFIGS[name]
            tps, out = burst(home, extra(draft))
            speeds[name].append(tps)
            stats[name] = out
            ids.setdefault(name, [s["token_ids"] for s in out])
            print(f"  {draft} round {r}: {name} {tps:.1f} tok/s", flush=True)
    med = {n: statistics.median(v) for n, v in speeds.items()}
    acc = {n: (sum(s["accepted_draft_tokens"] for s in stats[n]), sum(s["draft_tokens"] for s in stats[n]))
           for n in ("apart", "together")}
    same = ids["off"] == ids["apart"] == ids["together"]
    table.append((draft, med, acc, same))
print(f"\n| draft model, {CLIENTS} clients | off tok/s | apart | together | together/apart | together/off "
      "| accepted / drafted (apart; together) | ids equal |")
print("|---|---:|---:|---:|---:|---:|---|---|")
for draft, med, acc, same in table:
    print(f"| {draft} | {med['off']:.1f} | {med['apart']:.1f} | {med['together']:.1f} | "
          f"{med['together'] / med['apart']:.2f}x | {med['together'] / med['off']:.2f}x | "
          f"{acc['apart'][0]} / {acc['apart'][1]}; {acc['together'][0]} / {acc['together'][1]} | "
          f"{'yes' if same else 'NO'} |")
print(f"\nrounds: {rounds}")
