#!/usr/bin/env python3
"""Speculative decoding (prompt-lookup drafts) side by side: three warm
daemons on the same weights, started with MLXBC_SPECULATE=off, auto (the
default: drafts where the cost model expects them to pay) and ngram (drafts
verified whenever there are any), the same greedy requests against each in
turn (the order rotating per round), through `mlxbc ask --json`. Prints,
per task, the decode tok/s of each (medians over rounds), the ratios to
off, the acceptance, and whether the token ids were equal in every round.
Then the batched row: 16 clients at once on code edits, total tok/s per
daemon (ROUNDS - 1 bursts, at least 2: one burst is one sample of a row
whose bursts scatter ±20% on a GPU); and the long-prompt row: an 8k-token agent-style prompt.

Usage: speculative_bench.py MLXBC HOME_OFF HOME_AUTO HOME_NGRAM ROUNDS
(ONLY=alone,batched,long, the default: those rows; TASKS=0,1: only
those of the rows alone; draft: SmolLM2's rows
with draft models named per request, DRAFTS=tiny-qwen3,smollm2-mlx,
DRAFT_TARGET=another model for them; CODE_MODEL and
SMALL_MODEL name other models for the Qwen2.5-Coder and SmolLM2 rows, as
on the GPU: scripts/gpu/real-size.sh spec)"""
import os, statistics, sys, threading, time

from daemon_client import ask_stats, wait_warm
from spec_tasks import FUNCTION, QWEN, QWEN_NAME, SMOL, TASKS, agent_prompt

mlxbc = sys.argv[1]
homes = dict(zip(["off", "auto", "ngram"], sys.argv[2:5]))
rounds = int(sys.argv[5])
# One daemon for every mode (the same home given three times, as on a GPU
# where three daemons' memory would not fit an 8k prompt): the mode is then
# chosen per request (`--speculate`), which is what the daemon's setting does.
ONE_DAEMON = len(set(homes.values())) == 1


def ask(home, model, max_tokens, prompt, extra=()):
    if ONE_DAEMON and home in homes and not extra:
        extra = ["--speculate", home]
        home = homes[home]
    return ask_stats(mlxbc, home, ["-m", model, "--temperature", "0", "--max-tokens", str(max_tokens), *extra, prompt])


MODES = ["off", "auto", "ngram"]


def burst(home, model, max_tokens, prompts):
    """All `prompts` at once: total decode tok/s (each answer's tokens after
    its first over the span from the last first token to the last answer:
    every row decoding together, the burst's batched prefill left out), and
    the stats."""
    out = [None] * len(prompts)

    def one(i):
        out[i] = ask(home, model, max_tokens, prompts[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    t = time.monotonic()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.monotonic() - t
    # Decode spans end at each answer's end; with one batch they overlap.
    decode = sum(s["generated_tokens"] - 1 for s in out)
    span = max(s["generated_tokens"] / max(s["decode_tokens_per_s"], 1e-9) for s in out)
    print(f"  burst: {sum(s['generated_tokens'] for s in out)} tokens in {wall:.1f} s wall", flush=True)
    return decode / span, out


def measure(name, run, rounds, by_mode=False):
    """`run(home)` (or `run(mode)` when `by_mode`) -> (tok/s, stats list)
    per mode, modes rotating per round."""
    speed = {m: [] for m in MODES}
    last, differs = {}, {}
    for r in range(rounds):
        for m in MODES[r % 3:] + MODES[:r % 3]:
            tps, stats = run(m if by_mode or ONE_DAEMON else homes[m])
            speed[m].append(tps)
            last[m] = stats
        for m in MODES:
            for s, o in zip(last[m], last["off"]):
                at = next((i for i, (a, b) in enumerate(zip(s["token_ids"], o["token_ids"])) if a != b),
                          None if len(s["token_ids"]) == len(o["token_ids"])
                          else min(len(s["token_ids"]), len(o["token_ids"])))
                if at is not None:
                    differs.setdefault(m, at)
    print(f"{name}: " + ", ".join(f"{m} {[round(x, 1) for x in speed[m]]}" for m in MODES), flush=True)
    med = {m: statistics.median(speed[m]) for m in MODES}
    acc = {m: (sum(s["accepted_draft_tokens"] for s in last[m]), sum(s["draft_tokens"] for s in last[m]),
               sum(s["generated_tokens"] for s in last[m])) for m in MODES}
    # "yes", or the modes whose ids differed from off's in some round, and
    # the first token where they parted.
    same = "yes" if not differs else "NO: " + ", ".join(f"{m} at token {differs[m]}" for m in MODES if m in differs)
    return name, med, acc, same


def main():
    only = os.environ.get("ONLY", "alone,batched,long").split(",")
    for home in set(homes.values()):  # load the models the rows use in every daemon
        for _, model, _, prompt in TASKS[::3]:
            if model == QWEN or "alone" in only:
                ask(home, model, 4, prompt)
    for home in set(homes.values()):  # their batch sizes warm alongside one another
        wait_warm(mlxbc, home)
    rows = []
    # TASKS=0,1: only those rows alone (a short device lease: the code edits).
    picked = [int(i) for i in os.environ["TASKS"].split(",")] if os.environ.get("TASKS") else range(len(TASKS))
    for name, model, max_tokens, prompt in [TASKS[i] for i in picked] if "alone" in only else []:
        def alone(home, model=model, max_tokens=max_tokens, prompt=prompt):
            s = ask(home, model, max_tokens, prompt)
            return s["decode_tokens_per_s"], [s]
        rows.append(measure(name, alone, rounds))
    edits = [f"Rename the variable `{old}` to `{new}` in this function. Answer with the whole function only."
             f"\n\n{FUNCTION}" for old, new in [("total", "acc"), ("count", "n"), ("smallest", "low"),
                                               ("largest", "high")]] * 4
    if "batched" in only:
        for home in set(homes.values()):  # a first burst warms the batch's shapes
            burst(home, QWEN, 8, edits)
        rows.append(measure(f"16 clients at once, code edits ({QWEN_NAME}), total decode tok/s",
                            lambda home: burst(home, QWEN, 96, edits), max(2, rounds - 1)))
    if "long" in only:
        long = agent_prompt()
        for home in set(homes.values()):  # its prefix in every daemon's prompt cache: rounds time the decode
            ask(home, QWEN, 1, long)

        def agent(home):
            s = ask(home, QWEN, 96, long)
            return s["decode_tokens_per_s"], [s]
        rows.append(measure(f"agent prompt of {last_prompt_tokens(long)} tokens, code edit ({QWEN_NAME})",
                            agent, rounds))
    if "draft" in only:
        # Draft models, named per request against the auto daemon: off,
        # auto with the draft (the cost model decides), the draft forced.
        # Columns: "ngram" reads "draft forced" for these rows.
        for draft in os.environ.get("DRAFTS", "tiny-qwen3,smollm2-mlx").split(","):
            args = {"off": ["--speculate", "off"], "auto": ["--draft", draft],
                    "ngram": ["--speculate", "draft", "--draft", draft]}
            target = os.environ.get("DRAFT_TARGET", SMOL)
            ask(homes["auto"], target, 2, "Hi.", args["ngram"])  # loads the draft
            for name, _, max_tokens, prompt in TASKS[3:5]:
                model = target
                name = name if target == SMOL else f"{name.split(' (')[0]} ({target})"
                def drafted(mode, model=model, max_tokens=max_tokens, prompt=prompt):
                    s = ask(homes["auto"], model, max_tokens, prompt, args[mode])
                    return s["decode_tokens_per_s"], [s]
                rows.append(measure(f"{name}, draft model {draft} (ngram column: draft forced)", drafted, rounds,
                                    by_mode=True))
    print("\n| task | off tok/s | auto | auto/off | ngram | ngram/off | auto: accepted / drafted (generated) "
          "| ngram: accepted / drafted | ids equal |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for name, med, acc, same in rows:
        a, n = acc["auto"], acc["ngram"]
        print(f"| {name} | {med['off']:.1f} | {med['auto']:.1f} | {med['auto'] / med['off']:.2f}x | "
              f"{med['ngram']:.1f} | {med['ngram'] / med['off']:.2f}x | {a[0]} / {a[1]} ({a[2]}) | "
              f"{n[0]} / {n[1]} | {same} |")


def last_prompt_tokens(prompt):
    return ask(homes["off"], QWEN, 1, prompt)["prompt_tokens"]


if __name__ == "__main__":
    main()
