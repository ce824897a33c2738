#!/usr/bin/env python3
"""Greedy ids and log-probabilities from mlx-lm's `generate_step` with a
quantized KV cache (`kv_bits`, `kv_group_size`, `quantized_kv_start`: its
`QuantizedKVCache` and `quantized_scaled_dot_product_attention`), on the
fixture SmolLM2 (dense f32 on CPU, as the daemon computes there) and the
tiny Qwen3 (grouped-query heads 32 wide: groups of 32), for the test prompts, in these
settings: 8 and 4 bits from the start, and 8 bits starting after 48
positions (the short prompts' caches are quantized during decode, the long
one's after its prefill). Also the full-precision answers, for counting how
many quantized answers equal them, and each step's five best tokens. Written to
tests/fixtures/reference/kv-quantized.json (tests need no Python).

Usage: mlx_lm_kv_quantized.py FIXTURES_DIR OUT_DIR
"""
import json
import sys
from pathlib import Path

import mlx.core as mx
import mlx_lm
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.utils import dequantize_model

sys.path.insert(0, str(Path(__file__).parent))
from mlx_lm_reference import PROMPTS, long_prompt  # noqa: E402

MAX_TOKENS = 32
# Each step's best tokens: where a sum's last bits differ (another BLAS's
# kernels, another batch's row count) greedy ids may part at a near tie, and
# the test checks the parting token against these.
TOP = 5
SETTINGS = [
    {"bits": 8, "group_size": 64, "start": 0},
    {"bits": 4, "group_size": 64, "start": 0},
    {"bits": 8, "group_size": 32, "start": 48},
    None,
]


def run(model, tokenizer, prompt, setting):
    kwargs = {}
    if setting:
        kwargs = {"kv_bits": setting["bits"], "kv_group_size": setting["group_size"],
                  "quantized_kv_start": setting["start"]}
    ids, logprobs, top = [], [], []
    for token, lp in generate_step(mx.array(prompt), model, max_tokens=MAX_TOKENS, **kwargs):
        token = int(token)
        if token in tokenizer.eos_token_ids:
            break
        ids.append(token)
        logprobs.append(lp[token].item())
        best = mx.argsort(-lp)[:TOP].tolist()
        top.append([[i, lp[i].item()] for i in best])
    return ids, logprobs, top


def main():
    fixtures, out = Path(sys.argv[1]), Path(sys.argv[2])
    hashes = json.loads((fixtures / "hashes.json").read_text())
    result = {"reference": f"mlx-lm {mlx_lm.__version__}, mlx {mx.__version__}, dense f32, CPU",
              "max_tokens": MAX_TOKENS, "models": {}}
    for name in ("smollm2-mlx", "tiny-qwen3"):
        model, tokenizer = load(str(fixtures / name))
        model = dequantize_model(model)
        cases = []
        # Groups no wider than the heads (tiny-qwen3's are 32 wide).
        head = model.args.head_dim or model.args.hidden_size // model.args.num_attention_heads
        settings = [s and {**s, "group_size": min(s["group_size"], head)} for s in SETTINGS]
        for messages in PROMPTS + [long_prompt(tokenizer)]:
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            for setting in settings:
                ids, logprobs, top = run(model, tokenizer, prompt, setting)
                cases.append({"messages": messages, "prompt_tokens": len(prompt), "kv": setting,
                              "generated_ids": ids, "logprobs": logprobs, "top_logprobs": top})
                print(name, setting, repr(tokenizer.decode(ids))[:70])
        result["models"][name] = {"weights_sha256": hashes[name], "cases": cases}
    (out / "kv-quantized.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
