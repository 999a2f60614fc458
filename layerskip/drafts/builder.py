"""The one way from a policy to a drafter: ``prepare_draft(model, policy)`` then ``.drafter(run)``.

Preparing is the expensive part and happens once per model and policy: the policy is checked
against the model, its exit adapter loaded and checked, the draft's low-precision copies of the
projections it keeps built, the truncated head's starting rows resolved, and an on-the-fly
selection state started. ``PreparedDraft.drafter(run)`` then assembles the cheap per-generation
drafter (head buffer sized for the run, lookup, hybrid, exit or on-the-fly wrapper).

Everything that needs a draft model without a drafter (teacher-forced agreement in the search
and the measures, exit training) asks ``draft_model_for`` here, so a ``DraftModel`` is built in
this module only.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from layerskip.drafts.base import Drafter, NoDrafter
from layerskip.drafts.exit_adapter import ExitAdapter
from layerskip.drafts.exit_draft import ExitDrafter
from layerskip.drafts.hybrid import HybridDrafter
from layerskip.drafts.lookup import LookupDrafter
from layerskip.drafts.model import DraftModel
from layerskip.drafts.onthefly import OnTheFlyDrafter, SelectionState
from layerskip.drafts.policy import SkipPolicy
from layerskip.drafts.skip import SkipDrafter
from layerskip.errors import LayerskipError
from layerskip.hf import adapters
from layerskip.sampling import Sampling


@dataclass(frozen=True)
class DraftRun:
    """What a drafter needs to know about the one generation it serves."""

    prompt_length: int = 0
    max_new_tokens: int = 0  # with the prompt: how far a truncated head may grow
    sampling: Sampling | None = None  # None = greedy
    generator: torch.Generator | None = None


def draft_model_for(
    model: nn.Module,
    precision: str = "model",
    keep: Iterable[tuple[int, str]] | None = None,
    exit: ExitAdapter | None = None,
) -> DraftModel:
    """The draft forward of ``model``: kept projections in ``precision`` (``keep``: which sublayers
    get copies, None = all), with ``exit`` applied after its layer."""
    return DraftModel(model, precision, keep, exit=exit)


def exit_adapter_for(policy: SkipPolicy, model: nn.Module) -> ExitAdapter | None:
    """The exit adapter ``policy`` drafts through, loaded and checked against the policy (None: no exit)."""
    if policy.exit is None:
        return None
    adapter = ExitAdapter.load(policy.exit_adapter_path(), model, policy.exit.sha256)
    if adapter.spec.layer != policy.exit.layer or adapter.spec.kind != policy.exit.kind:
        raise LayerskipError(
            f"exit adapter {policy.exit_adapter_path()} is a {adapter.spec.kind} exit after layer "
            f"{adapter.spec.layer}, but the policy says {policy.exit.kind} after {policy.exit.layer}"
        )
    return adapter


def kept_sublayers(policy: SkipPolicy, model: nn.Module) -> list[tuple[int, str]] | None:
    """The sublayers a policy's draft may run (None: any, as on-the-fly selection may keep any)."""
    if policy.on_the_fly is not None:
        return None
    return [
        (i, kind)
        for i in range(adapters.num_layers(model))
        for kind, skipped in (("attention", policy.skip_attention), ("mlp", policy.skip_mlp))
        if i not in skipped
    ]


class PreparedDraft:
    """A policy's draft, ready to serve any number of generations of ``model``.

    ``vocab_rows`` overrides the truncated draft head's starting rows (default: the policy's).
    What on-the-fly selection learns (``selection``) carries over between generations.
    """

    def __init__(self, model: nn.Module, policy: SkipPolicy, vocab_rows: torch.Tensor | None = None) -> None:
        policy.validate_for(model)
        self.model = model
        self.policy = policy
        self.vocab_size = adapters.lm_head(model).weight.shape[0]
        self.exit = exit_adapter_for(policy, model)
        self.selection = SelectionState.start(policy, model) if policy.on_the_fly is not None else None
        self.draft_model: DraftModel | None = None
        if policy.draft.use_skip_draft:
            self.draft_model = draft_model_for(model, policy.draft.precision, kept_sublayers(policy, model), self.exit)
        if vocab_rows is None:
            rows = policy.head_rows(self.vocab_size)
            vocab_rows = None if rows is None else torch.tensor(rows, dtype=torch.long)
        self.vocab_rows = vocab_rows

    def cache_windows(self) -> list[int | None]:
        """Per cache layer, its sliding window: the model's layers, and a layer exit adapter's own."""
        windows = adapters.sliding_windows(self.model)
        if self.exit is not None and self.exit.uses_cache:
            windows.append(windows[self.exit.spec.layer])
        return windows

    def drafter(self, run: DraftRun) -> Drafter:
        """The drafter for one generation (its head sized for the prompt and the tokens to come)."""
        policy, settings = self.policy, self.policy.draft
        skip: Drafter | None = None
        if self.draft_model is not None:
            head = self.draft_model.head(self.vocab_rows, growth=run.prompt_length + run.max_new_tokens)
            args = (self.draft_model, policy.skip_attention, policy.skip_mlp, settings, head)
            args += (run.sampling, run.generator)
            skip = ExitDrafter(*args, reuse_kv=policy.exit.reuse_kv) if policy.exit is not None else SkipDrafter(*args)
            if self.selection is not None:
                skip = OnTheFlyDrafter(skip, self.model, self.selection)
        if not settings.lookup_max_ngram:
            assert skip is not None  # a policy validates to lookup, a skip draft, or both
            return skip
        return HybridDrafter(LookupDrafter(settings, self.vocab_size, run.sampling), skip)


def prepare_draft(
    model: nn.Module, policy: SkipPolicy | None, vocab_rows: torch.Tensor | None = None
) -> PreparedDraft | None:
    """``policy``'s draft prepared for ``model`` (None for plain decoding: no policy)."""
    return None if policy is None else PreparedDraft(model, policy, vocab_rows)


def build_drafter(model: nn.Module, policy: SkipPolicy | None, run: DraftRun = DraftRun()) -> Drafter:
    """A ready drafter for one generation; plain decoding's (drafts nothing) without a policy."""
    prepared = prepare_draft(model, policy)
    return NoDrafter() if prepared is None else prepared.drafter(run)
