"""The rollback KV cache: per-layer lengths after every decode step, and RollbackLayer/RollbackCache units."""

from __future__ import annotations

import pytest
import torch
from oracles import layer_lengths
from tiny_models import LAYERS, random_prompt, tiny_model

from layerskip.drafts.policy import DraftSettings, SkipPolicy
from layerskip.engine.decoding import DecodeSettings, decode
from layerskip.hf import adapters
from layerskip.hf.cache import _MIN_CAPACITY, RollbackCache, RollbackLayer

POLICIES = {
    "attention-0": SkipPolicy(skip_attention=(0,), skip_mlp=(2,)),
    "early-exit-1": SkipPolicy.early_exit(LAYERS, 1),
    "whole-layers": SkipPolicy.skip_layers([0, 3], draft=DraftSettings(max_draft_tokens=6)),
    "adaptive": SkipPolicy(skip_attention=(2,), draft=DraftSettings(adaptive=True)),
    "by-cost": SkipPolicy(skip_attention=(2,), draft=DraftSettings(max_draft_tokens=5, length_by_cost=True)),
    "hybrid": SkipPolicy(skip_attention=(1, 3), draft=DraftSettings(lookup_max_ngram=2)),
}


@pytest.mark.parametrize("policy_name", list(POLICIES))
@pytest.mark.parametrize("arch", ["llama", "gemma2", "gpt2"])
def test_every_layer_holds_exactly_the_committed_tokens_after_every_step(arch: str, policy_name: str) -> None:
    model = tiny_model(arch)
    prompt = random_prompt()
    seen: list[tuple[list[int], int]] = []

    def observe(cache: RollbackCache, committed: int) -> None:
        assert isinstance(cache, RollbackCache)
        assert len(cache.layers) == adapters.num_layers(model)
        seen.append((layer_lengths(cache), committed))
        for layer in cache.layers:  # the views the attention reads agree with the length
            assert layer.keys.shape[-2] == layer.length == layer.values.shape[-2]

    tokens, stats = decode(model, prompt, POLICIES[policy_name], DecodeSettings(30), cache_observer=observe)
    assert len(seen) == stats.steps
    for step, (lengths, committed) in enumerate(seen):
        assert lengths == [committed] * len(lengths), f"step {step}: layer lengths {lengths}, committed {committed}"
    committed = [c for _, c in seen]
    assert committed[0] == len(prompt)
    assert all(b > a for a, b in zip(committed, committed[1:], strict=False))
    # The cache holds everything but the last chosen token (pending).
    assert committed[-1] == len(prompt) + len(tokens) - 1


def _kv(batch: int = 1, heads: int = 2, length: int = 3, dim: int = 4, start: float = 0.0) -> torch.Tensor:
    count = batch * heads * length * dim
    return torch.arange(start, start + count, dtype=torch.float32).reshape(batch, heads, length, dim)


def test_layer_update_appends_and_returns_views() -> None:
    layer = RollbackLayer()
    assert not layer.is_sliding and layer.get_seq_length() == 0
    k1, v1 = _kv(length=3), -_kv(length=3)
    keys, values = layer.update(k1, v1)
    assert layer.length == 3 and layer.get_seq_length() == 3
    torch.testing.assert_close(keys, k1)
    torch.testing.assert_close(values, v1)
    k2, v2 = _kv(length=2, start=1000), -_kv(length=2, start=1000)
    keys, values = layer.update(k2, v2)
    torch.testing.assert_close(keys, torch.cat([k1, k2], dim=-2))
    torch.testing.assert_close(values, torch.cat([v1, v2], dim=-2))
    assert layer.get_mask_sizes(4) == (9, 0)


def test_layer_truncate_then_overwrite() -> None:
    layer = RollbackLayer(sliding_window=4)
    assert layer.is_sliding and layer.sliding_window == 4
    k1 = _kv(length=5)
    layer.update(k1, k1)
    layer.truncate(2)
    assert layer.length == 2
    torch.testing.assert_close(layer.keys, k1[..., :2, :])
    k2 = _kv(length=2, start=500)
    keys, _ = layer.update(k2, k2)  # overwrites the rolled-back slots
    torch.testing.assert_close(keys, torch.cat([k1[..., :2, :], k2], dim=-2))
    layer.truncate(4)  # rolling back to the current length is a no-op
    assert layer.length == 4


def test_layer_rollback_to_a_longer_length_raises() -> None:
    layer = RollbackLayer()
    layer.update(_kv(length=3), _kv(length=3))
    with pytest.raises(RuntimeError, match="roll"):
        layer.truncate(4)
    assert layer.length == 3


def test_layer_crop_follows_transformers_convention() -> None:
    layer = RollbackLayer()
    layer.update(_kv(length=6), _kv(length=6))
    layer.crop(-2)  # negative: remove that many
    assert layer.length == 4
    layer.crop(3)  # positive: keep that many
    assert layer.length == 3
    layer.reset()
    assert layer.length == 0 and layer.keys.shape[-2] == 0


def test_layer_grows_past_initial_capacity_and_keeps_contents() -> None:
    layer = RollbackLayer()
    chunks = []
    total = 0
    while total <= 3 * _MIN_CAPACITY:
        chunk = _kv(length=37, start=float(total * 8))
        chunks.append(chunk)
        layer.update(chunk, -chunk)
        total += 37
    assert layer.length == total > _MIN_CAPACITY
    assert layer._key_buffer.shape[-2] >= total
    expected = torch.cat(chunks, dim=-2)
    torch.testing.assert_close(layer.keys, expected)
    torch.testing.assert_close(layer.values, -expected)
    # Roll back below the initial capacity, then grow again: contents before the cut survive.
    layer.truncate(100)
    extra = _kv(length=300, start=-1e6)
    keys, _ = layer.update(extra, extra)
    torch.testing.assert_close(keys, torch.cat([expected[..., :100, :], extra], dim=-2))


def test_layer_first_update_larger_than_min_capacity() -> None:
    layer = RollbackLayer()
    big = _kv(length=_MIN_CAPACITY + 10)
    keys, _ = layer.update(big, big)
    torch.testing.assert_close(keys, big)
    keys, _ = layer.update(_kv(length=1), _kv(length=1))
    assert keys.shape[-2] == _MIN_CAPACITY + 11


def test_cache_rollback_and_lengths() -> None:
    cache = RollbackCache([None, 4, None])
    assert [layer.sliding_window for layer in cache.layers] == [None, 4, None]
    assert cache.get_seq_length() == 0 and layer_lengths(cache) == [0, 0, 0]
    for i, layer in enumerate(cache.layers):
        layer.update(_kv(length=5 + i), _kv(length=5 + i))
    # Every length the model asks for is the longest layer's.
    assert layer_lengths(cache) == [5, 6, 7]
    assert cache.length == cache.get_seq_length() == cache.get_seq_length(0) == 7
    assert cache.get_mask_sizes(3, 0) == (10, 0)
    assert cache.get_query_offset(0) == 7
    cache.rollback(5)
    assert layer_lengths(cache) == [5, 5, 5]
    cache.crop(-2)
    assert layer_lengths(cache) == [3, 3, 3]
    cache.crop(2)
    assert layer_lengths(cache) == [2, 2, 2]


def test_cache_rollback_to_a_longer_length_raises() -> None:
    cache = RollbackCache([None, None])
    cache.layers[0].update(_kv(length=4), _kv(length=4))
    cache.layers[1].update(_kv(length=2), _kv(length=2))
    with pytest.raises(RuntimeError, match="fewer than"):
        cache.rollback(3)  # layer 1 holds only 2
    cache.layers[1].update(_kv(length=2), _kv(length=2))
    cache.rollback(3)
    assert layer_lengths(cache) == [3, 3]


def test_cache_drives_a_model_forward() -> None:
    """Used as ``past_key_values``, the cache reproduces a no-cache forward, also after a rollback."""
    model = tiny_model("llama")
    ids = torch.tensor([random_prompt(length=12)])
    with torch.inference_mode():
        full = model(input_ids=ids).logits[0]
        cache = RollbackCache(adapters.sliding_windows(model))
        model(input_ids=ids[:, :8], past_key_values=cache, use_cache=True)
        model(input_ids=torch.tensor([[1, 2, 3]]), past_key_values=cache, use_cache=True)  # to be rolled back
        cache.rollback(8)
        assert layer_lengths(cache) == [8] * LAYERS
        tail = model(
            input_ids=ids[:, 8:], past_key_values=cache, use_cache=True, position_ids=torch.arange(8, 12)[None]
        ).logits[0]
    torch.testing.assert_close(tail, full[8:], rtol=1e-4, atol=1e-4)
