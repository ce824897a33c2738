"""The speculation benchmarks' tasks (scripts/bench.d/speculative_bench.py,
scripts/gpu/real/pass_ab.py): real requests on real weights, code edits
and JSON on Qwen2.5-Coder 0.5B, a quotation and open-ended chat; and an
8k-token agent prompt. CODE_MODEL and SMALL_MODEL name other models for the
Qwen2.5-Coder and SmolLM2 rows, as on the GPU."""
import os

QWEN = os.environ.get("CODE_MODEL", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
SMOL = os.environ.get("SMALL_MODEL", "SmolLM2-135M-Instruct.Q4_1.gguf")
QWEN_NAME = "Qwen2.5-Coder 0.5B" if "CODE_MODEL" not in os.environ else QWEN
SMOL_NAME = "SmolLM2 135M" if "SMALL_MODEL" not in os.environ else SMOL
FUNCTION = '''def summarize(values, skip_missing=True):
    total = 0
    count = 0
    smallest = None
    largest = None
    for value in values:
        if value is None:
            if skip_missing:
                continue
            raise ValueError("a missing value")
        total += value
        count += 1
        if smallest is None or value < smallest:
            smallest = value
        if largest is None or value > largest:
            largest = value
    if count == 0:
        return None
    average = total / count
    spread = largest - smallest
    return {"total": total, "count": count, "average": average, "smallest": smallest,
            "largest": largest, "spread": spread}
'''
PASSAGE = ("The lighthouse stood at the end of the harbour wall for two hundred years. Every night its keeper "
           "climbed the hundred and twelve steps, trimmed the wick, wound the clockwork and watched the beam "
           "sweep across the water until dawn. Ships that had never seen the coast knew it by that light.")
TASKS = [
    (f"code edit: rename a variable ({QWEN_NAME})", QWEN, 160,
     f"Rename the variable `total` to `running_sum` in this function. Answer with the whole function only.\n\n{FUNCTION}"),
    (f"code edit: add type hints ({QWEN_NAME})", QWEN, 160,
     f"Add type hints to this function. Answer with the whole function only.\n\n{FUNCTION}"),
    (f"JSON repeating the prompt's keys ({QWEN_NAME})", QWEN, 120,
     'Fill in this JSON object for the city of Lyon, keeping every key: {"name": "", "country": "", '
     '"population": 0, "river": "", "founded": "", "mayor": "", "area_km2": 0}'),
    (f"quote a passage ({SMOL_NAME})", SMOL, 100, f"Quote this passage word for word:\n\n{PASSAGE}"),
    (f"open-ended chat ({SMOL_NAME})", SMOL, 100, "Tell me about the history of the bicycle."),
    (f"open-ended chat ({QWEN_NAME})", QWEN, 100, "Tell me about the history of the bicycle."),
]



def agent_prompt():
    """An agent's request (~8k tokens with Qwen2.5's tokenizer): tool descriptions, a long source
    file to work on, and the edit asked for (the peers' regression case)."""
    tools = "\n".join(
        f"- {name}(path: str{extra}) -> str: {what}" for name, extra, what in [
            ("read_file", "", "returns the file's text"),
            ("write_file", ", text: str", "replaces the file's text"),
            ("search", ", pattern: str", "lines matching a regular expression, with line numbers"),
            ("run_tests", "", "runs the test suite of the package at path and returns its report"),
        ])
    parts = []
    for i in range(115):
        parts.append(f'''def metric_{i}(values, weight={i % 7 + 1}):
    """Weighted summary number {i} of a list of readings."""
    total = 0
    for value in values:
        if value is None:
            continue
        total += value * weight
    return total / max(len(values), 1) + {i}
''')
    source = "\n".join(parts)
    return (f"You are a coding agent. Tools:\n{tools}\n\nThe file metrics.py:\n```python\n{source}```\n\n"
            "Rename the parameter `values` to `readings` in metric_87 and answer with that whole function only.")
