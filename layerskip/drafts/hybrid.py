"""The hybrid drafter: prompt lookup where the context repeats, the skip draft otherwise."""

from __future__ import annotations

from layerskip.drafts.base import Drafter, DraftRequest, Proposal, WrappingDrafter
from layerskip.drafts.lookup import LookupDrafter


class HybridDrafter(WrappingDrafter):
    """Lookup when the context repeats an earlier n-gram, otherwise the skip draft, which learns
    from its own drafts only but sees every verify."""

    def __init__(self, lookup: LookupDrafter, skip: Drafter) -> None:
        super().__init__(skip)
        self.lookup = lookup

    def propose(self, request: DraftRequest) -> Proposal:
        proposal = self.lookup.propose(request)
        return proposal if len(proposal) else self.inner.propose(request)
