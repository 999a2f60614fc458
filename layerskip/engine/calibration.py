"""``auto``'s calibration: what each drafting choice costs on the machine at hand, cached.

Measured with the latency model the search uses (``engine.latency``): a plain step and the
engine's greedy verify per block length (the verify curve t(n)), one draft step (nothing
bypassed, the draft's precision) per candidate head size, and a batch's plain and draft steps per
row count (``engine.batch_prices`` prices a batch's steps with them); where the policy lets it, the draft's
precision first (int4 or int8, each copy's agreement with the model and draft step priced:
``engine.precision_choice``). It is cached in the ``calibration``
cache (``engine.result_cache``: ``$LAYERSKIP_CALIBRATION_CACHE``, default ``calibration/`` in
the model cache, ``~/.cache/layerskip``), keyed by the model (shape fingerprint and a sample of
its weight values), dtype, device, the machine record (CPU model and kernel flags, or the GPU's
name), torch threads and the torch and transformers versions: a calibration made on another
machine, dtype or model is never used. A calibration whose plain-step timings spread widely (a
busy machine) is used by this process only, never cached.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from layerskip.drafts.auto import best_skip_rate
from layerskip.drafts.builder import DraftModels
from layerskip.drafts.costs import DraftCosts, block_cost
from layerskip.drafts.policy import SkipPolicy
from layerskip.engine.latency import BatchStepTimings, batch_step_timings, head_size_timings, measure_latency
from layerskip.engine.precision_choice import (
    PrecisionPrice,
    agreement,
    candidates,
    chosen,
    own_texts,
)
from layerskip.engine.result_cache import ResultCache, cache_env, model_key
from layerskip.hf import adapters
from layerskip.hf.cache import model_cache
from layerskip.hf.forward import full_logits
from layerskip.hf.prompting import first_token_id
from layerskip.machine import this_machine

FORMAT = 3  # 2: with the draft's precision chosen; 3: with a batch's steps by row count
VERIFY_BLOCKS = (2, 3, 4, 5, 6, 8, 12, 17)  # 17: a lookup run of 16 and the pending token
BATCH_ROWS = (2, 4, 8, 16)  # row counts a batch's plain and draft steps are timed at (one row goes alone)
PLAIN_REPEATS = 9
VERIFY_REPEATS = 5
DRAFT_REPEATS = 7
BATCH_REPEATS = 2
CONTEXT_TOKENS = 96  # attention over a realistic context, as after a short prompt

Log = Callable[[str], None]


CACHE = "calibration"  # the result cache that holds calibrations
CACHE_ENV = cache_env(CACHE)


def calibration_key(model: nn.Module, policy: SkipPolicy) -> dict[str, Any]:
    """Everything a calibration depends on; a cached one is used only when all of it is equal."""
    parameter = next(model.parameters())
    assert policy.auto is not None
    vocab = adapters.lm_head(model).weight.shape[0]
    return {
        "format": FORMAT,
        **model_key(model),
        "machine": this_machine(parameter.device).to_dict(),
        "host": platform.node(),
        "threads": torch.get_num_threads(),
        "precision": policy.draft.precision,
        "precisions": list(candidates(policy.draft.precision, policy.auto.choose_precision)),
        "head_sizes": list(policy.auto.head_sizes(vocab)),
        "blocks": list(VERIFY_BLOCKS),
        "batch_rows": list(BATCH_ROWS),
    }


def prepare_calibration(
    model: nn.Module, policy: SkipPolicy | None, models: DraftModels, progress: bool = False
) -> DraftCosts | None:
    """The calibration ``policy`` is priced by, prepared before its draft is (None: a policy that
    is not ``auto`` needs none): the draft's low-precision copy built in ``models`` (every draft of
    the policy runs from it, so preparing the draft later finds it there), then the costs measured
    or read from the cache (``calibrate``). Hand the value to ``prepare_draft`` or the decoder."""
    if policy is None or policy.auto is None:
        return None
    costs = calibrate(model, policy, models, progress=progress)
    start = time.perf_counter()
    models.get(costs.precision or policy.draft.precision)  # the copy with every sublayer: any skip set runs from it
    costs.info["draft_build_seconds"] = round(time.perf_counter() - start, 3)  # 0 where the calibration built it
    return costs


def calibrate(
    model: nn.Module,
    policy: SkipPolicy,
    models: DraftModels,
    context: Sequence[int] | None = None,
    root: str | os.PathLike[str] | None = None,
    read: bool = True,
    progress: bool = False,
) -> DraftCosts:
    """``policy``'s (an ``auto`` policy's) costs on this machine: from the cache when an entry
    with the same key is there and ``read``, else measured (after ``context`` tokens, default a
    text the model writes itself) and cached. ``DraftCosts.info`` says which, and how long it took
    (building the draft's low-precision copy, which every policy's draft needs, is not counted:
    ``models`` may hold it already)."""
    start = time.perf_counter()
    key = calibration_key(model, policy)
    cache = ResultCache(CACHE, root, "calibration cache")
    cached = cache.load("costs", key, lambda data: _costs(data, key)) if read else None
    if cached is not None:
        cached.info.update(cached=True, seconds=round(time.perf_counter() - start, 3))
        return cached
    costs = _measure(model, policy, models, context, key, progress)
    costs.info.update(cached=False, seconds=round(time.perf_counter() - start, 3))
    if "warning" not in costs.info:  # measured on a busy machine: used by this process only
        problem = cache.store("costs", key, {"costs": costs.to_dict()})
        if problem is not None:
            costs.info["not_cached"] = problem
    return costs


def _measure(
    model: nn.Module,
    policy: SkipPolicy,
    models: DraftModels,
    context: Sequence[int] | None,
    key: dict[str, Any],
    progress: bool,
) -> DraftCosts:
    context = list(context) if context else own_text(model)
    latency = measure_latency(model, context, VERIFY_BLOCKS, progress, PLAIN_REPEATS, VERIFY_REPEATS)
    info: dict[str, Any] = {"machine": key["machine"], "measured_at": latency.measured_at}
    precision = policy.draft.precision
    if len(key["precisions"]) > 1:
        max_draft = policy.draft.max_draft_tokens
        precision, info["precisions"] = _choose_precision(
            model, key["precisions"], max_draft, models, context, latency.verify_seconds
        )
    draft_model = models.get(precision)  # the copy auto drafts from: every sublayer
    draft = head_size_timings(draft_model, context, key["head_sizes"], DRAFT_REPEATS)
    batch = BatchStepTimings({}, {})
    if draft_model.lean is not None:  # a batch drafts its rows together only through the lean step
        # The smallest head a batch may draft with: the draft curve's shape over rows, which
        # engine.batch_prices scales to the head size a batch chooses.
        head = min((size for size in key["head_sizes"] if size), default=0)
        batch = batch_step_timings(model, draft_model, context, key["batch_rows"], head, BATCH_REPEATS)
        info["batch_draft_head"] = head
    if latency.warning is not None:
        info["warning"] = latency.warning
    chosen = precision if len(key["precisions"]) > 1 else ""
    return DraftCosts(latency.plain_step_seconds, latency.verify_seconds, draft, info, chosen, batch.plain, batch.draft)


def _choose_precision(
    model: nn.Module,
    precisions: Sequence[str],
    max_draft: int,
    models: DraftModels,
    context: Sequence[int],
    verify: dict[int, float],
) -> tuple[str, dict[str, Any]]:
    """The copy of ``precisions`` to draft from (``engine.precision_choice``: the first, the
    policy's, unless another is priced clearly faster), and each one's price; copies built only to
    be priced are dropped again."""
    texts = own_texts(model)
    prices = []
    built_here = []
    for precision in precisions:
        if not models.holds(precision):
            built_here.append(precision)
        draft_model = models.get(precision)
        step = head_size_timings(draft_model, context, [0], DRAFT_REPEATS)[0]
        accepted = agreement(draft_model, texts)
        rate = best_skip_rate(accepted, step, lambda block: block_cost(verify, block), max_draft)
        prices.append(PrecisionPrice(precision, accepted, step, rate))
    choice = chosen(prices).precision
    for precision in built_here:
        if precision != choice:
            models.discard(precision)
    return choice, {"chosen": choice, **{price.precision: price.to_dict() for price in prices}}


@torch.inference_mode()
def own_text(model: nn.Module, tokens: int = 16) -> list[int]:
    """A context of ``CONTEXT_TOKENS`` tokens when no prompt is given: the model's own greedy
    continuation of its first token, repeated (its head's certified argmax then costs what it
    costs on real text, unlike on random ids)."""
    device = next(model.parameters()).device
    cache = model_cache(model)
    ids = [first_token_id(model)]
    for position in range(tokens):
        block = torch.tensor([ids[-1:]] if position else [ids], device=device)
        logits = full_logits(model, block, cache, len(ids) - block.shape[1], keep=1)
        ids.append(int(logits[-1].argmax()))
    return (ids * (CONTEXT_TOKENS // len(ids) + 1))[:CONTEXT_TOKENS]


def _costs(data: dict[str, Any], key: dict[str, Any]) -> DraftCosts:
    """The cached costs, if they hold what ``key`` asked for (ValueError: out of range, or for other
    head sizes or blocks; ``calibrate`` then measures again)."""
    return DraftCosts.from_dict(data.get("costs"), key["head_sizes"], [1, *key["blocks"]], key["batch_rows"])
