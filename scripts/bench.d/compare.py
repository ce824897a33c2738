"""Tables for `scripts/bench compare`: medians over interleaved rounds of an
earlier mlxbcd build (before) and this one (after)."""
import json
import pathlib
import statistics
import sys

results, rounds = pathlib.Path(sys.argv[1]), int(sys.argv[2])


def load(side, name):
    return [json.loads((results / f"{side}-{r}-{name}.json").read_text()) for r in range(1, rounds + 1)]


def med(values):
    return statistics.median(values)


def spread(values, fmt):
    """Median and range, e.g. `490 (410-523)`."""
    return f"{format(med(values), fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


print("\nText (through the socket; 512-token prefill, 128-token decode)\n")
print("| model | build | decode tok/s, median (range) | prefill tok/s | TTFT 50 tok (ms) |")
print("|---|---|---:|---:|---:|")
for name, label in [("smol", "SmolLM2-135M Q4_1"), ("qwen3", "tiny Qwen3 f32")]:
    for side in ["before", "after"]:
        rows = load(side, name)
        print(f"| {label} | {side} | {spread([x['decode_tps'] for x in rows], '.1f')} | "
              f"{spread([x['prefill_tps'] for x in rows], '.0f')} | {spread([x['ttft_ms'] for x in rows], '.1f')} |")

print("\nImages (320x240 PNG; TTFT of a request, ms)\n")
print("| model | case | before | after |")
print("|---|---|---:|---:|")
for name, label in [("gemma-img", "tiny Gemma 3"), ("qwen-img", "tiny Qwen2.5-VL")]:
    before, after = load("before", name), load("after", name)
    for i, case in enumerate(x["case"] for x in before[0]):
        print(f"| {label} | {case} | {med([r[i]['ttft_ms'] for r in before]):.1f} | {med([r[i]['ttft_ms'] for r in after]):.1f} |")

print("\n8 requests with new 1024x1024 images sent while a 600-token generation runs (tiny Gemma 3)")
print("per image request, from the daemon's stats (medians over requests and rounds, ms):\n")
print("| build | preprocess, off the engine | encode, on the engine | prefill | engine time per image request | running generation decode tok/s (alone) | all 8 answered (ms) |")
print("|---|---:|---:|---:|---:|---:|---:|")
for side in ["before", "after"]:
    rows = load(side, "queued")
    reqs = [q for r in rows for q in r["requests"]]
    pre = med([q.get("preprocess_ms", 0.0) for q in reqs])
    enc = med([q["encode_ms"] for q in reqs])
    fill = med([q["prefill_ms"] for q in reqs])
    engine = med([q["encode_ms"] + q["prefill_ms"] + q["lookup_ms"] * (side == "before") for q in reqs])
    # (after: the engine's own re-lookup before encoding is microseconds)
    print(f"| {side} | {pre:.1f} | {enc:.1f} | {fill:.1f} | {engine:.1f} | "
          f"{med([r['running_decode_tps'] for r in rows]):.1f} ({med([r['alone_decode_tps'] for r in rows]):.1f}) | "
          f"{med([r['all_answered_ms'] for r in rows]):.0f} |")
print("\nencode: the tower on the engine thread; preprocess: decoding, resizing and the store lookup, off it")
print("(builds before 2026-12-01's issue 12 counted decoding and resizing in encode).")
