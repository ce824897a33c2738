"""The agent loop of `scripts/bench prompts` against mlx-lm's own server
(`python -m mlx_lm.server`, which keeps a prompt cache in RAM and reuses the
longest cached prefix), on the same weights and the same messages as
mlxbc-bench --prompts (the same `facts` text): time to first streamed token
per turn, then the long prompt once. Prints JSON.
   mlx_lm_server_loop.py MODEL_DIR SYSTEM TURNS TURN ANSWER LONG"""
import json
import socket
import subprocess
import sys
import time
import urllib.request

model, system, turns, turn_tokens, answer, long_tokens = sys.argv[1], *map(int, sys.argv[2:7])


def facts(tag, tokens):
    # Must match mlxbc-bench's `facts`.
    return "".join(f"Fact {tag}{i}: item {i} weighs {i * 7 + 3} grams. " for i in range(-(-tokens // 20)))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


port = free_port()
server = subprocess.Popen([sys.executable, "-m", "mlx_lm.server", "--model", model, "--port", str(port), "--log-level", "WARNING"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def ttft(messages, max_tokens):
    body = json.dumps({"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body, {"Content-Type": "application/json"})
    t = time.perf_counter()
    first = None
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if first is None and line.startswith(b"data: {") and b'"content"' in line:
                first = (time.perf_counter() - t) * 1000
    return first if first is not None else (time.perf_counter() - t) * 1000


try:
    for _ in range(600):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=1)
            break
        except Exception:
            time.sleep(0.5)
    ttft([{"role": "user", "content": "hi"}], 1)
    messages = [{"role": "system", "content": facts("s", system)}]
    rows = []
    for turn in range(1, turns + 1):
        messages.append({"role": "user", "content": facts(f"t{turn}-", turn_tokens) + f"Question {turn}: what does item {turn} weigh?"})
        rows.append({"turn": turn, "ttft_ms": ttft(messages, answer)})
        messages.append({"role": "assistant", "content": f"Item {turn} weighs {turn * 7 + 3} grams, as fact t{turn} says; " + facts("a", answer)})
    print(json.dumps({"turns": rows}))
finally:
    server.terminate()
    server.wait(timeout=30)
