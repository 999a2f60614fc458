"""A token tree: several candidate continuations of the pending token, merged on shared prefixes.

The root is the pending token (block position 0, not a node). Nodes are kept in depth-first
order, so node ``i`` sits at block position ``i + 1``, every parent comes before its children,
every subtree is contiguous, and the first candidate merged is block positions ``1..k``: a tree
with one branch is exactly a chain's verify block.

Building (``TreeBuilder``) merges candidates in priority order under a node budget: a lookup
match, a draft chain, siblings at the draft's uncertain positions. Each token added is also an
``Attempt`` (how it was proposed), which the sampled verify needs; see ``layerskip.sampling``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from layerskip.sampling import DETERMINISTIC, ROOT, Attempt, Draw


@dataclass(frozen=True)
class TokenTree:
    tokens: list[int]  # [n] node tokens, depth-first
    parents: list[int]  # [n] parent node index; ROOT (-1) = the pending token
    attempts: list[Attempt] = field(default_factory=list)  # every proposal, in the order the verify tests them
    q: torch.Tensor | None = None  # [m, V] proposal rows that ``Draw.q_row`` indexes (sampling)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        """One child per node: the block is a plain chain's (a causal mask would do)."""
        return all(parent == node - 1 for node, parent in enumerate(self.parents))

    @property
    def first_branch_length(self) -> int:
        """Nodes of the first branch, the chain the tree was built around (depth-first order puts it
        at nodes ``0..length-1``)."""
        length = 0
        while length < len(self.parents) and self.parents[length] == length - 1:
            length += 1
        return length

    def children(self, node: int = ROOT) -> list[int]:
        return [child for child, parent in enumerate(self.parents) if parent == node]

    def path(self, node: int) -> list[int]:
        """Node indices from the root's child down to ``node`` (``[]`` for ROOT)."""
        path: list[int] = []
        while node != ROOT:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def path_tokens(self, node: int) -> list[int]:
        return [self.tokens[i] for i in self.path(node)]

    @staticmethod
    def block_rows(path: Sequence[int]) -> list[int]:
        """Block positions of the root and an accepted path: what ``RollbackCache.keep_paths`` keeps."""
        return [0, *(node + 1 for node in path)]


@dataclass(frozen=True)
class ChainNodes:
    """Where ``TreeBuilder.add_chain`` put a draft chain."""

    nodes: list[int]  # node of each chain token that fit (a prefix of the chain)
    q_offset: int | None  # q row of chain token 0 for a sampled chain (token t: q_offset + t); else None


class TreeBuilder:
    """Merges candidates into a tree of at most ``budget`` nodes, in the order they are added.

    A token that its parent already has is merged into that node (no budget used). For sampling,
    a token drawn from a q row is one more draw even when it merges, and the verify must replay
    it (it moves the residual), so it is recorded as an attempt; a deterministic duplicate is
    certain to be rejected and leaves the residual as it is, so it is not. Once the budget is
    full no drawn token is added at all, merging or not: whether a draw is tested must not
    depend on the token drawn.
    """

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._tokens: list[int] = []
        self._parents: list[int] = []
        self._child: dict[tuple[int, int], int] = {}  # (parent, token) -> node, in insertion numbering
        self._attempts: list[Attempt] = []
        self._q: list[torch.Tensor] = []
        self._q_rows = 0

    def __len__(self) -> int:
        return len(self._tokens)

    @property
    def full(self) -> bool:
        return len(self._tokens) >= self.budget

    def add_q(self, q: torch.Tensor) -> int:
        """Register proposal rows ``q [k, V]``; returns the ``q_row`` of its first row."""
        offset = self._q_rows
        self._q.append(q)
        self._q_rows += q.shape[0]
        return offset

    def add_child(self, parent: int, token: int, proposal: Draw = DETERMINISTIC) -> int | None:
        """Add ``token`` under ``parent`` (a node index of this builder, or ROOT); its node, or None when full."""
        if parent != ROOT and not 0 <= parent < len(self._tokens):
            raise ValueError(f"no node {parent} to add a child to")
        drawn = proposal.q_row is not None
        if drawn and self.full:
            return None
        node = self._child.get((parent, token))
        if node is None:
            if self.full:
                return None
            node = len(self._tokens)
            self._tokens.append(token)
            self._parents.append(parent)
            self._child[(parent, token)] = node
        elif not drawn:
            return node
        self._attempts.append(Attempt(parent, node, proposal))
        return node

    def add_path(self, tokens: Sequence[int], proposals: Sequence[Draw] | None = None, parent: int = ROOT) -> list[int]:
        """Merge a candidate continuation of ``parent``; the nodes of the tokens that fit (a prefix)."""
        proposals = proposals if proposals is not None else [DETERMINISTIC] * len(tokens)
        nodes: list[int] = []
        for token, proposal in zip(tokens, proposals, strict=True):
            node = self.add_child(parent, token, proposal)
            if node is None:
                break
            nodes.append(node)
            parent = node
        return nodes

    def add_chain(self, tokens: Sequence[int], q: torch.Tensor | None = None, parent: int = ROOT) -> ChainNodes:
        """A draft chain: token t drawn from ``q[t]`` (``[k, V]``, sampling), or deterministic when q is None."""
        if q is None:
            return ChainNodes(self.add_path(tokens, parent=parent), None)
        offset = self.add_q(q)
        return ChainNodes(self.add_path(tokens, [Draw(offset + t) for t in range(len(tokens))], parent), offset)

    def build(self) -> TokenTree:
        """The tree in depth-first order (children in the order they were first added)."""
        children: dict[int, list[int]] = {}
        for node, parent in enumerate(self._parents):
            children.setdefault(parent, []).append(node)
        order: list[int] = []
        stack = list(reversed(children.get(ROOT, [])))
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(reversed(children.get(node, [])))
        new = {old: i for i, old in enumerate(order)}
        new[ROOT] = ROOT
        attempts = [Attempt(new[a.parent], new[a.node], a.proposal) for a in self._attempts]
        q = torch.cat(self._q) if self._q else None
        return TokenTree(
            tokens=[self._tokens[old] for old in order],
            parents=[new[self._parents[old]] for old in order],
            attempts=attempts,
            q=q,
        )
