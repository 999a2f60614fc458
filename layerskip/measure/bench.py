"""Benchmark harness: every method on the same prompts, interleaved, in one process.

Timing and the speedup definition are ``measure.timing``'s: each call timed from the outside,
methods back to back per prompt in a rotating order after a warm-up; speedup is aggregate
throughput against ``hf-ar`` (HF ``generate``, greedy). Greedy outputs are compared with
hf-ar's token for token; each method's first divergence is classed ``rounding`` or ``defect``
against an fp32 copy of the weights (``measure.divergence``), after the timed runs.

Peers that compute with other arithmetic (``llama.cpp``, ``llama.cpp-lookup``: a GGUF's quantised
weights in llama.cpp, ``measure.llamacpp``) are timed alike; their outputs are counted where they
equal hf-ar's, and their divergences are not classed (``PromptResult.computes_with`` says why).

Sampled (``BenchConfig.sampling``): every method, hf-ar included, samples with the same
temperature / top-k / top-p, seeded per prompt (``prompt_seed``). Draws are not compared token for
token (a draft changes which random numbers a draw uses, not the distribution it draws from:
``tests/test_sampling.py`` tests that), so a sampled row's ``identical`` is None.
"""

from __future__ import annotations

import platform
import resource
import zlib
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from datetime import UTC, datetime
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from layerskip.data import Prompt
from layerskip.drafts.drafters.auto import AUTO_REVISION
from layerskip.drafts.policy.skip_policy import DraftSettings, SkipPolicy
from layerskip.drafts.policy.spec import PLAIN
from layerskip.engine.decoding import Decoder, DecodeSettings
from layerskip.errors import LayerskipError
from layerskip.hf import adapters
from layerskip.integration.baselines import hf_custom_generate, hf_generate
from layerskip.integration.decoders import decoder_for
from layerskip.machine import code_version, this_machine
from layerskip.measure import llamacpp
from layerskip.measure.divergence import DEFECT, ROUNDING, DivergenceCheck
from layerskip.measure.memory import MethodMemory, call_growth_mb
from layerskip.measure.timing import Runner, run_interleaved, throughput
from layerskip.sampling import Sampling
from layerskip.stats import GenerationStats

BASELINE = "hf-ar"
METHODS = (
    "hf-ar",
    "ar",
    "self-spec",
    "self-spec-lookup",
    "self-spec-on-the-fly",
    "hf-custom",
    "hf-pld",
    "hf-early-exit",
    "hf-assistant",
    *llamacpp.METHODS,
)


@dataclass
class Method:
    name: str
    run: Runner  # (prompt ids, max new tokens) -> (new tokens, stats or None)
    policy: SkipPolicy | None = None
    draft_memory_mb: float | None = None  # the draft's low-precision copies, if any
    # Another program's arithmetic (llama.cpp on a quantised GGUF: ``llamacpp.label``); None: the HF model's.
    computes_with: str | None = None


@dataclass
class PromptResult:
    """One method on one prompt: what the timing helper measured plus our engine's own record."""

    prompt_id: str
    category: str
    method: str
    new_tokens: int
    seconds: float
    identical: bool | None  # None: sampled, so not compared with hf-ar's draw
    divergence: dict[str, Any] | None = None  # measure.divergence.Divergence.to_dict(): where, and its class
    peak_memory_mb: float | None = None
    stats: GenerationStats | None = None  # None for HF methods (they expose no step counts)
    # Set where the method computes with other arithmetic than the HF model's (llama.cpp on a
    # quantised GGUF): ``identical`` is then a plain count of equal outputs, no divergence is classed.
    computes_with: str | None = None

    @property
    def tokens_per_second(self) -> float:
        return throughput(self.new_tokens, self.seconds)

    @property
    def steps(self) -> int | None:
        return None if self.stats is None else self.stats.steps

    @property
    def drafted(self) -> int | None:
        return None if self.stats is None else self.stats.drafted

    @property
    def accepted(self) -> int | None:
        return None if self.stats is None else self.stats.accepted


@dataclass
class BenchConfig:
    max_new_tokens: int = 128
    warmup_tokens: int = 16
    progress: bool = True
    sampling: Sampling | None = None  # None: greedy; else every method samples alike (build_methods)


def prompt_seed(ids: Sequence[int], seed: int = 0) -> int:
    """The seed of a sampled run's draws on one prompt: the same for every method on that prompt
    (and on every run of it), different from prompt to prompt."""
    return zlib.crc32(",".join(map(str, ids)).encode(), seed & 0xFFFFFFFF)


def check_methods(names: Sequence[str], has_policy: bool, has_assistant: bool) -> None:
    """Method names a run can honour; raised before any model is loaded."""
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        raise LayerskipError(f"unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
    for name in ("self-spec", "hf-custom"):
        if name in names and not has_policy:
            raise LayerskipError(f"method {name} needs a policy; pass --policy PATH")
    if "hf-assistant" in names and not has_assistant:
        raise LayerskipError("method hf-assistant needs --assistant-model")


LOOKUP_ONLY = SkipPolicy(draft=DraftSettings(use_skip_draft=False, lookup_max_ngram=3, lookup_min_ngram=1))


def build_methods(
    model: nn.Module,
    names: Sequence[str],
    eos_token_ids: tuple[int, ...],
    policies: dict[str, SkipPolicy],
    assistant: nn.Module | None = None,
    lookup_tokens: int = 10,
    ablate: bool | Sequence[str] = False,
    threads: Sequence[int | str] = ("auto",),
    tree_ablation: bool = False,
    sampling: Sampling | None = None,
    seed: int = 0,
    generation: dict[str, Any] | None = None,
    gguf: llamacpp.GGUFPeer | None = None,
    tokenizers: tuple[Any, Any] | None = None,
) -> list[Method]:
    """Runnable methods by name. ``self-spec`` expands to one method per policy (``self-spec:NAME``
    when there are several); ``self-spec-lookup`` is prompt lookup alone inside our engine.
    With ``ablate``, each policy also runs with each of its drafting ingredients turned off
    (``self-spec:NAME-no-lookup`` ...; see ``SkipPolicy.ablations``). ``self-spec-on-the-fly`` picks
    its skip sets while generating, from nothing bypassed (``SkipPolicy.adaptive_selection``; its
    decoder keeps what it learns from prompt to prompt, as a server would). ``hf-custom`` runs each
    policy through ``model.generate(custom_generate=...)`` (``hf-custom:NAME`` when there are
    several), so the plug-in's overhead against ``self-spec`` is measured. Each policy's draft is
    prepared here, once (like loading a model), not inside the timed calls. With
    ``tree_ablation``, every policy that drafts token trees runs again with them off, as
    ``METHOD (chain)``, interleaved with it.

    ``threads``: our decoders' CPU thread setting ("auto" or a count, ``Decoder.for_policy(threads=...)``);
    each further entry adds every method again under that setting, named ``NAME@tN`` /
    ``NAME@auto`` (HF methods only for counts: they have no "auto"), so thread settings are
    compared in one interleaved run. The baseline stays at the process's own thread count.

    ``sampling``: every method samples with it instead of decoding greedily (HF's methods through
    ``generate(do_sample=True, ...)``, ours through ``DecodeSettings.sampling``), each prompt's draws
    seeded with ``prompt_seed(ids, seed)``.

    ``generation``: HF ``generate`` arguments that add logits processors (``min_new_tokens``,
    ``repetition_penalty``, ``no_repeat_ngram_size``, ``suppress_tokens`` ...), given to every method
    alike: HF's methods take them directly, ours through the plug-in (``model.generate`` with
    ``custom_generate``), where HF turns them into processors as it does for plain ``generate``.

    ``gguf``: the file and context of ``llama.cpp`` and ``llama.cpp-lookup`` (``measure.llamacpp``),
    which run greedily at HF's methods' thread count; they take no sampling and no ``generation``."""
    check_methods(names, bool(policies), assistant is not None)
    if not threads:
        raise LayerskipError("threads needs at least one setting ('auto' or a count)")
    if llamacpp.wanted(names):
        if gguf is None:
            raise LayerskipError(f"{', '.join(llamacpp.wanted(names))} need a GGUF file (gguf=GGUFPeer(...))")
        llamacpp.check_request(names, str(gguf.path), str(gguf.path), sampling is not None, generation)
    processors = dict(generation or {})  # HF arguments that add logits processors, for every method alike

    def seed_for(ids: Sequence[int]) -> int | None:
        return None if sampling is None else prompt_seed(ids, seed)

    def hf(count: int | None, **extra: Any) -> Runner:
        """HF ``generate`` with ``extra`` under ``count`` CPU threads (None: the process's own)."""

        def run(ids: list[int], max_new: int) -> tuple[list[int], None]:
            return hf_generate(model, ids, max_new, eos_token_ids, sampling, seed_for(ids), **processors, **extra), None

        return _with_threads(run, count)

    def custom(policy: SkipPolicy | str, count: int | None) -> Runner:
        """``policy`` through the plug-in under ``count`` threads (None: the process's own)."""

        def run(ids: list[int], max_new: int) -> tuple[list[int], GenerationStats]:
            return hf_custom_generate(model, ids, max_new, policy, eos_token_ids, sampling, seed_for(ids), **processors)

        return _with_threads(run, count)

    def ours(name: str, policy: SkipPolicy | None, setting: int | str) -> Method:
        """Our engine decoding with ``policy`` (None: no draft) under thread ``setting``."""
        if processors:
            # Processors come from HF's own reading of the arguments: through the plug-in, which
            # hands them to the engine as plain generate would apply them.
            spec = PLAIN if policy is None else policy
            memory = _draft_memory(decoder_for(model, spec))
            return Method(name, custom(spec, None), policy, memory)  # the process's threads, as ours
        decoder = Decoder.for_policy(model, policy, threads=setting)

        def run(ids: list[int], max_new: int) -> tuple[list[int], GenerationStats]:
            return decoder.decode(ids, DecodeSettings(max_new, sampling, seed_for(ids), eos_token_ids))

        return Method(name, run, policy, _draft_memory(decoder))

    def methods_for(setting: int | str, hf_threads: int | None) -> list[Method]:
        """Every method named, for one thread setting: ``setting`` for our decoders, ``hf_threads``
        for HF's own methods (None: the process's count)."""
        methods: list[Method] = []
        for name in names:
            if name == "hf-ar":
                methods.append(Method(name, hf(hf_threads)))
            elif name == "ar":
                methods.append(ours(name, None, setting))
            elif name == "self-spec":
                variants = _variants(policies, ablate, tree_ablation)
                for label, policy in variants.items():
                    methods.append(ours(name if len(variants) == 1 else f"{name}:{label}", policy, setting))
            elif name == "self-spec-lookup":
                draft = replace(LOOKUP_ONLY.draft, lookup_max_tokens=lookup_tokens, max_draft_tokens=lookup_tokens)
                methods.append(ours(name, replace(LOOKUP_ONLY, draft=draft), setting))
            elif name == "self-spec-on-the-fly":
                selection = SkipPolicy.adaptive_selection(device=next(model.parameters()).device)
                methods.append(ours(name, selection, setting))
            elif name == "hf-custom":
                for label, policy in policies.items():
                    full = name if len(policies) == 1 else f"{name}:{label}"
                    memory = _draft_memory(decoder_for(model, policy))
                    methods.append(Method(full, custom(policy, hf_threads), policy, memory))
            elif name == "hf-pld":
                methods.append(Method(name, hf(hf_threads, prompt_lookup_num_tokens=lookup_tokens)))
            elif name == "hf-early-exit":
                depth = _early_exit_depth(model, next(iter(policies.values()), None))
                methods.append(Method(name, hf(hf_threads, assistant_early_exit=depth)))
            elif name == "hf-assistant":
                # Tokenizers that differ (another family's model) take HF's universal assisted
                # generation, which needs both.
                differ = tokenizers is not None and tokenizers[0].get_vocab() != tokenizers[1].get_vocab()
                pair = dict(tokenizer=tokenizers[0], assistant_tokenizer=tokenizers[1]) if differ else {}
                methods.append(Method(name, hf(hf_threads, assistant_model=assistant, **pair)))
            elif name in llamacpp.METHODS and gguf is not None:
                runner = llamacpp.LlamaCppRunner(
                    gguf,
                    torch.get_num_threads() if hf_threads is None else hf_threads,  # as HF's methods run
                    eos_token_ids,
                    lookup_tokens if name == "llama.cpp-lookup" else None,
                    expected_vocab=_vocabulary(model),
                )
                methods.append(Method(name, runner, computes_with=llamacpp.label(runner.quantisation)))
        return methods

    methods = methods_for(threads[0], None)
    for setting in threads[1:]:
        suffix = f"@t{setting}" if setting != "auto" else "@auto"
        for method in methods_for(setting, setting if isinstance(setting, int) else None):
            # HF's methods and llama.cpp take counts, not "auto": the first setting ran them at the process's count.
            takes_counts = method.name.startswith("hf-") and method.name != "hf-custom" or method.computes_with
            if setting == "auto" and takes_counts:
                continue
            methods.append(replace(method, name=method.name + suffix))
    if BASELINE not in [m.name for m in methods]:
        methods.insert(0, Method(BASELINE, hf(None)))
    return methods


def _variants(
    policies: dict[str, SkipPolicy], ablate: bool | Sequence[str], tree_ablation: bool
) -> dict[str, SkipPolicy]:
    """``self-spec``'s policies by label, each followed by its chain twin (``tree_ablation``, for a
    policy that drafts trees) and its ablations (``ablate``: all, or only those named)."""
    variants = {}
    for label, policy in policies.items():
        variants[label] = policy
        if tree_ablation and policy.draft.uses_trees:
            variants[f"{label} (chain)"] = policy.chain()
        if ablate:
            chosen = policy.ablations()
            if not isinstance(ablate, bool):  # only the ablations named
                chosen = {suffix: v for suffix, v in chosen.items() if suffix in set(ablate)}
            variants.update({f"{label}-{suffix}": v for suffix, v in chosen.items()})
    return variants


def _with_threads(runner: Runner, count: int | None) -> Runner:
    """``runner`` under ``count`` CPU threads (None: the process's own), restored afterwards."""
    if count is None:
        return runner

    def run(ids: list[int], max_new: int) -> Any:
        previous = torch.get_num_threads()
        torch.set_num_threads(count)
        try:
            return runner(ids, max_new)
        finally:
            torch.set_num_threads(previous)

    return run


def _vocabulary(model: nn.Module) -> int | None:
    """Rows of the model's output layer: the token ids a prompt can hold (None where it has none)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return None if head is None else int(head.weight.shape[0])


def _draft_memory(decoder: Decoder) -> float | None:
    """MiB of the draft's low-precision copies, if any."""
    return decoder.draft_model.nbytes / 2**20 if decoder.draft_model is not None else None


def _early_exit_depth(model: nn.Module, policy: SkipPolicy | None) -> int:
    """The policy's early-exit depth if it is a prefix draft, else half the layers."""
    count = adapters.num_layers(model)
    if policy is not None and policy.skip_attention == policy.skip_mlp and policy.skip_attention:
        first = policy.skip_attention[0]
        if policy.skip_attention == tuple(range(first, count)):
            return first
    return count // 2


def run_benchmark(
    model: nn.Module,
    methods: list[Method],
    prompts: Sequence[Prompt],
    prompt_ids: Sequence[list[int]],
    config: BenchConfig,
    tokenizer: Any | None = None,
) -> list[PromptResult]:
    """Run every method on every prompt, interleaved; returns one row per (prompt, method).

    After the timed runs, each output that is not identical to hf-ar's gets its first
    divergence classed (``measure.divergence``; ``tokenizer`` adds the two tokens' text). A sampled
    run (``config.sampling``) compares nothing: its rows' ``identical`` is None."""
    device = next(model.parameters()).device
    runners = {m.name: m.run for m in methods}
    runs = run_interleaved(
        runners, prompt_ids, config.max_new_tokens, device, config.warmup_tokens, config.progress, desc="benchmark"
    )
    sampled = config.sampling is not None  # draws: nothing to compare token for token, no divergence to class
    quiet = sampled or not config.progress
    rows: list[PromptResult] = []
    with DivergenceCheck(model, tokenizer) as check:  # its fp32 copy, if one is made, goes with it
        bar = tqdm(list(zip(prompts, prompt_ids, runs)), "divergence check", leave=False, disable=quiet)
        for prompt, ids, by_method in bar:
            reference = by_method[BASELINE].tokens
            # Other arithmetic (llama.cpp) is counted where it equals hf-ar, never classed.
            classed = [] if sampled else [m for m in methods if m.computes_with is None]
            outputs = {m.name: by_method[m.name].tokens for m in classed}
            # A `defect` verdict is checked once more against the method's own forward schedule (run again).
            reruns = {m.name: _rerun(m.run, ids, config.max_new_tokens) for m in classed if m.name != BASELINE}
            found = check.classify_many(ids, reference, outputs, reruns)
            for method in methods:
                run = by_method[method.name]
                divergence = found.get(method.name)
                same = divergence is None if method.computes_with is None else list(run.tokens) == list(reference)
                rows.append(
                    PromptResult(
                        prompt.id,
                        prompt.category,
                        method.name,
                        len(run.tokens),
                        run.seconds,
                        None if sampled else same,
                        None if divergence is None else divergence.to_dict(),
                        run.peak_memory_mb,
                        run.stats,
                        method.computes_with,
                    )
                )
    return rows


def measure_memory(
    methods: Sequence[Method],
    prompt_ids: Sequence[list[int]],
    max_new_tokens: int,
    device: torch.device,
    loaded_mb: float | None,
) -> dict[str, Any] | None:
    """Each method's memory (``measure.memory``): ``loaded_mb``, what the process held with the
    model loaded and no draft built, plus the method's draft copies, plus the most one untimed
    call on the longest prompt added. None where this system cannot measure a call's peak.
    Methods that run another program's model (llama.cpp) get no figure: it would count the HF
    model, which they do not use, and miss their own."""
    if loaded_mb is None or not methods or not prompt_ids:
        return None
    longest = max(prompt_ids, key=len)
    figures: dict[str, dict[str, float]] = {}
    for method in methods:
        if method.computes_with is not None:
            continue
        growth = call_growth_mb(_rerun(method.run, longest, max_new_tokens), device)
        if growth is None:
            return None
        figures[method.name] = MethodMemory(loaded_mb, method.draft_memory_mb or 0.0, growth).to_dict()
    what = "allocated GPU memory" if device.type == "cuda" else "resident memory"
    return {"measure": what, "prompt_tokens": len(longest), "new_tokens": max_new_tokens, "methods": figures}


def _rerun(run: Runner, ids: list[int], max_new_tokens: int) -> Callable[[], list[int]]:
    return lambda: run(ids, max_new_tokens)[0]


def _throughput(rows: Sequence[PromptResult]) -> float:
    return throughput(sum(r.new_tokens for r in rows), sum(r.seconds for r in rows))


def tuning_categories(policy: SkipPolicy | None) -> frozenset[str] | None:
    """The prompt categories a policy was tuned on, from its provenance (``calibration.categories``);
    None when the file does not say."""
    calibration = (policy.provenance if policy is not None else {}).get("calibration") or {}
    categories = calibration.get("categories")
    return frozenset(categories) if categories else None


def summarise(
    rows: Sequence[PromptResult], tuned_on: dict[str, frozenset[str]] | None = None
) -> dict[str, dict[str, Any]]:
    """Figures per method, overall and by category; speedup is aggregate throughput against hf-ar's
    on the same prompts (``measure.timing``). ``tuned_on`` maps a method to the categories its
    policy was tuned on: such a method also gets ``held_out`` figures, over the other categories
    (and ``tuned`` over those), so a policy that only holds where it was tuned shows it."""

    def figures(subset: list[PromptResult], baseline: list[PromptResult]) -> dict[str, Any]:
        tps, base = _throughput(subset), _throughput(baseline)
        compared = any(r.identical is not None for r in subset)
        computes_with = subset[0].computes_with  # other arithmetic: equal outputs counted, nothing classed
        is_plain = subset[0].method in ("hf-ar", "ar", "llama.cpp")
        ours = [r.stats for r in subset if r.stats is not None]
        stats = GenerationStats.combined(ours) if len(ours) == len(subset) else None
        divergences = [r.divergence for r in subset if r.divergence]
        memory = [r.peak_memory_mb for r in subset if r.peak_memory_mb is not None]
        return {
            "tokens_per_second": tps,
            "speedup": tps / base if base else None,
            "mean_accepted": 1.0 if is_plain else (stats.mean_accepted if stats is not None else None),
            "acceptance_rate": None if is_plain or stats is None or not stats.drafted else stats.acceptance_rate,
            # None for a sampled run: its draws were not compared with hf-ar's.
            "identical_fraction": sum(bool(r.identical) for r in subset) / len(subset) if compared else None,
            **(divergence_counts(subset) if compared and computes_with is None else {}),
            **({"computes_with": computes_with} if computes_with else {}),
            "n_prompts": len(subset),
            "new_tokens": sum(r.new_tokens for r in subset),
            "divergences": divergences,
            "peak_memory_mb": max(memory) if memory else None,
            "profile": None if stats is None else time_profile(stats, sum(r.seconds for r in subset), len(subset)),
            # On-the-fly selection: how often the bypassed set changed, and the sets it drafted with.
            "skip_changes": stats.skip_changes if stats is not None and stats.skip_sets else None,
            "skip_sets": dict(stats.skip_sets) if stats is not None and stats.skip_sets else None,
            # CPU thread counts the draft and verify ran with ("draft:1" -> runs): see engine.threads.
            "thread_runs": dict(stats.thread_runs) if stats is not None and stats.thread_runs else None,
            # How the draft step and the verify head ran (generations per path), and the verify rows
            # the fp32 head decided (too flat for the certified bf16 head).
            "paths": dict(stats.paths) if stats is not None and stats.paths else None,
            "head_fallback_rows": stats.head_fallback_rows if stats is not None else None,
            # Tokens drafted per step -> steps; auto's choices besides (head size, calibration).
            "draft_lengths": dict(sorted(stats.draft_histogram.items())) if stats is not None else None,
            # Token trees: verify steps that were trees, and those that accepted off the first branch.
            "tree_steps": stats.tree_steps if stats is not None else None,
            "off_branch_steps": stats.off_branch_steps if stats is not None else None,
            "auto": auto_choices(stats) if stats is not None and stats.calibration else None,
        }

    by_method: dict[str, list[PromptResult]] = defaultdict(list)
    for row in rows:
        by_method[row.method].append(row)
    baseline = by_method[BASELINE]
    categories = sorted({r.category for r in rows})
    summary: dict[str, dict[str, Any]] = {}
    for name, subset in by_method.items():
        summary[name] = {
            "overall": figures(subset, baseline),
            "by_category": {
                c: figures([r for r in subset if r.category == c], [r for r in baseline if r.category == c])
                for c in categories
                if any(r.category == c for r in subset)
            },
        }
        tuned = (tuned_on or {}).get(name)
        if tuned is not None:
            split = {}
            for group, inside in (("tuned", True), ("held_out", False)):
                mine = [r for r in subset if (r.category in tuned) == inside]
                base = [r for r in baseline if (r.category in tuned) == inside]
                split[group] = figures(mine, base) if mine else None
            summary[name]["split"] = {"tuned_categories": sorted(tuned), **split}
    return summary


def auto_choices(stats: GenerationStats) -> dict[str, Any]:
    """What ``auto`` chose over some generations: the share of steps each kind of draft took, the
    draft lengths, the head size, the skip sets and how often they changed, the calibration."""
    steps = sum(stats.draft_histogram.values())
    skip_steps = sum(stats.head_rows.values())
    return {
        "lookup_share": stats.lookup_steps / steps if steps else None,
        "skip_share": skip_steps / steps if steps else None,
        "draft_lengths": {str(k): v for k, v in sorted(stats.draft_histogram.items())},
        "head_rows": {str(k): v for k, v in sorted(stats.head_rows.items())},
        "skip_sets": dict(stats.skip_sets),
        "skip_changes": stats.skip_changes,
        "calibration": dict(stats.calibration),
    }


def divergence_counts(rows: Sequence[PromptResult]) -> dict[str, int]:
    """Outputs identical to hf-ar's, and divergences by class (``unclassified``: rows saved before
    divergences were classed, re-read with ``--from-results``)."""
    classes = [(r.divergence or {}).get("class") for r in rows if not r.identical]
    return {
        "n_identical": sum(bool(r.identical) for r in rows),
        "n_rounding": classes.count(ROUNDING),
        "n_defect": classes.count(DEFECT),
        "n_unclassified": sum(c not in (ROUNDING, DEFECT) for c in classes),
    }


def time_profile(stats: GenerationStats, seconds: float, runs: int) -> dict[str, Any] | None:
    """Where our engine's time went, in ms per generated token.

    ``prefill`` is the prompt forward (with the call's set-up); ``draft`` is proposing (skip-draft
    forwards or the lookup search); ``verify`` is the full-model forward over each block plus
    acceptance and cache rollback; ``other`` is the rest of the measured time (emitting tokens,
    stop checks, the call itself). ``lookup_share`` is the fraction of verify steps whose draft
    came from prompt lookup.
    """
    if not stats.new_tokens:
        return None
    steps = stats.steps - runs  # each run's prefill step is not a verify
    per_token = 1000.0 / stats.new_tokens
    accounted = stats.prefill_seconds + stats.draft_seconds + stats.verify_seconds
    return {
        "prefill_ms": stats.prefill_seconds * per_token,
        "draft_ms": stats.draft_seconds * per_token,
        "verify_ms": stats.verify_seconds * per_token,
        "other_ms": max(0.0, seconds - accounted) * per_token,
        "total_ms": seconds * per_token,
        "verify_ms_per_step": 1000.0 * stats.verify_seconds / steps if steps else None,
        "lookup_share": stats.lookup_steps / steps if steps else None,
    }


def environment(device: torch.device) -> dict[str, Any]:
    import transformers

    machine = this_machine(device)  # the same record a tuned policy keeps in its provenance
    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),  # when the run ended
        "device": str(device),
        "device_name": machine.device_name,
        "cpu_model": machine.cpu_model,
        "cpu_flags": list(machine.cpu_flags),
        "cores": machine.cores,
        "cpu_threads": torch.get_num_threads(),
        **code_version(),  # "commit" and "dirty": the code that ran (None outside a git checkout)
        "auto_revision": AUTO_REVISION,  # which auto ran: the first screen quotes only the current one
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def rows_as_dicts(rows: Sequence[PromptResult]) -> list[dict[str, Any]]:
    """One flat record per row: the measured figures, then our engine's stats (if any) in full."""
    result = []
    for row in rows:
        data = asdict(row)
        data.update(
            tokens_per_second=row.tokens_per_second, steps=row.steps, drafted=row.drafted, accepted=row.accepted
        )
        data["stats"] = None if row.stats is None else row.stats.to_dict()
        result.append(data)
    return result


def rows_from_dicts(records: Sequence[dict[str, Any]]) -> list[PromptResult]:
    """Back from ``rows_as_dicts`` (a saved results.json's ``per_prompt``)."""
    names = {f.name for f in fields(PromptResult)}
    rows = []
    for record in records:
        values = {k: v for k, v in record.items() if k in names}
        stats = values.pop("stats", None)
        rows.append(PromptResult(**values, stats=None if stats is None else GenerationStats.from_dict(stats)))
    return rows
