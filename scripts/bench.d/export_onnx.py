#!/usr/bin/env python3
"""all-MiniLM-L6-v2 as an ONNX graph for fastembed in `scripts/bench embed`:
the same safetensors weights traced by torch.onnx (opset 17; batch and
sequence dynamic; output 0 the token states, which fastembed mean-pools and
normalizes), the tokenizer files beside it. fastembed fetches its own ONNX
export (qdrant/all-MiniLM-L6-v2-onnx) from the Hugging Face hub, which the
bench machines cannot reach; this is the same model in the same runtime.
    export_onnx.py MINILM_DIR OUT_DIR"""
import os, shutil, sys, warnings

import torch
from transformers import AutoModel

src, out = sys.argv[1], sys.argv[2]
os.makedirs(out, exist_ok=True)
warnings.filterwarnings("ignore")  # the tracer's notes on constant masks
model = AutoModel.from_pretrained(src).eval()
ids = torch.ones(2, 16, dtype=torch.long)
names = ["input_ids", "attention_mask", "token_type_ids"]
with torch.no_grad():
    torch.onnx.export(model, (ids, torch.ones_like(ids), torch.zeros_like(ids)), os.path.join(out, "model.onnx"),
                      input_names=names, output_names=["last_hidden_state"],
                      dynamic_axes={n: {0: "batch", 1: "sequence"} for n in [*names, "last_hidden_state"]},
                      opset_version=17, dynamo=False)
for f in os.listdir(src):
    if f.endswith(".json") or f == "vocab.txt":
        shutil.copy(os.path.join(src, f), out)
