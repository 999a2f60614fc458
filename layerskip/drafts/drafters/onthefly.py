"""On-the-fly skip selection: the draft's bypassed sublayers are re-chosen while generating.

No study is needed. The verify pass already runs the full model over the accepted tokens, so
every ``refresh_every`` steps it also measures (forward hooks, ``adapters.sublayer_contributions``)
how much each sublayer changes the residual stream there: ``|delta h| / |h|`` per position,
averaged over the positions the full model accepted (the prompt, at prefill). A sublayer that
barely moves the stream is one the draft can lose. Scores are smoothed across refreshes, and
the draft bypasses the ``count`` lowest-scoring sublayers (with hysteresis against noise).

How many to bypass is priced by what it buys: every skip-drafted step's tokens and seconds
(draft + verify, measured by the drafter) are credited to the count in use, and the count
hill-climbs on tokens per second: try a neighbouring count, keep it if it is faster by a
margin, come back if not, and settle when neither neighbour is faster. An acceptance rule
alone cannot settle: more bypass lowers acceptance, which asks for less bypass, and so on. The
draft length adapts as every adaptive skip draft does (``AdaptiveStop``).

Only the draft changes: the verify is the full model, so greedy output stays identical and
rejection sampling stays exact. The learned state lives in ``SelectionState``, owned by the
``Decoder``, so a decoder serving many prompts keeps what it learned (it settles once).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from layerskip.drafts.base import DraftRequest, Proposal, Verdict, WrappingDrafter
from layerskip.drafts.drafters.skip import ChainDraft, SkipDrafter
from layerskip.drafts.policy.skip_policy import OnTheFlySettings, SkipPolicy
from layerskip.hf import adapters
from layerskip.stats import GenerationStats

Sublayer = tuple[int, str]  # (layer, "attention" | "mlp")


@dataclass
class CountRecord:
    """Skip-drafted steps at one count: tokens produced and seconds spent, decayed so the figures
    follow the text being generated."""

    steps: int = 0
    tokens: float = 0.0
    seconds: float = 0.0

    DECAY = 0.98

    def add(self, tokens: int, seconds: float) -> None:
        self.steps += 1
        self.tokens = self.DECAY * self.tokens + tokens
        self.seconds = self.DECAY * self.seconds + seconds

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class SelectionState:
    """What on-the-fly selection has learned about one model: sublayer scores, the measured speed
    at each count tried, the count and the set in use."""

    settings: OnTheFlySettings
    num_layers: int
    count: int
    attention: tuple[int, ...] = ()
    mlp: tuple[int, ...] = ()
    scores: dict[Sublayer, float] = field(default_factory=dict)
    speed: dict[int, CountRecord] = field(default_factory=dict)
    home: int = -1  # the best count measured so far (the start until one beats it)
    settled: bool = False
    refreshes: int = 0

    def __post_init__(self) -> None:
        if self.home < 0:
            self.home = self.count

    @classmethod
    def start(cls, policy: SkipPolicy, model: nn.Module) -> SelectionState:
        settings = policy.on_the_fly
        assert settings is not None
        layers = adapters.num_layers(model)
        given = len(policy.skip_attention) + len(policy.skip_mlp)
        count = given or round(settings.start_fraction * 2 * layers)
        state = cls(settings, layers, 0, policy.skip_attention, policy.skip_mlp)
        state.count = state.home = min(count, state.max_count)
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

    def observe(self, tokens: int, seconds: float) -> None:
        """One skip-drafted step at the current count: ``tokens`` produced in ``seconds`` (draft + verify)."""
        self.speed.setdefault(self.count, CountRecord()).add(tokens, seconds)

    def _tried(self, count: int) -> bool:
        record = self.speed.get(count)
        return record is not None and record.steps >= self.settings.min_steps

    def next_count(self) -> int:
        """Hill-climb on measured tokens per second: from ``home`` (the best count so far) measure
        a neighbour; adopt it if it is ``gain_margin`` faster, else go back; settle at a home whose
        neighbours are both measured."""
        s = self.settings
        here = self.count
        if self.settled or not self._tried(here):
            return here
        if here != self.home:  # a neighbour being measured
            if self.speed[here].rate <= (1 + s.gain_margin) * self.speed[self.home].rate:
                return self.home
            self.home = here
        untried = [n for n in (here + 1, here - 1) if 0 <= n <= self.max_count and not self._tried(n)]
        if untried:
            return untried[0]  # one more bypassed first
        self.settled = True
        return here

    def reselect(self) -> bool:
        """Price the count, then bypass the lowest-scoring sublayers; True if the set changed."""
        self.refreshes += 1
        self.count = self.next_count()
        if not self.scores:
            return False
        # Hysteresis: sublayers in use score (1 - swap_margin) lower, so a newcomer must beat them clearly.
        chosen = self.ranking(in_use_weight=1.0 - self.settings.swap_margin)[: self.count]
        attention = tuple(sorted(i for i, kind in chosen if kind == "attention"))
        mlp = tuple(sorted(i for i, kind in chosen if kind == "mlp"))
        changed = (attention, mlp) != (self.attention, self.mlp)
        self.attention, self.mlp = attention, mlp
        return changed

    def ranking(self, in_use_weight: float = 1.0) -> list[Sublayer]:
        """Every scored sublayer, from the one that changes the residual stream least (ties:
        attention first, then by layer); the scores of sublayers in use are weighted by ``in_use_weight``."""
        current = {(i, "attention") for i in self.attention} | {(i, "mlp") for i in self.mlp}

        def rank(sub: Sublayer) -> tuple[float, bool, int]:
            return (self.scores[sub] * (in_use_weight if sub in current else 1.0), sub[1] != "attention", sub[0])

        return sorted(self.scores, key=rank)

    def summary(self) -> dict[str, Any]:
        """What was learned, as JSON-ready figures: the set in use, the count, the speed per count."""
        return {
            "skip_attention": list(self.attention),
            "skip_mlp": list(self.mlp),
            "count": self.count,
            "settled": self.settled,
            "refreshes": self.refreshes,
            "tokens_per_second_by_count": {
                str(n): round(record.rate, 3) for n, record in sorted(self.speed.items()) if record.steps
            },
            "sublayer_ranking": [[i, kind] for i, kind in self.ranking()],
        }


def converged_policy(policy: SkipPolicy, state: SelectionState) -> SkipPolicy:
    """A fixed policy with the skip sets on-the-fly selection is using now (to reuse, or to seed a
    study: ``search.py --warm-start``). Draft settings are the selection's own; the provenance
    records what was learned (``SelectionState.summary``) and whether the count had settled."""
    learned = state.summary()
    provenance = {"source": "on-the-fly", "started_from": policy.provenance, "selection": learned}
    return replace(policy, skip_attention=state.attention, skip_mlp=state.mlp, on_the_fly=None, provenance=provenance)


class OnTheFlyDrafter(WrappingDrafter):
    """A skip drafter whose bypassed sublayers follow a ``SelectionState`` learned from the verifies."""

    def __init__(self, skip: SkipDrafter, model: nn.Module, state: SelectionState) -> None:
        super().__init__(skip)
        self.skip = skip
        self.model = model
        self.state = state
        self.verifies = 0
        self.record: adapters.ContributionRecord | None = None  # the last watched verify, not yet learned from
        self.changes = 0
        self.steps_per_set: dict[str, int] = {}
        self.started = time.perf_counter()
        self._drafted = False  # whether the step being verified is its own skip draft
        self._apply()

    def _apply(self) -> None:
        # An exit draft always bypasses the layers after its exit; the selection adds to that.
        deep = getattr(self.skip, "deep_layers", ())
        self.skip.attention = tuple(sorted({*self.state.attention, *deep}))
        self.skip.mlp = tuple(sorted({*self.state.mlp, *deep}))

    @contextlib.contextmanager
    def watch_verify(self, block: int) -> Iterator[None]:
        with self.skip.watch_verify(block):
            if self.verifies % self.state.settings.refresh_every:
                yield
                return
            with adapters.sublayer_contributions(self.model) as record:
                yield
            self.record = record

    def propose(self, request: DraftRequest) -> Proposal:
        return self.draft_chain(request).proposal()

    def draft_chain(self, request: DraftRequest) -> ChainDraft:
        self.started = time.perf_counter()  # the step's clock: this draft, its verify, the acceptance
        if self.record is not None:  # the prefill: every prompt position is the full model's own
            self._learn(positions=len(request.history) - 1)
            self.verifies += 1
        chain = self.skip.draft_chain(request)
        self._drafted = bool(chain.tokens)
        if chain.tokens:
            label = f"a{','.join(map(str, self.skip.attention))}|m{','.join(map(str, self.skip.mlp))}"
            self.steps_per_set[label] = self.steps_per_set.get(label, 0) + 1
        return chain

    def learn(self, proposal: Proposal, verdict: Verdict) -> None:
        self.skip.learn(proposal, verdict)
        if self._drafted:
            # Host time: the acceptance has read the verify's tokens back, so device work is done.
            self.state.observe(verdict.accepted + 1, time.perf_counter() - self.started)
            self._drafted = False
        if self.record is not None:
            self._learn(positions=verdict.accepted + 1)  # pending and the accepted drafts: the committed tokens
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
