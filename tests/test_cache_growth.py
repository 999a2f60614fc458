"""The shared cache keeps the model's dtype across every growth of its buffers, whoever writes.

A layer's buffer starts small here (``_MIN_CAPACITY`` patched to 2), so a 60-token generation
grows it: at the prefill, and where a row's drafter first drafts (room for the row's whole budget
is reserved then, so its view of the cache never grows away from the buffers). A draft in another precision
(bf16, int8, int4 products) writes its K/V into the model's cache: growth must never turn the
buffer into the draft's dtype (an fp32 verify would meet bf16 keys, or silently round them).
"""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch
from compare import assert_same_tokens, hf_greedy
from test_sampling import E2E_SEEDS, E2E_TV_BOUND, E2E_VOCAB, _e2e_model, _exact_laws, tv
from tiny_models import random_prompt, tiny_model

from layerskip.drafts.model.precision import PRECISIONS
from layerskip.drafts.policy.skip_policy import DraftSettings, SkipPolicy
from layerskip.engine.decoding import Decoder, DecodeSettings
from layerskip.hf import cache as cache_module
from layerskip.hf.cache import RollbackCache
from layerskip.sampling import Sampling

NEW_TOKENS = 60
SMALL_CAPACITY = 2

# Skip drafts only (no lookup): most steps write several draft tokens, so drafts overflow buffers
# as often as verifies do.
SHAPES = {
    "chain": DraftSettings(max_draft_tokens=5),
    "tree": DraftSettings(max_draft_tokens=5, tree_siblings=2, tree_margin=0.9),
}


@pytest.fixture(autouse=True)
def _small_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cache_module, "_MIN_CAPACITY", SMALL_CAPACITY)
    # The prefill's room for the whole budget would spare every growth below.
    monkeypatch.setattr(RollbackCache, "reserve_ahead", lambda cache, positions: None)


@functools.cache
def _model(impl: str, dtype: torch.dtype) -> torch.nn.Module:
    return tiny_model("llama", attn_implementation=impl).to(dtype)


@functools.cache
def _reference(impl: str, dtype: torch.dtype) -> tuple[list[int], torch.Tensor]:
    return hf_greedy(_model(impl, dtype), random_prompt(), NEW_TOKENS)


def _observe(dtype: torch.dtype, capacities: list[int]):
    def observe(cache: RollbackCache, committed: int) -> None:
        for layer in cache.layers:
            if layer.is_initialized:
                assert layer.key_buffer.dtype == dtype and layer.value_buffer.dtype == dtype
                assert layer.keys.dtype == dtype
        capacities.append(max(layer.key_buffer.shape[-2] for layer in cache.layers if layer.is_initialized))

    return observe


def _decode(impl: str, dtype: torch.dtype, precision: str, shape: str, **settings) -> tuple[list[int], list[int]]:
    model = _model(impl, dtype)
    policy = SkipPolicy(skip_attention=(1,), skip_mlp=(2,), draft=replace(SHAPES[shape], precision=precision))
    capacities: list[int] = []
    tokens, stats = Decoder.for_policy(model, policy).decode(
        random_prompt(),
        DecodeSettings(max_new_tokens=NEW_TOKENS, **settings),
        cache_observer=_observe(dtype, capacities),
    )
    assert len(tokens) == NEW_TOKENS and stats.drafted > 0
    return tokens, capacities


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_growth_keeps_fp32_and_greedy_output(impl: str, precision: str, shape: str) -> None:
    tokens, capacities = _decode(impl, torch.float32, precision, shape)
    assert len(set(capacities)) >= 2, f"the buffers never grew: {capacities}"
    ref, logits = _reference(impl, torch.float32)
    assert_same_tokens(tokens, ref, ref_logits=logits, label=f"{impl} {precision} {shape}")


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("precision", PRECISIONS)
def test_growth_keeps_bf16(precision: str, shape: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 model: buffers stay bf16, and growing them changes nothing (same text as unpatched)."""
    grown, capacities = _decode("sdpa", torch.bfloat16, precision, shape)
    assert len(set(capacities)) >= 2
    monkeypatch.setattr(cache_module, "_MIN_CAPACITY", 4096)
    whole, capacities = _decode("sdpa", torch.bfloat16, precision, shape)
    assert set(capacities) == {4096}
    assert grown == whole


@pytest.mark.parametrize("precision", ["bfloat16", "int4"])
def test_growth_keeps_fp32_when_sampling(precision: str) -> None:
    tokens, _ = _decode("sdpa", torch.float32, precision, "chain", sampling=Sampling(temperature=0.8), seed=3)
    assert len(tokens) == NEW_TOKENS


def test_growing_cache_keeps_the_sampled_distribution() -> None:
    """The sampled law of the second token with an int4 draft whose every step grows the buffers."""
    model = _e2e_model()
    prompt = random_prompt(E2E_VOCAB, 6)
    _, p2, _ = _exact_laws(model, prompt)
    policy = SkipPolicy.skip_layers([1, 2, 3], draft=DraftSettings(max_draft_tokens=2, precision="int4"))
    decoder = Decoder.for_policy(model, policy)
    second = torch.zeros(E2E_VOCAB)
    for seed in range(E2E_SEEDS):
        capacities: list[int] = []
        settings = DecodeSettings(max_new_tokens=3, sampling=Sampling(), seed=seed)
        tokens, _ = decoder.decode(prompt, settings, cache_observer=_observe(torch.float32, capacities))
        assert capacities[0] == len(prompt) < capacities[1]  # the prefill filled it; the first step grew it
        second[tokens[1]] += 1
    assert tv(second / E2E_SEEDS, p2) < E2E_TV_BOUND


def test_a_draft_in_bf16_never_changes_the_stored_dtype() -> None:
    """The cause itself: a bf16 write that grows an fp32 buffer leaves it fp32, the old rows exact."""
    cache = RollbackCache([None], dtype=torch.float32)  # 2 positions (_small_buffers)
    layer = cache.layers[0]
    first = torch.randn(1, 1, 2, 4)
    layer.update(first, first)
    cache.advance(2)
    layer.update(torch.ones(1, 1, 3, 4, dtype=torch.bfloat16), torch.ones(1, 1, 3, 4, dtype=torch.bfloat16))
    assert layer.key_buffer.dtype == torch.float32 and layer.key_buffer.shape[-2] >= 5
    assert torch.equal(layer.keys[..., :2, :], first)


@pytest.mark.parametrize("make_policy", [SkipPolicy.auto_choice, SkipPolicy.auto_trees], ids=["auto", "auto-trees"])
def test_auto_grows_the_cache_and_stays_exact(make_policy) -> None:
    model = _model("sdpa", torch.float32)
    capacities: list[int] = []
    tokens, _ = Decoder.for_policy(model, make_policy()).decode(
        random_prompt(), DecodeSettings(max_new_tokens=NEW_TOKENS), cache_observer=_observe(torch.float32, capacities)
    )
    assert len(set(capacities)) >= 2
    ref, logits = _reference("sdpa", torch.float32)
    assert_same_tokens(tokens, ref, ref_logits=logits, label=make_policy.__name__)
