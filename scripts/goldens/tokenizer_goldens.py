#!/usr/bin/env python3
"""Reference token ids for the VLM fixtures' tokenizers, from independent
implementations, so the Rust test can check the tokenizer.json files that
gguf_tokenizer.py rebuilt from GGUF metadata (and that the daemon loads).

  gemma3   SentencePiece itself (the `sentencepiece` package) on a ModelProto
           holding the GGUF's pieces, scores and types
  qwen2.5  the tokenizer.json that transformers' GGUF loader rebuilt from the
           full Qwen2.5 GGUF (scripts/goldens/regenerate makes it
           with transformers from the fixture GGUF)

Writes tests/fixtures/reference/tokenizers.json.
Usage: tokenizer_goldens.py GEMMA3.gguf[.part] QWEN_TOKENIZER_JSON OUT_DIR
       (venv with sentencepiece, protobuf and tokenizers: the mlx-vlm venv of scripts/bench)
"""
import json
import sys
from pathlib import Path

import sentencepiece
from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "fixtures"))  # gguf_tokenizer
import gguf_tokenizer  # noqa: E402

CORPUS = [
    "What is in this picture?",
    "Describe the image in one sentence. Then list three colours you see.",
    "The quick brown fox jumps over the lazy dog; THE QUICK BROWN FOX!",
    "  two leading spaces, then    four, and a trailing tab\t",
    "line one\nline two\n\nafter a blank line\n\n\n\nmany newlines",
    "\tindented\n\t\tdeeper\n",
    "def area(r: float) -> float:\n    return 3.14159 * r ** 2  # circle\n",
    "numbers 0 7 42 1234567890 3.14 -0.5e-3 1,000,000",
    "Ünïcödé façade — naïve café; ÅÄÖ åäö ß",
    "中文字符和日本語のテキスト、한국어 문장도 있습니다.",
    "emoji 🦀🎉👍🏽 and symbols ∑∫√≈≠ ← → ©®",
    "<table><tr><td>a</td><td>b</td></tr></table> <h1>Title</h1>",
    "https://example.com/path?q=1&r=two#frag",
    "a\u200bzero-width space and a\u00a0no-break space",
    "".join(chr(c) for c in range(0x20, 0x7f)),
]
GEMMA_ONLY = ["<start_of_image> and <end_of_image> are user-defined pieces"]
QWEN_ONLY = ["<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What?<|im_end|>\n<|im_start|>assistant\n"]


def main():
    gemma_gguf, qwen_json, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    sp = sentencepiece.SentencePieceProcessor(
        model_proto=gguf_tokenizer.sentencepiece_model(gguf_tokenizer.read_metadata(gemma_gguf)))
    qwen = Tokenizer.from_file(str(qwen_json))
    golden = {
        "gemma3": {"reference": f"sentencepiece {sentencepiece.__version__} on the Gemma 3 GGUF's pieces",
                   "cases": [[t, sp.encode(t)] for t in CORPUS + GEMMA_ONLY]},
        "qwen2.5": {"reference": "transformers' GGUF loader on the full Qwen2.5-Coder-0.5B GGUF",
                    "cases": [[t, qwen.encode(t, add_special_tokens=False).ids] for t in CORPUS + QWEN_ONLY]},
    }
    (out / "tokenizers.json").write_text(json.dumps(golden, ensure_ascii=False, indent=1) + "\n")


if __name__ == "__main__":
    main()
