"""Batches: HF's batched ``generate`` against self-speculative batches through ``model.generate``,
and the same engine decoding plainly (the plug-in with ``"plain"``): a batch's drafting pays only
where it beats the engine's own plain step.

All methods get the same left-padded batch (``input_ids`` and ``attention_mask``) and the same
generation arguments; ours adds ``custom_generate`` (the plug-in) and ``skip_policy``. Each batch
size and layout runs the methods back to back, in an order that alternates between repeats,
after one warm-up of each; a method's figure is its median over the repeats. Throughput is the
batch's new tokens (up to each row's EOS) over the batch's seconds; every row of a batch comes
back when the batch does, so a row's latency is the batch's seconds. Rows are compared with
HF's token for token.

Beside each batch of two or more rows, ours runs the same prompts one at a time (each alone,
unpadded, one after another): what a batch buys in throughput, and what it costs each row in time
to finish (alone, a row's latency is its own decode; in a batch, the whole batch's).

Layouts: ``similar`` takes prompts of neighbouring lengths (little padding), ``mixed`` spreads
them from the shortest to the longest (HF pads every row to the longest).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from layerskip.errors import LayerskipError
from layerskip.integration.plugin import self_speculative_generate
from layerskip.sampling import Sampling
from layerskip.stats import DeviceClock

LAYOUTS = ("similar", "mixed")
BASELINE = "hf-batched"
OURS = "self-spec-batched"
OURS_PLAIN = "plain-batched"  # the engine's own plain step, no draft
OURS_ALONE = "self-spec-one-at-a-time"  # ours on the batch's prompts, each alone in turn


@dataclass
class BatchFigure:
    """One method on one batch: medians over the repeats."""

    size: int
    layout: str
    method: str
    seconds: float  # median over repeats; also each row's latency
    new_tokens: int  # the batch's new tokens, up to each row's EOS
    identical_rows: int  # rows equal to HF's, token for token
    prompt_ids: list[str]
    steps: dict[str, int] | None = None  # ours: the batch's steps of each kind
    row_seconds: list[float] | None = None  # one at a time: each row's own seconds (medians over repeats)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


def pick_batch(lengths: Sequence[int], size: int, layout: str) -> list[int]:
    """Indices of ``size`` prompts: neighbours in length (``similar``, from the middle of the
    length order) or spread from the shortest to the longest (``mixed``)."""
    if size > len(lengths):
        raise LayerskipError(f"a batch of {size} needs {size} prompts; only {len(lengths)} were given")
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    if layout == "similar":
        start = (len(order) - size) // 2
        return order[start : start + size]
    if layout == "mixed":
        if size == 1:
            return [order[len(order) // 2]]
        return [order[round(k * (len(order) - 1) / (size - 1))] for k in range(size)]
    raise LayerskipError(f"unknown batch layout '{layout}'; use one of {', '.join(LAYOUTS)}")


def left_padded(rows: Sequence[list[int]], pad: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` ``[B, longest]``, each row padded on the left."""
    longest = max(len(row) for row in rows)
    ids = torch.tensor([[pad] * (longest - len(row)) + row for row in rows], device=device)
    mask = torch.tensor([[0] * (longest - len(row)) + [1] * len(row) for row in rows], device=device)
    return ids, mask


def new_tokens(output: torch.Tensor, prompt_width: int, eos: Sequence[int]) -> list[list[int]]:
    """Each row's new tokens up to and including its first EOS (what follows is padding)."""
    rows = []
    for row in output[:, prompt_width:].tolist():
        end = next((i + 1 for i, token in enumerate(row) if token in eos), len(row))
        rows.append(row[:end])
    return rows


BatchRunner = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict[str, int] | None]]


def batch_runner(
    model: nn.Module,
    max_new_tokens: int,
    eos: Sequence[int],
    pad: int,
    skip_policy: Any | None,
    sampling: Sampling | None = None,
    seed: int | None = None,
    generation: dict[str, Any] | None = None,
) -> BatchRunner:
    """``(input_ids, attention_mask) -> (sequences, the batch's steps of each kind or None)``
    through ``model.generate``: HF's own loop (``skip_policy`` None) or the self-speculative
    plug-in with that policy; greedy, or with ``sampling`` (each call seeding torch's RNG with
    ``seed`` when given)."""
    arguments: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "do_sample": False,
        "temperature": None,
        "top_p": None,
        "top_k": None,
        "eos_token_id": list(eos) or None,
        "pad_token_id": pad,
        **(generation or {}),  # arguments that add logits processors, for both methods alike
    }
    if sampling is not None:
        arguments.update(
            do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or None
        )
    if skip_policy is not None:
        arguments.update(
            custom_generate=self_speculative_generate, skip_policy=skip_policy, return_dict_in_generate=True
        )

    def run(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, int] | None]:
        if sampling is not None and seed is not None:
            torch.manual_seed(seed)
        output = model.generate(input_ids=ids, attention_mask=mask, **arguments)
        if skip_policy is None:
            return output, None
        return output.sequences, dict(output.stats.batch_steps)

    return run


@torch.inference_mode()
def run_batches(
    model: nn.Module,
    prompt_ids: Sequence[list[int]],
    prompt_names: Sequence[str],
    sizes: Sequence[int],
    layouts: Sequence[str],
    max_new_tokens: int,
    eos: Sequence[int],
    pad: int,
    skip_policy: Any,
    repeats: int = 2,
    progress: bool = True,
    generation: dict[str, Any] | None = None,
) -> list[BatchFigure]:
    """Every method on every (size, layout) batch, interleaved; one figure per method and batch.
    ``generation``: HF arguments that add logits processors, given to both methods alike."""
    device = next(model.parameters()).device
    clock = DeviceClock(device)
    runners = {
        BASELINE: batch_runner(model, max_new_tokens, eos, pad, None, generation=generation),
        OURS: batch_runner(model, max_new_tokens, eos, pad, skip_policy, generation=generation),
        OURS_PLAIN: batch_runner(model, max_new_tokens, eos, pad, "plain", generation=generation),
    }
    lengths = [len(ids) for ids in prompt_ids]
    warm = pick_batch(lengths, min(2, len(lengths)), "similar")
    for run in runners.values():  # warm-up: kernels, the draft's copies, auto's calibration
        run(*left_padded([prompt_ids[i][:64] for i in warm], pad, device))
    figures: list[BatchFigure] = []
    cases = [(size, layout) for size in sizes for layout in layouts if size > 1 or layout == layouts[0]]
    for size, layout in tqdm(cases, desc="batches", unit="batch", disable=not progress):
        chosen = pick_batch(lengths, size, layout)
        ids, mask = left_padded([prompt_ids[i] for i in chosen], pad, device)
        seconds: dict[str, list[float]] = {name: [] for name in runners}
        outputs: dict[str, tuple[torch.Tensor, dict[str, int] | None]] = {}
        alone: list[list[float]] = []  # per repeat, each row's own seconds
        alone_rows: list[list[int]] = []
        methods = [*runners, *([OURS_ALONE] if size > 1 else [])]
        for repeat in range(repeats):
            for name in methods if repeat % 2 == 0 else reversed(methods):
                if name == OURS_ALONE:
                    alone_rows, times = _one_at_a_time(runners[OURS], [prompt_ids[i] for i in chosen], eos, clock)
                    alone.append(times)
                    continue
                start = clock.now()
                outputs[name] = runners[name](ids, mask)
                seconds[name].append(clock.now() - start)
        reference = new_tokens(outputs[BASELINE][0], ids.shape[1], eos)
        names = [prompt_names[i] for i in chosen]
        for name, (output, steps) in outputs.items():
            rows = new_tokens(output, ids.shape[1], eos)
            made = sum(len(row) for row in rows)
            same = sum(a == b for a, b in zip(rows, reference, strict=True))
            figures.append(BatchFigure(size, layout, name, statistics.median(seconds[name]), made, same, names, steps))
        if alone:
            made = sum(len(row) for row in alone_rows)
            same = sum(a == b for a, b in zip(alone_rows, reference, strict=True))
            total = statistics.median(sum(times) for times in alone)
            per_row = [statistics.median(times) for times in zip(*alone, strict=True)]
            figures.append(BatchFigure(size, layout, OURS_ALONE, total, made, same, names, None, per_row))
    return figures


def _one_at_a_time(
    run: BatchRunner, prompts: Sequence[list[int]], eos: Sequence[int], clock: DeviceClock
) -> tuple[list[list[int]], list[float]]:
    """Each prompt alone through ``run`` (no padding), in turn: each row's new tokens and seconds."""
    rows, times = [], []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=clock.device)
        start = clock.now()
        output, _ = run(ids, torch.ones_like(ids))
        times.append(clock.now() - start)
        rows.extend(new_tokens(output, ids.shape[1], eos))
    return rows, times


def summarise_batches(figures: Sequence[BatchFigure]) -> list[dict[str, Any]]:
    """One row per (size, layout): each method's tokens per second, ours over HF's and over our
    plain decoding's, identical rows."""
    table = []
    keyed = {(f.size, f.layout, f.method): f for f in figures}
    for size, layout in sorted({(f.size, f.layout) for f in figures}):
        hf, ours = keyed.get((size, layout, BASELINE)), keyed.get((size, layout, OURS))
        plain, alone = keyed.get((size, layout, OURS_PLAIN)), keyed.get((size, layout, OURS_ALONE))
        if hf is None or ours is None:
            continue
        plain_rate = plain.tokens_per_second if plain is not None else None
        one_at_a_time = {}
        if alone is not None and alone.row_seconds:
            one_at_a_time = {
                "alone_tokens_per_second": round(alone.tokens_per_second, 2),
                "vs_alone": round(ours.tokens_per_second / alone.tokens_per_second, 3),
                "row_latency_alone_s": round(statistics.median(alone.row_seconds), 3),
                "identical_rows_alone": alone.identical_rows,
            }
        table.append(
            {
                "batch_size": size,
                "layout": layout,
                "hf_tokens_per_second": round(hf.tokens_per_second, 2),
                "ours_tokens_per_second": round(ours.tokens_per_second, 2),
                "speedup": round(ours.tokens_per_second / hf.tokens_per_second, 3) if hf.tokens_per_second else None,
                "plain_tokens_per_second": round(plain_rate, 2) if plain_rate is not None else None,
                "vs_plain": round(ours.tokens_per_second / plain_rate, 3) if plain_rate else None,
                "row_latency_hf_s": round(hf.seconds, 3),
                "row_latency_ours_s": round(ours.seconds, 3),
                "identical_rows": ours.identical_rows,
                "rows": size,
                **one_at_a_time,
            }
        )
    return table


def figures_as_dicts(figures: Sequence[BatchFigure]) -> list[dict[str, Any]]:
    return [{**asdict(f), "tokens_per_second": f.tokens_per_second} for f in figures]
