"""Which candidate tokens go into one verify block: the tree's shape, chosen by expected tokens per second.

Every candidate node carries ``chance``, the estimated probability that the full model accepts
it (its ancestors included). A verify of ``n`` nodes yields ``1 + sum(chance)`` tokens on average
(the accepted path plus the model's own token: the chances of siblings add up because at most
one of them can be accepted) and costs ``spent + v(n + 1)``: what drafting the candidates
took, and the verify over the root and n nodes. Nodes are taken most likely first (a node
only after its parent), and the tree is the prefix of that order with the highest ratio: a
branch is added only where the expected tokens grow faster than the verify's cost does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from layerskip.drafts.rules.token_tree import TokenTree, TreeBuilder
from layerskip.sampling import ROOT

# Candidate continuations of the pending token (lookup matches, greedy chains), each with the
# chance that each of its tokens is accepted, its earlier ones included.
Paths = list[tuple[list[int], list[float]]]


@dataclass(frozen=True)
class Candidate:
    parent: int  # index of the parent candidate in the list; ROOT for a child of the pending token
    token: int
    chance: float  # probability the full model accepts it, its ancestors included


@dataclass(frozen=True)
class Shape:
    tree: TokenTree
    expected_tokens: float
    seconds: float  # drafting spent plus the verify of this tree

    @property
    def rate(self) -> float:
        return self.expected_tokens / self.seconds if self.seconds > 0 else 0.0


def likeliest_order(candidates: Sequence[Candidate], taken: Sequence[int], budget: int) -> Iterator[int]:
    """The candidates not in ``taken``, most likely first, each once its parent is in (a child
    never beats its parent), until ``taken`` and these fill ``budget``."""
    chosen = set(taken)
    count = len(chosen)
    pending = sorted((i for i in range(len(candidates)) if i not in chosen), key=lambda i: (-candidates[i].chance, i))
    while pending and count < budget:
        ready = next((i for i in pending if candidates[i].parent in chosen or candidates[i].parent == ROOT), None)
        if ready is None:
            return
        pending.remove(ready)
        chosen.add(ready)
        count += 1
        yield ready


def shape_tree(
    candidates: Sequence[Candidate], verify_price: Callable[[int], float], spent: float, budget: int, required: int = 0
) -> Shape:
    """The tree of the candidates that raise the ratio, built in the given order (the first
    candidate's branch is the block's first positions, as a chain's would be). The first
    ``required`` candidates are always taken (a draft chain whose length was already decided
    token by token)."""
    taken = list(range(min(required, len(candidates), budget)))
    tokens = 1.0 + sum(candidates[i].chance for i in taken)
    best = (list(taken), tokens, spent + verify_price(len(taken) + 1))
    for ready in likeliest_order(candidates, taken, budget):
        taken.append(ready)
        tokens += candidates[ready].chance
        seconds = spent + verify_price(len(taken) + 1)
        if tokens / seconds > best[1] / best[2]:
            best = (list(taken), tokens, seconds)
    return Shape(_build(candidates, sorted(best[0])), best[1], best[2])


def likeliest_tree(candidates: Sequence[Candidate], budget: int) -> TokenTree:
    """The ``budget`` likeliest candidates as a tree: its shape where no costs price the nodes
    (every node taken is then worth its place)."""
    return _build(candidates, sorted(likeliest_order(candidates, (), budget)))


def _build(candidates: Sequence[Candidate], keep: Sequence[int]) -> TokenTree:
    """The tree of candidates ``keep`` (ascending), built in that order."""
    builder = TreeBuilder(len(keep))
    node_of: dict[int, int] = {}
    for index in keep:
        candidate = candidates[index]
        parent = ROOT if candidate.parent == ROOT else node_of[candidate.parent]
        node = builder.add_child(parent, candidate.token)
        if node is not None:
            node_of[index] = node
    return builder.build()


def merged_paths(paths: Sequence[tuple[Sequence[int], Sequence[float]]]) -> list[Candidate]:
    """Deterministic continuations (lookup matches, greedy chains), each with its per-token
    chances, merged on shared prefixes: a shared node counts once, with the larger chance."""
    candidates: list[Candidate] = []
    index: dict[tuple[int, int], int] = {}
    for tokens, chances in paths:
        parent = ROOT
        for token, chance in zip(tokens, chances, strict=True):
            key = (parent, token)
            if key in index:
                node = index[key]
                if chance > candidates[node].chance:
                    candidates[node] = Candidate(parent, token, chance)
            else:
                node = index[key] = len(candidates)
                candidates.append(Candidate(parent, token, chance))
            parent = node
    return candidates
