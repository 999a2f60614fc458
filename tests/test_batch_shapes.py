"""Everything one prompt can do, a batch does: token trees, exit-adapter drafts, sampling and
streaming in batches of 2, 4 and 8 rows (one stepper serves them all), each greedy row token for
token what HF ``generate`` gives that prompt, each sampled row its own distribution."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from compare import assert_same_tokens, chain_rule_as_tree, hf_greedy
from test_exit_draft import exit_policy
from test_sampling import E2E_SEEDS, E2E_TV_BOUND, E2E_VOCAB, _e2e_model, _exact_laws, always_accept, tv
from tiny_models import ARCHS, random_prompt, tiny_model

from layerskip.drafts.drafters import exit_draft
from layerskip.drafts.policy.skip_policy import DraftSettings, SkipPolicy
from layerskip.engine import verifiers
from layerskip.engine.decoding import Decoder, DecodeSettings
from layerskip.sampling import Sampling

NEW_TOKENS = 16
TREE = SkipPolicy(
    skip_attention=(1,), skip_mlp=(2,), draft=DraftSettings(max_draft_tokens=4, tree_siblings=2, tree_margin=0.9)
)
LOOKUP_TREE = SkipPolicy(
    draft=DraftSettings(lookup_max_ngram=2, lookup_min_ngram=1, tree_matches=3, max_draft_tokens=4)
)


@functools.cache
def _model(arch: str) -> torch.nn.Module:
    return tiny_model(arch)


def _prompts(rows: int) -> list[list[int]]:
    # Repeats inside each prompt (lookup finds matches); lengths differ, so the rows are ragged.
    return [random_prompt(128, 3 + 2 * r, seed=40 + r) * 2 for r in range(rows)]


@functools.cache
def _reference(arch: str, prompt: tuple[int, ...]) -> tuple[list[int], torch.Tensor]:
    return hf_greedy(_model(arch), list(prompt), NEW_TOKENS)


def _check_rows(arch: str, policy: SkipPolicy, rows: int, label: str) -> list:
    prompts = _prompts(rows)
    results = Decoder.for_policy(_model(arch), policy).decode_batch(
        prompts, DecodeSettings(NEW_TOKENS, eos_token_ids=())
    )
    for r, ((tokens, _), prompt) in enumerate(zip(results, prompts, strict=True)):
        ref, logits = _reference(arch, tuple(prompt))
        assert_same_tokens(tokens, ref, ref_logits=logits, label=f"{label} {arch} row {r} of {rows}")
    return results


@pytest.mark.parametrize("arch", ARCHS)
def test_token_trees_in_a_batch_of_four(arch: str) -> None:
    results = _check_rows(arch, TREE, 4, "skip tree")
    assert sum(stats.tree_steps for _, stats in results) > 0  # trees really went into the batch's verify


@pytest.mark.parametrize("rows", [2, 8])
@pytest.mark.parametrize("policy", [TREE, LOOKUP_TREE], ids=["skip-tree", "lookup-tree"])
def test_token_trees_in_batches_of_two_and_eight(rows: int, policy: SkipPolicy) -> None:
    _check_rows("gemma3_text", policy, rows, "tree")


@pytest.mark.parametrize("rows", [2, 4, 8])
@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "gpt2"])
def test_exit_adapter_drafts_in_batches(arch: str, rows: int, tmp_path: Path) -> None:
    results = _check_rows(arch, exit_policy(_model(arch), tmp_path, "linear"), rows, "exit")
    assert sum(stats.drafted for _, stats in results) > 0


SHAPING = [("linear", True), ("layer", False), ("layer", True)]


@pytest.mark.parametrize("rows", [2, 4, 8])
@pytest.mark.parametrize(("kind", "reuse"), SHAPING, ids=[f"{k}-{'reuse' if r else 'recompute'}" for k, r in SHAPING])
def test_exit_drafts_that_shape_the_verify_run_in_batches(
    kind: str, reuse: bool, rows: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reused shallow K/V and a layer adapter's own K/V enter the batch's one verify for every row."""
    entered, filled = [], []
    enter, fill = exit_draft.entering_after_exit, exit_draft.fill_adapter_cache

    def entering(model: torch.nn.Module, layer: int, hidden: torch.Tensor) -> object:
        entered.append(hidden.shape)  # [B, q, H]
        return enter(model, layer, hidden)

    def filling(*args: object) -> None:
        filled.append(args[2].shape)  # the block, [B, q]
        fill(*args)

    monkeypatch.setattr(exit_draft, "entering_after_exit", entering)
    monkeypatch.setattr(exit_draft, "fill_adapter_cache", filling)
    results = _check_rows("llama", exit_policy(_model("llama"), tmp_path, kind, reuse), rows, f"exit {kind}")
    assert sum(stats.drafted for _, stats in results) > 0
    if reuse:  # the rows' own drafts ran (each kind is tried once): every row entered after the exit layer
        assert any(shape[0] == rows for shape in entered), entered
    if kind == "layer" and not reuse:  # every verify of the whole batch fills the adapter's K/V
        assert filled and filled[0][0] == rows
    else:
        assert kind == "layer" or not filled


def test_each_row_streams_its_own_tokens() -> None:
    prompts = _prompts(3)
    streamed: list[list[int]] = [[] for _ in prompts]
    decoder = Decoder.for_policy(_model("llama"), TREE)
    results = decoder.decode_batch(
        prompts, DecodeSettings(NEW_TOKENS, eos_token_ids=()), on_tokens=[streamed[r].extend for r in range(3)]
    )
    assert [tokens for tokens, _ in results] == streamed


def _tree_law() -> tuple[torch.Tensor, torch.Tensor, int]:
    """Token 2's law over four rows of one prompt, a lookup tree (three continuations of the last
    token) verified every step; the exact law; the tree steps."""
    model = _e2e_model()
    # Every token the first new one can be is followed by three distinct tokens somewhere in the
    # prompt: whatever it is, lookup proposes a tree of three continuations for token 2.
    prompt = [t for v in range(E2E_VOCAB) for c in (3, 5, 9) for t in (v, (v * c + c) % E2E_VOCAB)]
    _, p2, _ = _exact_laws(model, prompt)
    decoder = Decoder.for_policy(model, LOOKUP_TREE)
    laws = torch.zeros(E2E_VOCAB)
    trees = 0
    for seed in range(E2E_SEEDS // 4):
        settings = DecodeSettings(max_new_tokens=3, sampling=Sampling(), seed=4 * seed, eos_token_ids=())
        for tokens, stats in decoder.decode_batch([prompt] * 4, settings):
            laws[tokens[1]] += 1
            trees += stats.tree_steps
    return laws / (4 * (E2E_SEEDS // 4)), p2, trees


def test_sampled_trees_in_a_batch_keep_each_rows_distribution() -> None:
    law, exact, trees = _tree_law()
    assert trees > 0
    assert tv(law, exact) < E2E_TV_BOUND


def test_sampled_trees_in_a_batch_with_always_accept_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same test catches a verify that keeps every draft."""
    monkeypatch.setattr(verifiers, "verify_tree_sampled", chain_rule_as_tree(always_accept))
    law, exact, _ = _tree_law()
    assert tv(law, exact) > E2E_TV_BOUND


def test_a_batch_pads_its_verify_only_by_whole_columns() -> None:
    """A policy's verify padding counts a batch's products (rows x width) and pads them only as far
    as whole columns reach the padded count: three rows' plain step (3 products) under a pad to 5
    stays one column wide, where rounding up verified two."""
    model = tiny_model("llama")
    policy = SkipPolicy(skip_attention=(1,), draft=DraftSettings(max_draft_tokens=3, min_verify_block=5))
    prompts = [random_prompt(length=7 + r, seed=r) for r in range(3)]
    decoder = Decoder.for_policy(model, policy)
    asked = []
    original = decoder.draft.verify_block

    def verify_block(positions: int, committed: int) -> int:
        asked.append((positions, original(positions, committed)))
        return asked[-1][1]

    decoder.draft.verify_block = verify_block
    results = decoder.decode_batch(prompts, DecodeSettings(max_new_tokens=12))
    assert asked[0] == (3, 5)  # the first step is a plain one, its 3 products padded to 5 ...
    for (tokens, stats), prompt in zip(results, prompts, strict=True):
        reference, logits = hf_greedy(model, prompt, 12)
        assert_same_tokens(tokens, reference, ref_logits=logits)
        assert 1 in stats.block_histogram  # ... and it ran one column wide
