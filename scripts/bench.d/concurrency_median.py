"""Medians over rounds of mlxbc-bench --concurrency JSON (one file per
round, each a whole run: every batch size, then the short question during
a long answer). Greedy-id comparisons come from the round that made them
(MLXBC_BENCH_CHECK_IDS=1). Prints JSON in the same shape, plus "rounds".
mlx_lm_batch.py's JSON (a list of rows) is merged the same way.
   concurrency_median.py ROUND1.json ROUND2.json ..."""
import json
import pathlib
import statistics
import sys

runs = [json.loads(pathlib.Path(p).read_text()) for p in sys.argv[1:]]
if isinstance(runs[0], list):  # mlx_lm_batch.py: rows only
    runs = [{"rows": r} for r in runs]
MEASURED = ("total_tps", "per_stream_tps", "ttft_p50_ms", "ttft_p99_ms", "wall_s")
rows = []
for i, first in enumerate(runs[0]["rows"]):
    same = [r["rows"][i] for r in runs]
    row = {k: statistics.median(x[k] for x in same) for k in first if k in MEASURED}
    row["clients"] = first["clients"]
    row["total_tps_rounds"] = [r for x in same for r in x.get("total_tps_rounds", [round(x["total_tps"], 1)])]
    checked = next((x for x in same if x.get("ids_equal_alone") is not None), first)
    row["ids_equal_alone"] = checked.get("ids_equal_alone")
    row["first_differing_token"] = checked.get("first_differing_token", [])
    rows.append(row)
if "short_during_long" not in runs[0]:
    print(json.dumps(rows))
    sys.exit()
short = {k: statistics.median(r["short_during_long"][k] for r in runs) for k in runs[0]["short_during_long"]}
print(json.dumps({"rows": rows, "short_during_long": short, "rounds": len(runs)}))
