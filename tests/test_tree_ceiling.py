"""The token-tree ceiling: each step scored against the text the model produced, and the recording
drafter that gathers the steps while decoding exactly as plain greedy decoding does."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import torch
from cli_helpers import assert_bad_input, run_script
from compare import assert_same_tokens, hf_greedy
from tiny_models import random_prompt, tiny_model

from layerskip.drafts.base import Proposal
from layerskip.drafts.builder import DraftRun
from layerskip.drafts.drafters.lookup import LookupMatch
from layerskip.drafts.policy.skip_policy import SkipPolicy
from layerskip.drafts.rules.token_tree import TreeBuilder
from layerskip.engine.decoding import Decoder, DecodeSettings
from layerskip.measure.tree_ceiling import (
    RecordingDrafter,
    StepRecord,
    TreeCeiling,
    agreement,
    first_branch,
    tree_agreement,
)


def test_agreement_counts_the_leading_tokens_the_text_continued_with() -> None:
    assert agreement([5, 6, 7], [5, 6, 9, 7]) == 2
    assert agreement([], [1]) == 0
    assert agreement([1, 2], [1]) == 1


def test_a_failed_skip_chain_is_scored_by_its_siblings_rank() -> None:
    # Text: prompt [1, 2, 3] then 10, 11, 12. The chain [10, 20] failed at position 1; the model's
    # token 11 was the draft's third choice there (its second other one).
    text = [1, 2, 3, 10, 11, 12]
    record = StepRecord(3, "skip", [10, 20], alternatives=[[10, 30, 31], [20, 40, 11]], accepted=1)
    ceiling = TreeCeiling(widths=(2, 3))
    ceiling.add([record], text, ngrams=(2, 3), max_tokens=8, matches=4)
    assert (ceiling.steps, ceiling.tokens, ceiling.skip_failures) == (1, 2, 1)
    assert ceiling.sibling_hits == {2: 0, 3: 1}
    assert ceiling.combined == 1 and ceiling.lookup_under_skip == 0
    summary = ceiling.summary()
    assert summary["extra_tokens_per_step"]["siblings (width 3)"] == 1.0
    assert summary["sibling_fixes_failure"] == {"2": 0.0, "3": 1.0}
    assert ceiling.verifies_saved == 0  # no step after it to carry as a branch


def test_a_sibling_hit_followed_by_its_next_step_saves_a_verify() -> None:
    text = [1, 2, 3, 10, 11, 12, 13, 14]
    failed = StepRecord(3, "skip", [10, 20], alternatives=[[10, 30], [20, 11]], accepted=1)
    following = StepRecord(5, "skip", [12, 13], alternatives=[[12, 1], [13, 1]], accepted=2)
    ceiling = TreeCeiling(widths=(2,))
    ceiling.add([failed, following], text, ngrams=(2, 3), max_tokens=8, matches=4)
    assert (ceiling.steps, ceiling.tokens, ceiling.verifies_saved) == (2, 5, 1)
    assert ceiling.tau_with_sibling_branches == 5.0  # both steps' tokens in one verify


def test_a_chain_that_held_leaves_nothing_for_a_tree() -> None:
    record = StepRecord(2, "skip", [7, 8], alternatives=[[7, 1], [8, 1]], accepted=2)
    ceiling = TreeCeiling()
    ceiling.add([record], [4, 5, 7, 8, 9], ngrams=(2, 3), max_tokens=8, matches=4)
    assert ceiling.skip_failures == 0 and ceiling.combined == 0


def test_lookup_steps_are_scored_against_every_match() -> None:
    # The history ends in "1 2", which was followed once by "5 6" (latest, the first match) and
    # earlier by "3 4 9"; the text goes on "3 4 9". The chain proposed "5" and was rejected.
    history = [1, 2, 3, 4, 9, 1, 2, 5, 6, 1, 2]
    text = [*history, 3, 4, 9]
    record = StepRecord(len(history), "lookup", [5], accepted=0)
    ceiling = TreeCeiling()
    ceiling.add([record], text, ngrams=(2, 2), max_tokens=3, matches=4)
    assert ceiling.lookup_steps == 1
    assert ceiling.other_matches == 3 and ceiling.combined == 3
    assert ceiling.longer_runs == 0  # the first match was wrong at once: cutting it cost nothing
    assert ceiling.matches_in_budget == 3  # both matches fit in 24 nodes


def test_tree_agreement_counts_only_what_fits_the_budget() -> None:
    matches = [LookupMatch([5, 6], 2), LookupMatch([3, 4, 9], 2)]
    assert tree_agreement(matches, 24, [3, 4, 9, 1]) == 3
    assert tree_agreement(matches, 3, [3, 4, 9, 1]) == 1  # [5, 6] and the first token of the second
    assert tree_agreement(matches, 24, [5, 7]) == 1
    assert tree_agreement([], 24, [5]) == 0


def test_a_cut_run_is_counted_apart_from_trees() -> None:
    history = [1, 2, 3, 4, 5, 1, 2]
    text = [*history, 3, 4, 5]
    record = StepRecord(len(history), "lookup", [3], accepted=1)  # the run "3 4 5" cut to one token
    ceiling = TreeCeiling()
    ceiling.add([record], text, ngrams=(2, 2), max_tokens=3, matches=4)
    assert ceiling.longer_runs == 2 and ceiling.other_matches == 0 and ceiling.combined == 0


def test_first_branch_is_the_chain_a_tree_was_built_around() -> None:
    builder = TreeBuilder(8)
    builder.add_path([4, 5, 6])
    builder.add_path([4, 9])
    builder.add_path([7])
    tree = builder.build()
    chain = first_branch(Proposal(tree, "lookup"))
    assert chain.tokens == [4, 5, 6] and chain.tree.is_chain and chain.source == "lookup"
    plain = Proposal.chain([1, 2], "skip")
    assert first_branch(plain) is plain


@torch.inference_mode()
def test_recording_drafter_decodes_exactly_and_records_every_step() -> None:
    model = tiny_model("llama")
    base = random_prompt(seed=5)
    prompt = (base * 3)[:20]  # n-grams that repeat: lookup steps as well as skip drafts
    reference, logits = hf_greedy(model, prompt, 32)
    auto = SkipPolicy.auto_trees()
    policy = replace(auto, draft=replace(auto.draft, tree_siblings=3, tree_matches=4))
    decoder = Decoder.for_policy(model, policy)
    assert decoder.draft is not None
    drafter = RecordingDrafter(decoder.draft.start(DraftRun(len(prompt), 32)))
    tokens, stats = decoder.decode(prompt, DecodeSettings(max_new_tokens=32), drafter=drafter)
    assert_same_tokens(tokens, reference, ref_logits=logits, label="recording drafter")
    assert stats.tree_steps == 0  # trees were cut to their first branch
    # Every step but the prefill is recorded, except those with no budget left to draft (the
    # drafter is not asked; such a step yields the model's token alone).
    unasked = stats.steps - 1 - len(drafter.records)
    assert 0 <= unasked <= 1
    assert 1 + sum(r.accepted + 1 for r in drafter.records) + unasked == len(tokens)
    skip = [r for r in drafter.records if r.source == "skip" and r.chain]
    assert skip and all(r.alternatives is not None and len(r.alternatives) == len(r.chain) for r in skip)
    assert all(len(row) == 4 for r in skip for row in r.alternatives or [])
    ceiling = TreeCeiling()
    ceiling.add(drafter.records, prompt + tokens, ngrams=(2, 3), max_tokens=16, matches=4)
    assert ceiling.steps == len(drafter.records)
    assert ceiling.tokens == sum(r.accepted + 1 for r in drafter.records)


def test_the_script_checks_out_before_any_work(tmp_path: Path) -> None:
    """An --out that is a file, or that holds a FIFO where a result goes, is refused before the model
    loads (a model that does not exist would answer "unknown model" otherwise): it used to do all
    its work first, then end in FileExistsError."""
    taken = tmp_path / "taken"
    taken.write_text("mine")
    (tmp_path / "out").mkdir()
    os.mkfifo(tmp_path / "out" / "tree_ceiling.md")
    for out, fragment in ((taken, "is a file"), (tmp_path / "out", "not a regular file")):
        result = run_script("tree_ceiling.py", "--model", str(tmp_path / "no-model"), "--out", str(out))
        assert_bad_input(result, "--out", fragment)
    assert taken.read_text() == "mine" and [p.name for p in (tmp_path / "out").iterdir()] == ["tree_ceiling.md"]
