"""Prompt lookup: matching, the learned run-length cut, and the search's exact replay of lookup drafting."""

from __future__ import annotations

import pytest
from tiny_models import random_prompt, tiny_model

from layerskip.drafts.drafters.lookup import LookupMatch, LookupRunLength, continuation, match_lookup
from layerskip.drafts.policy.skip_policy import DraftSettings, SkipPolicy
from layerskip.engine.decoding import DecodeSettings, decode
from layerskip.measure.agreement import Reference, simulate_greedy


def test_match_prefers_the_longest_then_the_latest_ngram() -> None:
    history = [1, 2, 3, 9, 2, 3, 7, 8, 1, 2, 3]
    assert match_lookup(history, 1, 3, 2) == LookupMatch([9, 2], 3)  # [1, 2, 3] occurred at 0
    assert match_lookup(history, 1, 2, 2) == LookupMatch([7, 8], 2)  # latest [2, 3] is at 4
    assert match_lookup([5, 6, 7], 1, 3, 4).tokens == []


def test_a_match_reaching_the_present_repeats_with_its_period() -> None:
    # "13-13-13-": the latest [13, 45] is one period (2 tokens) back; its continuation runs into
    # the present and goes on as the loop does, rather than stopping after one period.
    history = [7, 13, 45, 13, 45, 13, 45]
    assert match_lookup(history, 2, 2, 5) == LookupMatch([13, 45, 13, 45, 13], 2)
    assert continuation([1, 2, 3, 4, 2, 3], 3, 6) == [4, 2, 3, 4, 2, 3]  # after [2, 3] at 1: period 3
    assert continuation([1, 2, 3, 4, 2, 3], 3, 2) == [4, 2]  # the history holds all of it
    # A match whose continuation the history already holds is not extended.
    assert match_lookup([1, 2, 9, 8, 7, 1, 2], 2, 2, 3) == LookupMatch([9, 8, 7], 2)


def _score(cut: LookupRunLength, match: LookupMatch, actual: list[int]) -> None:
    """Track ``match`` at the end of a history, then let the history continue with ``actual``."""
    history = [0, 0, 0]
    cut.track(match, len(history))
    cut.observe(history + actual)


def test_run_length_learns_where_runs_fail() -> None:
    cut = LookupRunLength(0.2)
    match = LookupMatch([10, 11, 12, 13, 14, 15], 2)
    # Uniform prior: 1/2, 1/4 pass 0.2, 1/8 does not.
    assert cut.cut(match) == [10, 11]
    for _ in range(6):  # the first token of 2-gram runs is always wrong
        _score(cut, LookupMatch([10, 11], 2), [99, 11])
    assert cut.cut(match) == []
    assert cut.cut(LookupMatch([10, 11, 12], 3)) == [10, 11]  # other n-gram lengths keep their prior
    for _ in range(20):  # 3-gram runs are right three tokens long
        _score(cut, LookupMatch([10, 11, 12], 3), [10, 11, 12])
    # Positions 0-2 at 21/22 each, then never-reached positions at the prior 1/2: 0.87, 0.43, 0.22, 0.11.
    assert cut.cut(LookupMatch([10, 11, 12, 13, 14, 15], 3)) == [10, 11, 12, 13, 14]
    assert LookupRunLength(0.0).cut(match) == match.tokens  # 0: never cut


def test_only_reached_positions_are_counted() -> None:
    cut = LookupRunLength(0.1)
    _score(cut, LookupMatch([5, 6, 7, 8], 1), [5, 9, 7, 8])  # right, then wrong: positions 2, 3 never reached
    assert cut.reached == {(1, 0): 1, (1, 1): 1} and cut.right == {(1, 0): 1}
    assert cut.pending == []  # settled at the first wrong token


def test_matches_are_scored_as_the_history_grows() -> None:
    cut = LookupRunLength(0.1)
    cut.track(LookupMatch([5, 6, 7], 2), 3)
    cut.observe([0, 0, 0, 5])  # one token known so far
    assert cut.reached == {(2, 0): 1} and len(cut.pending) == 1
    cut.observe([0, 0, 0, 5, 6, 7])
    assert cut.right == {(2, 0): 1, (2, 1): 1, (2, 2): 1} and cut.pending == []


def test_a_cut_to_nothing_does_not_switch_an_ngram_length_off() -> None:
    """Runs cut to zero tokens are still scored against what the model produced, so when the
    context starts repeating, the n-gram length is proposed again (a cut that only learned from
    proposed tokens would never propose it again in this generation)."""
    cut = LookupRunLength(0.3)
    for _ in range(3):
        _score(cut, LookupMatch([10, 11], 2), [99, 98])  # wrong runs: the cut drops the length to nothing
    assert cut.cut(LookupMatch([10, 11], 2)) == []
    for _ in range(8):  # matches that would have been right (at first not even proposed)
        _score(cut, LookupMatch([10, 11], 2), [10, 11])
    assert cut.cut(LookupMatch([10, 11], 2)) == [10, 11]


@pytest.mark.parametrize("confidence", [0.0, 0.3])
def test_replay_of_lookup_drafting_is_exact(confidence: float) -> None:
    """Lookup-only drafting depends only on the token history, so the search's replay of greedy
    decoding over the full model's reference must give the engine's very steps."""
    model = tiny_model("llama")
    prompt = random_prompt(seed=3) * 2  # a repeated prompt: lookup has matches
    draft = DraftSettings(
        lookup_max_ngram=3, lookup_min_ngram=1, lookup_max_tokens=5, use_skip_draft=False, lookup_confidence=confidence
    )
    settings = DecodeSettings(max_new_tokens=40)
    reference, _ = decode(model, prompt, None, settings)
    tokens, stats = decode(model, prompt, SkipPolicy(draft=draft), settings)
    assert tokens == reference
    replay = simulate_greedy(Reference(tuple(prompt), tuple(reference)), draft)
    assert replay.tokens == len(reference)
    assert (replay.drafted, replay.accepted) == (stats.drafted, stats.accepted)
    assert len(replay.blocks) == stats.steps  # the prompt's forward counts as the first step in both
    assert stats.accepted > 0 and stats.drafted > stats.accepted
