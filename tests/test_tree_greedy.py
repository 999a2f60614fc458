"""Greedy decoding with token trees is exact: token for token HF ``generate``'s, on every tiny architecture.

A small self-contained loop (the engine's integration comes later) drives the primitives: each
step merges deliberately mixed candidates into one tree (prompt-lookup matches, a skip draft's
greedy chain with its ranked siblings where its top-2 margin is narrow, and an oracle candidate
that is right for a random number of tokens and then wrong, at a random priority), verifies it
in one forward, accepts the longest argmax path and keeps its K/V. 30 new tokens from an 8-token
prompt run far past the sliding window (4) of Mistral / Gemma 2 / Gemma 3.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from compare import assert_same_tokens, hf_greedy
from oracles import is_bypassed
from tiny_models import ARCHS, VOCAB, random_prompt, tiny_model

from layerskip.drafts.drafters.branching import add_siblings, ranked_siblings
from layerskip.drafts.drafters.lookup import match_lookups
from layerskip.drafts.rules.token_tree import TokenTree, TreeBuilder
from layerskip.hf import adapters
from layerskip.hf.cache import RollbackCache
from layerskip.hf.forward import block_hidden, full_hidden
from layerskip.sampling import accept_tree_greedy

NEW_TOKENS = 30
BUDGET = 16
DRAFT_TOKENS = 4
MARGIN = 0.5  # siblings where the draft's top-2 probabilities are closer than this


@dataclass
class TreeRun:
    tokens: list[int]
    steps: int = 0  # verify forwards
    accepted: int = 0  # tree tokens accepted
    gathered: int = 0  # steps whose accepted path was not already in place (keep_paths moved K/V)
    off_first: int = 0  # steps that accepted a node outside the tree's first branch


Propose = Callable[[list[int], int], TokenTree]


@torch.inference_mode()
def tree_decode(model: torch.nn.Module, prompt: list[int], new_tokens: int, propose: Propose) -> TreeRun:
    """Greedy decoding, one token tree per step; ``propose(history, produced)`` builds the tree."""
    cache = RollbackCache(adapters.sliding_windows(model))
    full_hidden(model, torch.tensor([prompt[:-1]]), cache, 1)  # all but the pending token
    history = list(prompt)
    run = TreeRun(tokens=[])
    while len(run.tokens) < new_tokens:
        start = len(history) - 1  # committed tokens; the pending one is history[-1]
        tree = propose(history, len(run.tokens))
        block = torch.tensor([[history[-1], *tree.tokens]])  # [1, n+1]
        hidden = block_hidden(model, block, cache, [tree.parents])[0]  # [n+1, H]
        targets = adapters.logits_from_hidden(model, hidden).argmax(dim=-1).tolist()
        path, nxt = accept_tree_greedy(tree.tokens, tree.parents, targets)
        rows = TokenTree.block_rows(path)
        cache.keep_paths([start], [rows])
        new = [tree.tokens[i] for i in path] + [nxt]
        history += new
        run.tokens += new
        run.steps += 1
        run.accepted += len(path)
        run.gathered += rows != list(range(len(rows)))
        run.off_first += any(node != depth for depth, node in enumerate(path))
        assert cache.longest == len(history) - 1
    run.tokens = run.tokens[:new_tokens]
    return run


def skip_draft(model: torch.nn.Module, history: list[int]) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """A greedy draft of the model with sublayers bypassed (no cache: it is a test): its chain and
    its top-3 tokens and probabilities at each position, ``[k, 3]`` each."""
    chain: list[int] = []
    top_tokens, top_probs = [], []
    with adapters.bypass(model, attention=(1,), mlp=(2,)):
        for _ in range(DRAFT_TOKENS):
            logits = model(input_ids=torch.tensor([history + chain])).logits[0, -1]
            top = logits.softmax(-1).topk(3)
            top_tokens.append(top.indices)
            top_probs.append(top.values)
            chain.append(int(top.indices[0]))
    return chain, torch.stack(top_tokens), torch.stack(top_probs)


def mixed_proposer(model: torch.nn.Module, reference: list[int], seed: int) -> Propose:
    generator = torch.Generator().manual_seed(seed)

    def propose(history: list[int], produced: int) -> TokenTree:
        truth = reference[produced:]
        right = int(torch.randint(0, 5, (), generator=generator))
        oracle = truth[:right] + [(truth[right] + 1) % VOCAB if right < len(truth) else 0, 3, 4]
        candidates: list[list[int]] = [m.tokens for m in match_lookups(history, 1, 3, 4, max_matches=2)]
        candidates.insert(int(torch.randint(0, len(candidates) + 1, (), generator=generator)), oracle)
        builder = TreeBuilder(BUDGET)
        chain, top_tokens, top_probs = skip_draft(model, history)
        draft_first = bool(torch.randint(0, 2, (), generator=generator))
        if draft_first:
            nodes = builder.add_chain(chain)
        for candidate in candidates:
            builder.add_path(candidate)
        if not draft_first:
            nodes = builder.add_chain(chain)
        add_siblings(builder, nodes, ranked_siblings(chain, top_tokens, top_probs, MARGIN, width=3))
        return builder.build()

    return propose


@functools.cache
def _model(arch: str) -> torch.nn.Module:
    return tiny_model(arch)


@functools.cache
def _reference(arch: str) -> tuple[list[int], torch.Tensor]:
    return hf_greedy(_model(arch), random_prompt(), NEW_TOKENS)


@pytest.mark.parametrize("arch", ARCHS)
def test_tree_greedy_matches_hf(arch: str) -> None:
    model = _model(arch)
    ref, logits = _reference(arch)
    run = tree_decode(model, random_prompt(), NEW_TOKENS, mixed_proposer(model, ref, seed=ARCHS.index(arch)))
    assert_same_tokens(run.tokens, ref, ref_logits=logits, label=f"{arch} tree")
    assert not is_bypassed(model)
    # The trees did their work: multi-token steps, some through later branches (K/V gathered).
    assert run.steps < NEW_TOKENS - 5
    assert run.off_first > 0 and run.gathered > 0


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_a_tree_of_wrong_candidates_is_plain_decoding(arch: str) -> None:
    """Nothing right in the tree: every step commits just the model's own token, still exact."""
    model = _model(arch)
    ref, logits = _reference(arch)

    def wrong(history: list[int], produced: int) -> TokenTree:
        builder = TreeBuilder(BUDGET)
        avoid = ref[produced]
        for first in range(3):
            builder.add_path([(avoid + 1 + first) % VOCAB, 7, 8])
        return builder.build()

    run = tree_decode(model, random_prompt(), NEW_TOKENS, wrong)
    assert_same_tokens(run.tokens, ref, ref_logits=logits, label=f"{arch} wrong trees")
    assert run.steps == NEW_TOKENS and run.accepted == 0
