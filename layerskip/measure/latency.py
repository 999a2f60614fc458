"""Measured latency of one draft step and of one verify, on the model's own device.

CUDA: CUDA events around each call; CPU: perf_counter. Warm-up first, median of repeats.
The cache is prefilled with a real context so attention cost is realistic.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from layerskip.engine.cache import RollbackCache
from layerskip.engine.forward import draft_logits, full_logits
from layerskip.hf import adapters


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


def median_seconds(fn: Callable[[], object], device: torch.device, repeats: int = 7, warmup: int = 2) -> float:
    for _ in range(warmup):
        _time_once(fn, device)
    return statistics.median(_time_once(fn, device) for _ in range(repeats))


def _prefilled_cache(model: nn.Module, context: Sequence[int]) -> tuple[RollbackCache, torch.device]:
    device = next(model.parameters()).device
    cache = RollbackCache(adapters.sliding_windows(model))
    full_logits(model, torch.tensor([list(context)], device=device), cache, 0, keep=1)
    return cache, device


@torch.inference_mode()
def draft_step_seconds(
    model: nn.Module,
    context: Sequence[int],
    skip_attention: Sequence[int] = (),
    skip_mlp: Sequence[int] = (),
    vocab_rows: torch.Tensor | None = None,
    repeats: int = 7,
) -> float:
    """Median seconds of one draft token (bypassed stack + head rows) after ``context``."""
    cache, device = _prefilled_cache(model, context)
    length = len(context)
    token = torch.tensor([[context[-1]]], device=device)
    head = adapters.draft_head(model, vocab_rows)

    def step() -> None:
        with adapters.bypass(model, skip_attention, skip_mlp):
            draft_logits(model, token, cache, length, head)
        cache.rollback(length)

    return median_seconds(step, device, repeats)


@torch.inference_mode()
def verify_seconds(model: nn.Module, context: Sequence[int], block: int, repeats: int = 7) -> float:
    """Median seconds of one full forward over ``block`` tokens after ``context`` (block=1: plain step)."""
    cache, device = _prefilled_cache(model, context)
    length = len(context)
    tokens = torch.tensor([[context[-1]] * block], device=device)

    def step() -> None:
        full_logits(model, tokens, cache, length, keep=block)
        cache.rollback(length)

    return median_seconds(step, device, repeats)


def block_cost(seconds: dict[int, float], block: int) -> float:
    """Seconds of a forward over ``block`` tokens, linearly interpolated between measured sizes
    (past either end, the nearest segment's slope continues)."""
    if block in seconds:
        return seconds[block]
    sizes = sorted(seconds)
    if len(sizes) == 1:
        return seconds[sizes[0]] * block / sizes[0]
    if block < sizes[0]:
        lower, upper = sizes[0], sizes[1]
    elif block > sizes[-1]:
        lower, upper = sizes[-2], sizes[-1]
    else:
        lower = max(s for s in sizes if s < block)
        upper = min(s for s in sizes if s > block)
    weight = (block - lower) / (upper - lower)
    return seconds[lower] + weight * (seconds[upper] - seconds[lower])
