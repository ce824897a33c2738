#!/usr/bin/env python3
"""A cross-encoder of ms-marco-MiniLM-L-6-v2's shape for `scripts/bench
embed`: all-MiniLM-L6-v2's encoder (real weights) under `bert.`, its
pooler (random where the checkpoint has none) and a random one-label
classifier, with BertForSequenceClassification's config. The scores mean
nothing; the cost is a real reranker's.
    make_cross_encoder.py MINILM_DIR OUT_DIR"""
import json, shutil, sys
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

src, out = Path(sys.argv[1]), Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
w = load_file(str(src / "model.safetensors"))
rng = np.random.default_rng(0)
t = {f"bert.{k}": v for k, v in w.items()}
hidden = w["embeddings.word_embeddings.weight"].shape[1]
if "bert.pooler.dense.weight" not in t:
    t["bert.pooler.dense.weight"] = (rng.standard_normal((hidden, hidden)) * 0.02).astype(np.float32)
    t["bert.pooler.dense.bias"] = np.zeros(hidden, np.float32)
t["classifier.weight"] = (rng.standard_normal((1, hidden)) * 0.02).astype(np.float32)
t["classifier.bias"] = np.zeros(1, np.float32)
save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})
config = json.loads((src / "config.json").read_text())
config.update(architectures=["BertForSequenceClassification"], id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
(out / "config.json").write_text(json.dumps(config, indent=1))
for f in ["tokenizer.json", "vocab.txt", "special_tokens_map.json"]:
    if (src / f).exists():
        shutil.copy(src / f, out / f)
tc = json.loads((src / "tokenizer_config.json").read_text())
tc["model_max_length"] = 512
(out / "tokenizer_config.json").write_text(json.dumps(tc, indent=1))
