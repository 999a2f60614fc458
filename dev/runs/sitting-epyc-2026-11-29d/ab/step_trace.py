"""The bench under a per-step trace: each step's kind, rows, wall ms and its verify's thread count and
trial flag, as one JSON line per runner call (to $TRACE_OUT)."""

import contextlib
import json
import os
import sys
import time

import layerskip.engine.step as st
import layerskip.engine.threads as T
import layerskip.measure.batches as mb
from layerskip.cli.bench import main

OUT = os.environ["TRACE_OUT"]
trace = []
last_verify = {}
orig_phase = T.ThreadTuner.phase


@contextlib.contextmanager
def phase(self, name, rows=1, learn=True):
    with orig_phase(self, name, rows, learn) as run:
        yield run
    if name == "verify":
        last_verify.update(threads=run.threads, trial=run.trial)


T.ThreadTuner.phase = phase
orig = st.Stepper.step


def step(self):
    rows = len(self.rows)
    t = time.perf_counter()
    k0 = dict(self.steps)
    orig(self)
    dt = time.perf_counter() - t
    kind = [k for k in self.steps if self.steps[k] != k0.get(k, 0)]
    trace.append({"kind": kind[0] if kind else "?", "rows": rows, "ms": round(1000 * dt, 2), **last_verify})


st.Stepper.step = step
orig_runner = mb.batch_runner


def runner(model, max_new, eos, pad, policy, *a, **k):
    run = orig_runner(model, max_new, eos, pad, policy, *a, **k)
    name = "hf" if policy is None else (policy if isinstance(policy, str) else "auto")

    def wrapped(ids, mask):
        trace.clear()
        t = time.perf_counter()
        out = run(ids, mask)
        s = time.perf_counter() - t
        with open(OUT, "a") as f:
            f.write(
                json.dumps(
                    {
                        "method": name,
                        "rows": ids.shape[0],
                        "width": ids.shape[1],
                        "seconds": round(s, 3),
                        "steps": list(trace),
                    }
                )
                + "\n"
            )
        return out

    return wrapped


mb.batch_runner = runner
sys.exit(main())
