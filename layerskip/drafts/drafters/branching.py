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
from dataclasses import dataclass

import torch

from layerskip.drafts.base import SKIP, DraftRequest, Proposal, WrappingDrafter
from layerskip.drafts.drafters.skip import ChainDraft, ChainDrafter
from layerskip.drafts.rules.token_tree import ChainNodes, TreeBuilder
from layerskip.drafts.rules.tree_shape import Paths
from layerskip.sampling import DETERMINISTIC, ROOT, Draw


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
            proposal = Draw(chain.q_offset + sibling.position, without_replacement=True)
        else:
            proposal = DETERMINISTIC
        node = builder.add_child(parent, sibling.token, proposal)
        if node is None:
            break
        nodes.append(node)
    return nodes


def branched(chain: ChainDraft, margin: float, width: int, budget: int) -> Proposal:
    """A greedy skip chain with its recorded alternatives (``ChainDraft.top_tokens``) as a token
    tree: the chain first, then up to ``width - 1`` siblings at each position whose top-2 margin
    is below ``margin``, at most ``budget`` nodes. A chain with no alternatives recorded or no
    uncertain position stays the chain."""
    if chain.top_tokens is None or chain.top_probs is None or not chain.tokens:
        return chain.proposal()
    siblings = ranked_siblings(chain.tokens, chain.top_tokens, chain.top_probs, margin, width)
    if not siblings:
        return chain.proposal()
    builder = TreeBuilder(budget)
    nodes = builder.add_chain(chain.tokens)
    add_siblings(builder, nodes, siblings)
    tree = builder.build()
    return chain.proposal() if tree.is_chain else Proposal(tree, SKIP)


def sibling_paths(
    chain: ChainDraft, reach: Sequence[float], accept: Sequence[float], sibling_chance: float, margin: float
) -> Paths:
    """The chain's candidate branches for a tree shaped by cost (``tree_shape``): at each position
    whose top-2 margin is below ``margin``, the chain up to it and then the draft's second choice,
    with the chance of each token (``reach[t]``: the chain's first t tokens all accepted;
    ``accept[t]``: token t accepted after them; ``sibling_chance``: the second choice is the
    model's token where the chain's was not)."""
    paths: Paths = []
    if chain.top_tokens is None or chain.top_probs is None:
        return paths
    for t, token in enumerate(chain.tokens):
        probs = chain.top_probs[t]
        if probs.shape[0] < 2 or float(probs[0] - probs[1]) >= margin:
            continue
        alternative = int(chain.top_tokens[t, 1])
        if alternative != token:
            chances = [*reach[1 : t + 1], reach[t] * (1 - accept[t]) * sibling_chance]
            paths.append(([*chain.tokens[:t], alternative], chances))
    return paths


class BranchingDrafter(WrappingDrafter):
    """A skip drafter whose greedy drafts become token trees (``branched``)."""

    def __init__(self, inner: ChainDrafter, margin: float, width: int, budget: int) -> None:
        super().__init__(inner)
        self.chains = inner
        self.margin = margin
        self.width = width
        self.budget = budget

    def propose(self, request: DraftRequest) -> Proposal:
        return branched(self.chains.draft_chain(request), self.margin, self.width, self.budget)
