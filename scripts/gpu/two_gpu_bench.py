#!/usr/bin/env python3
"""Issue "The distributed group on two NVIDIA GPUs": one model on one GPU
(a plain mlxbcd pinned to GPU 0) against the same model split over a group
of two mlxbcd ranks (`--backend nccl`, each rank on its own GPU: the daemon
derives NCCL's environment and the rank's GPU from the hostfile), both up
at once, rounds interleaved, medians; then the faults. On a CPU the same
script runs with BACKEND=ring (how it is checked without the GPUs).

Rows: greedy ids of the group against one GPU (the first differing
position when they part); one stream's TTFT and decode tok/s; 16 and 64
clients' total decode tok/s; the group's collective time per call from
`mlxbc status`. Faults: rank 1 killed (-9) mid-answer: how long the
client waits for its error; rank 0 still answering LOCAL_MODEL (not
split); rank 1 started again: how long until the group re-forms and the
split model answers again.

usage: two_gpu_bench.py BIN_DIR MODELS_DIR MODEL LOCAL_MODEL BACKEND ROUNDS TOKENS [LEVELS]
(LEVELS: client counts, default 1,16,64; 1 is the single-stream row)"""
import json, os, shutil, socket, statistics, subprocess, sys, tempfile, time
from concurrent.futures import ThreadPoolExecutor

bin_dir, models, model, local_model, backend = sys.argv[1:6]
rounds, tokens = int(sys.argv[6]), int(sys.argv[7])
levels = [int(x) for x in (sys.argv[8] if len(sys.argv) > 8 else "1,16,64").split(",")]
gpu = backend == "nccl"
env = dict(os.environ, MLXBC_LOG="info")
env.pop("MLXBC_SOCKET", None)
if not gpu:
    env["OPENBLAS_NUM_THREADS"] = "1"
procs = {}


def port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p


def home(tag):
    h = tempfile.mkdtemp(prefix=f"mlxbc-2gpu-{tag}-")
    os.makedirs(f"{h}/models")
    for m in os.listdir(models):
        os.symlink(os.path.join(models, m), f"{h}/models/{m}")
    return h


def mlxbc(h, *args, timeout=900):
    return subprocess.run([f"{bin_dir}/mlxbc", *args], env=dict(env, MLXBC_HOME=h), capture_output=True, text=True,
                          timeout=timeout)


def start(name, h, args, extra=None):
    log = open(f"{h}/daemon.log", "a")
    procs[name] = subprocess.Popen([f"{bin_dir}/mlxbcd", *args], env=dict(env, MLXBC_HOME=h, **(extra or {})),
                                   stderr=log)


def ask(h, m, n, prompt, ignore_eos=True):
    """One greedy answer of n tokens: its stats (ids, TTFT, decode tok/s) or raises with the CLI's error."""
    args = ["ask", "-m", m, "-n", str(n), "--temperature", "0", "--json", prompt]
    if ignore_eos:
        args.insert(5, "--ignore-eos")
    out = mlxbc(h, *args)
    for line in out.stdout.splitlines():
        e = json.loads(line)
        if e.get("event") == "done":
            return e["stats"]
    raise RuntimeError((out.stderr or out.stdout)[-400:])


def formed(h, timeout=600):
    t = time.monotonic()
    while time.monotonic() - t < timeout:
        s = mlxbc(h, "status")
        if s.returncode == 0 and "group:    formed" in s.stdout:
            return time.monotonic() - t
        time.sleep(0.2)
    raise SystemExit(f"the group did not form:\n{mlxbc(h, 'status').stdout}")


one = home("one")
start("one", one, [], {"CUDA_VISIBLE_DEVICES": "0"} if gpu else None)
g0, g1 = home("rank0"), home("rank1")
hostfile = f"{g0}/hosts.json"
json.dump([[f"127.0.0.1:{port()}"], [f"127.0.0.1:{port()}"]], open(hostfile, "w"))
open(f"{g0}/config.toml", "w").write(f'[cluster]\nsharded = ["{model}"]\nstep_timeout = "30s"\n')
rank1_args = ["--hostfile", hostfile, "--rank", "1", "--backend", backend]
start("rank1", g1, rank1_args)
start("rank0", g0, ["--hostfile", hostfile, "--rank", "0", "--backend", backend])
setups = {"1 GPU": one, "2 GPUs": g0} if gpu else {"1 rank": one, "2 ranks": g0}
try:
    for _ in range(300):
        if mlxbc(one, "status").returncode == 0:
            break
        time.sleep(0.2)
    print(f"group formed in {formed(g0):.1f} s", flush=True)
    prompt = "Write a long story about a lighthouse keeper and the sea, in many chapters."
    for name, h in setups.items():  # loads, and warms the batch sizes a burst brings
        ask(h, model, 8, "warm up")
        for n in levels:
            with ThreadPoolExecutor(n) as ex:
                list(ex.map(lambda i: ask(h, model, 16, f"[warm {i}] {prompt}"), range(n)))
    res = {name: {n: [] for n in levels} | {"ttft": [], "ids": []} for name in setups}
    for r in range(rounds):
        order = list(setups) if r % 2 == 0 else list(setups)[::-1]
        for n in levels:
            for name in order:
                h = setups[name]
                if n == 1:
                    st = ask(h, model, tokens, prompt)
                    res[name][1].append(st["decode_tokens_per_s"])
                    res[name]["ttft"].append(st["time_to_first_token_ms"])
                    res[name]["ids"].append(st["token_ids"])
                    continue
                t = time.monotonic()
                with ThreadPoolExecutor(n) as ex:
                    done = list(ex.map(lambda i: ask(h, model, 128, f"[{r}.{i}] {prompt}"), range(n)))
                res[name][n].append(sum(d["generated_tokens"] for d in done) / (time.monotonic() - t))
                print(f"round {r}, {n} clients, {name}: {res[name][n][-1]:.1f} tok/s", flush=True)
    a, b = list(setups)
    print(f"\n### {model}: one against a group of two ({backend}), {rounds} rounds interleaved, medians\n")
    print(f"| | {a} | {b} | {b} / {a} |\n|---|---:|---:|---:|")
    for n in levels:
        label = "1 stream, decode tok/s" if n == 1 else f"{n} clients, total tok/s (128 tokens each)"
        x, y = statistics.median(res[a][n]), statistics.median(res[b][n])
        print(f"| {label} | {x:.1f} | {y:.1f} | {y / x:.2f}x |")
    if 1 in levels:
        x, y = statistics.median(res[a]["ttft"]), statistics.median(res[b]["ttft"])
        print(f"| 1 stream, TTFT ms | {x:.0f} | {y:.0f} | {y / x:.2f}x |")
        for r, (ia, ib) in enumerate(zip(res[a]["ids"], res[b]["ids"])):
            first = next((i for i, (p, q) in enumerate(zip(ia, ib)) if p != q), None)
            print(f"\nround {r}: greedy ids {'equal' if first is None else f'part at position {first}'} ({len(ia)} tokens)")
    print("\n" + mlxbc(g0, "status").stdout)

    # Faults: rank 1 killed mid-answer.
    with ThreadPoolExecutor(1) as ex:
        long = ex.submit(lambda: (time.monotonic(), mlxbc(g0, "ask", "-m", model, "-n", "4096", "--ignore-eos",
                                                          "--temperature", "0", prompt)))
        time.sleep(3)
        killed = time.monotonic()
        procs["rank1"].kill()
        procs["rank1"].wait()
        _, out = long.result()
        waited = time.monotonic() - killed
    said = (out.stderr or out.stdout).strip()
    print(f"rank 1 killed mid-answer: the client's error after {waited:.2f} s: "
          f"{said.splitlines()[0][:200] if said else 'no error!'}")
    t = time.monotonic()
    st = ask(g0, local_model, 16, "Say hello.", ignore_eos=False)
    print(f"rank 0 answers {local_model} meanwhile: {st['generated_tokens']} tokens in {time.monotonic() - t:.2f} s")
    t = time.monotonic()
    start("rank1", g1, rank1_args)
    formed(g0)
    st = ask(g0, model, 16, "Say hello again.")
    print(f"rank 1 started again: the group re-formed and {model} answered {time.monotonic() - t:.1f} s later")
finally:
    for p in procs.values():
        p.kill()
    for h in (one, g0, g1):
        for log in ("daemon.log",):
            if os.path.exists(f"{h}/{log}") and os.environ.get("OUT"):
                shutil.copy(f"{h}/{log}", f"{os.environ['OUT']}/{os.path.basename(h)}-{log}")
