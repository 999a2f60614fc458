"""Per auto batch of 8 or 16 rows in the step traces: its batched-draft (skip:N) steps and their
seconds, at the batch's full rows / after rows left. Usage: python skip_seconds.py round3 round4"""

import glob
import gzip
import json
import sys

for folder in sys.argv[1:]:
    for path in sorted(glob.glob(f"{folder}/steps-*.jsonl.gz")):
        cells = []
        for line in gzip.open(path, "rt"):
            run = json.loads(line)
            if run["method"] != "auto" or run["rows"] < 8:
                continue
            skips = [s for s in run["steps"] if s["kind"].startswith("skip:")]
            full = [s["ms"] for s in skips if s["rows"] == run["rows"]]
            fewer = [s["ms"] for s in skips if s["rows"] < run["rows"]]
            cells.append(f"{run['rows']}:{len(full)}/{sum(full) / 1000:.2f}s+{len(fewer)}/{sum(fewer) / 1000:.2f}s")
        print(path, " ".join(cells))
