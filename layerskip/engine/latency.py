"""The latency model: measured seconds of a plain step, of a verify block and of a draft step.

Everything that prices a draft times it here, on the model's own device and with the engine's
own verify: the search's calibration, ``auto``'s calibration at load, the benchmark scripts.
CUDA: CUDA events around each call; CPU: perf_counter. Warm-up first, median of repeats; the
cache is prefilled with a real context so the attention cost is realistic.
"""

from __future__ import annotations

import contextlib
import datetime
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import torch
from torch import nn
from tqdm.auto import tqdm

from layerskip.drafts.builder import (
    WIDE_BLOCK,
    WIDE_ROWS_UP_TO,
    DraftCosts,
    DraftHead,
    DraftModel,
    ExitAdapter,
    exit_verify,
)
from layerskip.engine.verify_head import VerifyHead, engine_verify_head
from layerskip.hf import adapters
from layerskip.hf.cache import RollbackCache, model_cache
from layerskip.hf.forward import block_hidden, full_hidden, full_logits

K = TypeVar("K")
# One set of repeats for the one curve auto and the search share (engine.calibration). A cold
# `auto` run pays for it at load, where a whole calibration must stay under 20 s (4.5-7.5 s of it
# on the embedded models on 2 CPU cores with these): 7 plain steps after one warm-up still give the
# quartiles whose spread tells a busy machine, 3 interleaved rounds a median per block (robust to
# one slow first call); 15 and 7 would time about twice as long.
PLAIN_REPEATS = 7
VERIFY_REPEATS = 3
BUSY_SPREAD = 0.25  # interquartile range / median of the plain-step timings above this: busy


def _time_once(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000.0
    begin = time.perf_counter()
    fn()
    return time.perf_counter() - begin


def timings(fn: Callable[[], object], device: torch.device, repeats: int = 7, warmup: int = 2) -> list[float]:
    """Seconds of each of ``repeats`` calls, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        _time_once(fn, device)
    return [_time_once(fn, device) for _ in range(repeats)]


def median_seconds(fn: Callable[[], object], device: torch.device, repeats: int = 7, warmup: int = 2) -> float:
    return statistics.median(timings(fn, device, repeats, warmup))


def prefilled_cache(
    model: nn.Module, context: Sequence[int], exit: ExitAdapter | None = None
) -> tuple[RollbackCache, torch.device]:
    """A cache holding ``context``; with a layer exit adapter, its own cache layer too."""
    device = next(model.parameters()).device
    windows = adapters.sliding_windows(model)
    if exit is not None and exit.uses_cache:
        windows.append(windows[exit.spec.layer])
    cache = model_cache(model, windows)
    block = torch.tensor([list(context)], device=device)
    # A layer exit adapter's own K/V are filled after the forward, as after every verify.
    with exit_verify(model, exit, False, cache, [0], block) if exit is not None else contextlib.nullcontext():
        full_logits(model, block, cache, keep=1)
    return cache, device


class DraftStep:
    """One draft token (the bypassed stack in the draft's precision, then its head on ``head_rows``
    and the context's tokens, or every row) after ``context``: a call runs it and rolls the cache
    back, so that it can be timed again and again. Build and call it under ``torch.inference_mode``."""

    def __init__(
        self,
        draft_model: DraftModel,
        context: Sequence[int],
        *,
        attention: Sequence[int] = (),
        mlp: Sequence[int] = (),
        head_rows: Sequence[int] | None = None,
    ) -> None:
        self.draft_model, self.attention, self.mlp = draft_model, attention, mlp
        self.cache, self.device = prefilled_cache(draft_model.model, context, draft_model.exit)
        self.length = len(context)
        self.token = torch.tensor([[context[-1]]], device=self.device)
        rows = None if head_rows is None else torch.tensor(sorted({*head_rows, *context}), dtype=torch.long)
        self.head = draft_model.head(rows)
        self.head_rows = None if rows is None else len(rows)  # the rows the head scores (None: every row)

    def __call__(self) -> None:
        with self.draft_model.active(self.attention, self.mlp):
            self.draft_model.logits(self.token, self.cache, self.head)
        self.cache.rollback(self.length)

    def hidden(self) -> torch.Tensor:
        """The hidden state the step's head reads."""
        with self.draft_model.active(self.attention, self.mlp):
            hidden = self.draft_model.hidden(self.token, self.cache)[0, -1]
        self.cache.rollback(self.length)
        return hidden


@torch.inference_mode()
def draft_step_seconds(
    draft_model: DraftModel,
    context: Sequence[int],
    attention: Sequence[int] = (),
    mlp: Sequence[int] = (),
    head_rows: Sequence[int] | None = None,
    repeats: int = 7,
) -> float:
    """Median seconds of one draft token (``DraftStep``) after ``context``."""
    step = DraftStep(draft_model, context, attention=attention, mlp=mlp, head_rows=head_rows)
    return median_seconds(step, step.device, repeats)


@torch.inference_mode()
def head_size_timings(
    draft_model: DraftModel, context: Sequence[int], sizes: Sequence[int], repeats: int
) -> dict[int, float]:
    """Median seconds of one draft token (nothing bypassed) for each head size (its first rows;
    0 = every row), the sizes timed in turn each round, as ``curve_timings`` times blocks."""
    cache, device = prefilled_cache(draft_model.model, context)
    length = len(context)
    token = torch.tensor([[context[-1]]], device=device)

    def step(head: DraftHead) -> None:
        with draft_model.active((), ()):
            draft_model.logits(token, cache, head)
        cache.rollback(length)

    steps = {}
    for size in sizes:
        rows = None if not size else torch.tensor(sorted({*range(size), *context}), dtype=torch.long)
        steps[size] = partial(step, draft_model.head(rows))
    seconds = interleaved_timings(steps, device, repeats)
    return {size: statistics.median(values) for size, values in seconds.items()}


@dataclass
class BatchStepTimings:
    """Median seconds of one batched step per row count: a plain step (every row verifies its
    pending token, greedy, as the engine's batched verify runs it), a draft step (every row
    drafts one token in one lean forward, nothing bypassed) and a wide verify (every row verifies
    ``WIDE_BLOCK`` positions)."""

    plain: dict[int, float]
    draft: dict[int, float]
    wide: dict[int, float] = field(default_factory=dict)


@torch.inference_mode()
def batch_step_timings(
    model: nn.Module, draft_model: DraftModel, context: Sequence[int], rows: Sequence[int], head_size: int, repeats: int
) -> BatchStepTimings:
    """``BatchStepTimings`` for each of ``rows`` rows, every row holding ``context``; the draft
    scores a head of ``head_size`` ranked rows (0: every row) plus the context's tokens.

    One row is prefilled and copied to the most rows; fewer rows keep the first ones (the largest
    count is timed first)."""
    device = next(model.parameters()).device
    largest = max(rows)
    cache = model_cache(model)
    block_hidden(model, torch.tensor([list(context)], device=device), cache)
    cache.keep_rows([0] * largest)  # every row holds the same context: one prefill, copied
    length = len(context)
    cache.set_lengths([length] * largest)
    cache.reserve(length + WIDE_BLOCK + 1)
    greedy = engine_verify_head(model)
    ranked = None if not head_size else torch.tensor(sorted({*range(head_size), *context}), dtype=torch.long)
    head = draft_model.head(ranked)
    timed = BatchStepTimings({}, {}, {})
    for count in sorted(set(rows), reverse=True):
        if cache.rows > count:
            cache.keep_rows(list(range(count)))
        token = torch.full((count, 1), context[-1], device=device)  # [R, 1]
        lengths = [length] * count

        def verify_step(block: torch.Tensor, lengths: list[int] = lengths) -> None:
            hidden = block_hidden(model, block, cache)  # [R, n, H]
            greedy.argmax(hidden.flatten(0, 1))
            cache.set_lengths(lengths)

        def draft_step(token: torch.Tensor = token, lengths: list[int] = lengths) -> None:
            with draft_model.active((), ()):
                head(draft_model.hidden(token, cache)[:, 0]).argmax(-1)  # [R, n] -> [R]
            cache.set_lengths(lengths)

        wide = token.expand(count, WIDE_BLOCK)  # [R, WIDE_BLOCK]
        steps = {"plain": partial(verify_step, token), "draft": draft_step}
        if count <= WIDE_ROWS_UP_TO:
            steps["wide"] = partial(verify_step, wide)
        for name, seconds in interleaved_timings(steps, device, repeats).items():
            getattr(timed, name)[count] = statistics.median(seconds)
    return timed


# Positions the full head's extra cost is timed at: one row's plain step and a batch's wide verify
# (its product grows from reading the head to computing with it); a row's long draft lies between.
DENSE_POSITIONS = (1, 32)


@torch.inference_mode()
def dense_head_timings(model: nn.Module, context: Sequence[int], repeats: int) -> dict[int, float]:
    """Seconds a verify's head takes beyond the engine's greedy head when a row needs every logit
    (a user's own logits processor, sampling), per count of positions: the full fp32 head over the
    context's last hidden states, less the greedy argmax over them (0 where the greedy head is the
    full one)."""
    device = next(model.parameters()).device
    cache = model_cache(model)
    hidden = block_hidden(model, torch.tensor([list(context)], device=device), cache)[0]  # [T, H]
    greedy = engine_verify_head(model)
    steps: dict[tuple[str, int], Callable[[], object]] = {}
    for count in DENSE_POSITIONS:
        rows = hidden[-count:] if count <= hidden.shape[0] else hidden[-1:].expand(count, -1)  # [count, H]
        steps["full", count] = lambda rows=rows: greedy.logits(rows)
        steps["greedy", count] = lambda rows=rows: greedy.argmax(rows)
    seconds = {key: statistics.median(values) for key, values in interleaved_timings(steps, device, repeats).items()}
    # Never 0: a cost of 0 is refused as no measurement (drafts.rules.costs); a microsecond prices as none.
    return {count: max(seconds["full", count] - seconds["greedy", count], 1e-6) for count in DENSE_POSITIONS}


def _verify_steps(
    model: nn.Module, context: Sequence[int], blocks: Sequence[int], greedy: VerifyHead | None
) -> tuple[dict[int, Callable[[], None]], torch.device]:
    """A full forward over each block length after ``context``, rolled back after every call:
    without ``greedy`` every row's full logits (block=1: a plain step, as HF ``generate`` takes
    it), with it the greedy verify as the engine runs it (its argmax)."""
    cache, device = prefilled_cache(model, context)
    length = len(context)

    def step(tokens: torch.Tensor) -> None:
        block = tokens.shape[1]
        if greedy is None:
            full_logits(model, tokens, cache, keep=block)
        else:
            greedy.argmax(full_hidden(model, tokens, cache, keep=block))
        cache.rollback(length)

    return {block: partial(step, torch.tensor([[context[-1]] * block], device=device)) for block in blocks}, device


@torch.inference_mode()
def verify_timings(
    model: nn.Module,
    context: Sequence[int],
    block: int,
    repeats: int = 7,
    greedy: VerifyHead | None = None,
    warmup: int = 2,
) -> list[float]:
    """Seconds of each of ``repeats`` full forwards over ``block`` tokens after ``context`` (``_verify_steps``)."""
    steps, device = _verify_steps(model, context, [block], greedy)
    return timings(steps[block], device, repeats, warmup)


@torch.inference_mode()
def curve_timings(
    model: nn.Module, context: Sequence[int], blocks: Sequence[int], repeats: int, greedy: VerifyHead
) -> dict[int, list[float]]:
    """Seconds of ``repeats`` greedy verifies of each block length after ``context``, interleaved:
    every round times each length once, so a load that comes and goes touches them all alike
    (timed one length after another, a busy spell would bend the curve)."""
    steps, device = _verify_steps(model, context, blocks, greedy)
    return interleaved_timings(steps, device, repeats)


def interleaved_timings(
    steps: dict[K, Callable[[], object]], device: torch.device, repeats: int
) -> dict[K, list[float]]:
    """Seconds of ``repeats`` calls of each step, the steps taking turns in every round: a load that
    comes and goes touches them all alike. No warm-up call: the callers take a median of at least 3
    rounds, which a slow first call (a new shape) does not move, and a cold calibration must stay short."""
    seconds: dict[K, list[float]] = {key: [] for key in steps}
    for _ in range(repeats):
        for key, step in steps.items():
            seconds[key].append(_time_once(step, device))
    return seconds


def verify_seconds(
    model: nn.Module, context: Sequence[int], block: int, repeats: int = 7, greedy: VerifyHead | None = None
) -> float:
    """Median seconds of one full forward over ``block`` tokens after ``context`` (see ``verify_timings``)."""
    return statistics.median(verify_timings(model, context, block, repeats, greedy))


def timing_spread(timings: Sequence[float]) -> float:
    """Interquartile range over median of repeated timings (0 for fewer than 4)."""
    if len(timings) < 4:
        return 0.0
    q1, median, q3 = statistics.quantiles(timings, n=4, method="inclusive")
    return (q3 - q1) / median if median > 0 else 0.0


def busy_warning(timings: Sequence[float], threshold: float | None = None) -> str | None:
    """A one-line warning when repeated plain-step timings spread too widely, else None."""
    threshold = BUSY_SPREAD if threshold is None else threshold
    spread = timing_spread(timings)
    if spread <= threshold:
        return None
    return (
        f"warning: the machine looks busy: repeated plain-step timings spread {spread:.0%} (interquartile "
        f"range / median, over {threshold:.0%} counts as busy), so the measured draft and verify costs may be "
        "off; this calibration is not cached"
    )


@dataclass
class Latency:
    """Measured seconds of one full forward of 1 (plain step) and of each verify block length."""

    plain_step_seconds: float
    verify_seconds: dict[int, float]
    plain_timings: list[float] = field(default_factory=list)
    warning: str | None = None
    measured_at: str = ""
    cached_from: str | None = None
    context: list[int] = field(default_factory=list)  # the tokens it was timed after: time drafts after them too

    def describe(self) -> dict[str, Any]:
        """What a study records about how its costs were measured."""
        info: dict[str, Any] = {
            "plain_step_ms": 1000 * self.plain_step_seconds,
            "plain_step_spread": round(timing_spread(self.plain_timings), 4),
            "measured_at": self.measured_at,
            "busy": self.warning is not None,
        }
        if self.warning is not None:
            info["warning"] = self.warning
        if self.cached_from is not None:
            info["cached_from"] = self.cached_from
        return info

    def to_dict(self) -> dict[str, Any]:
        return {
            "plain_step": self.plain_step_seconds,
            "verify": {str(block): seconds for block, seconds in sorted(self.verify_seconds.items())},
            "plain_timings": self.plain_timings,
            "measured_at": self.measured_at,
            "context": self.context,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], vocab: int) -> Latency:
        """Back from ``to_dict``, checked as a cached calibration of auto is (ValueError: seconds not
        finite and above 0, a block below 1, a timing that is no number, a token outside ``vocab``)."""
        costs = DraftCosts.from_dict(
            {"plain_step": data["plain_step"], "verify": data["verify"], "draft_step": {"0": 1}}
        )
        timings, context = data["plain_timings"], data["context"]
        if not all(isinstance(t, (int, float)) and not isinstance(t, bool) for t in timings):
            raise ValueError("plain timings are not numbers")
        if not context or not all(type(t) is int and 0 <= t < vocab for t in context):
            raise ValueError("its context is not token ids of this model")
        timings = [float(t) for t in timings]
        return cls(costs.plain_step, costs.verify, timings, None, str(data["measured_at"]), context=context)


def measure_latency(
    model: nn.Module,
    context: Sequence[int],
    blocks: Sequence[int],
    progress: bool,
    plain_repeats: int = PLAIN_REPEATS,
    verify_repeats: int = VERIFY_REPEATS,
) -> Latency:
    """Plain-step timings (median and spread; a step as HF ``generate`` takes it: the full logits)
    and the median of every verify block length as the engine's greedy verify runs it (1 included:
    with the certified head a one-token verify can cost less than a plain step)."""
    bar = tqdm(total=2 + len(blocks), desc="latency calibration", disable=not progress)
    plain = verify_timings(model, context, 1, plain_repeats, warmup=1)
    bar.update()
    greedy = engine_verify_head(model)
    curve = curve_timings(model, context, [1, *blocks], verify_repeats, greedy)
    verify = {block: statistics.median(seconds) for block, seconds in curve.items()}
    bar.update(1 + len(blocks))
    bar.close()
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    return Latency(statistics.median(plain), verify, plain, busy_warning(plain), now, context=list(context))
