"""On-the-fly skip selection: the draft's bypassed sublayers are re-chosen while generating.

No study is needed. The verify pass already runs the full model over the accepted tokens, so
every ``refresh_every`` steps it also measures (forward hooks, ``adapters.sublayer_contributions``)
how much each sublayer changes the residual stream there: ``|delta h| / |h|`` per position,
averaged over the positions the full model accepted (the prompt, at prefill). A sublayer that
barely moves the stream is one the draft can lose. Scores are smoothed across refreshes; the
draft bypasses the ``count`` lowest-scoring sublayers, and ``count`` follows the skip drafts'
acceptance (more while drafts are accepted, fewer when they are not), within the policy's
budget. The draft length adapts as every adaptive skip draft does (``AdaptiveStop``).

Only the draft changes: the verify is the full model, so greedy output stays identical and
rejection sampling stays exact. The learned state lives in ``SelectionState``, owned by the
``Decoder``, so a decoder serving many prompts keeps what it learned (it settles once).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from layerskip.engine.drafters import BaseDrafter, Draft, DraftRequest, SkipDrafter
from layerskip.engine.policy import OnTheFlySettings, SkipPolicy
from layerskip.engine.stats import GenerationStats
from layerskip.hf import adapters

Sublayer = tuple[int, str]  # (layer, "attention" | "mlp")


def skip_set_label(attention: tuple[int, ...], mlp: tuple[int, ...]) -> str:
    return f"a{','.join(map(str, attention))}|m{','.join(map(str, mlp))}"


@dataclass
class SelectionState:
    """What on-the-fly selection has learned about one model: sublayer scores, how many to bypass,
    the skip drafts' smoothed acceptance, and the set in use."""

    settings: OnTheFlySettings
    num_layers: int
    count: int
    attention: tuple[int, ...] = ()
    mlp: tuple[int, ...] = ()
    scores: dict[Sublayer, float] = field(default_factory=dict)
    smoothed_acceptance: float | None = None
    refreshes: int = 0

    @classmethod
    def start(cls, policy: SkipPolicy, model: nn.Module) -> SelectionState:
        settings = policy.on_the_fly
        assert settings is not None
        layers = adapters.num_layers(model)
        given = len(policy.skip_attention) + len(policy.skip_mlp)
        count = given or round(settings.start_fraction * 2 * layers)
        state = cls(settings, layers, 0, policy.skip_attention, policy.skip_mlp)
        state.count = min(count, state.max_count)
        return state

    @property
    def max_count(self) -> int:
        return min(int(self.settings.max_fraction * 2 * self.num_layers), 2 * self.num_layers - 1)

    def learn(self, record: adapters.ContributionRecord, positions: int) -> None:
        """Fold the contributions at the first ``positions`` positions of one verify into the scores."""
        layers = range(self.num_layers)
        if positions <= 0 or any(i not in record.residual for i in layers):
            return
        residual = torch.stack([record.residual[i][:positions] for i in layers]).clamp_min(1e-6)  # [L, n]
        attention = (torch.stack([record.attention[i][:positions] for i in layers]) / residual).mean(1)  # [L]
        mlp = (torch.stack([record.mlp[i][:positions] for i in layers]) / residual).mean(1)
        values = torch.stack([attention, mlp]).tolist()  # one device sync per refresh
        momentum = self.settings.momentum
        for kind, row in zip(("attention", "mlp"), values):
            for i, value in enumerate(row):
                old = self.scores.get((i, kind))
                self.scores[(i, kind)] = value if old is None else momentum * old + (1 - momentum) * value

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted:
            rate = accepted / drafted
            old = self.smoothed_acceptance
            self.smoothed_acceptance = rate if old is None else 0.7 * old + 0.3 * rate

    def reselect(self) -> bool:
        """Move the count by the acceptance, then bypass the lowest-scoring sublayers; True if the set changed."""
        s = self.settings
        self.refreshes += 1
        if self.smoothed_acceptance is not None:
            if self.smoothed_acceptance > s.raise_above:
                self.count = min(self.count + 1, self.max_count)
            elif self.smoothed_acceptance < s.lower_below:
                self.count = max(self.count - 1, 0)
        if not self.scores:
            return False
        ranked = sorted(self.scores, key=lambda sub: (self.scores[sub], sub[1] != "attention", sub[0]))
        chosen = ranked[: self.count]
        attention = tuple(sorted(i for i, kind in chosen if kind == "attention"))
        mlp = tuple(sorted(i for i, kind in chosen if kind == "mlp"))
        changed = (attention, mlp) != (self.attention, self.mlp)
        self.attention, self.mlp = attention, mlp
        return changed


class OnTheFlyDrafter(BaseDrafter):
    """A skip drafter whose bypassed sublayers follow a ``SelectionState`` learned from the verifies."""

    def __init__(self, skip: SkipDrafter, model: nn.Module, state: SelectionState) -> None:
        self.skip = skip
        self.model = model
        self.state = state
        self.verifies = 0
        self.record: adapters.ContributionRecord | None = None  # the last watched verify, not yet learned from
        self.changes = 0
        self.steps_per_set: dict[str, int] = {}
        self._apply()

    def _apply(self) -> None:
        self.skip.attention, self.skip.mlp = self.state.attention, self.state.mlp

    @contextlib.contextmanager
    def watch_verify(self) -> Iterator[None]:
        if self.verifies % self.state.settings.refresh_every:
            yield
            return
        with adapters.sublayer_contributions(self.model) as record:
            yield
        self.record = record

    def propose(self, request: DraftRequest) -> Draft:
        if self.record is not None:  # the prefill: every prompt position is the full model's own
            self._learn(positions=len(request.history) - 1)
            self.verifies += 1
        draft = self.skip.propose(request)
        if draft.tokens:
            label = skip_set_label(self.skip.attention, self.skip.mlp)
            self.steps_per_set[label] = self.steps_per_set.get(label, 0) + 1
        return draft

    def update(self, draft: Draft, accepted: int) -> None:
        self.skip.update(draft, accepted)
        if draft.source == "skip":
            self.state.observe(len(draft.tokens), accepted)
        if self.record is not None:
            self._learn(positions=accepted + 1)  # pending and the accepted drafts: the committed tokens
        self.verifies += 1

    def _learn(self, positions: int) -> None:
        assert self.record is not None
        self.state.learn(self.record, positions)
        self.record = None
        if self.state.reselect():
            self.changes += 1
            self._apply()

    def report(self, stats: GenerationStats) -> None:
        stats.skip_changes += self.changes
        for label, steps in self.steps_per_set.items():
            stats.skip_sets[label] = stats.skip_sets.get(label, 0) + steps
