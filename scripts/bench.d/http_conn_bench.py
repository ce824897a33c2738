"""The gateway's connection handling against an earlier build: two daemons
(this build's and a baseline's) with the same model, rounds interleaved,
medians. Cases, none of which generates (what is measured is the HTTP path,
not the model): GET /api/version on one keep-alive connection, the same on
a new connection each time, and POST /v1/messages/count_tokens with a
body of 1 MiB and 7 MiB of text (read whole, parsed, and refused by the
prompt-size check before tokenizing: a 400, which is the answer expected).
    http_conn_bench.py NEW_URL BASE_URL MODEL [ROUNDS=5]"""
import http.client
import json
import statistics
import sys
import time
import urllib.parse

new_url, base_url, model = sys.argv[1:4]
rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 5


def hostport(url):
    u = urllib.parse.urlparse(url)
    return u.hostname, u.port


def keepalive(url, n=500):
    h, p = hostport(url)
    c = http.client.HTTPConnection(h, p)
    t = time.perf_counter()
    for _ in range(n):
        c.request("GET", "/api/version")
        r = c.getresponse()
        assert r.status == 200, r.status
        r.read()
    c.close()
    return (time.perf_counter() - t) / n * 1e6


def fresh(url, n=300):
    h, p = hostport(url)
    t = time.perf_counter()
    for _ in range(n):
        c = http.client.HTTPConnection(h, p)
        c.request("GET", "/api/version", headers={"Connection": "close"})
        r = c.getresponse()
        assert r.status == 200, r.status
        r.read()
        c.close()
    return (time.perf_counter() - t) / n * 1e6


def count_tokens(url, mib, n=3):
    h, p = hostport(url)
    text = ("the quick brown fox jumps over the lazy dog " * (mib * 1024 * 1024 // 44 + 1))[: mib * 1024 * 1024 - 200]
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": text}]}).encode()
    c = http.client.HTTPConnection(h, p, timeout=300)
    t = time.perf_counter()
    for _ in range(n):
        c.request("POST", "/v1/messages/count_tokens", body, {"Content-Type": "application/json"})
        r = c.getresponse()
        out = r.read()
        assert r.status == 400 and b"shorten it" in out, (r.status, out[:200])
    c.close()
    return (time.perf_counter() - t) / n * 1e6


CASES = {
    "GET /api/version, keep-alive (us/request)": keepalive,
    "GET /api/version, a new connection each (us/request)": fresh,
    "POST 1 MiB body, refused by size (us/request)": lambda u: count_tokens(u, 1),
    "POST 7 MiB body, refused by size (us/request)": lambda u: count_tokens(u, 7),
}
results = {(case, side): [] for case in CASES for side in ("this build", "baseline")}
for r in range(rounds):
    for i, case in enumerate(CASES):
        sides = [("this build", new_url), ("baseline", base_url)]
        if (r + i) % 2:
            sides.reverse()
        for side, url in sides:
            results[(case, side)].append(CASES[case](url))
print(f"| case | this build | baseline | ratio |")
print("|---|---:|---:|---:|")
for case in CASES:
    a = statistics.median(results[(case, "this build")])
    b = statistics.median(results[(case, "baseline")])
    print(f"| {case} | {a:,.0f} | {b:,.0f} | {a / b:.2f} |")
print(f"medians of {rounds} rounds, interleaved")
