"""``auto``'s calibration: what each drafting choice costs on the machine at hand, cached.

Measured with the latency model (``engine.latency``): a plain step and the engine's greedy
verify per block length (the verify curve t(n)), one draft step (nothing bypassed, the draft's
precision) per candidate head size, and a batch's plain and draft steps per row count
(``engine.step_kinds`` prices a batch's steps with them); where the policy lets it, the draft's
precision first (int4 or int8, each copy's agreement with the model and draft step priced:
``engine.precision_choice``). It is cached in the ``calibration`` cache (``layerskip.result_cache``:
``$LAYERSKIP_CALIBRATION_CACHE``, default ``calibration/`` in the model cache,
``~/.cache/layerskip``) as two entries: ``latency``, the plain step and verify curve, which the
search reads and writes too (``machine_latency``), keyed by the model (shape fingerprint and a
sample of its weight values), dtype, device, the machine record (CPU model and kernel flags, or
the GPU's name), torch threads and the torch and transformers versions (``latency_key``); and
``costs``, the rest, keyed by all that and the policy's choices. A calibration made on another
machine, dtype or model is never used. One whose plain-step timings spread widely (a busy
machine) is used by this process only, never cached.
"""

from __future__ import annotations

import functools
import os
import platform
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from layerskip.drafts.builder import DraftCosts, DraftModels, SkipPolicy, block_cost
from layerskip.engine.latency import (
    BatchStepTimings,
    Latency,
    batch_step_timings,
    dense_head_timings,
    head_size_timings,
    measure_latency,
)
from layerskip.engine.precision_choice import (
    PrecisionPrice,
    agreement,
    candidates,
    chosen,
    greedy_continuation,
    own_texts,
    priced_heads,
)
from layerskip.hf import adapters
from layerskip.hf.prompting import first_token_id
from layerskip.machine import this_machine
from layerskip.result_cache import ResultCache, cache_env, model_key

# 2: with the draft's precision chosen; 3: with a batch's steps by row count; 4: the plain and
# verify curve an entry of its own, shared with the search (older entries are measured again);
# 5: the int4 copy rounded by a least-squares fit per group (its agreement and price changed);
# 6: a batch's wide verify timed per row count, and the full head's cost beyond the greedy one;
# 7: the precision priced at the head it drafts with, on texts from the model's own start tokens;
# 8: fewer rounds, no warm-up rounds, a wide batched verify timed up to 8 rows: a cold calibration
# of the embedded models in 13-17 s on 2 cores (was 19-28 s); 9: the int4 copy's fit weighs each
# input by what the model feeds it (its agreement and price changed); 10: a verify of several
# positions reads grouped K/V heads in place (``hf.adapters.grouped_attention``): cheaper, most of
# all a batch's wide verify.
FORMAT = 10
# The search's default draft lengths + 1 (2 to 9) each timed, none interpolated (on CPU a 2-3-row
# matmul can cost more than a 4-row one); past them auto interpolates up to 17, a lookup run of 16
# and the pending token. A longer search extends the curve once (machine_latency).
VERIFY_BLOCKS = (*range(2, 10), 17)
BATCH_ROWS = (2, 4, 8, 16)  # row counts a batch's plain and draft steps are timed at (one row goes alone)
DRAFT_REPEATS = 5
REST_HEAD_REPEATS = 3
# The full head's extra cost is a large product whose timings spread little, and it prices only the
# rarer dense verifies (a user's own processor, sampling): three rounds keep a cold calibration short.
DENSE_REPEATS = 3
BATCH_REPEATS = 3
CONTEXT_TOKENS = 96  # attention over a realistic context, as after a short prompt

Log = Callable[[str], None]


CACHE = "calibration"  # the result cache that holds calibrations
CACHE_ENV = cache_env(CACHE)


def latency_key(model: nn.Module) -> dict[str, Any]:
    """Everything a model's timings on this machine depend on: the model (``model_key``), the
    machine record, host and torch threads. The key of the curve ``auto`` and the search share."""
    return {
        "format": FORMAT,
        **model_key(model),
        "machine": this_machine(next(model.parameters()).device).to_dict(),
        "host": platform.node(),
        "threads": torch.get_num_threads(),
    }


def calibration_key(model: nn.Module, policy: SkipPolicy) -> dict[str, Any]:
    """Everything a calibration depends on; a cached one is used only when all of it is equal."""
    assert policy.auto is not None
    vocab = adapters.lm_head(model).weight.shape[0]
    return {
        **latency_key(model),
        "precision": policy.draft.precision,
        "precisions": list(candidates(policy.draft.precision, policy.auto.choose_precision)),
        "head_sizes": list(policy.auto.head_sizes(vocab)),
        "batch_rows": list(BATCH_ROWS),
    }


def machine_latency(
    model: nn.Module,
    blocks: Sequence[int] = (),
    root: str | os.PathLike[str] | None = None,
    read: bool = True,
    progress: bool = False,
    warn: Log | None = None,
    context: Callable[[], list[int]] | None = None,
) -> Latency:
    """The plain step and verify curve of ``model`` on this machine, timed after its own text
    (``own_text``): from the cache when ``read`` and its entry holds ``VERIFY_BLOCKS`` and
    ``blocks``, else measured over those (and what the entry held) and cached unless the machine
    looked busy. ``warn`` hears of an entry passed by as damaged or not written; ``context`` makes
    the tokens the curve is timed after where it is measured (default ``own_text``)."""
    cache = ResultCache(CACHE, root, "calibration cache", warn)
    key = latency_key(model)
    vocab = adapters.lm_head(model).weight.shape[0]
    wanted = {*VERIFY_BLOCKS, *blocks}
    cached = cache.load("latency", key, lambda data: Latency.from_dict(data, vocab)) if read else None
    if cached is not None and wanted <= set(cached.verify_seconds):
        cached.cached_from = str(cache.path("latency", key))
        return cached
    if cached is not None:  # too short for this caller: the new curve keeps what the entry held
        wanted |= set(cached.verify_seconds) - {1}
    tokens = context() if context is not None else own_text(model)
    latency = measure_latency(model, tokens, sorted(wanted), progress)
    if latency.warning is None:  # measured on a busy machine: used by this process only
        problem = cache.store("latency", key, latency.to_dict())
        if problem is not None and warn is not None:
            warn(f"warning: {problem}")
    return latency


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
    root: str | os.PathLike[str] | None = None,
    read: bool = True,
    progress: bool = False,
) -> DraftCosts:
    """``policy``'s (an ``auto`` policy's) costs on this machine: from the cache when its entries
    are there and ``read``, else measured (the curve only where the search or another policy left
    none: ``machine_latency``) and cached. ``DraftCosts.info`` says which, and how long it took
    (building the draft's low-precision copy, which every policy's draft needs, is not counted:
    ``models`` may hold it already)."""
    start = time.perf_counter()
    # The model's own texts, generated once where something is measured: the precision choice's
    # agreement reads them, and the first is the context a curve measured now is timed after.
    texts = functools.cache(lambda: own_texts(model))
    latency = machine_latency(model, root=root, read=read, progress=progress, context=lambda: repeated(texts()))
    key = calibration_key(model, policy)
    cache = ResultCache(CACHE, root, "calibration cache")
    # Draft costs are read only beside the curve they were priced with (a curve measured now
    # may choose another precision), so a fresh curve measures them too.
    cached = cache.load("costs", key, lambda data: _costs(data, key, latency)) if latency.cached_from else None
    if cached is not None:
        cached.info.update(cached=True, seconds=round(time.perf_counter() - start, 3))
        return cached
    costs = _measure(model, policy, models, latency, key, texts)
    costs.info.update(cached=False, seconds=round(time.perf_counter() - start, 3))
    if "warning" not in costs.info:  # measured on a busy machine: used by this process only
        curve = ("plain_step", "verify")  # stored once, in the latency entry
        problem = cache.store("costs", key, {"costs": {k: v for k, v in costs.to_dict().items() if k not in curve}})
        if problem is not None:
            costs.info["not_cached"] = problem
    return costs


def _measure(
    model: nn.Module,
    policy: SkipPolicy,
    models: DraftModels,
    latency: Latency,
    key: dict[str, Any],
    texts: Callable[[], torch.Tensor],
) -> DraftCosts:
    context = latency.context  # drafts timed after the tokens the verify curve was
    info: dict[str, Any] = {"machine": key["machine"], "measured_at": latency.measured_at}
    precision = policy.draft.precision
    timed: dict[int, float] = {}  # the chosen copy's draft step by head size, timed while pricing it
    if len(key["precisions"]) > 1:
        max_draft = policy.draft.max_draft_tokens
        heads = priced_heads(key["head_sizes"])
        price, info["precisions"] = _choose_precision(
            texts(), key["precisions"], heads, max_draft, models, context, latency.verify_seconds
        )
        precision, timed = price.precision, dict(price.draft_step)
    draft_model = models.get(precision)  # the copy auto drafts from: every sublayer
    # The other head sizes cost about what the priced ones do (their rows are a small part of a
    # draft token): fewer rounds place them between.
    rest = [size for size in key["head_sizes"] if size not in timed]
    timed.update(head_size_timings(draft_model, context, rest, REST_HEAD_REPEATS) if rest else {})
    draft = {size: timed[size] for size in key["head_sizes"]}
    batch = BatchStepTimings({}, {})
    if draft_model.lean is not None:  # a batch drafts its rows together only through the lean step
        # The smallest head a batch may draft with: the draft curve's shape over rows, which
        # engine.step_kinds scales to the head size a batch chooses.
        head = min((size for size in key["head_sizes"] if size), default=0)
        batch = batch_step_timings(model, draft_model, context, key["batch_rows"], head, BATCH_REPEATS)
        info["batch_draft_head"] = head
    dense = dense_head_timings(model, context, DENSE_REPEATS)
    if latency.warning is not None:
        info["warning"] = latency.warning
    choice = precision if len(key["precisions"]) > 1 else ""
    plain, verify = latency.plain_step_seconds, latency.verify_seconds
    return DraftCosts(plain, verify, draft, info, choice, batch.plain, batch.draft, batch.wide, dense)


def _choose_precision(
    texts: torch.Tensor,
    precisions: Sequence[str],
    heads: Sequence[int],
    max_draft: int,
    models: DraftModels,
    context: Sequence[int],
    verify: dict[int, float],
) -> tuple[PrecisionPrice, dict[str, Any]]:
    """The price of the copy of ``precisions`` to draft from (``engine.precision_choice``: the
    fastest priced, its draft token timed with each of ``heads``) and the record of every price and
    the reason (``texts``: the model's own, ``own_texts``); copies built only to be priced are
    dropped again."""
    curve = functools.partial(block_cost, verify)
    prices = []
    built_here = []
    for precision in precisions:
        if not models.holds(precision):
            built_here.append(precision)
        draft_model = models.get(precision)
        steps = head_size_timings(draft_model, context, heads, DRAFT_REPEATS)
        accepted = agreement(draft_model, texts)
        prices.append(PrecisionPrice.priced(precision, accepted, steps, curve, max_draft))
    best, why = chosen(prices)
    for precision in built_here:
        if precision != best.precision:
            models.discard(precision)
    return best, {"chosen": best.precision, "why": why, **{p.precision: p.to_dict() for p in prices}}


@torch.inference_mode()
def own_text(model: nn.Module, tokens: int = 16) -> list[int]:
    """A context of ``CONTEXT_TOKENS`` tokens when no prompt is given: the model's own greedy
    continuation of its first token, repeated (its head's certified argmax then costs what it
    costs on real text, unlike on random ids)."""
    start = torch.full((1, 1), first_token_id(model), device=next(model.parameters()).device)
    return repeated(greedy_continuation(model, start, tokens))


def repeated(texts: torch.Tensor) -> list[int]:
    """The first of ``texts`` (``[R, T]``) repeated to ``CONTEXT_TOKENS`` tokens."""
    ids = texts[0].tolist()
    return (ids * (CONTEXT_TOKENS // len(ids) + 1))[:CONTEXT_TOKENS]


def _costs(data: dict[str, Any], key: dict[str, Any], latency: Latency) -> DraftCosts:
    """The cached costs with ``latency``'s curve, if they hold what ``key`` asked for (ValueError:
    out of range, or for other head sizes or rows; ``calibrate`` then measures again)."""
    curve = latency.to_dict()
    costs = {**data["costs"], "plain_step": curve["plain_step"], "verify": curve["verify"]}
    return DraftCosts.from_dict(costs, key["head_sizes"], None, key["batch_rows"])
