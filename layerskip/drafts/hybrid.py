"""The hybrid drafter: prompt lookup where the context repeats, the skip draft otherwise."""

from __future__ import annotations

import contextlib

import torch

from layerskip.drafts.base import BaseDrafter, Draft, Drafter, DraftRequest
from layerskip.drafts.lookup import LookupDrafter
from layerskip.hf.cache import RollbackCache
from layerskip.stats import GenerationStats


class HybridDrafter(BaseDrafter):
    """Lookup when the context repeats an earlier n-gram, otherwise the skip draft."""

    def __init__(self, lookup: LookupDrafter, skip: Drafter | None) -> None:
        self.lookup = lookup
        self.skip = skip

    def propose(self, request: DraftRequest) -> Draft:
        draft = self.lookup.propose(request)
        if not draft.tokens and self.skip is not None:
            draft = self.skip.propose(request)
        return draft

    def update(self, draft: Draft, accepted: int) -> None:
        if self.skip is not None:  # it learns from skip drafts only, but sees every verify
            self.skip.update(draft, accepted)

    def watch_verify(self, block: int) -> contextlib.AbstractContextManager[object]:
        return self.skip.watch_verify(block) if self.skip is not None else contextlib.nullcontext()

    def report(self, stats: GenerationStats) -> None:
        if self.skip is not None:
            self.skip.report(stats)

    def around_verify(
        self, cache: RollbackCache, start: int, block: torch.Tensor
    ) -> contextlib.AbstractContextManager[object]:
        return self.skip.around_verify(cache, start, block) if self.skip is not None else contextlib.nullcontext()
