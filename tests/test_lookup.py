"""Prompt lookup: matching, the learned run-length cut, and the search's exact replay of lookup drafting."""

from __future__ import annotations

import pytest
from tiny_models import random_prompt, tiny_model

from layerskip.engine.decoding import DecodeSettings, decode_autoregressive, decode_speculative
from layerskip.engine.drafters import LookupMatch, LookupRunLength, find_lookup, match_lookup
from layerskip.engine.policy import DraftSettings, SkipPolicy
from layerskip.measure.agreement import Reference, simulate_greedy


def test_match_prefers_the_longest_then_the_latest_ngram() -> None:
    history = [1, 2, 3, 9, 2, 3, 7, 8, 1, 2, 3]
    assert match_lookup(history, 1, 3, 2) == LookupMatch([9, 2], 3)  # [1, 2, 3] occurred at 0
    assert match_lookup(history, 1, 2, 2) == LookupMatch([7, 8], 2)  # latest [2, 3] is at 4
    assert find_lookup([5, 6, 7], 1, 3, 4) == []


def test_run_length_learns_where_runs_fail() -> None:
    cut = LookupRunLength(0.2)
    match = LookupMatch([10, 11, 12, 13, 14, 15], 2)
    # Uniform prior: 1/2, 1/4 pass 0.2, 1/8 does not.
    assert cut.cut(match) == [10, 11]
    for _ in range(6):  # the first token of 2-gram runs is always rejected
        cut.update(2, drafted=2, accepted=0)
    assert cut.cut(match) == []
    assert cut.cut(LookupMatch([10, 11, 12], 3)) == [10, 11]  # other n-gram lengths keep their prior
    for _ in range(20):  # 3-gram runs are accepted whole
        cut.update(3, drafted=3, accepted=3)
    # Positions 0-2 at 21/22 each, then never-reached positions at the prior 1/2: 0.87, 0.43, 0.22, 0.11.
    assert cut.cut(LookupMatch([10, 11, 12, 13, 14, 15], 3)) == [10, 11, 12, 13, 14]
    assert LookupRunLength(0.0).cut(match) == match.tokens  # 0: never cut


def test_only_reached_positions_are_counted() -> None:
    cut = LookupRunLength(0.1)
    cut.update(1, drafted=4, accepted=1)
    assert cut.reached == {(1, 0): 1, (1, 1): 1} and cut.accepted == {(1, 0): 1}


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
    reference, _ = decode_autoregressive(model, prompt, settings)
    tokens, stats = decode_speculative(model, prompt, SkipPolicy(draft=draft), settings)
    assert tokens == reference
    replay = simulate_greedy(Reference(tuple(prompt), tuple(reference)), reference, [1.0] * len(reference), draft)
    assert replay.tokens == len(reference)
    assert (replay.drafted, replay.accepted) == (stats.drafted, stats.accepted)
    assert len(replay.blocks) == stats.steps  # the prompt's forward counts as the first step in both
    assert stats.accepted > 0 and stats.drafted > stats.accepted
