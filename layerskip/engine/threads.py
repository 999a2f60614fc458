"""CPU thread counts for the draft and the verify, chosen by their measured time while generating.

Why: on a CPU that another process keeps busy, a multi-threaded torch kernel waits for its
descheduled thread at every barrier. Small kernels (a one-token int4 draft forward) are hit
hardest: on a busy machine they can run several times slower on 2 threads than on 1, while on an
idle one 2 threads are faster. No fixed count is right for both, and a machine's load changes
while a server runs, so each phase keeps a moving average of its own time per unit under each
candidate count, uses the fastest, and now and then re-tries another (less often while the
choice holds).

Thread counts change no result: greedy output is the verify's argmax whatever the count.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask: a container or ``taskset`` can give it
    fewer than the machine has). More torch threads than this only wait for each other."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def candidate_counts(available: int) -> tuple[int, ...]:
    """Thread counts worth trying with ``available`` threads: all of them, one, and half on big machines."""
    if available <= 1:
        return (1,)
    if available <= 4:
        return (available, 1)
    return (available, available // 2, 1)


@dataclass
class PhaseThreads:
    """The thread count of one phase: the fastest by moving average, with sparse re-tries of the others.

    ``record(threads, seconds_per_unit)`` after each run of the phase; ``next()`` says the count for
    the next run. Each candidate is tried ``warmup`` times first. Then every ``interval`` runs one
    other candidate is tried once; the interval doubles (up to ``max_interval``) while the choice
    holds and goes back to ``min_interval`` when it changes.
    """

    candidates: tuple[int, ...]
    alpha: float = 0.3
    warmup: int = 2
    min_interval: int = 8
    max_interval: int = 128
    average: dict[int, float] = field(default_factory=dict)  # threads -> seconds per unit (EMA)
    uses: dict[int, int] = field(default_factory=dict)  # threads -> runs recorded
    last_run: dict[int, int] = field(default_factory=dict)  # threads -> index of its latest recorded run
    runs: int = 0
    chosen: int | None = None
    interval: int = 0
    since_probe: int = 0
    probe_turn: int = 0

    def __post_init__(self) -> None:
        if not self.candidates:
            raise ValueError("PhaseThreads needs at least one candidate thread count")
        self.interval = self.min_interval

    def next(self) -> int:
        for count in self.candidates:  # warm-up: every candidate a few times, in turn
            if self.uses.get(count, 0) < self.warmup:
                return count
        best = self.best()
        if best != self.chosen:
            self.chosen, self.interval, self.since_probe = best, self.min_interval, 0
        self.since_probe += 1
        if self.since_probe >= self.interval and len(self.candidates) > 1:
            self.since_probe = 0
            self.interval = min(2 * self.interval, self.max_interval)
            others = [c for c in self.candidates if c != best]
            self.probe_turn += 1
            return others[self.probe_turn % len(others)]
        return best

    def record(self, threads: int, seconds_per_unit: float) -> None:
        if threads not in self.candidates or seconds_per_unit <= 0:
            return
        previous = self.average.get(threads)
        # A count last measured long ago (a re-try) starts afresh: its old average describes the
        # machine as it was then, and blending it in would take many sparse re-tries to forget.
        stale = self.runs - self.last_run.get(threads, self.runs) > 2
        self.average[threads] = (
            seconds_per_unit
            if previous is None or stale
            else (1 - self.alpha) * previous + self.alpha * seconds_per_unit
        )
        self.uses[threads] = self.uses.get(threads, 0) + 1
        self.runs += 1
        self.last_run[threads] = self.runs

    def best(self) -> int:
        """The fastest count measured so far (the most threads before any measurement); no re-try."""
        return min(self.candidates, key=lambda c: (self.average.get(c, float("inf")), -c))


class ThreadTuner:
    """Sets torch's CPU thread count per phase (``draft``, ``verify``) and learns which count is fastest.

    ``threads="auto"`` tunes between ``candidate_counts(torch.get_num_threads())``; an int fixes
    both phases to that count; on a GPU nothing is set. Built once per ``Decoder``, so what it
    learns carries over from prompt to prompt. ``session()`` restores the caller's thread count.

    One choice serves both phases, learnt from the draft when there is one: a draft forward is
    the same work every time (one token), so its time per token is a clean signal, while a
    verify's time depends on its block length (1 to k+1 tokens), which moves it as much as the
    thread count does. Busy or idle, the two phases measured the same way (one thread wins both
    under contention, all threads win both when idle), so a verify after draft forwards follows
    the draft's count (the best one known where the draft's was on trial). A step without draft
    forwards (plain, lookup) tunes the verify's own count, its width in plain steps the unit: the
    draft's best, learnt from a few one-token forwards, can be wrong for a sixteen-row verify, and
    a batch that takes mostly plain steps would keep it, never re-tried (a 16-row SmolLM2 batch on
    one thread of two ran ~1.45x slower). In a size class whose verify tunes itself more often than
    its draft runs, the draft follows the verify's best and tries no count of its own.
    """

    def __init__(self, threads: int | str, device: torch.device) -> None:
        if threads != "auto" and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
            raise ValueError(f"threads must be 'auto' or a positive integer (got {threads!r})")
        self.enabled = torch.device(device).type == "cpu"
        available = torch.get_num_threads()
        self.counts = candidate_counts(available) if threads == "auto" else (int(threads),)
        # Per phase and size of batch (rows grouped by powers of two: 1, 2-3, 4-7, ...): a step over
        # many rows is other work than one over one row (wider products, perhaps another best
        # count), while a batch whose rows leave one by one keeps what its size class learnt.
        self.phases: dict[tuple[str, int], PhaseThreads] = {}
        self.last_draft_threads: int | None = None
        self.last_draft_trial = False
        self.used: dict[str, int] = {}  # "phase:threads" -> runs in the current session, for stats

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """One generation: the caller's thread count comes back afterwards, whatever happens."""
        previous = torch.get_num_threads()
        self.used = {}
        try:
            yield
        finally:
            self.last_draft_threads = None
            if torch.get_num_threads() != previous:
                torch.set_num_threads(previous)

    def phase_threads(self, name: str, rows: int = 1) -> PhaseThreads:
        """The thread choice of phase ``name`` over ``rows`` rows (their size class)."""
        key = (name, rows.bit_length())
        if key not in self.phases:
            self.phases[key] = PhaseThreads(self.counts)
        return self.phases[key]

    @contextlib.contextmanager
    def phase(self, name: str, rows: int = 1, learn: bool = True) -> Iterator[PhaseRun]:
        """Run one phase of a step over ``rows`` rows under its chosen count; its time per unit is
        recorded afterwards.

        The caller sets ``run.units`` (drafted tokens for a draft, a verify's width in plain steps;
        0 = do not learn from this run, e.g. a prompt-lookup draft that ran no forward).
        ``learn=False`` (the prefill, work unlike any step's and many steps long: sixteen prompts'
        prefill on one thread of two cost a second): the best count known, nothing tried and
        nothing learnt.
        """
        run = PhaseRun()
        if not self.enabled:
            yield run
            return
        own = self.phase_threads(name, rows)
        follows_draft = name == "verify" and self.last_draft_threads is not None
        if follows_draft:  # this step's draft ran forwards: its count, used up here
            # A draft on trial tried its count for itself: the verify (most of a many-row step's
            # seconds) runs on the best count known. The step still counts as on trial.
            run.threads, run.trial = self.last_draft_threads, self.last_draft_trial
            if run.trial:
                known = own if own.average else self.phase_threads("draft", rows)
                run.threads = known.best()
            self.last_draft_threads = None
        elif learn and name == "draft" and (verify := self.phase_threads("verify", rows)).runs > own.runs:
            # Where the verify tunes itself more often than the draft runs (a batch taking mostly
            # plain steps), the draft takes the verify's best and tries nothing: a trial's slow count
            # would land on a drafting step that is itself rare (sixteen SmolLM2 rows' 6-token draft on
            # one thread of two made a step of 2.1 s, some twenty plain steps).
            run.threads = verify.best()
        elif learn:  # a step without draft forwards (plain, lookup) tunes the verify's own count
            run.threads = own.next()
            run.trial = run.threads != own.best()
        elif own.average:
            run.threads = own.best()
        else:  # the prefill before any verify was timed: the draft's best, else the most threads
            run.threads = self.phase_threads("draft", rows).best()
        if torch.get_num_threads() != run.threads:
            torch.set_num_threads(run.threads)
        start = time.perf_counter()
        yield run
        seconds = time.perf_counter() - start
        key = f"{name}:{run.threads}"
        self.used[key] = self.used.get(key, 0) + 1
        if name == "draft":
            # only a draft that ran forwards sets the verify's count
            self.last_draft_threads = run.threads if run.units > 0 else None
            self.last_draft_trial = run.trial
        if learn and run.units > 0 and not follows_draft:
            own.record(run.threads, seconds / run.units)


@dataclass
class PhaseRun:
    """One run of a phase: the thread count it got, and how many units of work it did."""

    threads: int = 0
    units: float = 1.0
    trial: bool = False  # a count tried (warm-up or re-try), not the best one known
