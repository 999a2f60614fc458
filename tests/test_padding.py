"""Padded verify blocks (``min_verify_block``): filler tokens after the draft change nothing but speed."""

from __future__ import annotations

from dataclasses import replace

import pytest
from tiny_models import random_prompt, tiny_model

from layerskip.drafts.policy.skip_policy import DraftSettings, SkipPolicy
from layerskip.engine.decoding import DecodeSettings, decode
from layerskip.hf import adapters
from layerskip.measure.agreement import Reference, simulate_greedy
from layerskip.sampling import Sampling

PAD = 6
POLICIES = {
    "skip-k2": SkipPolicy(skip_attention=(0, 2), draft=DraftSettings(max_draft_tokens=2)),
    "lookup-cut": SkipPolicy(
        draft=DraftSettings(lookup_max_ngram=3, lookup_min_ngram=1, use_skip_draft=False, lookup_confidence=0.3)
    ),
    "hybrid": SkipPolicy(skip_mlp=(1,), draft=DraftSettings(max_draft_tokens=3, lookup_max_ngram=2)),
}


def _padded(policy: SkipPolicy) -> SkipPolicy:
    return replace(policy, draft=replace(policy.draft, min_verify_block=PAD))


@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "gpt2"])
def test_greedy_padding_changes_only_the_block_lengths(arch: str, name: str) -> None:
    model = tiny_model(arch)
    prompt = random_prompt(seed=2) * 2
    settings = DecodeSettings(max_new_tokens=30)
    plain_tokens, plain = decode(model, prompt, POLICIES[name], settings)
    tokens, padded = decode(model, prompt, _padded(POLICIES[name]), settings)
    assert tokens == plain_tokens
    assert (padded.drafted, padded.accepted, padded.steps) == (plain.drafted, plain.accepted, plain.steps)
    assert any(2 <= b < PAD for b in plain.block_histogram), "nothing to pad: not a real test"
    assert all(b == 1 or b >= PAD for b in padded.block_histogram), padded.block_histogram
    assert sum(padded.block_histogram.values()) == padded.steps - 1  # every verify, not the prefill


def test_sampled_output_is_unchanged_by_padding() -> None:
    model = tiny_model("llama")
    settings = DecodeSettings(max_new_tokens=25, sampling=Sampling(temperature=0.9), seed=11)
    policy = POLICIES["skip-k2"]
    tokens, stats = decode(model, random_prompt(), policy, settings)
    padded_tokens, padded = decode(model, random_prompt(), _padded(policy), settings)
    assert padded_tokens == tokens and padded.accepted == stats.accepted
    assert all(b == 1 or b >= PAD for b in padded.block_histogram)


def test_replay_charges_the_padded_block() -> None:
    reference = Reference((1, 2, 3, 1, 2, 3), (1, 2, 9, 9, 9))
    draft = DraftSettings(lookup_max_ngram=2, lookup_min_ngram=1, lookup_max_tokens=2, use_skip_draft=False)
    plain = simulate_greedy(reference, draft)
    padded = simulate_greedy(reference, replace(draft, min_verify_block=PAD))
    assert (padded.tokens, padded.drafted, padded.accepted) == (plain.tokens, plain.drafted, plain.accepted)
    assert padded.blocks == [b if b == 1 else max(b, PAD) for b in plain.blocks] and padded.blocks != plain.blocks


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_max_positions(arch: str) -> None:
    assert adapters.max_positions(tiny_model(arch)) >= 64
