"""The drafter interface: what a draft is, what a drafter is asked, and the plain "no draft".

Every drafter has two methods, after Hugging Face's candidate generators: ``propose`` returns
up to ``max_tokens`` candidates (with their proposal distribution q when sampling), and
``update(draft, accepted)`` learns from how many of them the full model accepted. What a
drafter needs to learn from a draft travels in the ``Draft`` itself (its source, the n-gram
that matched), so no drafter remembers its previous call. The engine uses drafters through
this interface only.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Protocol

import torch

from layerskip.hf.cache import RollbackCache
from layerskip.stats import GenerationStats


@dataclass
class Draft:
    tokens: list[int]
    q: torch.Tensor | None = None  # [k, V] proposal probabilities (sampling only)
    source: str = "none"  # "skip", "lookup" or "none"
    ngram: int = 0  # lookup: length of the n-gram that matched
    # Skip drafts with draft length by cost: each token's top-2 confidence, and the draft's time.
    confidence: list[float] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def from_lookup(self) -> bool:
        return self.source == "lookup"


@dataclass
class DraftRequest:
    """What a drafter may look at: the sequence so far and the cache, which holds all of it but ``pending``."""

    history: list[int]  # prompt + generated tokens; the last one is ``pending``
    cache: RollbackCache
    max_tokens: int
    device: torch.device

    @property
    def pending(self) -> int:
        return self.history[-1]

    @property
    def position(self) -> int:
        return len(self.history) - 1


class Drafter(Protocol):
    def propose(self, request: DraftRequest) -> Draft: ...

    def update(self, draft: Draft, accepted: int) -> None: ...

    def watch_verify(self, block: int) -> contextlib.AbstractContextManager[object]:
        """Entered around every verify forward of ``block`` positions (on-the-fly selection reads
        the full model there; draft length by cost times it)."""
        ...

    def report(self, stats: GenerationStats) -> None:
        """Adds what the drafter tracked to the generation's stats at the end."""
        ...

    def around_verify(
        self, cache: RollbackCache, start: int, block: torch.Tensor
    ) -> contextlib.AbstractContextManager[object]:
        """Entered around every verify forward of ``block [1, q]`` at positions ``start..``: an exit
        draft may let the verify reuse what it computed, or fill its adapter's cache after it."""
        ...


class BaseDrafter:
    """Defaults for the optional drafter methods: nothing to watch, nothing to report."""

    def watch_verify(self, block: int) -> contextlib.AbstractContextManager[object]:
        return contextlib.nullcontext()

    def report(self, stats: GenerationStats) -> None:
        pass

    def around_verify(
        self, cache: RollbackCache, start: int, block: torch.Tensor
    ) -> contextlib.AbstractContextManager[object]:
        return contextlib.nullcontext()


class NoDrafter(BaseDrafter):
    """Plain decoding: nothing proposed, so every step verifies just the pending token."""

    def propose(self, request: DraftRequest) -> Draft:
        return Draft([])

    def update(self, draft: Draft, accepted: int) -> None:
        pass
