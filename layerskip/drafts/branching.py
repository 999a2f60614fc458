"""Where a draft chain branches: siblings at the positions where the draft's top-1 is uncertain.

A draft that is sure of its next token (a wide top-2 margin) is usually right; where the margin
is narrow its second choice is often the model's. There the tree gets the draft's next choices
as siblings of the chain token (leaves: children of the chain's previous node).

The inputs are plain tensors recorded while drafting greedily, one row per chain position: the
draft's top-K tokens and their probabilities, ``top_tokens [k, K]`` / ``top_probs [k, K]``, best
first. The siblings are the best tokens other than the chain's, in rank order: deterministic
proposals (one-hot q). A sampled draft stays a chain (the builder branches greedy drafts only).
A sibling marked ``drawn`` names a draw from the chain's proposal row without replacement, which
the sampled tree verify tests against q renormalised without the earlier draws.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from layerskip.drafts.base import Draft, Drafter, DraftRequest, WrappingDrafter
from layerskip.drafts.token_tree import ChainNodes, TreeBuilder
from layerskip.sampling import DETERMINISTIC, ROOT, Proposal


@dataclass(frozen=True)
class Sibling:
    position: int  # chain index t: an alternative to chain[t], under chain[t-1] (the root for t = 0)
    token: int
    drawn: bool = False  # drawn from q[t] without replacement (else a deterministic alternative)


def uncertain_positions(top_probs: torch.Tensor, margin: float) -> list[int]:
    """Chain positions where the draft's top-2 margin ``top_probs[t, 0] - top_probs[t, 1]`` is below ``margin``."""
    if top_probs.shape[-1] < 2:
        return []
    gap = top_probs[:, 0] - top_probs[:, 1]  # [k]
    return torch.nonzero(gap < margin).flatten().tolist()


def ranked_siblings(
    chain: Sequence[int], top_tokens: torch.Tensor, top_probs: torch.Tensor, margin: float, width: int
) -> list[Sibling]:
    """Up to ``width - 1`` alternatives per uncertain position: the draft's best tokens other than
    ``chain[t]``, in rank order (``top_tokens`` / ``top_probs``: ``[k, K]``, best first).
    Earlier positions come first: a sibling at depth t only counts when chain[:t] is accepted."""
    siblings: list[Sibling] = []
    for t in uncertain_positions(top_probs, margin):
        if t >= len(chain):
            break
        alternatives = [token for token in top_tokens[t].tolist() if token != chain[t]]
        siblings.extend(Sibling(t, token) for token in alternatives[: width - 1])
    return siblings


def add_siblings(builder: TreeBuilder, chain: ChainNodes, siblings: Sequence[Sibling]) -> list[int]:
    """Add siblings of a chain already in ``builder`` (where ``add_chain`` put it); a drawn sibling at
    position t names the chain's q row for t. Returns the nodes added or merged; stops at the budget."""
    nodes: list[int] = []
    for sibling in siblings:
        if sibling.position >= len(chain.nodes):
            # The chain token it is an alternative to did not fit: a drawn sibling's q (without
            # the chain token) would then be wrong, and its parent may be missing too.
            continue
        parent = chain.nodes[sibling.position - 1] if sibling.position else ROOT
        if sibling.drawn:
            if chain.q_offset is None:
                raise ValueError("drawn siblings need a sampled chain (its q rows)")
            proposal = Proposal(chain.q_offset + sibling.position, without_replacement=True)
        else:
            proposal = DETERMINISTIC
        node = builder.add_child(parent, sibling.token, proposal)
        if node is None:
            break
        nodes.append(node)
    return nodes


def branched_draft(draft: Draft, margin: float, width: int, budget: int) -> Draft:
    """A greedy skip draft with its recorded alternatives (``Draft.top_tokens``) as a token tree:
    the chain first, then up to ``width - 1`` siblings at each position whose top-2 margin is
    below ``margin``, at most ``budget`` nodes. A draft with no uncertain position stays a chain."""
    if draft.tree is not None or draft.top_tokens is None or draft.top_probs is None or not draft.tokens:
        return draft
    siblings = ranked_siblings(draft.tokens, draft.top_tokens, draft.top_probs, margin, width)
    if not siblings:
        return draft
    builder = TreeBuilder(budget)
    chain = builder.add_chain(draft.tokens)
    add_siblings(builder, chain, siblings)
    tree = builder.build()
    if tree.is_chain:
        return draft
    return replace(draft, tokens=list(tree.tokens), tree=tree, chain=list(draft.tokens))


class BranchingDrafter(WrappingDrafter):
    """A skip drafter whose greedy drafts become token trees (``branched_draft``)."""

    def __init__(self, inner: Drafter, margin: float, width: int, budget: int) -> None:
        super().__init__(inner)
        self.margin = margin
        self.width = width
        self.budget = budget

    def propose(self, request: DraftRequest) -> Draft:
        return branched_draft(self.inner.propose(request), self.margin, self.width, self.budget)
