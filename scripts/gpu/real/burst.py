"""N concurrent greedy `mlxbc ask --json --ignore-eos` clients against one
daemon (its MLXBC_HOME), released together: what attention_ab.py and
env_sweep.py measure with."""
import json, os, subprocess, threading, time

TOPICS = ["a lighthouse keeper", "a robot gardener", "a lost cat", "a mountain village", "a jazz pianist",
          "an old library", "a desert caravan", "a deep-sea diver", "a clockmaker", "a snowstorm",
          "a space station", "a street market", "a wandering knight", "a coral reef", "a night train", "a beekeeper"]
# Prompts of different lengths, so batches are padded.
PROMPTS = [f"Write a short story about {t}." + " Make it vivid." * (i % 5) for i, t in enumerate(TOPICS)]


def ask(mlxbc, model, max_tokens, home, prompt, barrier, res, i):
    cmd = [mlxbc, "ask", "--json", "-m", model, "--temperature", "0", "--max-tokens", str(max_tokens),
           "--ignore-eos", "--keep-alive", "30m", prompt]
    barrier.wait()
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                         env=dict(os.environ, MLXBC_HOME=home))
    stats, done, first = None, None, None
    text = []
    for line in p.stdout:
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if ev.get("event") == "token":
            first = first or time.perf_counter()
            text.append(str(ev.get("text", "")))
        if ev.get("event") == "done":
            stats, done = ev["stats"], time.perf_counter()
    err = p.stderr.read()
    p.wait()
    res[i] = dict(t0=t0, done=done, first=first, stats=stats, rc=p.returncode, err=err[-300:], text="".join(text))


def level(mlxbc, model, max_tokens, home, n):
    """n clients at once: (aggregate tok/s, each client's result)."""
    res = [None] * n
    barrier = threading.Barrier(n)
    th = [threading.Thread(target=ask, args=(mlxbc, model, max_tokens, home, PROMPTS[i % len(PROMPTS)], barrier,
                                             res, i)) for i in range(n)]
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
