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

from layerskip.drafts.token_tree import TokenTree
from layerskip.hf.cache import RollbackCache
from layerskip.stats import GenerationStats


@dataclass
class Draft:
    """What a drafter proposes: a chain of tokens, or a token tree (``tree``: its nodes are then
    ``tokens``, depth-first; the verify runs over all of them at once)."""

    tokens: list[int]
    q: torch.Tensor | None = None  # [k, V] proposal probabilities (sampling only)
    source: str = "none"  # "skip", "lookup" or "none"
    ngram: int = 0  # lookup: length of the n-gram that matched
    # Skip drafts with draft length by cost: each token's top-2 confidence, and the draft's time.
    confidence: list[float] = field(default_factory=list)
    seconds: float = 0.0
    tree: TokenTree | None = None
    # The chain a tree was built around (a skip draft's own tokens), and after the verify the
    # accepted path (node indices): what a drafter learns from.
    chain: list[int] = field(default_factory=list)
    path: list[int] | None = None
    # Skip drafts asked for alternatives: the draft's best tokens and probabilities per position,
    # [k, K] best first (greedy).
    top_tokens: torch.Tensor | None = None
    top_probs: torch.Tensor | None = None

    @property
    def from_lookup(self) -> bool:
        return self.source == "lookup"

    def chain_accepted(self, accepted: int) -> int:
        """How many of the chain's own tokens were accepted (a tree may accept a sibling's path)."""
        if self.tree is None or self.path is None:
            return accepted
        run = 0
        for node, token in zip(self.path, self.chain):
            if node != run or self.tree.tokens[node] != token:  # the chain is the first branch
                break
            run += 1
        return run


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


class WrappingDrafter(BaseDrafter):
    """A drafter that changes what ``inner`` proposes (or records it) and passes everything else on."""

    def __init__(self, inner: Drafter) -> None:
        self.inner = inner

    def propose(self, request: DraftRequest) -> Draft:
        return self.inner.propose(request)

    def update(self, draft: Draft, accepted: int) -> None:
        self.inner.update(draft, accepted)

    def watch_verify(self, block: int) -> contextlib.AbstractContextManager[object]:
        return self.inner.watch_verify(block)

    def around_verify(
        self, cache: RollbackCache, start: int, block: torch.Tensor
    ) -> contextlib.AbstractContextManager[object]:
        return self.inner.around_verify(cache, start, block)

    def report(self, stats: GenerationStats) -> None:
        self.inner.report(stats)


class NoDrafter(BaseDrafter):
    """Plain decoding: nothing proposed, so every step verifies just the pending token."""

    def propose(self, request: DraftRequest) -> Draft:
        return Draft([])

    def update(self, draft: Draft, accepted: int) -> None:
        pass
