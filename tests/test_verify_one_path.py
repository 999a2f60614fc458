"""One verify path: a chain is a token tree with one branch, and every verifier runs chains and
trees through the same code (greedy: the argmax walk down the tree; sampled: tree rejection
sampling, which on a chain is the chain rule draw for draw)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from oracles import chain_rule
from tiny_models import random_prompt, tiny_model

from layerskip.drafts.base import Proposal, Verdict, chain_run
from layerskip.drafts.rules.token_tree import TreeBuilder
from layerskip.engine import verifiers
from layerskip.engine.verifiers import GreedyVerifier, HookedVerifier, SampledVerifier
from layerskip.hf.cache import model_cache
from layerskip.hf.forward import block_hidden, stack_forward
from layerskip.hf.tree import block_masks
from layerskip.sampling import Sampling

V = 6


class IdentityHead:
    """A verify head whose logits are the hidden states themselves (``[n+1, V]``)."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    def argmax(self, hidden: torch.Tensor) -> list[int]:
        return hidden.argmax(dim=-1).tolist()


def _one_hot_rows(targets: list[int]) -> torch.Tensor:
    """Logits ``[n+1, V]`` whose argmax at block position i is ``targets[i]``."""
    return torch.nn.functional.one_hot(torch.tensor(targets), V).float() * 5.0


def _tree() -> Proposal:
    """Chain 1 2 3, a sibling 4 of its second token, and a branch 5 0 from the root."""
    builder = TreeBuilder(8)
    builder.add_path([1, 2, 3])
    builder.add_path([1, 4])
    builder.add_path([5, 0])
    return Proposal(builder.build(), "lookup")


def _counting(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """Counts the calls of ``verifiers.<name>`` (the one rule every proposal goes through)."""
    calls: list[int] = []
    real: Callable = getattr(verifiers, name)

    def counted(*args: object) -> object:
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(verifiers, name, counted)
    return calls


def test_greedy_runs_a_chain_and_a_tree_through_one_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _counting(monkeypatch, "accept_tree_greedy")
    verifier = GreedyVerifier(IdentityHead())  # type: ignore[arg-type]
    chain = Proposal.chain([1, 2, 3], "skip")
    assert chain.tree.parents == [-1, 0, 1] and chain.tree.is_chain
    # The model agrees with 1 2, then wants 4: the chain keeps its first two nodes.
    verdict = verifier.verify(_one_hot_rows([1, 2, 4, 0]), chain, [])
    assert verdict == Verdict((0, 1), 4) and verdict.accepted == 2 and verdict.tokens(chain) == [1, 2, 4]
    tree = _tree()  # depth-first: 1 2 3 | 4 (under 1) | 5 0
    assert tree.tokens == [1, 2, 3, 4, 5, 0] and tree.tree.parents == [-1, 0, 1, 0, -1, 4]
    # Row i is the model's choice after block position i: after 1 it wants 4 (the sibling), then 2.
    targets = [1, 4, 0, 0, 2, 0, 0]
    verdict = verifier.verify(_one_hot_rows(targets), tree, [])
    assert verdict == Verdict((0, 3), 2) and verdict.tokens(tree) == [1, 4, 2]
    assert len(calls) == 2


def test_sampled_runs_a_chain_and_a_tree_through_one_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _counting(monkeypatch, "verify_tree_sampled")
    g = torch.Generator().manual_seed(0)
    verifier = SampledVerifier(IdentityHead(), Sampling(), g)  # type: ignore[arg-type]
    logits = torch.randn(4, V, generator=g)
    q = torch.randn(3, V, generator=g).softmax(-1)
    verifier.verify(logits, Proposal.chain([1, 2, 3], "skip", q), [])
    tree = _tree()
    verifier.verify(torch.randn(len(tree) + 1, V, generator=g), tree, [])
    assert len(calls) == 2


@pytest.mark.parametrize("drawn", [True, False], ids=["sampled chain", "deterministic chain"])
def test_a_sampled_chain_is_the_chain_rule_draw_for_draw(drawn: bool) -> None:
    """The same seed gives the same verdict as the textbook chain rule (``chain_rule``): a sampled
    draft's chain tested against its q rows, a lookup chain against one-hot rows."""
    laws = torch.Generator().manual_seed(3)
    for seed in range(200):
        p = torch.randn(4, V, generator=laws).mul(2).softmax(-1)
        q = torch.randn(3, V, generator=laws).mul(2).softmax(-1)
        tokens = torch.randint(V, (3,), generator=laws).tolist()
        proposal = Proposal.chain(tokens, "skip", q if drawn else None)
        verifier = SampledVerifier(IdentityHead(), Sampling(), torch.Generator().manual_seed(seed))  # type: ignore[arg-type]
        got = verifier.choose(p.log(), proposal)
        rows = q if drawn else torch.nn.functional.one_hot(torch.tensor(tokens), V).float()
        accepted, token = chain_rule(tokens, p, rows, torch.Generator().manual_seed(seed))
        assert (got.accepted, got.next_token) == (accepted, token), seed
        assert got.path == tuple(range(accepted))


def test_a_hook_sees_each_rows_text_for_a_chain_and_a_tree() -> None:
    seen: list[list[int]] = []

    def hook(context: list[int], logits: torch.Tensor) -> torch.Tensor:
        seen.append(list(context))
        return logits

    verifier = HookedVerifier(IdentityHead(), hook, None)  # type: ignore[arg-type]
    verdict = verifier.verify(_one_hot_rows([1, 2, 3, 0]), Proposal.chain([1, 2, 3], "lookup"), [9])
    assert verdict == Verdict((0, 1, 2), 0) and seen == [[9, 1, 2, 3]]  # a chain's rows in one call
    seen.clear()
    tree = _tree()
    verdict = verifier.verify(_one_hot_rows([5, 0, 0, 0, 0, 0, 4]), tree, [9])
    assert verdict == Verdict((4, 5), 4)
    assert seen == [[9], [9, 1], [9, 1, 2], [9, 1, 2, 3], [9, 1, 4], [9, 5], [9, 5, 0]]


def test_a_chain_learns_how_much_of_its_chain_held() -> None:
    """What a drafter reads back from a verdict on a tree built around its chain."""
    tree = _tree()
    assert chain_run(tree, Verdict((0, 1), 3), [1, 2, 3]) == (3, 2)
    assert chain_run(tree, Verdict((0, 3), 2), [1, 2, 3]) == (3, 1)  # the sibling held after the first
    assert chain_run(Proposal.chain([1, 2], "skip"), Verdict((0,), 7), [1, 2, 3]) == (2, 1)  # cut to two
    assert Verdict((0, 1, 2), 5).cut(1) == Verdict((0,), 5)


@torch.inference_mode()
def test_the_forward_of_a_chain_block_is_the_tree_forward() -> None:
    """``block_hidden`` runs a chain as the plain causal forward: the rows a tree mask gives."""
    model = tiny_model("llama")
    prompt = random_prompt(length=10)
    block = torch.tensor([[prompt[-1], 5, 7, 9]])
    hidden = []
    for masked in (False, True):
        cache = model_cache(model)
        block_hidden(model, torch.tensor([prompt[:-1]]), cache)
        if masked:  # the tree mask's path, forced
            masks, where = block_masks(model, cache.lengths, [[-1, 0, 1]], 4, block.device)
            hidden.append(stack_forward(model, block, cache, where, masks)[0])
        else:
            hidden.append(block_hidden(model, block, cache, [[-1, 0, 1]])[0])
    torch.testing.assert_close(hidden[0], hidden[1], rtol=1e-4, atol=1e-5)
