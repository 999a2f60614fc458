"""The run folder's tables from its batches.json and one-prompt results (medians as the bench wrote them)."""
import json, glob, os, sys
root = sys.argv[1]
print("| round | model | run | commit | 1 row | 2 rows | 4 rows | 8 rows | 16 rows | ÷ HF at 2-16 rows | identical |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for rnd in ("round1", "round2"):
    for model in ("smollm2-135m", "gemma3-270m"):
        for tag in ("old", "new", "old2"):
            path = f"{root}/{rnd}/batch-{model}-{tag}/batches.json"
            if not os.path.exists(path):
                continue
            d = json.load(open(path))
            b = {x["batch_size"]: x for x in d["batches"]}
            ident = all(x["identical_rows"] == x["rows"] for x in d["batches"])
            hf = [b[s]["speedup"] for s in (2, 4, 8, 16)]
            cells = " | ".join(f"{b[s]['vs_plain']:.2f}" for s in (1, 2, 4, 8, 16))
            print(f"| {rnd[-1]} | {model} | {tag.replace('2', ' again')} | {d['environment']['commit'][:7]} | {cells} | {min(hf):.2f}-{max(hf):.2f} | {'all' if ident else 'NOT all'} |")
