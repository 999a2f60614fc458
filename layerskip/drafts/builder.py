"""The one way from a policy to a draft: ``prepare_draft(model, policy)``, then ``.start(run)`` per generation.

Every ``DraftModel`` is built here, by ``DraftModels``: one model's draft forwards, built once per
(precision, exit adapter, compile) and kept. Building one costs seconds and memory (quantising
weights, like loading a model), so a process that drafts the same model many ways (a study's
trials, a benchmark's policies, a script's table) shares them. Exit adapters are resolved
against their policy's directory, loaded and checked against the policy's layer and kind there,
once per file and hash.

``PreparedDraft`` owns a policy once it is loaded. Preparing, the expensive part, happens once
per model and policy: the policy checked against the model, its draft forward (with its exit
adapter) taken from ``DraftModels``, the head's starting rows resolved, an on-the-fly selection
started. The decode loop then asks it, and nothing else, about drafting: cache windows, the
drafter of one generation (``start``), the padding of a verify block.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from layerskip.drafts.base import Drafter, Proposal
from layerskip.drafts.drafters.auto import (
    MAX_ACCEPTANCE,
    AutoDrafter,
    AutoState,
    Price,
    StepPrices,
    best_head_rate,
    best_skip_rate,
)
from layerskip.drafts.drafters.branching import BranchingDrafter
from layerskip.drafts.drafters.exit_draft import ExitDrafter, exit_verify
from layerskip.drafts.drafters.lookup import HybridDrafter, LookupDrafter, LookupRunLength
from layerskip.drafts.drafters.onthefly import OnTheFlyDrafter, SelectionState, converged_policy
from layerskip.drafts.drafters.skip import ChainDrafter, SkipDrafter
from layerskip.drafts.model.draft_model import DraftModel
from layerskip.drafts.model.exit_adapter import ExitAdapter
from layerskip.drafts.model.head import DraftHead
from layerskip.drafts.policy.skip_policy import SkipPolicy, check_vocabulary_ids
from layerskip.drafts.policy.spec import AUTO, PLAIN, load_policy
from layerskip.drafts.rules.costs import WIDE_BLOCK, WIDE_ROWS_UP_TO, DraftCosts, block_cost, expected_tokens
from layerskip.drafts.rules.draft_length import DraftLengthByCost
from layerskip.errors import LayerskipError, few
from layerskip.hf import adapters
from layerskip.hf.cache import RollbackCache
from layerskip.sampling import Sampling

# The face of drafts/ for the engine, which imports nothing of drafts/ but drafts.base and this
# module (tests/test_layout.py): the builder's own names, then the draft's types the engine names,
# the policy argument it parses, and what its calibration and batches price and time drafts with.
__all__ = [
    "DraftModels",
    "DraftRun",
    "PreparedDraft",
    "check_policy_fits",
    "head_rows",
    "prepare_draft",
    # types
    "AutoState",
    "DraftCosts",
    "DraftHead",
    "DraftModel",
    "ExitAdapter",
    "SelectionState",
    "LookupDrafter",
    "LookupRunLength",
    "SkipDrafter",
    "SkipPolicy",
    # the policy argument
    "AUTO",
    "PLAIN",
    "load_policy",
    # pricing and timing a draft
    "MAX_ACCEPTANCE",
    "Price",
    "StepPrices",
    "WIDE_BLOCK",
    "WIDE_ROWS_UP_TO",
    "best_skip_rate",
    "best_head_rate",
    "block_cost",
    "exit_verify",
    "expected_tokens",
]


@dataclass(frozen=True)
class DraftRun:
    """What a drafter needs to know about the one generation it serves."""

    prompt_length: int = 0
    max_new_tokens: int = 0  # with the prompt: how far a truncated head may grow
    sampling: Sampling | None = None  # None = greedy
    generator: torch.Generator | None = None
    dense_verify: bool = False  # the verify reads every logit (a user's own processor, sampling: the engine says)


@dataclass(frozen=True)
class DraftModelKey:
    precision: str
    exit: tuple[str, str] = ("", "")  # (resolved adapter path, sha256); ("", "") without an exit
    compile: bool | str = False


def kept_sublayers(policy: SkipPolicy, model: nn.Module) -> frozenset[tuple[int, str]] | None:
    """The sublayers a policy's draft may run (None: any, as on-the-fly selection may keep any)."""
    if policy.on_the_fly is not None:
        return None
    return frozenset(
        (i, kind)
        for i in range(adapters.num_layers(model))
        for kind, skipped in (("attention", policy.skip_attention), ("mlp", policy.skip_mlp))
        if i not in skipped
    )


def check_policy_fits(model: nn.Module, policy: SkipPolicy) -> None:
    """Raise LayerskipError unless ``policy`` can drive ``model``: its own settings, the model it
    names, its layer indices, its truncated head and its exit."""
    policy.draft.validate()
    check_vocabulary_ids(policy.draft_vocabulary)
    if policy.on_the_fly is not None:
        policy.on_the_fly.validate()
        if not policy.draft.use_skip_draft:
            raise LayerskipError("on-the-fly selection needs a skip draft; set draft.use_skip_draft to true")
    if policy.auto is not None:
        policy.auto.validate()
        if policy.on_the_fly is None or policy.exit is not None or not policy.draft.lookup_max_ngram:
            raise LayerskipError(
                "auto chooses between prompt lookup and an on-the-fly skip draft without an exit adapter; "
                "give it on_the_fly settings and lookup_max_ngram > 0, and no exit"
            )
    count = adapters.num_layers(model)
    _check_identity(model, policy, count)
    adapters.check_indices(model, policy.skip_attention, policy.skip_mlp)
    _check_head(policy, adapters.lm_head(model).weight.shape[0])
    if policy.exit is not None:
        _check_exit(policy, count)
    if len(policy.skip_attention) == count and len(policy.skip_mlp) == count:
        raise LayerskipError(
            "policy bypasses every sublayer, so the draft would ignore the input; keep at least one layer"
        )


def _check_identity(model: nn.Module, policy: SkipPolicy, count: int) -> None:
    """The model the policy says it was made for, where it says: architecture, layers, weights."""
    ident = policy.model
    arch = adapters.architecture_of(model)
    if ident.architecture and ident.architecture != arch:
        raise LayerskipError(
            f"policy was made for a '{ident.architecture}' model ({ident.name or 'unnamed'}) but this model is "
            f"'{arch}'; load the model the policy names or search a policy for this one"
        )
    if ident.num_layers and ident.num_layers != count:
        raise LayerskipError(
            f"policy was made for a {ident.num_layers}-layer model ({ident.name or 'unnamed'}) but this model has "
            f"{count} layers; use a policy made for this model"
        )
    if ident.fingerprint and ident.fingerprint != adapters.weights_fingerprint(model):
        raise LayerskipError(
            f"policy was made for another model ({ident.name or 'unnamed'}: weight shapes differ); "
            "use a policy made for this model"
        )
    # Output would stay exact, but the policy's choices were tuned (and its speed measured) on
    # other weights: as for another shape, it is refused rather than quietly run slower.
    if ident.weights_sample and ident.weights_sample != adapters.weights_sample_digest(model):
        raise LayerskipError(
            f"policy was tuned for another model of the same shape ({ident.name or 'unnamed'}: weights differ, "
            "as a fine-tune's do); use a policy made for this model"
        )


def _check_head(policy: SkipPolicy, rows: int) -> None:
    """The truncated head's size and rows against a head of ``rows`` rows."""
    size, vocabulary = policy.draft.draft_vocab_size, policy.draft_vocabulary
    too_large = [t for t in vocabulary if t >= rows]
    if too_large:
        raise LayerskipError(
            f"draft_vocabulary holds token id(s) {few(too_large)} but this model's head has {rows} rows "
            f"(ids 0..{rows - 1}); use a policy made for this model"
        )
    # An on-the-fly policy's size is the device's default, chosen before the model is known (a
    # size past the vocabulary is the full head there); any other is a number someone wrote.
    if size > rows and policy.on_the_fly is None:
        raise LayerskipError(
            f"draft.draft_vocab_size {size} is more than this model's {rows} vocabulary rows; "
            f"use 0 (the full head) or a size below {rows}"
        )
    if vocabulary and 0 < size < rows and len(vocabulary) < size:
        raise LayerskipError(
            f"draft_vocabulary lists {len(vocabulary)} token ids but draft.draft_vocab_size is {size}; "
            "list at least that many distinct ids, or lower draft_vocab_size"
        )


def _check_exit(policy: SkipPolicy, count: int) -> None:
    """An exit adapter's layer against the model's depth and the policy's skip lists."""
    exit, draft = policy.exit, policy.draft
    assert exit is not None
    exit.validate()
    if draft.uses_trees:
        raise LayerskipError(
            "token trees do not combine with an exit adapter (its verify reuses a chain's layers); "
            "set draft.tree_matches to 1 and draft.tree_siblings to 0"
        )
    layer = exit.layer
    if not draft.use_skip_draft:
        raise LayerskipError("an exit adapter needs a skip draft; set draft.use_skip_draft to true")
    if layer >= count - 1:
        raise LayerskipError(f"exit.layer {layer} leaves no layer to bypass in a {count}-layer model")
    deep = set(range(layer + 1, count))
    if not deep <= set(policy.skip_attention) or not deep <= set(policy.skip_mlp):
        raise LayerskipError(
            f"a policy exiting after layer {layer} must bypass layers {layer + 1}..{count - 1} in both skip lists"
        )
    if layer in policy.skip_attention and layer in policy.skip_mlp:
        raise LayerskipError(f"the exit layer {layer} is bypassed whole; exit after a layer the draft runs")
    if exit.reuse_kv:
        shallow = [i for i in (*policy.skip_attention, *policy.skip_mlp) if i <= layer]
        if shallow or draft.precision != "model" or policy.on_the_fly is not None:
            raise LayerskipError(
                "exit.reuse_kv needs the draft to run layers 0..exit with the model's own weights "
                "(precision 'model', nothing bypassed up to the exit, no on-the-fly selection); "
                "set reuse_kv to false"
            )


def head_rows(policy: SkipPolicy, vocab_size: int) -> tuple[int, ...] | None:
    """The vocabulary rows ``policy``'s truncated draft head starts from (None: the full head)."""
    size = policy.draft.draft_vocab_size
    if not size or size >= vocab_size:
        return None
    ranked = policy.draft_vocabulary or range(size)
    return tuple(t for t in ranked[:size] if t < vocab_size)


class DraftModels:
    """Draft forwards of ``model`` by (precision, exit adapter, compile), each built on first use.

    A draft model built for every sublayer serves any skip set; one built for a fixed policy's kept
    sublayers (``for_policy``) serves only that policy's and is rebuilt for a wider request.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._built: dict[DraftModelKey, tuple[frozenset[tuple[int, str]] | None, DraftModel]] = {}
        self._exits: dict[tuple[str, str], ExitAdapter] = {}

    def get(self, precision: str = "model", exit: ExitAdapter | None = None, compile: bool | str = False) -> DraftModel:
        """The draft forward in ``precision`` with copies of every sublayer."""
        exit_key = ("", "") if exit is None else (f"adapter object {id(exit)}", "")
        return self._get(DraftModelKey(precision, exit_key, compile), None, exit)

    def for_policy(self, policy: SkipPolicy, all_sublayers: bool = False) -> DraftModel:
        """The draft forward ``policy`` drafts with: its precision and exit adapter, copies of the
        sublayers it keeps (``all_sublayers``: every one, to serve other skip sets too)."""
        wanted = None if all_sublayers else kept_sublayers(policy, self.model)
        exit_key = ("", "") if policy.exit is None else _exit_key(policy)
        return self._get(DraftModelKey(policy.draft.precision, exit_key), wanted, self.exit_adapter(policy))

    def holds(self, precision: str) -> bool:
        """Whether the plain draft forward in ``precision`` (no exit, not compiled) is built."""
        return DraftModelKey(precision) in self._built

    def discard(self, precision: str) -> None:
        """Drop the plain draft forward in ``precision`` (its copies' memory goes with it)."""
        self._built.pop(DraftModelKey(precision), None)

    def exit_adapter(self, policy: SkipPolicy) -> ExitAdapter | None:
        """The exit adapter ``policy`` drafts through, loaded and checked against what the policy
        says of it (None: no exit)."""
        settings = policy.exit
        if settings is None:
            return None
        key = _exit_key(policy)
        if key not in self._exits:
            path = Path(key[0])
            adapter = ExitAdapter.load(path, self.model, settings.sha256)
            if adapter.spec.layer != settings.layer or adapter.spec.kind != settings.kind:
                raise LayerskipError(
                    f"exit adapter {path} is a {adapter.spec.kind} exit after layer {adapter.spec.layer}, "
                    f"but the policy says {settings.kind} after {settings.layer}"
                )
            self._exits[key] = adapter
        return self._exits[key]

    def _get(
        self, key: DraftModelKey, wanted: frozenset[tuple[int, str]] | None, exit: ExitAdapter | None
    ) -> DraftModel:
        built = self._built.get(key)
        if built is not None:
            covered, draft_model = built
            if covered is None or (wanted is not None and wanted <= covered):
                return draft_model
            wanted = None if wanted is None else wanted | covered
        draft_model = DraftModel(self.model, key.precision, wanted, exit=exit, compile=key.compile)
        self._built[key] = (wanted, draft_model)
        return draft_model


def _exit_key(policy: SkipPolicy) -> tuple[str, str]:
    assert policy.exit is not None
    return str(policy.exit_adapter_path().resolve()), policy.exit.sha256


class PreparedDraft:
    """A policy's draft, ready to serve any number of generations of ``model``.

    ``vocab_rows`` overrides the truncated draft head's starting rows (default: the policy's).
    ``models`` shares draft forwards with other drafts of the same model (default: its own).
    What on-the-fly selection learns (``selection``) carries over between generations.
    """

    def __init__(
        self,
        model: nn.Module,
        policy: SkipPolicy,
        vocab_rows: torch.Tensor | None = None,
        models: DraftModels | None = None,
        costs: DraftCosts | None = None,
    ) -> None:
        check_policy_fits(model, policy)
        if policy.auto is not None and costs is not None and costs.precision not in ("", policy.draft.precision):
            # the calibration priced another copy higher on this model (engine.precision_choice)
            policy = replace(policy, draft=replace(policy.draft, precision=costs.precision))
        self.model = model
        self.policy = policy
        self.vocab_size = adapters.lm_head(model).weight.shape[0]
        self.models = models if models is not None else DraftModels(model)
        self.exit = self.models.exit_adapter(policy)
        self.draft_model = self.models.for_policy(policy) if policy.draft.use_skip_draft else None
        if vocab_rows is None:
            rows = head_rows(policy, self.vocab_size)
            vocab_rows = None if rows is None else torch.tensor(rows, dtype=torch.long)
        self.vocab_rows = vocab_rows
        self._max_positions = adapters.max_positions(model)
        self.auto: AutoState | None = None
        if policy.auto is not None:
            if costs is None:
                raise LayerskipError(
                    "an auto policy is priced by a calibration of this machine; prepare one with "
                    "engine.calibration.prepare_calibration(model, policy, models) and pass it as costs, "
                    "or build the decoder with Decoder.for_policy(model, policy), which does"
                )
            self.auto = AutoState.start(costs, policy.draft)
        self.selection = SelectionState.start(policy, model) if policy.on_the_fly is not None else None

    def around_verify(
        self, cache: RollbackCache, committed: list[int], block: torch.Tensor, proposals: tuple[Proposal, ...] = ()
    ) -> contextlib.AbstractContextManager[object]:
        """Entered around every verify forward of a batch, ``block [B, q]`` (row ``b`` after
        ``committed[b]`` tokens, its ``proposals[b]``; none at the prefill): an exit draft's verify
        enters the stack after its exit layer, or fills its adapter's own K/V after it
        (``drafters.exit_draft.exit_verify``); any other draft leaves the verify as it is."""
        if self.exit is None:
            return contextlib.nullcontext()
        assert self.policy.exit is not None
        return exit_verify(self.model, self.exit, self.policy.exit.reuse_kv, cache, committed, block, proposals)

    @property
    def fills_adapter_cache(self) -> bool:
        """Whether every verify's layer-L outputs go through a layer exit adapter afterwards (the
        prefill then runs as one forward, so one capture holds every row's)."""
        return self.exit is not None and self.exit.uses_cache

    def cache_windows(self) -> list[int | None]:
        """Per cache layer, its sliding window: the model's layers, and a layer exit adapter's own."""
        windows = adapters.sliding_windows(self.model)
        if self.exit is not None and self.exit.uses_cache:
            windows.append(windows[self.exit.spec.layer])
        return windows

    def verify_block(self, positions: int, committed: int) -> int:
        """How many positions to verify a block of ``positions`` as: padded with fillers to the
        policy's ``min_verify_block`` where a drafted block is shorter (some CPUs run a few-row
        matmul slower than a 4-row one), never past the model's position limit."""
        pad_to = self.auto.padded(positions) if self.auto is not None else self.policy.draft.min_verify_block
        if positions < 2 or positions >= pad_to:
            return positions
        if self._max_positions is not None and committed + pad_to > self._max_positions:
            return positions
        return pad_to

    def fixed_policy(self) -> SkipPolicy:
        """The policy this draft runs now, fixed: on-the-fly's current skip sets, and ``auto``'s head
        size and verify padding (to reuse as a file, or to start a study from: ``--warm-start``)."""
        policy = self.policy
        if self.selection is not None:
            policy = converged_policy(policy, self.selection)
        if self.auto is None:
            return policy
        costs = self.auto.costs
        rows = self.auto.head_rows if self.auto.head_rows >= 0 else self.auto.choose_head([])
        pad = self.auto.padded(2) if self.auto.padded(2) > 2 else 0
        draft = replace(policy.draft, draft_vocab_size=rows, min_verify_block=pad)
        provenance = {**policy.provenance, "source": "auto", "calibration": costs.info}
        return replace(policy, draft=draft, auto=None, provenance=provenance)

    def paths(self) -> list[str]:
        """How the draft step runs, for ``GenerationStats.paths``."""
        if self.draft_model is None:
            return []
        compiled = "yes" if self.draft_model.compile else "no"
        return [f"draft step: {self.draft_model.step_kind}", f"draft compiled: {compiled}"]

    def start(self, run: DraftRun) -> Drafter:
        """The drafter for one generation (its head sized for the prompt and the tokens to come)."""
        if self.auto is not None:
            return self._auto_drafter(run)
        policy, settings = self.policy, self.policy.draft
        lookup = self.lookup_drafter()
        if self.draft_model is None:
            assert lookup is not None  # a policy validates to lookup, a skip draft, or both
            return lookup
        head = self.draft_model.head(self.vocab_rows, growth=run.prompt_length + run.max_new_tokens)
        args = (self.draft_model, policy.skip_attention, policy.skip_mlp, settings, head, run.sampling, run.generator)
        chains: ChainDrafter
        if policy.exit is not None:
            chains = ExitDrafter(*args, reuse_kv=policy.exit.reuse_kv)
        else:
            chains = SkipDrafter(*args, alternatives=settings.tree_siblings)
        if self.selection is not None:
            chains = OnTheFlyDrafter(chains, self.model, self.selection)
        skip: Drafter = chains
        if settings.tree_siblings and run.sampling is None:
            skip = BranchingDrafter(chains, settings.tree_margin, 1 + settings.tree_siblings, settings.node_budget)
        return skip if lookup is None else HybridDrafter(lookup, skip)

    def lookup_drafter(self) -> LookupDrafter | None:
        """The policy's prompt lookup for a batch's lookup steps (None: the policy has none)."""
        settings = self.policy.draft
        return LookupDrafter(settings) if settings.lookup_max_ngram else None

    def batch_draft(self, run: DraftRun, prompts: list[list[int]]) -> SkipDrafter | None:
        """The skip draft for a batch's rows at once (None where the draft has no lean step, or
        none at all): the policy's skip sets (``auto``: the whole draft model) and one shared
        head, ``auto``'s chosen size or the policy's rows."""
        if self.draft_model is None or self.draft_model.lean is None or self.exit is not None:
            return None
        policy = self.policy
        rows = self.vocab_rows
        attention, mlp = policy.skip_attention, policy.skip_mlp
        if self.auto is not None:
            rows = self._ranked_rows(self.auto.choose_head([token for prompt in prompts for token in prompt]))
            attention, mlp = (), ()
        growth = sum(len(p) for p in prompts) + len(prompts) * run.max_new_tokens
        head = self.draft_model.head(rows, growth=growth)
        return SkipDrafter(self.draft_model, tuple(attention), tuple(mlp), policy.draft, head, run.sampling, None)

    def _ranked_rows(self, size: int) -> torch.Tensor | None:
        """The policy's ``size`` best-ranked head rows (0: None, the full head)."""
        ranking = self.policy.draft_vocabulary or range(self.vocab_size)
        return None if size == 0 else torch.tensor(ranking[:size], dtype=torch.long)

    def _auto_drafter(self, run: DraftRun) -> AutoDrafter:
        """``auto``'s drafter; it builds its skip drafter once it has chosen the head size."""
        assert self.auto is not None and self.draft_model is not None and self.selection is not None
        draft_model, selection, settings = self.draft_model, self.selection, self.policy.draft

        def make_skip(rows: int, length: DraftLengthByCost) -> ChainDrafter:
            head = draft_model.head(self._ranked_rows(rows), growth=run.prompt_length + run.max_new_tokens)
            skip = SkipDrafter(
                draft_model, (), (), settings, head, run.sampling, run.generator, length, settings.tree_siblings
            )
            return OnTheFlyDrafter(skip, self.model, selection)

        return AutoDrafter(self.auto, make_skip, run.dense_verify)


def prepare_draft(
    model: nn.Module,
    policy: SkipPolicy | None,
    vocab_rows: torch.Tensor | None = None,
    models: DraftModels | None = None,
    costs: DraftCosts | None = None,
) -> PreparedDraft | None:
    """``policy``'s draft prepared for ``model`` (None for plain decoding: no policy); an ``auto``
    policy needs ``costs``, its calibration on this machine (``engine.calibration``)."""
    return None if policy is None else PreparedDraft(model, policy, vocab_rows, models, costs)
