"""The hybrid drafter: prompt lookup where the context repeats, the skip draft otherwise."""

from __future__ import annotations

import contextlib

import torch

from layerskip.drafts.base import BaseDrafter, Drafter, DraftRequest, Proposal, Verdict
from layerskip.drafts.lookup import LookupDrafter
from layerskip.hf.cache import RollbackCache
from layerskip.stats import GenerationStats


class HybridDrafter(BaseDrafter):
    """Lookup when the context repeats an earlier n-gram, otherwise the skip draft."""

    def __init__(self, lookup: LookupDrafter, skip: Drafter | None) -> None:
        self.lookup = lookup
        self.skip = skip

    def propose(self, request: DraftRequest) -> Proposal:
        proposal = self.lookup.propose(request)
        if not len(proposal) and self.skip is not None:
            proposal = self.skip.propose(request)
        return proposal

    def learn(self, proposal: Proposal, verdict: Verdict) -> None:
        if self.skip is not None:  # it learns from its own drafts only, but sees every verify
            self.skip.learn(proposal, verdict)

    def watch_verify(self, block: int) -> contextlib.AbstractContextManager[object]:
        return self.skip.watch_verify(block) if self.skip is not None else contextlib.nullcontext()

    def report(self, stats: GenerationStats) -> None:
        if self.skip is not None:
            self.skip.report(stats)

    def around_verify(
        self, cache: RollbackCache, start: int, block: torch.Tensor
    ) -> contextlib.AbstractContextManager[object]:
        return self.skip.around_verify(cache, start, block) if self.skip is not None else contextlib.nullcontext()
