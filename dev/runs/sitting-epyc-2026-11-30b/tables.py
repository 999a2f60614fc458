"""The run folder's batch tables from its batches.json files: python tables.py ."""

import json
import os
import sys

root = sys.argv[1]
print("| round | model | run | commit | 1 row | 2 rows | 4 rows | 8 rows | 16 rows | ÷ HF | identical |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for round_name in ("round3", "round4", "round5", "round6"):
    for model in ("smollm2-135m", "gemma3-270m"):
        for tag in ("old", "new", "old2"):
            path = f"{root}/{round_name}/batch-{model}-{tag}/batches.json"
            if not os.path.exists(path):
                continue
            data = json.load(open(path))
            by_size = {row["batch_size"]: row for row in data["batches"]}
            identical = "all" if all(row["identical_rows"] == row["rows"] for row in data["batches"]) else "NOT all"
            vs_hf = [by_size[size]["speedup"] for size in (2, 4, 8, 16) if size in by_size]
            cells = " | ".join(
                f"{by_size[size]['vs_plain']:.2f}" if size in by_size else "-" for size in (1, 2, 4, 8, 16)
            )
            run = tag.replace("2", " again")
            commit = data["environment"]["commit"][:7]
            hf = f"{min(vs_hf):.2f}-{max(vs_hf):.2f}"
            print(f"| {round_name[-1]} | {model} | {run} | {commit} | {cells} | {hf} | {identical} |")
