"""scripts/bench distributed: one model served by 1, 2 and 4 ranks (every
rank a real mlxbcd with its own home, ring over loopback), all groups up at
once and rounds interleaved (an idle group sleeps), through `mlxbc ask`:
time to first token, decode tok/s, and what the group spends on its
collectives. Medians of ROUNDS. Not a test: numbers.

usage: distributed_bench.py BIN_DIR MODEL_FILE ROUNDS DECODE_TOKENS PROMPT_WORDS
"""
import json, os, socket, statistics, subprocess, sys, tempfile, time

bin_dir, model, rounds, tokens, words = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
name = os.path.basename(model)
env = dict(os.environ, OPENBLAS_NUM_THREADS="1", MLXBC_LOG="info")
env.pop("MLXBC_SOCKET", None)
procs, groups = [], {}


def port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p


def home():
    h = tempfile.mkdtemp(prefix="mlxbc-bench-dist")
    os.makedirs(f"{h}/models"); os.symlink(model, f"{h}/models/{name}")
    return h


def mlxbc(h, *args):
    return subprocess.run([f"{bin_dir}/mlxbc", *args], env=dict(env, MLXBC_HOME=h), capture_output=True, text=True)


for ranks in (1, 2, 4):
    h0 = home()
    args = []
    if ranks > 1:
        hostfile = f"{h0}/hosts.json"
        json.dump([[f"127.0.0.1:{port()}"] for _ in range(ranks)], open(hostfile, "w"))
        for r in range(1, ranks):
            procs.append(subprocess.Popen([f"{bin_dir}/mlxbcd", "--hostfile", hostfile, "--rank", str(r)],
                                          env=dict(env, MLXBC_HOME=home()), stderr=subprocess.DEVNULL))
        open(f"{h0}/config.toml", "w").write(f'[cluster]\nsharded = ["{name}"]\nstep_timeout = "60s"\n')
        args = ["--hostfile", hostfile, "--rank", "0"]
    procs.append(subprocess.Popen([f"{bin_dir}/mlxbcd", *args], env=dict(env, MLXBC_HOME=h0),
                                  stderr=open(f"{h0}/daemon.log", "w")))
    groups[ranks] = h0

try:
    for ranks, h in groups.items():
        for _ in range(600):
            s = mlxbc(h, "status")
            if s.returncode == 0 and (ranks == 1 or "group:    formed" in s.stdout):
                break
            time.sleep(0.2)
        else:
            sys.exit(f"the {ranks}-rank group did not form")
        mlxbc(h, "ask", "-m", name, "-n", "4", "--temperature", "0", "warm up")
    prompt = " ".join(f"word{i}" for i in range(words)) + "\nContinue the list."
    res = {r: {"ttft": [], "tps": []} for r in groups}
    for _ in range(rounds):
        for ranks, h in groups.items():
            out = mlxbc(h, "ask", "-m", name, "-n", str(tokens), "--ignore-eos", "--temperature", "0", "--json", prompt)
            stats = [json.loads(l) for l in out.stdout.splitlines() if l.strip()]
            done = [e for e in stats if "stats" in json.dumps(e)][-1]
            st = done.get("stats", done.get("Done", {}).get("stats", done))
            st = st if "decode_tokens_per_s" in st else next(v for v in done.values() if isinstance(v, dict))
            res[ranks]["ttft"].append(st["time_to_first_token_ms"]); res[ranks]["tps"].append(st["decode_tokens_per_s"])
    print(f"\n### Distributed: {name}, {tokens} decoded tokens after a {words}-word prompt, ring over loopback, "
          f"every rank one OpenBLAS thread, {rounds} rounds interleaved (medians)\n")
    print("| ranks | TTFT ms | decode tok/s | step ms | all-reduce (4096 f32) us | plan+inputs ms/call | calls |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for ranks, h in groups.items():
        tps = statistics.median(res[ranks]["tps"])
        c = mlxbc(h, "status").stdout
        line = next((l for l in c.splitlines() if "calls," in l), "")
        calls = line.split()[0] if line else "-"
        msg = line.split("of which ")[1].split(" ms")[0] if line else "-"
        allsum = line.split("row ")[1].split(" us")[0] if line else "-"
        print(f"| {ranks} | {statistics.median(res[ranks]['ttft']):.0f} | {tps:.1f} | {1000 / tps:.1f} | {allsum} | {msg} | {calls} |")
finally:
    for p in procs:
        p.kill()
