#!/usr/bin/env python3
"""The text section of scripts/bench (and of the GPU run): per model, mlxbcd
through its socket, mlx-lm in process on the same weights, and llama.cpp on
the same GGUF where given; one table per model, plus the machine's measured
memory bandwidth and the decode floor it implies.

Run with the Python that has mlx and mlx-lm (the reference venv).
Usage: text_bench.py --bench MLXBC_BENCH --export MLXBC_GGUF_TO_MLX --work DIR
                     [--llama-bench PATH] [--prompt 512] [--decode 256] [--runs 1]
                     [--json OUT.jsonl] NAME=PATH ...
PATH is a .gguf file (exported for mlx-lm with the daemon's exact arrays) or
an MLX model directory.
"""
import argparse
import json
import os
import pathlib
import statistics
import struct
import subprocess
import sys
import time

import mlx.core as mx

HERE = pathlib.Path(__file__).resolve().parent


def measured_bandwidth():
    """Bytes per second a decode step's kind of work reads on this device: a
    matrix-vector product over a 256 MiB f32 matrix (BLAS on CPU), the
    operation that streams the weights."""
    w = mx.random.normal((8192, 8192)).astype(mx.float32)
    x = mx.random.normal((8192,)).astype(mx.float32)
    mx.eval(w, x)
    times = []
    for _ in range(12):
        t = time.perf_counter()
        mx.eval(w @ x)
        times.append(time.perf_counter() - t)
    return w.nbytes / statistics.median(times[2:])


def weight_bytes_per_token(model_dir, dense_f32):
    """Weight bytes one decode step reads: every matrix once, and of the
    embedding table one row (all of it when it doubles as the output head).
    dense_f32: as mlxbcd holds weights on CPU (dequantized to f32); else as stored."""
    config = json.loads((model_dir / "config.json").read_text())
    text_config = config.get("text_config", config)
    tied = text_config.get("tie_word_embeddings", config.get("tie_word_embeddings", False)) or \
        config.get("model_type") == "gemma3"
    sizes = {"F32": 4, "F16": 2, "BF16": 2, "U32": 4, "I32": 4, "U8": 1}
    total = 0
    for f in model_dir.glob("*.safetensors"):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
        header.pop("__metadata__", None)
        for name, t in header.items():
            if "vision" in name or "multi_modal" in name:
                continue  # the tower is not run while decoding text
            n = 1
            for d in t["shape"]:
                n *= d
            stored = n * sizes.get(t["dtype"], 2)
            if dense_f32:
                if name.endswith((".scales", ".biases")):
                    continue
                if t["dtype"] == "U32":  # packed: the dense matrix it expands to
                    scales = header[name[: -len("weight")] + "scales"]["shape"]
                    n = scales[0] * scales[-1] * (config.get("quantization", {}).get("group_size", 64))
                stored = n * 4
            if "embed_tokens" in name and not tied:
                stored //= t["shape"][0]
            total += stored
    return total


def run_json(cmd, env=None, timeout=1800):
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    lines = [l for l in out.stdout.splitlines() if l.startswith("{")]
    if out.returncode != 0 or not lines:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        prog = next((pathlib.Path(str(c)).name for c in cmd if str(c).endswith((".py", "bench"))), str(cmd[0]))
        raise RuntimeError(f"{last} ({prog} exited {out.returncode})")
    result = json.loads(lines[-1])
    # The daemon's profile of its longest decode (MLXBC_BENCH_LOG=info):
    # host time queueing steps vs waiting for tokens.
    profiles = [l[l.index("decode ("):] for l in out.stderr.splitlines() if "decode (" in l]
    if profiles:
        result["decode_profile"] = max(profiles, key=lambda l: int(l.split("): ")[1].split(" steps")[0]))
    return result


def mlxbcd(bench, path, n_prompt, n_decode, mode=None, chunk=None):
    """mlxbc-bench on `path`; `mode` sets MLXBC_DECODE and `chunk` the prefill
    chunk (else the daemon's defaults for the device)."""
    env = dict(os.environ, MLXBC_BENCH_LOG="info")
    if mode:
        env["MLXBC_DECODE"] = mode
    if chunk:
        env["MLXBC_BENCH_PREFILL_CHUNK"] = str(chunk)
    return run_json([bench, path, str(n_prompt), str(n_decode)], env=env)


def llama_cpp(binary, gguf, n_prompt, n_decode):
    out = subprocess.run([binary, "-m", gguf, "-p", str(n_prompt), "-n", str(n_decode), "-t", str(os.cpu_count()),
                          "-o", "json"], capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"llama-bench failed:\n{out.stderr[-2000:]}")
    rows = json.loads(out.stdout)
    by = {("pp" if r["n_prompt"] else "tg"): r["avg_ts"] for r in rows}
    return {"prefill_tps": by["pp"], "decode_tps": by["tg"], "engine": "llama.cpp llama-bench"}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bench", required=True)
    p.add_argument("--export", required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--llama-bench")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--decode", type=int, default=256)
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--json")
    p.add_argument("--step-rows", action="store_true",
                   help="also mlxbcd with each decode step forced (MLXBC_DECODE=compiled, =eager)")
    p.add_argument("--chunks", help="prefill chunk sweep, e.g. 256,512,1024,2048: mlxbcd alone, one row per "
                   "chunk size (run it with a --prompt longer than the largest chunk)")
    p.add_argument("--engines", help="keep only engines whose label starts with one of these "
                   "(separated by ';', e.g. 'mlxbcd;mlx-lm, dense')")
    p.add_argument("models", nargs="+")
    a = p.parse_args()
    on_gpu = mx.default_device() == mx.gpu
    device = "gpu" if on_gpu else "cpu"
    work = pathlib.Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    bandwidth = measured_bandwidth()
    print(f"device: {device} ({mx.default_device()}); memory bandwidth {bandwidth / 1e9:.1f} GB/s "
          f"(MLX, f32 matrix-vector product over 256 MiB)\n", flush=True)
    log = open(a.json, "a") if a.json else None
    for spec in a.models:
        name, path = spec.split("=", 1)
        path = pathlib.Path(path)
        if path.suffix == ".gguf":
            # GPU: mlxbcd keeps packed weights with f16 floats; CPU: it dequantizes to f32.
            mlx_dir = work / f"{path.stem}-{'f16' if on_gpu else 'f32'}"
            if not (mlx_dir / "config.json").exists():
                subprocess.run([a.export, path, mlx_dir, "float16" if on_gpu else "float32"], check=True)
        else:
            mlx_dir = path
        label = "mlxbcd" + (" (GGUF)" if path.suffix == ".gguf" else "")
        engines = [(label, lambda: mlxbcd(a.bench, path, a.prompt, a.decode))]
        if a.step_rows:
            engines.append((label + ", compiled step", lambda: mlxbcd(a.bench, path, a.prompt, a.decode, "compiled")))
            engines.append((label + ", eager step", lambda: mlxbcd(a.bench, path, a.prompt, a.decode, "eager")))
        if a.chunks:
            engines = [(f"mlxbcd, prefill chunk {c}", lambda c=c: mlxbcd(a.bench, path, a.prompt, a.decode, chunk=c))
                       for c in map(int, a.chunks.split(","))]
        reference = [sys.executable, HERE / "mlx_lm_bench.py", mlx_dir, str(a.prompt), str(a.decode)]
        if not on_gpu and not a.chunks:
            engines.append(("mlx-lm, dense f32 (mlxbcd's CPU form)", lambda: run_json(reference + ["dense"])))
        if not a.chunks:
            engines.append(("mlx-lm, packed" + (" f16" if on_gpu else ""), lambda: run_json(reference + ["packed"])))
        if a.llama_bench and path.suffix == ".gguf" and not on_gpu and not a.chunks:
            engines.append(("llama.cpp (same GGUF)", lambda: llama_cpp(a.llama_bench, str(path), a.prompt, a.decode)))
        if a.engines:
            keep = tuple(e.strip() for e in a.engines.split(";") if e.strip())
            engines = [(label, m) for label, m in engines if label.startswith(keep)]
        floor_bytes = weight_bytes_per_token(mlx_dir, dense_f32=not on_gpu)
        floor_ms = floor_bytes / bandwidth * 1000
        print(f"{name} | {device} | prompt {a.prompt} tokens, decode {a.decode} tokens | "
              f"weights read per token {floor_bytes / 2**20:.1f} MiB -> bandwidth floor {floor_ms:.3f} ms/token\n")
        print("| engine | run | TTFT, 50-token prompt (ms) | prefill tok/s | decode tok/s | ms/token | "
              "x floor | IPC overhead | peak memory (MiB) |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        decode, profiles = {}, []
        # Runs are interleaved (every engine once, then again): the lent
        # GPU's speed drifts within a lease, and rows of one round share it.
        for run, (label, measure) in ((r, e) for r in range(1, a.runs + 1) for e in engines):
            try:
                r = measure()
            except Exception as e:  # a failed engine is a row that says so, not a lost table
                print(f"| {label} | {run} | failed: {str(e).splitlines()[0][:160]} | | | | | | |", flush=True)
                continue
            ms = 1000 / r["decode_tps"] if r.get("decode_tps") else float("nan")
            decode.setdefault(label, []).append(r["decode_tps"])
            peak = r.get("mlx_peak_bytes") if on_gpu else r.get("peak_rss_bytes")
            ipc = f"{r['ipc_overhead_pct']:+.2f}%" if "ipc_overhead_pct" in r else ""
            ttft = f"{r['ttft_ms']:.1f}" if "ttft_ms" in r else ""
            mem = f"{peak / 2**20:.0f}" if peak else ""
            print(f"| {label} | {run} | {ttft} | {r['prefill_tps']:,.0f} | {r['decode_tps']:.1f} | {ms:.2f} | "
                  f"{ms / floor_ms:.1f} | {ipc} | {mem} |", flush=True)
            if "decode_profile" in r:
                profiles.append(f"{label}, run {run}: {r['decode_profile']}")
            if log:
                log.write(json.dumps({"model": name, "device": device, "engine": label, "run": run,
                                      "floor_ms": floor_ms, **r}) + "\n")
        if profiles:
            print("\nmlxbcd's host time per decoded token (its log):")
            for line in profiles:
                print(f"  {line}")
        ours = [v for k, v in decode.items() if k.startswith("mlxbcd")]
        for form in ("dense", "packed"):
            theirs = [v for k, v in decode.items() if k.startswith(f"mlx-lm, {form}")]
            if ours and theirs:
                ratio = statistics.median(ours[0]) / statistics.median(theirs[0])
                print(f"\ndecode, mlxbcd / mlx-lm {form} (medians of {len(ours[0])} and {len(theirs[0])}): {ratio:.2f}x")
        print(flush=True)


if __name__ == "__main__":
    main()
