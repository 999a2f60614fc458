"""Benchmark harness: every method on the same prompts, interleaved, in one process.

For each prompt the methods run back to back (their order rotates from prompt to prompt so
none always runs first), after a warm-up of every method. ``hf-ar`` (HF ``generate``, greedy)
is the baseline: speedup = a method's mean tokens/s over prompts / hf-ar's. Greedy outputs are
compared with hf-ar's token for token; at a divergence the full model's top-2 logit gap there
is recorded, so a near-tie can be told apart from a bug.
"""

from __future__ import annotations

import platform
import resource
import statistics
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn
from tqdm.auto import tqdm

from layerskip.data import Prompt
from layerskip.engine.decoding import DecodeSettings, decode
from layerskip.engine.policy import SkipPolicy
from layerskip.engine.vocab import DraftVocabulary
from layerskip.errors import LayerskipError
from layerskip.hf import adapters
from layerskip.hf.baselines import hf_generate

T = TypeVar("T")

BASELINE = "hf-ar"
METHODS = ("hf-ar", "ar", "self-spec", "self-spec-lookup", "hf-pld", "hf-early-exit", "hf-assistant")


@dataclass
class Run:
    """One method on one prompt."""

    tokens: list[int]
    seconds: float
    steps: int | None = None  # full-model forwards (None where HF does not expose it)
    drafted: int | None = None
    accepted: int | None = None
    peak_memory_mb: float | None = None
    # Where our engine's time went (None for HF methods): see GenerationStats.
    prefill_seconds: float | None = None
    draft_seconds: float | None = None
    verify_seconds: float | None = None
    lookup_steps: int | None = None


@dataclass
class Method:
    name: str
    run: Callable[[list[int], int], Run]  # (prompt ids, max new tokens) -> Run
    policy: SkipPolicy | None = None


@dataclass
class PromptResult:
    prompt_id: str
    category: str
    method: str
    new_tokens: int
    seconds: float
    tokens_per_second: float
    steps: int | None
    drafted: int | None
    accepted: int | None
    identical: bool | None
    divergence: dict[str, Any] | None = None
    peak_memory_mb: float | None = None
    prefill_seconds: float | None = None
    draft_seconds: float | None = None
    verify_seconds: float | None = None
    lookup_steps: int | None = None


@dataclass
class BenchConfig:
    max_new_tokens: int = 128
    warmup_tokens: int = 16
    progress: bool = True
    extra: dict[str, Any] = field(default_factory=dict)


def _peak_memory_mb(device: torch.device) -> float | None:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return None


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def check_methods(names: Sequence[str], has_policy: bool, has_assistant: bool) -> None:
    """Method names a run can honour; raised before any model is loaded."""
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        raise LayerskipError(f"unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
    if "self-spec" in names and not has_policy:
        raise LayerskipError("method self-spec needs a policy; pass --policy PATH")
    if "hf-assistant" in names and not has_assistant:
        raise LayerskipError("method hf-assistant needs --assistant-model")


def build_methods(
    model: nn.Module,
    names: Sequence[str],
    eos_token_ids: tuple[int, ...],
    policies: dict[str, SkipPolicy],
    vocabulary: DraftVocabulary | None = None,
    assistant: nn.Module | None = None,
    lookup_tokens: int = 10,
    ablate: bool = False,
) -> list[Method]:
    """Runnable methods by name. ``self-spec`` expands to one method per policy (``self-spec:NAME``
    when there are several); ``self-spec-lookup`` is prompt lookup alone inside our engine.
    With ``ablate``, each policy also runs with each of its drafting ingredients turned off
    (``self-spec:NAME-no-lookup`` ...; see ``SkipPolicy.ablations``)."""
    device = next(model.parameters()).device
    check_methods(names, bool(policies), assistant is not None)

    def settings(max_new: int) -> DecodeSettings:
        return DecodeSettings(max_new_tokens=max_new, eos_token_ids=eos_token_ids)

    def ours(policy: SkipPolicy | None) -> Callable[[list[int], int], Run]:
        def run(ids: list[int], max_new: int) -> Run:
            _reset_peak(device)
            tokens, stats = decode(model, ids, policy, settings(max_new), vocabulary=vocabulary)
            return Run(
                tokens,
                stats.total_seconds,
                stats.steps,
                stats.drafted,
                stats.accepted,
                _peak_memory_mb(device),
                stats.prefill_seconds,
                stats.draft_seconds,
                stats.verify_seconds,
                stats.lookup_steps,
            )

        return run

    def hf(**extra: Any) -> Callable[[list[int], int], Run]:
        def run(ids: list[int], max_new: int) -> Run:
            _reset_peak(device)
            tokens, seconds = hf_generate(model, ids, max_new, eos_token_ids, **extra)
            return Run(tokens, seconds, peak_memory_mb=_peak_memory_mb(device))

        return run

    methods: list[Method] = []
    for name in names:
        if name == "hf-ar":
            methods.append(Method(name, hf()))
        elif name == "ar":
            methods.append(Method(name, ours(None)))
        elif name == "self-spec":
            variants = {}
            for label, policy in policies.items():
                variants[label] = policy
                if ablate:
                    variants.update({f"{label}-{suffix}": v for suffix, v in policy.ablations().items()})
            for label, policy in variants.items():
                full = name if len(variants) == 1 else f"{name}:{label}"
                methods.append(Method(full, ours(policy), policy))
        elif name == "self-spec-lookup":
            lookup = SkipPolicy.from_dict(
                {
                    "format": "layerskip-policy",
                    "version": 1,
                    "draft": {
                        "use_skip_draft": False,
                        "lookup_max_ngram": 3,
                        "lookup_min_ngram": 1,
                        "lookup_max_tokens": lookup_tokens,
                        "max_draft_tokens": lookup_tokens,
                    },
                }
            )
            methods.append(Method(name, ours(lookup), lookup))
        elif name == "hf-pld":
            methods.append(Method(name, hf(prompt_lookup_num_tokens=lookup_tokens)))
        elif name == "hf-early-exit":
            depth = _early_exit_depth(model, next(iter(policies.values()), None))
            methods.append(Method(name, hf(assistant_early_exit=depth)))
        elif name == "hf-assistant":
            methods.append(Method(name, hf(assistant_model=assistant)))
    if BASELINE not in [m.name for m in methods]:
        methods.insert(0, Method(BASELINE, hf()))  # every figure is a ratio against it
    return methods


def _early_exit_depth(model: nn.Module, policy: SkipPolicy | None) -> int:
    """The policy's early-exit depth if it is a prefix draft, else half the layers."""
    count = adapters.num_layers(model)
    if policy is not None and policy.skip_attention == policy.skip_mlp and policy.skip_attention:
        first = policy.skip_attention[0]
        if policy.skip_attention == tuple(range(first, count)):
            return first
    return count // 2


@torch.inference_mode()
def top2_gap(model: nn.Module, prompt: list[int], reference: list[int], position: int) -> float:
    """The full model's top-1 minus top-2 logit where ``reference[position]`` was chosen."""
    device = next(model.parameters()).device
    ids = torch.tensor([[*prompt, *reference[:position]]], device=device)
    logits = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def rotated(items: Sequence[T], index: int) -> list[T]:
    """The run order for prompt ``index``: rotated by one per prompt, so no method always runs first."""
    shift = index % len(items)
    return [*items[shift:], *items[:shift]]


def run_benchmark(
    model: nn.Module,
    methods: list[Method],
    prompts: Sequence[Prompt],
    prompt_ids: Sequence[list[int]],
    config: BenchConfig,
) -> list[PromptResult]:
    """Run every method on every prompt, interleaved; returns one row per (prompt, method)."""
    for method in tqdm(methods, desc="warm-up", disable=not config.progress, leave=False):
        method.run(prompt_ids[0], config.warmup_tokens)
    rows: list[PromptResult] = []
    bar = tqdm(total=len(prompts) * len(methods), desc="benchmark", disable=not config.progress)
    for index, (prompt, ids) in enumerate(zip(prompts, prompt_ids)):
        runs: dict[str, Run] = {}
        for method in rotated(methods, index):
            runs[method.name] = method.run(ids, config.max_new_tokens)
            bar.update()
        reference = runs[BASELINE].tokens
        for method in methods:
            run = runs[method.name]
            identical = run.tokens == reference
            divergence = None
            if not identical:
                position = next(
                    (i for i, (a, b) in enumerate(zip(run.tokens, reference)) if a != b),
                    min(len(run.tokens), len(reference)),
                )
                gap = top2_gap(model, ids, reference, position) if position < len(reference) else None
                divergence = {"position": position, "top2_logit_gap": gap}
            rows.append(
                PromptResult(
                    prompt.id,
                    prompt.category,
                    method.name,
                    len(run.tokens),
                    run.seconds,
                    len(run.tokens) / run.seconds if run.seconds > 0 else 0.0,
                    run.steps,
                    run.drafted,
                    run.accepted,
                    identical,
                    divergence,
                    run.peak_memory_mb,
                    run.prefill_seconds,
                    run.draft_seconds,
                    run.verify_seconds,
                    run.lookup_steps,
                )
            )
    bar.close()
    return rows


def summarise(rows: Sequence[PromptResult]) -> dict[str, dict[str, Any]]:
    """FIGS per method, overall and by category (speedup against hf-ar on the same prompts)."""

    def figures(subset: list[PromptResult], baseline_tps: float) -> dict[str, Any]:
        tps = statistics.fmean(r.tokens_per_second for r in subset)
        tokens = sum(r.new_tokens for r in subset)
        steps = [r.steps for r in subset if r.steps is not None]
        drafted = sum(r.drafted or 0 for r in subset)
        accepted = sum(r.accepted or 0 for r in subset)
        is_plain = subset[0].method in ("hf-ar", "ar")
        mean_accepted = 1.0 if is_plain else (tokens / sum(steps) if len(steps) == len(subset) and sum(steps) else None)
        divergences = [r.divergence for r in subset if r.divergence]
        memory = [r.peak_memory_mb for r in subset if r.peak_memory_mb is not None]
        return {
            "tokens_per_second": tps,
            "speedup": tps / baseline_tps if baseline_tps else None,
            "mean_accepted": mean_accepted,
            "acceptance_rate": None if is_plain else (accepted / drafted if drafted else None),
            "identical_fraction": sum(bool(r.identical) for r in subset) / len(subset),
            "n_prompts": len(subset),
            "new_tokens": tokens,
            "divergences": divergences,
            "peak_memory_mb": max(memory) if memory else None,
            "profile": time_profile(subset),
        }

    by_method: dict[str, list[PromptResult]] = defaultdict(list)
    for row in rows:
        by_method[row.method].append(row)
    baseline = by_method[BASELINE]
    categories = sorted({r.category for r in rows})
    base_overall = statistics.fmean(r.tokens_per_second for r in baseline)
    base_by_cat = {c: statistics.fmean(r.tokens_per_second for r in baseline if r.category == c) for c in categories}
    summary: dict[str, dict[str, Any]] = {}
    for name, subset in by_method.items():
        summary[name] = {
            "overall": figures(subset, base_overall),
            "by_category": {
                c: figures([r for r in subset if r.category == c], base_by_cat[c])
                for c in categories
                if any(r.category == c for r in subset)
            },
        }
    return summary


def time_profile(subset: Sequence[PromptResult]) -> dict[str, Any] | None:
    """Where our engine's time went, in ms per generated token (None for HF methods).

    ``prefill`` is the prompt forward; ``draft`` is proposing (skip-draft forwards or the lookup
    search); ``verify`` is the full-model forward over each block plus acceptance and cache
    rollback; ``other`` is the rest of the loop (emitting tokens, stop checks). ``lookup_share``
    is the fraction of verify steps whose draft came from prompt lookup.
    """
    if any(r.verify_seconds is None for r in subset):
        return None
    tokens = sum(r.new_tokens for r in subset)
    if not tokens:
        return None
    prefill = sum(r.prefill_seconds or 0.0 for r in subset)
    draft = sum(r.draft_seconds or 0.0 for r in subset)
    verify = sum(r.verify_seconds or 0.0 for r in subset)
    total = sum(r.seconds for r in subset)
    steps = sum((r.steps or 1) - 1 for r in subset)  # the prefill step is not a verify
    per_token = 1000.0 / tokens
    return {
        "prefill_ms": prefill * per_token,
        "draft_ms": draft * per_token,
        "verify_ms": verify * per_token,
        "other_ms": max(0.0, total - prefill - draft - verify) * per_token,
        "total_ms": total * per_token,
        "verify_ms_per_step": 1000.0 * verify / steps if steps else None,
        "lookup_share": sum(r.lookup_steps or 0 for r in subset) / steps if steps else None,
    }


def environment(device: torch.device) -> dict[str, Any]:
    import transformers

    info: dict[str, Any] = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "cpu_threads": torch.get_num_threads(),
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    try:
        info["cpu_model"] = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    return info


def rows_as_dicts(rows: Sequence[PromptResult]) -> list[dict[str, Any]]:
    return [asdict(r) for r in rows]
