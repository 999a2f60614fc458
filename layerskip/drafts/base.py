"""The drafter interface: what a step proposes, what the verify answers, and the plain "no draft".

Every drafter has two methods, after Hugging Face's candidate generators: ``propose`` returns a
``Proposal`` of up to ``max_tokens`` candidates, and ``learn(proposal, verdict)`` learns from the
full model's ``Verdict`` on it. A proposal holds what the verify needs and nothing else; what a
drafter wants to remember about its own draft (the n-gram that matched, each token's
confidence, the draft's time, its alternatives) it keeps itself, and compares with the verdict
in ``learn``. The engine uses drafters through this interface only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from layerskip.drafts.model.head import LogitEdits
from layerskip.drafts.rules.token_tree import TokenTree
from layerskip.hf.cache import RollbackCache
from layerskip.sampling import DETERMINISTIC, Attempt, Draw
from layerskip.stats import GenerationStats

# Where a proposal's candidates came from: what the stats count by.
NONE, SKIP, LOOKUP = "none", "skip", "lookup"


@dataclass(frozen=True)
class Proposal:
    """One row's candidates for one verify: a token tree (node tokens and their parents; a chain is
    a tree with one branch, parents ``-1, 0, 1, ...``), with the draft's probabilities and how each
    node was drawn where sampling needs them (``TokenTree.q`` / ``attempts``), and where it came from.

    Node ``i`` sits at verify block position ``i + 1``, after the pending token at position 0; its
    position id is the committed length plus its depth (``layerskip.hf.tree.block_depths``).
    """

    tree: TokenTree
    source: str = NONE
    # A chain's hidden states after the exit layer, ``[1, len + 1, H]`` for [pending, its tokens],
    # computed by an exit draft with the model's own shallow layers: the verify may enter the stack
    # after that layer (``drafters.exit_draft``). None: the verify runs every layer.
    entry: torch.Tensor | None = None

    @classmethod
    def chain(
        cls, tokens: Sequence[int], source: str, q: torch.Tensor | None = None, entry: torch.Tensor | None = None
    ) -> Proposal:
        """A chain: token t follows token t-1; drawn from ``q[t]`` (``[k, V]``, a sampled draft), or
        chosen deterministically (an argmax, a lookup match) when ``q`` is None."""
        tokens = list(tokens)
        parents = list(range(-1, len(tokens) - 1))
        draws = [Draw(t) for t in range(len(tokens))] if q is not None else [DETERMINISTIC] * len(tokens)
        attempts = [Attempt(parent, node, draw) for node, (parent, draw) in enumerate(zip(parents, draws))]
        return cls(TokenTree(tokens, parents, attempts, q), source, entry)

    @classmethod
    def nothing(cls) -> Proposal:
        return cls.chain([], NONE)

    @property
    def tokens(self) -> list[int]:
        return self.tree.tokens

    def __len__(self) -> int:
        return len(self.tree)


@dataclass(frozen=True)
class Proposals:
    """A batch's proposals, one per row (several sequences verified in one forward)."""

    rows: tuple[Proposal, ...]

    def __len__(self) -> int:
        return len(self.rows)


@dataclass(frozen=True)
class Verdict:
    """The full model's answer to a proposal: the accepted path (node indices from the root down;
    along a chain ``0, 1, ..., n-1``) and its own token after it."""

    path: tuple[int, ...]
    next_token: int

    @property
    def accepted(self) -> int:
        return len(self.path)

    def tokens(self, proposal: Proposal) -> list[int]:
        """The accepted candidates, then the full model's own token."""
        return [*(proposal.tree.tokens[node] for node in self.path), self.next_token]

    def cut(self, kept: int) -> Verdict:
        """The verdict as far as ``kept`` accepted candidates were used (an EOS or the budget came first)."""
        return self if kept >= len(self.path) else Verdict(self.path[:kept], self.next_token)


def chain_run(proposal: Proposal, verdict: Verdict, chain: Sequence[int]) -> tuple[int, int]:
    """How a drafter's own ``chain`` fared when it went into ``proposal`` as its first branch (a
    tree may add branches around it, or a chooser cut it): (its tokens that were verified, those
    of them accepted: the accepted path's leading nodes on that branch)."""
    tree = proposal.tree
    verified = 0
    while verified < min(len(chain), len(tree)) and tree.parents[verified] == verified - 1:
        if tree.tokens[verified] != chain[verified]:
            break
        verified += 1
    run = 0
    while run < min(verified, len(verdict.path)) and verdict.path[run] == run:
        run += 1
    return verified, run


def off_first_branch(verdict: Verdict) -> bool:
    """Whether the accepted path left the tree's first branch (a sibling or another match held)."""
    return any(node != depth for depth, node in enumerate(verdict.path))


# drafted tokens so far -> the processors' edits of the next token (None: none it can say cheaply)
EditsAfter = Callable[[Sequence[int]], LogitEdits | None]


@dataclass
class DraftRequest:
    """What a drafter may look at: the sequence so far and the cache, which holds all of it but ``pending``."""

    history: list[int]  # prompt + generated tokens; the last one is ``pending``
    cache: RollbackCache
    max_tokens: int
    device: torch.device
    # What the user's logits processors do to the token after the history and the tokens drafted
    # so far, where they touch few tokens (an EOS masked before ``min_new_tokens``, a repetition
    # penalty, an n-gram that may not repeat): a draft that ignored them would propose what the
    # verify rejects, so it applies them too (to its proposals only; the verify decides what is
    # kept). None: no such processors.
    edits: EditsAfter | None = None

    @property
    def pending(self) -> int:
        return self.history[-1]

    @property
    def position(self) -> int:
        return len(self.history) - 1


class Drafter(Protocol):
    """What the engine drafts with. A drafter that subclasses it explicitly takes the defaults of
    the optional methods (every one but ``propose``): nothing to learn, watch or report."""

    def propose(self, request: DraftRequest) -> Proposal: ...

    def learn(self, proposal: Proposal, verdict: Verdict) -> None:
        """What the full model made of the step's proposal (the verdict cut to what was used)."""

    def watch_verify(self, block: int) -> contextlib.AbstractContextManager[object]:
        """Entered around every verify forward of ``block`` positions (on-the-fly selection reads
        the full model there; draft length by cost times it)."""
        return contextlib.nullcontext()

    def report(self, stats: GenerationStats) -> None:
        """Adds what the drafter tracked to the generation's stats at the end."""


class WrappingDrafter(Drafter):
    """A drafter that changes what ``inner`` proposes (or records it) and passes everything else on."""

    def __init__(self, inner: Drafter) -> None:
        self.inner = inner

    def propose(self, request: DraftRequest) -> Proposal:
        return self.inner.propose(request)

    def learn(self, proposal: Proposal, verdict: Verdict) -> None:
        self.inner.learn(proposal, verdict)

    def watch_verify(self, block: int) -> contextlib.AbstractContextManager[object]:
        return self.inner.watch_verify(block)

    def report(self, stats: GenerationStats) -> None:
        self.inner.report(stats)


class NoDrafter(Drafter):
    """Plain decoding: nothing proposed, so every step verifies just the pending token."""

    def propose(self, request: DraftRequest) -> Proposal:
        return Proposal.nothing()
