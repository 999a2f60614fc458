"""Run the bench with the thread tuner's phase choices logged per (phase, rows-class, threads, why)."""
import atexit, collections, contextlib, sys, time
from layerskip.engine import threads as T
counts = collections.Counter(); secs = collections.Counter()
orig = T.ThreadTuner.phase
@contextlib.contextmanager
def phase(self, name, rows=1, learn=True):
    t = time.perf_counter()
    with orig(self, name, rows, learn) as run:
        yield run
    k = (name, rows, run.threads, run.trial)
    counts[k] += 1; secs[k] += time.perf_counter() - t
T.ThreadTuner.phase = phase
def dump():
    for k in sorted(counts): print("THR", k, counts[k], round(secs[k], 2), file=sys.stderr)
atexit.register(dump)
from layerskip.cli.bench import main
sys.exit(main())
