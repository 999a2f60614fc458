"""Run the bench with the thread tuner's phase choices counted per (phase, rows, threads, on trial)."""

import atexit
import collections
import contextlib
import sys
import time

from layerskip.cli.bench import main
from layerskip.engine import threads

counts: collections.Counter = collections.Counter()
seconds: collections.Counter = collections.Counter()
original = threads.ThreadTuner.phase


@contextlib.contextmanager
def phase(self, name, rows=1, learn=True):
    start = time.perf_counter()
    with original(self, name, rows, learn) as run:
        yield run
    key = (name, rows, run.threads, run.trial)
    counts[key] += 1
    seconds[key] += time.perf_counter() - start


def dump() -> None:
    for key in sorted(counts):
        print("THR", key, counts[key], round(seconds[key], 2), file=sys.stderr)


threads.ThreadTuner.phase = phase
atexit.register(dump)
sys.exit(main())
