"""Token trees as values: merging candidates, depth-first order, budgets, lookup matches, siblings."""

from __future__ import annotations

import pytest
import torch
from drawn_siblings import sampled_siblings

from layerskip.drafts.drafters.branching import (
    Sibling,
    add_siblings,
    ranked_siblings,
    uncertain_positions,
)
from layerskip.drafts.drafters.lookup import LookupMatch, match_lookup, match_lookups
from layerskip.drafts.rules.token_tree import ChainNodes, TokenTree, TreeBuilder
from layerskip.hf.tree import block_depths, block_visibility
from layerskip.sampling import DETERMINISTIC, ROOT, Attempt, Draw, accept_tree_greedy


def tree_from_candidates(candidates: list[list[int]], budget: int) -> TokenTree:
    """Deterministic candidates in priority order, merged into one tree by ``TreeBuilder.add_path``."""
    builder = TreeBuilder(budget)
    for candidate in candidates:
        builder.add_path(candidate)
    return builder.build()


# -- merging ---------------------------------------------------------------------------------------


def test_candidates_merge_on_shared_prefixes_in_depth_first_order() -> None:
    tree = tree_from_candidates([[1, 2, 3], [1, 4], [5, 6], [1, 2, 7], [5]], budget=10)
    #        root
    #       /    \
    #      1      5
    #     / \     |
    #    2   4    6
    #   / \
    #  3   7
    assert tree.tokens == [1, 2, 3, 7, 4, 5, 6]
    assert tree.parents == [ROOT, 0, 1, 1, 0, ROOT, 5]
    assert block_depths(tree.parents) == [0, 1, 2, 3, 3, 2, 1, 2]  # the root, then each node
    assert tree.children() == [0, 5] and tree.children(1) == [2, 3]
    assert [a.node for a in tree.attempts if a.parent == 1] == [2, 3] and not tree.is_chain
    assert tree_from_candidates([[1, 2, 3], [1, 2]], budget=5).is_chain
    assert tree.path(3) == [0, 1, 3] and tree.path_tokens(3) == [1, 2, 7] and tree.path(ROOT) == []
    assert TokenTree.block_rows([0, 1, 3]) == [0, 1, 2, 4]
    visible = block_visibility(tree.parents)
    assert visible[4].tolist() == [True, True, True, False, True, False, False, False]  # node 3: root, 1, 2, itself
    # Deterministic candidates: one attempt per node, duplicates dropped.
    assert [a.node for a in tree.attempts] == [0, 1, 2, 4, 5, 6, 3]
    assert all(a.proposal == DETERMINISTIC for a in tree.attempts)


def test_the_first_candidate_is_the_chain_block() -> None:
    tree = tree_from_candidates([[4, 5, 6], [4, 7], [8]], budget=8)
    assert tree.tokens[:3] == [4, 5, 6] and tree.parents[:3] == [ROOT, 0, 1]


def test_budget_cuts_candidates_but_merging_is_free() -> None:
    tree = tree_from_candidates([[1, 2, 3], [4, 5], [1, 2, 6], [1, 2]], budget=4)
    assert tree.tokens == [1, 2, 3, 4]  # [4, 5] cut after 4; [1, 2, 6] merges [1, 2], 6 does not fit
    assert tree_from_candidates([[1, 2]], budget=0).tokens == []


def test_drawn_duplicates_stay_attempts() -> None:
    """A sampled draft token that merges into a lookup node is one more draw the verify replays."""
    builder = TreeBuilder(budget=6)
    builder.add_path([3, 4])  # a lookup match
    chain = builder.add_chain([3, 9], torch.full((2, 10), 0.1))  # the draft drew 3 too, then 9
    assert chain == ChainNodes([0, 2], 0)
    assert builder.add_child(ROOT, 3) == 0  # a deterministic duplicate: merged, no new attempt
    tree = builder.build()
    assert tree.tokens == [3, 4, 9] and tree.q.shape == (2, 10)
    assert tree.attempts == [
        Attempt(ROOT, 0, DETERMINISTIC),
        Attempt(0, 1, DETERMINISTIC),
        Attempt(ROOT, 0, Draw(0)),
        Attempt(0, 2, Draw(1)),
    ]


def test_a_full_tree_refuses_every_draw() -> None:
    """Whether a drawn token is tested must not depend on the token: when full, duplicates are refused too."""
    builder = TreeBuilder(budget=1)
    builder.add_chain([3], torch.full((1, 10), 0.1))
    assert builder.full
    assert builder.add_child(ROOT, 3, Draw(0)) is None
    assert builder.add_child(ROOT, 3) == 0  # deterministic merges still walk the tree
    assert builder.add_child(ROOT, 4) is None
    with pytest.raises(ValueError):
        builder.add_child(5, 1)


def test_greedy_acceptance_follows_the_argmax() -> None:
    tree = tree_from_candidates([[1, 2, 3], [1, 4], [5, 6]], budget=10)  # tokens [1, 2, 3, 4, 5, 6]
    #            block positions: root  1  2  3  4  5  6
    assert accept_tree_greedy(tree.tokens, tree.parents, [1, 4, 0, 0, 9, 0, 0]) == ([0, 3], 9)
    assert accept_tree_greedy(tree.tokens, tree.parents, [5, 0, 0, 0, 0, 6, 8]) == ([4, 5], 8)
    assert accept_tree_greedy(tree.tokens, tree.parents, [1, 2, 3, 7, 0, 0, 0]) == ([0, 1, 2], 7)
    assert accept_tree_greedy(tree.tokens, tree.parents, [8, 0, 0, 0, 0, 0, 0]) == ([], 8)
    assert accept_tree_greedy([], [], [3]) == ([], 3)


# -- lookup matches --------------------------------------------------------------------------------


def test_lookup_matches_are_distinct_longest_then_latest() -> None:
    history = [1, 2, 3, 9, 4, 2, 3, 7, 8, 5, 3, 6, 1, 2, 3]
    matches = match_lookups(history, 1, 3, 2, max_matches=8)
    assert matches == [
        LookupMatch([9, 4], 3),  # [1, 2, 3] at 0
        LookupMatch([7, 8], 2),  # [2, 3] at 5 (the one at 1 continues as [9, 4]: skipped)
        LookupMatch([6, 1], 1),  # [3] at 10, then at 6 and 2 (skipped)
    ]
    assert matches[0] == match_lookup(history, 1, 3, 2)
    assert match_lookups(history, 1, 3, 2, max_matches=2) == matches[:2]
    assert match_lookups([5, 6, 7], 1, 3, 4, max_matches=3) == []


def test_lookup_matches_skip_prefixes_of_earlier_ones() -> None:
    # [4] is followed by [5, 6] (latest), [5] (a prefix: skipped), [7, 5].
    history = [4, 7, 5, 4, 5, 6, 4, 5, 0, 4]
    assert [m.tokens for m in match_lookups(history, 1, 1, 2, max_matches=5)] == [[5, 0], [5, 6], [7, 5]]


# -- siblings where the draft is unsure ------------------------------------------------------------


def test_ranked_siblings_at_narrow_margins() -> None:
    chain = [10, 20, 30]
    top_tokens = torch.tensor([[10, 11, 12], [21, 20, 22], [30, 31, 32]])
    top_probs = torch.tensor([[0.9, 0.05, 0.01], [0.4, 0.35, 0.1], [0.5, 0.3, 0.1]])
    assert uncertain_positions(top_probs, 0.25) == [1, 2]
    siblings = ranked_siblings(chain, top_tokens, top_probs, margin=0.25, width=2)
    assert siblings == [Sibling(1, 21), Sibling(2, 31)]  # the chain token itself is never a sibling
    wide = ranked_siblings(chain, top_tokens, top_probs, margin=0.25, width=3)
    assert wide == [Sibling(1, 21), Sibling(1, 22), Sibling(2, 31), Sibling(2, 32)]

    builder = TreeBuilder(budget=5)
    nodes = builder.add_chain(chain)
    assert nodes == ChainNodes([0, 1, 2], None)
    assert add_siblings(builder, nodes, wide) == [3, 4]  # the budget: two siblings fit
    tree = builder.build()
    assert tree.tokens == [10, 20, 30, 21, 22] and tree.parents == [ROOT, 0, 1, 0, 0]


def test_sampled_siblings_are_draws_without_replacement() -> None:
    q = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.9, 0.1, 0.0, 0.0], [0.3, 0.3, 0.2, 0.2]])
    chain = [1, 0, 2]
    g = torch.Generator().manual_seed(0)
    siblings = sampled_siblings(chain, q, margin=0.2, width=4, generator=g)
    # Position 0: only token 0 is left; position 1 is sure; position 2: three draws of {0, 1, 3}.
    assert siblings[0] == Sibling(0, 0, drawn=True)
    assert [s.position for s in siblings] == [0, 2, 2, 2]
    assert sorted(s.token for s in siblings[1:]) == [0, 1, 3]

    builder = TreeBuilder(budget=10)
    builder.add_q(torch.zeros(1, 4))  # rows of another chain first: this chain's q rows start at 1
    nodes = builder.add_chain(chain, q)
    assert nodes.q_offset == 1
    add_siblings(builder, nodes, siblings)
    tree = builder.build()
    drawn = [a for a in tree.attempts if a.proposal.without_replacement]
    assert len(drawn) == 4 and {a.proposal.q_row for a in drawn} == {1, 3}
    # Siblings of a chain token that is not in the tree are left out.
    short = TreeBuilder(budget=10)
    assert add_siblings(short, short.add_chain(chain[:2], q[:2]), siblings) == [2]
    # A full tree takes no drawn sibling.
    full = TreeBuilder(budget=3)
    assert add_siblings(full, full.add_chain(chain, q), siblings) == []
    with pytest.raises(ValueError, match="sampled chain"):
        greedy = TreeBuilder(4)
        add_siblings(greedy, greedy.add_chain([1]), [Sibling(0, 2, drawn=True)])
