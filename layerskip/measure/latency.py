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

from layerskip.drafts.exit_adapter import ExitAdapter
from layerskip.drafts.exit_draft import capturing_layer_output, fill_adapter_cache
from layerskip.drafts.model import DraftModel
from layerskip.engine.verify_head import VerifyHead
from layerskip.hf import adapters
from layerskip.hf.cache import RollbackCache
from layerskip.hf.forward import full_hidden, full_logits


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


def _prefilled_cache(
    model: nn.Module, context: Sequence[int], exit: ExitAdapter | None = None
) -> tuple[RollbackCache, torch.device]:
    """A cache holding ``context``; with a layer exit adapter, its own cache layer too."""
    device = next(model.parameters()).device
    windows = adapters.sliding_windows(model)
    if exit is not None and exit.uses_cache:
        windows.append(windows[exit.spec.layer])
    cache = RollbackCache(windows)
    block = torch.tensor([list(context)], device=device)
    if exit is None or not exit.uses_cache:
        full_logits(model, block, cache, 0, keep=1)
        return cache, device
    captured: list[torch.Tensor] = []
    with capturing_layer_output(model, exit.spec.layer, captured):
        full_logits(model, block, cache, 0, keep=1)
    fill_adapter_cache(model, exit, block, captured[-1], cache, 0)
    return cache, device


@torch.inference_mode()
def draft_step_seconds(
    draft_model: DraftModel,
    context: Sequence[int],
    attention: Sequence[int] = (),
    mlp: Sequence[int] = (),
    head_rows: Sequence[int] | None = None,
    repeats: int = 7,
) -> float:
    """Median seconds of one draft token (bypassed stack in the draft's precision + its head) after ``context``."""
    cache, device = _prefilled_cache(draft_model.model, context, draft_model.exit)
    length = len(context)
    token = torch.tensor([[context[-1]]], device=device)
    rows = None if head_rows is None else torch.tensor(sorted({*head_rows, *context}), dtype=torch.long)
    head = draft_model.head(rows)

    def step() -> None:
        with draft_model.active(attention, mlp):
            draft_model.logits(token, cache, length, head)
        cache.rollback(length)

    return median_seconds(step, device, repeats)


@torch.inference_mode()
def verify_timings(
    model: nn.Module, context: Sequence[int], block: int, repeats: int = 7, greedy: VerifyHead | None = None
) -> list[float]:
    """Seconds of each of ``repeats`` full forwards over ``block`` tokens after ``context``.

    Without ``greedy`` every row's full logits are computed (block=1: a plain step, as HF
    ``generate`` takes it); with it, the greedy verify as the engine runs it (its argmax).
    """
    cache, device = _prefilled_cache(model, context)
    length = len(context)
    tokens = torch.tensor([[context[-1]] * block], device=device)

    def step() -> None:
        if greedy is None:
            full_logits(model, tokens, cache, length, keep=block)
        else:
            greedy.argmax(full_hidden(model, tokens, cache, length, keep=block))
        cache.rollback(length)

    return timings(step, device, repeats)


def verify_seconds(
    model: nn.Module, context: Sequence[int], block: int, repeats: int = 7, greedy: VerifyHead | None = None
) -> float:
    """Median seconds of one full forward over ``block`` tokens after ``context`` (see ``verify_timings``)."""
    return statistics.median(verify_timings(model, context, block, repeats, greedy))


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


PROJECTION_OPS = ("aten::mm", "aten::addmm", "aten::_weight_int4pack_mm_for_cpu", "aten::_weight_int8pack_mm")
ATTENTION_OPS = ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention_math")


@torch.inference_mode()
def draft_step_breakdown(
    draft_model: DraftModel,
    context: Sequence[int],
    attention: Sequence[int] = (),
    mlp: Sequence[int] = (),
    head_rows: Sequence[int] | None = None,
    repeats: int = 15,
) -> dict[str, float]:
    """Where one draft step's milliseconds go (CPU): the LM head, the kept projections, attention
    kernels, the other tensor ops (norms, rotary, residual adds, casts, cache writes), and the rest
    of the wall time (Python, module calls, op dispatch). Op times are torch.profiler self times."""
    from torch.profiler import ProfilerActivity, profile

    cache, device = _prefilled_cache(draft_model.model, context, draft_model.exit)
    length = len(context)
    token = torch.tensor([[context[-1]]], device=device)
    rows = None if head_rows is None else torch.tensor(sorted({*head_rows, *context}), dtype=torch.long)
    head = draft_model.head(rows)

    def step() -> None:
        with draft_model.active(attention, mlp):
            draft_model.logits(token, cache, length, head)
        cache.rollback(length)

    wall = median_seconds(step, device, repeats)
    with draft_model.active(attention, mlp):
        hidden = draft_model.hidden(token, cache, length)[0, -1]
    cache.rollback(length)
    head_seconds = median_seconds(lambda: head(hidden), device, repeats)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(repeats):
            step()
    self_us: dict[str, float] = {}
    for event in prof.key_averages():
        self_us[event.key] = self_us.get(event.key, 0.0) + event.self_cpu_time_total
    total_ops = sum(self_us.values()) / repeats / 1e6
    projections = sum(self_us.get(op, 0.0) for op in PROJECTION_OPS) / repeats / 1e6
    attention_ops = sum(self_us.get(op, 0.0) for op in ATTENTION_OPS) / repeats / 1e6
    return {
        "total_ms": 1000 * wall,
        "head_ms": 1000 * head_seconds,
        "layer_projections_ms": 1000 * max(0.0, projections - head_seconds),
        "attention_kernels_ms": 1000 * attention_ops,
        "other_ops_ms": 1000 * max(0.0, total_ops - projections - attention_ops),
        "python_and_dispatch_ms": 1000 * max(0.0, wall - total_ops),
    }


def copy_bandwidth(device: torch.device, megabytes: int = 256, repeats: int = 7) -> float:
    """Bytes per second a large copy moves on ``device`` (what it reads plus what it writes): the
    memory bandwidth a bandwidth-bound step can hope for."""
    source = torch.empty(megabytes * 2**20 // 4, dtype=torch.float32, device=device).uniform_()
    target = torch.empty_like(source)
    seconds = median_seconds(lambda: target.copy_(source), torch.device(device), repeats)
    return 2 * source.numel() * source.element_size() / seconds


def draft_bytes_read(
    draft_model: DraftModel,
    context: Sequence[int],
    attention: Sequence[int] = (),
    mlp: Sequence[int] = (),
    head_rows: Sequence[int] | None = None,
) -> int:
    """Bytes one draft step after ``context`` must read: the kept projections (the draft's copies,
    or the model's own weights), the head rows it scores in the draft's dtype, and the K/V of the
    kept attention layers (``len(context)`` positions each, the model's dtype). Norms, biases and
    the embedding row are left out: a rounding error next to these."""
    model = draft_model.model
    skipped = {(i, "attention") for i in attention} | {(i, "mlp") for i in mlp}
    weights = 0
    for index in range(adapters.num_layers(model)):
        for kind in ("attention", "mlp"):
            if (index, kind) in skipped:
                continue
            if (index, kind) in draft_model.projections:
                weights += sum(group.nbytes for _, group in draft_model.projections[(index, kind)])
            else:
                modules = adapters.sublayer_projections(model, index, kind)
                weights += sum(m.weight.numel() * m.weight.element_size() for m in modules)
    if draft_model.exit is not None:
        weights += sum(p.numel() * p.element_size() for p in draft_model.exit.module.parameters())
    head = adapters.lm_head(model).weight
    rows = head.shape[0] if head_rows is None else len({*head_rows, *context})
    head_bytes = rows * head.shape[1] * torch.tensor([], dtype=draft_model.dtype).element_size()
    kv = 0
    config = model.config.get_text_config(decoder=True)
    windows = adapters.sliding_windows(model)
    kv_heads = getattr(config, "num_key_value_heads", None) or getattr(config, "num_attention_heads", 1)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element = next(model.parameters()).element_size()
    for index in range(adapters.num_layers(model)):
        if index not in attention:
            seen = len(context) if windows[index] is None else min(len(context), windows[index])
            kv += 2 * kv_heads * head_dim * seen * element
    return weights + head_bytes + kv
