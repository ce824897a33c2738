"""What each API of the HTTP gateway costs over the socket, and what
logprobs and constrained decoding cost: the same greedy question through
the socket's CLI-free path (chat completions is the baseline), OpenAI chat,
Anthropic messages, the Responses API and ollama's /api/chat on one warm
daemon, rounds interleaved (each round starts one case later, so no case
always follows the same one), medians. Plain HTTP (urllib), no SDK overhead.
    gateway_bench.py BASE_URL MODEL [ROUNDS=7] [TOKENS=64]"""
import json
import statistics
import sys
import time
import urllib.request

base, model = sys.argv[1], sys.argv[2]
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 7
tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 64
question = "Write a short story about a robot who learns to paint."
msgs = [{"role": "user", "content": question}]


def post(path, body):
    req = urllib.request.Request(f"{base}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"})
    t = time.perf_counter()
    with urllib.request.urlopen(req) as r:
        out = json.load(r)
    return time.perf_counter() - t, out


def chat(extra=None):
    return post("/v1/chat/completions",
                {"model": model, "temperature": 0, "max_tokens": tokens, "messages": msgs, **(extra or {})})


CASES = {
    "openai chat": lambda: chat(),
    "openai chat, logprobs top 5": lambda: chat({"logprobs": True, "top_logprobs": 5}),
    "openai chat, logprobs top 20": lambda: chat({"logprobs": True, "top_logprobs": 20}),
    "openai chat, json_object": lambda: chat({"response_format": {"type": "json_object"}}),
    "anthropic messages": lambda: post("/v1/messages", {"model": model, "temperature": 0, "max_tokens": tokens,
                                                        "messages": msgs}),
    "responses": lambda: post("/v1/responses", {"model": model, "temperature": 0, "max_output_tokens": tokens,
                                                "input": question}),
    "ollama /api/chat": lambda: post("/api/chat", {"model": model, "stream": False, "messages": msgs,
                                                   "options": {"temperature": 0, "num_predict": tokens}}),
}


def generated(out):
    if "usage" in out and "completion_tokens" in out["usage"]:
        return out["usage"]["completion_tokens"]
    if "usage" in out:
        return out["usage"]["output_tokens"]
    return out["eval_count"]


chat()  # warm: load, first shapes
times = {k: [] for k in CASES}
counts = {}
names = list(CASES)
for r in range(rounds):
    for name in names[r % len(names):] + names[:r % len(names)]:
        dt, out = CASES[name]()
        times[name].append(dt)
        counts[name] = generated(out)
base_ms = statistics.median(times["openai chat"]) * 1e3
print(f"{'request (greedy, ' + str(tokens) + ' tokens asked)':<34} {'median ms':>10} {'tokens':>7} {'ms/token':>9} {'vs chat':>8}")
for name in CASES:
    ms = statistics.median(times[name]) * 1e3
    print(f"{name:<34} {ms:>10.1f} {counts[name]:>7} {ms / max(counts[name], 1):>9.2f} {ms / base_ms:>7.2f}x")
