"""Tree rejection sampling keeps the target distribution exactly, whatever the tree's candidates are.

A two-level toy: the target's law of the first token is ``p_root`` and of the second, given the
first x, ``p_next[x]``; the draft's are ``q_root`` / ``q_next[x]``, far from them. Each draw builds
a fresh tree the way a drafter would (sampled chain, siblings drawn with or without replacement,
deterministic lookup branches and ranked siblings that may duplicate drawn tokens), verifies it,
and records the first two output tokens (a second token the step did not produce is sampled from
p_next, as the next step would). Their joint law must be ``p_root(x) p_next[x](y)``.

The generators are seeded, so every test is deterministic; bounds leave several standard
deviations of room, and each broken rule (no residual update, siblings tested as if drawn with
replacement, drawn duplicates dropped) is shown to fail the same bound.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from drawn_siblings import sampled_siblings
from oracles import chain_rule

from layerskip import sampling
from layerskip.drafts.drafters.branching import add_siblings, ranked_siblings
from layerskip.drafts.rules.token_tree import ChainNodes, TokenTree, TreeBuilder
from layerskip.hf.tree import block_depths
from layerskip.sampling import Attempt, Draw, sample, verify_tree_sampled

V = 4
DRAWS = 4_000
BROKEN_DRAWS = 1_000
TV_BOUND = 0.05  # the empirical TV of 4000 draws over 16 outcomes is ~0.02; the broken rules give 0.25-0.47
FIRST_TV_BOUND = 0.04  # over the 4 outcomes of the first token alone: ~0.01; forgetting duplicates gives 0.12


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().sum() / 2)


def _laws(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(1 + V, V, generator=g) * 1.5
    draft = target + torch.randn(1 + V, V, generator=g) * 2.5
    p, q = target.softmax(-1), draft.softmax(-1)
    return {"p_root": p[0], "p_next": p[1:], "q_root": q[0], "q_next": q[1:]}


LAWS = _laws(37)  # seeded laws where every broken rule below is far off (q_root peaked on one token)
LOOKUP = [int(LAWS["p_root"].argsort()[1]), 0]  # a deterministic two-token match, first token middling


# -- how each kind of tree is drafted: (laws, generator) -> tree -----------------------------------


def _chain(laws: dict, g: torch.Generator, builder: TreeBuilder) -> tuple[list[int], torch.Tensor, ChainNodes]:
    """A sampled two-token draft chain: its tokens, proposal rows ``[2, V]`` and where it went."""
    x = int(sample(laws["q_root"], g))
    y = int(sample(laws["q_next"][x], g))
    q = torch.stack([laws["q_root"], laws["q_next"][x]])  # [2, V]
    return [x, y], q, builder.add_chain([x, y], q)


def sequoia_tree(laws: dict, g: torch.Generator) -> TokenTree:
    """Chain x, y; two more draws without replacement at each chain position (siblings of x and of y)."""
    builder = TreeBuilder(budget=8)
    chain, q, nodes = _chain(laws, g, builder)
    add_siblings(builder, nodes, sampled_siblings(chain, q, margin=2.0, width=3, generator=g))
    return builder.build()


def specinfer_tree(laws: dict, g: torch.Generator) -> TokenTree:
    """Three i.i.d. draws from q_root at the root (duplicates merge, and stay attempts), a chain under the first."""
    builder = TreeBuilder(budget=8)
    _, _, nodes = _chain(laws, g, builder)
    for _ in range(2):
        builder.add_child(-1, int(sample(laws["q_root"], g)), Draw(nodes.q_offset))
    return builder.build()


def lookup_tree(laws: dict, g: torch.Generator) -> TokenTree:
    """A lookup match first (one-hot), then a sampled chain (it may draw the lookup's token: a merged
    node with two attempts), then ranked siblings: q's best token other than the chain's (one-hot)."""
    builder = TreeBuilder(budget=8)
    builder.add_path(LOOKUP)
    chain, q, nodes = _chain(laws, g, builder)
    top = q.topk(V, dim=-1)
    add_siblings(builder, nodes, ranked_siblings(chain, top.indices, top.values, margin=2.0, width=2))
    return builder.build()


def chain_tree(laws: dict, g: torch.Generator) -> TokenTree:
    builder = TreeBuilder(budget=8)
    _chain(laws, g, builder)
    return builder.build()


TREES: dict[str, Callable[[dict, torch.Generator], TokenTree]] = {
    "sequoia": sequoia_tree,
    "specinfer": specinfer_tree,
    "lookup": lookup_tree,
}


def _targets(tree: TokenTree, laws: dict) -> torch.Tensor:
    """``[n+1, V]`` target rows per block position (depth 2 and deeper: p_root, never read here)."""
    rows = [laws["p_root"]]
    for token, depth in zip(tree.tokens, block_depths(tree.parents)[1:], strict=True):
        rows.append(laws["p_next"][token] if depth == 1 else laws["p_root"])
    return torch.stack(rows)


def _joint(draft_tree: Callable, laws: dict, seed: int, draws: int = DRAWS) -> torch.Tensor:
    """Empirical joint law ``[V, V]`` of the first two output tokens."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V, V)
    for _ in range(draws):
        tree = draft_tree(laws, g)
        path, nxt = verify_tree_sampled(tree.tokens, tree.attempts, _targets(tree, laws), tree.q, g)
        out = [tree.tokens[i] for i in path] + [nxt]
        second = out[1] if len(out) > 1 else int(sample(laws["p_next"][out[0]], g))
        counts[out[0], second] += 1
    return counts / draws


def _exact(laws: dict) -> torch.Tensor:
    return laws["p_root"][:, None] * laws["p_next"]  # [V, V]


@pytest.mark.parametrize("name", list(TREES))
def test_tree_sampling_outputs_the_target_distribution(name: str) -> None:
    joint = _joint(TREES[name], LAWS, seed=1)
    assert tv(joint, _exact(LAWS)) < TV_BOUND, (name, joint, _exact(LAWS))


def test_the_toy_draft_is_far_from_the_target() -> None:
    assert tv(LAWS["q_root"], LAWS["p_root"]) > 0.3
    assert tv(LAWS["q_root"][:, None] * LAWS["q_next"], _exact(LAWS)) > 0.3


def test_trees_do_accept_siblings() -> None:
    """The toy exercises the sibling branches: some accepted nodes are not their parent's first attempt."""
    g = torch.Generator().manual_seed(0)
    later = 0
    for _ in range(300):
        tree = sequoia_tree(LAWS, g)
        path, _ = verify_tree_sampled(tree.tokens, tree.attempts, _targets(tree, LAWS), tree.q, g)
        later += bool(path) and path[0] != tree.attempts[0].node
    assert later > 20


# -- the check can fail ----------------------------------------------------------------------------


def _keep_residual(r: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Broken: after a rejection, the next sibling is tested against the same r (no residual update)."""
    return r


def _with_replacement(proposal: Draw, token: int, q, drawn: list[int], like: torch.Tensor) -> torch.Tensor:
    """Broken: siblings drawn without replacement tested against the raw q."""
    return original_proposal(Draw(proposal.q_row), token, q, [], like)


original_proposal = sampling.proposal_distribution


@pytest.mark.parametrize(
    "name,broken",
    [
        ("sequoia", ("residual_after_rejection", _keep_residual)),
        ("specinfer", ("residual_after_rejection", _keep_residual)),
        ("lookup", ("residual_after_rejection", _keep_residual)),
        ("sequoia", ("proposal_distribution", _with_replacement)),
    ],
)
def test_broken_rules_fail_the_same_bound(name: str, broken: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sampling, *broken)
    joint = _joint(TREES[name], LAWS, seed=1, draws=BROKEN_DRAWS)
    assert tv(joint, _exact(LAWS)) > 2 * TV_BOUND


def iid_tree(laws: dict, g: torch.Generator) -> TokenTree:
    """Four i.i.d. draws from q_root at the root (SpecInfer's siblings): duplicates are frequent."""
    builder = TreeBuilder(budget=8)
    row = builder.add_q(laws["q_root"][None])
    for _ in range(4):
        builder.add_child(-1, int(sample(laws["q_root"], g)), Draw(row))
    return builder.build()


def test_dropping_drawn_duplicates_is_caught() -> None:
    """A tree that forgets a repeated draw of a token already proposed is biased: that draw's
    residual update is part of the exact rule (first-token law: 4 outcomes, a tighter bound)."""

    def forgetful(laws: dict, g: torch.Generator) -> TokenTree:
        tree = iid_tree(laws, g)
        seen: set[tuple[int, int]] = set()
        kept: list[Attempt] = []
        for attempt in tree.attempts:
            if (attempt.parent, attempt.node) not in seen:
                kept.append(attempt)
            seen.add((attempt.parent, attempt.node))
        return TokenTree(tree.tokens, tree.parents, kept, tree.q)

    laws = dict(LAWS, p_root=torch.tensor([0.05, 0.6, 0.3, 0.05]), q_root=torch.tensor([0.6, 0.3, 0.05, 0.05]))
    first = _joint(iid_tree, laws, seed=2).sum(dim=1)
    assert tv(first, laws["p_root"]) < FIRST_TV_BOUND
    broken = _joint(forgetful, laws, seed=2, draws=BROKEN_DRAWS).sum(dim=1)
    assert tv(broken, laws["p_root"]) > 2 * FIRST_TV_BOUND


# -- a chain is the chain rule ---------------------------------------------------------------------


def test_a_chain_tree_is_the_chain_rule() -> None:
    """One independent draw per node: the law of (accepted count, next token) is the textbook chain rule's."""
    g_tree, g_chain = torch.Generator().manual_seed(5), torch.Generator().manual_seed(6)
    draws = 3_000
    tree_law = torch.zeros(3, V)
    chain_law = torch.zeros(3, V)
    for _ in range(draws):
        tree = chain_tree(LAWS, g_tree)
        path, nxt = verify_tree_sampled(tree.tokens, tree.attempts, _targets(tree, LAWS), tree.q, g_tree)
        tree_law[len(path), nxt] += 1
        chain = chain_tree(LAWS, g_chain)
        accepted, nxt = chain_rule(chain.tokens, _targets(chain, LAWS), chain.q, g_chain)
        chain_law[accepted, nxt] += 1
    assert tv(tree_law / draws, chain_law / draws) < TV_BOUND  # two empirical laws over 12 outcomes: ~0.02


def test_deterministic_edges() -> None:
    """q = p is always accepted; a one-hot candidate with r(x) = 1 too; no candidate samples p."""
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.2, 0.3, 0.5, 0.0], [0.0, 0.0, 0.0, 1.0]])
    for _ in range(50):
        x = int(sample(p[0], g))
        path, nxt = verify_tree_sampled([x], [Attempt(-1, 0, Draw(0))], p, p[:1], g)
        assert path == [0] and nxt == 3
    sure = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    tokens, attempts = [0, 1], [Attempt(-1, 0), Attempt(-1, 1)]
    assert verify_tree_sampled(tokens, attempts, sure, None, g) == ([1], 0)
    assert verify_tree_sampled([], [], p[1:], None, g) == ([], 3)
