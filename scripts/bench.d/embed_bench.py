#!/usr/bin/env python3
"""Embeddings and reranking side by side on the same weights, in one run:
mlxbcd (a warm daemon, through its gateway's /api/embed, which truncates
as sentence-transformers does, and /v1/rerank)
beside sentence-transformers (torch, CPU, the same machine's cores) on
all-MiniLM-L6-v2 (real weights). Rounds interleaved (each starts with the
other engine than the last), medians:
- 1,000 chunks of this repository's source (~200 tokens each; cut at the
  model's 256): texts per second computing them (each round's chunks are
  new to the daemon's store: a round tag leads each), and the same 1,000
  again from the daemon's store (time as a share of computing them),
  twice: through ollama's /api/embed (floats as JSON text, which the
  client's parsing bounds) and through OpenAI's /v1/embeddings with
  `encoding_format: base64`, which the `openai` SDK asks for by default
  (decoded here as the SDK decodes it: numpy over the base64 bytes);
- reranking 100 of the chunks for a query: latency (a new query each
  round, so nothing comes from the store), on a cross-encoder of
  ms-marco-MiniLM-L-6-v2's shape (MiniLM's encoder weights and a random
  one-label head: no real reranker ships on PyPI; the cost is the shape's).
Also the smallest cosine between the two engines' vectors (a check, not a
speed). With FASTEMBED=DIR (an ONNX export of the same weights,
scripts/bench.d/export_onnx.py: fastembed's own export comes from the
Hugging Face hub, which this machine cannot reach), fastembed (onnxruntime,
CPU) computes the same chunks in the same rounds. With BASELINE_URL, a
second daemon (the same build with MLXBC_CPU_MATH=mlx: MLX's own erf and
exp on the CPU) is measured in the same rounds as "mlxbcd mlx-math".
With REFERENCE=none (the GPU machine, which has torch but not
sentence-transformers), mlxbcd alone: no reference rows, no cosine.
    embed_bench.py BASE_URL ROUNDS MINILM_DIR CROSS_ENCODER_DIR [BASELINE_URL]"""
import base64, json, statistics, subprocess, sys, time, urllib.request

import os

import numpy as np

REFERENCE = os.environ.get("REFERENCE", "st") != "none"
if REFERENCE:
    import torch
    from sentence_transformers import CrossEncoder, SentenceTransformer, __version__ as st_version

base, rounds, minilm, cross = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
FASTEMBED = os.environ.get("FASTEMBED") if REFERENCE else None
daemons = {"mlxbcd": base}
if len(sys.argv) > 5:
    daemons["mlxbcd mlx-math"] = sys.argv[5]
# The second daemon's environment (scripts/bench: BASELINE).
BASELINE = sys.argv[6] if len(sys.argv) > 6 else "MLXBC_CPU_MATH=mlx"
CHUNKS, WORDS = 1000, 90


def post(path, body, base=base):
    req = urllib.request.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=1800) as r:
        return json.loads(r.read())


def tracked(*patterns):
    """The repository's files (git's list; the device's copy of the tree has no .git: the same files walked)."""
    try:
        return subprocess.run(["git", "ls-files", *patterns], capture_output=True, text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        from pathlib import Path
        return sorted(str(p) for pat in patterns for p in Path(".").rglob(pat)
                      if not p.parts[0].startswith((".", "target", "dist")))


def chunks():
    files = tracked("*.rs", "*.md", "*.py")
    words = []
    for f in sorted(files):
        words += open(f, encoding="utf-8", errors="replace").read().split()
        if len(words) > CHUNKS * WORDS:
            break
    return [" ".join(words[i * WORDS:(i + 1) * WORDS]) for i in range(CHUNKS)]


texts = chunks()
# Each chunk cut to what the model reads (254 word pieces and its two
# markers), as indexers chunk to fit their embedder: OpenAI's API refuses a
# longer input where ollama's truncates, and both rows must send the same.
from tokenizers import Tokenizer

word_pieces = Tokenizer.from_file(os.path.join(minilm, "tokenizer.json"))
word_pieces.no_truncation()


def fit(text, most=254):
    pieces = word_pieces.encode(text, add_special_tokens=False)
    return text if len(pieces.ids) <= most else text[:pieces.offsets[most - 1][1]]

if REFERENCE:
    st = SentenceTransformer(minilm, device="cpu")
    ce = CrossEncoder(cross, device="cpu", max_length=512)
    tokens = [min(len(st.tokenizer(t)["input_ids"]), 256) for t in texts]
    print(f"{len(texts)} chunks, {statistics.mean(tokens):.0f} tokens on average (cut at 256); "
          f"sentence-transformers {st_version}, torch {torch.__version__} with {torch.get_num_threads()} threads")
if FASTEMBED:
    import onnxruntime
    from fastembed import TextEmbedding, __version__ as fe_version
    from fastembed.common.model_description import ModelSource, PoolingType

    # A custom model over the local export: mean pooling and normalization,
    # as fastembed's own entry for all-MiniLM-L6-v2 declares.
    TextEmbedding.add_custom_model(model="local/all-MiniLM-L6-v2", pooling=PoolingType.MEAN, normalization=True,
                                   sources=ModelSource(hf="sentence-transformers/all-MiniLM-L6-v2"), dim=384,
                                   model_file="model.onnx")
    fe = TextEmbedding(model_name="local/all-MiniLM-L6-v2", specific_model_path=FASTEMBED)
    print(f"fastembed {fe_version}, onnxruntime {onnxruntime.__version__} (CPU; its threads: all cores)")
else:
    # The daemon's own count (ollama's prompt_eval_count), for the table's heading.
    counted = post("/api/embed", {"model": "all-MiniLM-L6-v2", "input": texts[:100]}).get("prompt_eval_count", 0)
    tokens = [counted / 100]
    print(f"{len(texts)} chunks, ~{tokens[0]:.0f} tokens on average (the daemon's count); no reference engine")

for url in daemons.values():
    post("/api/embed", {"model": "all-MiniLM-L6-v2", "input": ["warm"]}, url)
    post("/v1/rerank", {"model": "minilm-cross-encoder", "query": "warm", "documents": ["up"]}, url)
if REFERENCE:
    st.encode(["warm"]), ce.predict([("warm", "up")])
if FASTEMBED:
    list(fe.embed(["warm"]))
rows = {k: [] for k in (["st", "rerank st"] if REFERENCE else [])}
if FASTEMBED:
    rows["fastembed"] = []
for name in daemons:
    rows.update({name: [], f"{name} store": [], f"{name} store b64": [], f"rerank {name}": []})
worst = 1.0
for r in range(rounds):
    batch = [fit(f"[round {r}] {t}") for t in texts]
    query = f"round {r}: how does the daemon keep a model resident and stream tokens back?"
    docs = texts[:100]
    order = [*daemons, "st"] if REFERENCE else [*daemons]
    if FASTEMBED:
        order.append("fastembed")
    order = order[r % len(order):] + order[:r % len(order)]
    for who in order:
        if who in daemons:
            url = daemons[who]
            t = time.monotonic()
            got = post("/api/embed", {"model": "all-MiniLM-L6-v2", "input": batch}, url)
            rows[who].append(len(batch) / (time.monotonic() - t))
            if who == "mlxbcd":
                mine = got
            t = time.monotonic()
            post("/api/embed", {"model": "all-MiniLM-L6-v2", "input": batch}, url)
            rows[f"{who} store"].append(time.monotonic() - t)
            t = time.monotonic()
            got64 = post("/v1/embeddings", {"model": "all-MiniLM-L6-v2", "input": batch, "encoding_format": "base64"}, url)
            vectors = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="float32") for d in got64["data"]]
            rows[f"{who} store b64"].append(time.monotonic() - t)
            assert len(vectors) == len(batch), f"{len(vectors)} vectors for {len(batch)} inputs"
            t = time.monotonic()
            post("/v1/rerank", {"model": "minilm-cross-encoder", "query": query, "documents": docs}, url)
            rows[f"rerank {who}"].append(time.monotonic() - t)
        elif who == "fastembed":
            t = time.monotonic()
            theirs_fe = np.array(list(fe.embed(batch, batch_size=32)))
            rows["fastembed"].append(len(batch) / (time.monotonic() - t))
        else:
            t = time.monotonic()
            theirs = st.encode(batch, batch_size=32)
            rows["st"].append(len(batch) / (time.monotonic() - t))
            t = time.monotonic()
            ce.predict([(query, d) for d in docs], batch_size=32)
            rows["rerank st"].append(time.monotonic() - t)
    a = np.array(mine["embeddings"])
    if REFERENCE:
        for ref in [theirs, theirs_fe] if FASTEMBED else [theirs]:
            worst = min(worst, float(np.min(np.sum(a * ref, axis=1) / np.linalg.norm(a, axis=1) / np.linalg.norm(ref, axis=1))))
    print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.3f}" for k, v in rows.items()), flush=True)

med = {k: statistics.median(v) for k, v in rows.items()}
if not REFERENCE:  # the reference columns print as "-"
    med["st"] = med["rerank st"] = float("nan")
compute_s = CHUNKS / med["mlxbcd"]
print(f"\n| all-MiniLM-L6-v2, {CHUNKS} chunks of ~{statistics.mean(tokens):.0f} tokens | mlxbcd | sentence-transformers | mlxbcd speed / st |")
print("|---|---:|---:|---:|")
print(f"| texts/s, computed | {med['mlxbcd']:.1f} | {med['st']:.1f} | {med['mlxbcd'] / med['st']:.2f}x |")
if FASTEMBED:
    print(f"| texts/s, computed: fastembed (onnxruntime) in its column | {med['mlxbcd']:.1f} | {med['fastembed']:.1f} | "
          f"{med['mlxbcd'] / med['fastembed']:.2f}x |")
print(f"| the same {CHUNKS} again, from the store | {med['mlxbcd store'] * 1000:.0f} ms "
      f"({100 * med['mlxbcd store'] / compute_s:.1f}% of computing them) | - | - |")
print(f"| the same through /v1/embeddings, base64 (the openai SDK's default), from the store | "
      f"{med['mlxbcd store b64'] * 1000:.0f} ms ({100 * med['mlxbcd store b64'] / compute_s:.1f}% of computing them) | - | - |")
print(f"| rerank 100 chunks for a query (MiniLM-L6 cross-encoder shape), latency | "
      f"{med['rerank mlxbcd'] * 1000:.0f} ms | {med['rerank st'] * 1000:.0f} ms | "
      f"{med['rerank st'] / med['rerank mlxbcd']:.2f}x |")
if "mlxbcd mlx-math" in daemons:
    print(f"| the same with {BASELINE}: texts/s | {med['mlxbcd mlx-math']:.1f} | - | "
          f"{med['mlxbcd mlx-math'] / med['st']:.2f}x |")
    print(f"| the same with {BASELINE}: rerank latency | {med['rerank mlxbcd mlx-math'] * 1000:.0f} ms | - | "
          f"{med['rerank st'] / med['rerank mlxbcd mlx-math']:.2f}x |")
print(f"\nrounds: {rounds}; smallest cosine between the engines' vectors: {worst:.6f}")
