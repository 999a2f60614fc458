"""Lossless on the real embedded SmolLM2-135M-Instruct: greedy self-speculative output == HF generate.

Four built-in prompts (one each of writing, translation, summarisation, maths) with the chat
template, 24 new tokens, five policies (attention skips, early exit, lookup + skip, the int4 draft
whose length is priced, skip sets chosen on the fly), each on two of the prompts: every prompt
meets at least two policies, and the tiny models of every architecture cover the full cross.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from compare import assert_same_tokens
from oracles import is_bypassed

from layerskip.data import builtin_prompts
from layerskip.drafts.builder import check_policy_fits
from layerskip.drafts.policy.skip_policy import DraftSettings, SkipPolicy
from layerskip.engine.decoding import DecodeSettings, decode
from layerskip.hf import adapters
from layerskip.hf.prompting import encode_prompt, eos_token_ids
from layerskip.integration.baselines import hf_generate

pytestmark = pytest.mark.slow

NEW_TOKENS = 24
PROMPT_IDS = ["builtin-2", "builtin-3", "builtin-6", "builtin-12"]
POLICIES = {
    "attention-5-20": SkipPolicy(skip_attention=(5, 20)),
    "early-exit-26": SkipPolicy.early_exit(30, 26),
    "lookup-hybrid": SkipPolicy(skip_attention=(5, 20), draft=DraftSettings(lookup_max_ngram=3)),
    "by-cost-int4": SkipPolicy(
        skip_attention=(6,), draft=DraftSettings(max_draft_tokens=6, length_by_cost=True, precision="int4")
    ),
    "on-the-fly": SkipPolicy.adaptive_selection(refresh_every=1, start_fraction=0.1),
}


@functools.cache
def _prompt_text(prompt_id: str) -> str:
    return next(p.text for p in builtin_prompts() if p.id == prompt_id)


@pytest.fixture(scope="module")
def reference(smollm2):
    """(prompt ids, eos ids, HF greedy tokens) per prompt, computed once per prompt."""
    cache: dict[str, tuple[list[int], tuple[int, ...], list[int]]] = {}

    def get(prompt_id: str) -> tuple[list[int], tuple[int, ...], list[int]]:
        if prompt_id not in cache:
            ids = encode_prompt(smollm2.tokenizer, _prompt_text(prompt_id), chat=True)
            eos = eos_token_ids(smollm2.model, smollm2.tokenizer)
            tokens = hf_generate(smollm2.model, ids, NEW_TOKENS, eos)
            cache[prompt_id] = (ids, eos, tokens)
        return cache[prompt_id]

    return get


def test_model_is_the_expected_one(smollm2) -> None:
    assert smollm2.name == "smollm2-135m" and smollm2.instruct
    assert adapters.architecture_of(smollm2.model) == "llama"
    assert adapters.num_layers(smollm2.model) == 30
    assert eos_token_ids(smollm2.model, smollm2.tokenizer)


CASES = [
    ("builtin-2", "attention-5-20"),
    ("builtin-12", "attention-5-20"),
    ("builtin-3", "early-exit-26"),
    ("builtin-6", "early-exit-26"),
    ("builtin-6", "lookup-hybrid"),
    ("builtin-12", "lookup-hybrid"),
    ("builtin-2", "by-cost-int4"),
    ("builtin-3", "by-cost-int4"),
    ("builtin-3", "on-the-fly"),
    ("builtin-12", "on-the-fly"),
]


@pytest.mark.parametrize(("prompt_id", "policy_name"), CASES)
def test_speculative_matches_hf_generate(smollm2, reference, prompt_id: str, policy_name: str) -> None:
    ids, eos, ref = reference(prompt_id)
    assert len(ref) == NEW_TOKENS or ref[-1] in eos
    policy = POLICIES[policy_name].with_model(smollm2.model, smollm2.name)
    tokens, stats = decode(smollm2.model, ids, policy, DecodeSettings(max_new_tokens=NEW_TOKENS, eos_token_ids=eos))
    assert_same_tokens(tokens, ref, model=smollm2.model, prompt=ids, label=f"{prompt_id} {policy_name}")
    assert stats.accepted > 0
    assert not is_bypassed(smollm2.model)


def test_autoregressive_matches_hf_generate(smollm2, reference) -> None:
    ids, eos, ref = reference(PROMPT_IDS[0])
    tokens, _ = decode(smollm2.model, ids, None, DecodeSettings(max_new_tokens=NEW_TOKENS, eos_token_ids=eos))
    assert_same_tokens(tokens, ref, model=smollm2.model, prompt=ids, label="autoregressive")


def test_saved_policy_gives_the_same_output(smollm2, reference, tmp_path: Path) -> None:
    ids, eos, ref = reference(PROMPT_IDS[2])
    policy = POLICIES["lookup-hybrid"].with_model(smollm2.model, smollm2.name)
    loaded = SkipPolicy.load(policy.save(tmp_path / "smollm2.json"))
    assert loaded == policy
    check_policy_fits(smollm2.model, loaded)
    settings = DecodeSettings(max_new_tokens=NEW_TOKENS, eos_token_ids=eos)
    tokens, _ = decode(smollm2.model, ids, loaded, settings)
    assert_same_tokens(tokens, ref, model=smollm2.model, prompt=ids, label="loaded policy")
