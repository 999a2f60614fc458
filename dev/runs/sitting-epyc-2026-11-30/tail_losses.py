"""Per auto batch of 4+ rows in the step traces: seconds that steps after which rows left took beyond
the batch's median plain step, and seconds of steps over 1 s. Usage: python tail_losses.py round1 round2"""

import glob
import gzip
import json
import statistics
import sys

for folder in sys.argv[1:]:
    for path in sorted(glob.glob(f"{folder}/steps-*.jsonl.gz")):
        cells = []
        for line in gzip.open(path, "rt"):
            run = json.loads(line)
            if run["method"] != "auto" or run["rows"] < 4:
                continue
            steps = run["steps"]
            plain = [s["ms"] for s in steps if s["kind"] == "plain" and s["rows"] == run["rows"]] or [1.0]
            median = statistics.median(plain)
            leave = sum(
                max(0.0, s["ms"] - median)
                for s, after in zip(steps, steps[1:])
                if after["rows"] < s["rows"] and s["kind"] in ("plain", "lookup")
            )
            slow = sum(s["ms"] for s in steps if s["ms"] > 1000)
            cells.append(f"{run['rows']}:{leave / 1000:.2f}/{slow / 1000:.2f}")
        print(path, " ".join(cells))
