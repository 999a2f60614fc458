"""The one KV cache: rows with their own lengths, one length for every layer of a row, after every
decode step and as units (writes, rollbacks, growth, kept paths, row views)."""

from __future__ import annotations

import pytest
import torch
from oracles import row_lengths
from tiny_models import LAYERS, random_prompt, tiny_model

from layerskip.drafts.policy.skip_policy import DraftSettings, SkipPolicy
from layerskip.engine.decoding import DecodeSettings, decode
from layerskip.hf import adapters
from layerskip.hf import cache as cache_module
from layerskip.hf.cache import RollbackCache
from layerskip.hf.forward import block_hidden, stack_forward

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
def test_the_cache_holds_exactly_the_committed_tokens_after_every_step(arch: str, policy_name: str) -> None:
    model = tiny_model(arch)
    prompt = random_prompt()
    seen: list[tuple[list[int], int]] = []

    def observe(cache: RollbackCache, committed: int) -> None:
        assert isinstance(cache, RollbackCache)
        assert len(cache.layers) == adapters.num_layers(model)
        seen.append((row_lengths(cache), committed))

    tokens, stats = decode(model, prompt, POLICIES[policy_name], DecodeSettings(30), cache_observer=observe)
    assert len(seen) == stats.steps
    for step, (lengths, committed) in enumerate(seen):
        assert lengths == [committed], f"step {step}: row lengths {lengths}, committed {committed}"
    committed = [c for _, c in seen]
    assert committed[0] == len(prompt)
    assert all(b > a for a, b in zip(committed, committed[1:], strict=False))
    # The cache holds everything but the last chosen token (pending).
    assert committed[-1] == len(prompt) + len(tokens) - 1


def _kv(rows: int = 1, heads: int = 2, length: int = 3, dim: int = 4, start: float = 0.0) -> torch.Tensor:
    count = rows * heads * length * dim
    return torch.arange(start, start + count, dtype=torch.float32).reshape(rows, heads, length, dim)


def _write(cache: RollbackCache, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What a forward does: every layer writes its block, then the rows move on."""
    out = [layer.update(k, v) for layer in cache.layers]
    cache.advance(k.shape[-2])
    return out[0]


def test_writes_append_rollbacks_cut_and_lengths_are_the_rows() -> None:
    cache = RollbackCache([None, 4, None])
    assert [layer.sliding_window for layer in cache.layers] == [None, 4, None]
    assert cache.get_seq_length() == 0 and row_lengths(cache) == [0]
    k1 = _kv(length=5)
    keys, values = _write(cache, k1, -k1)
    torch.testing.assert_close(keys, k1)
    torch.testing.assert_close(values, -k1)
    assert cache.get_seq_length() == cache.get_query_offset() == 5
    assert cache.get_mask_sizes(3, 0) == (8, 0) and cache.layers[1].get_mask_sizes(3) == (8, 0)
    cache.rollback(2)
    k2 = _kv(length=2, start=500)
    keys, _ = _write(cache, k2, k2)  # overwrites the rolled-back slots
    torch.testing.assert_close(keys, torch.cat([k1[..., :2, :], k2], dim=-2))
    cache.crop(-1)  # transformers' convention: negative removes that many
    assert cache.lengths == [3]
    cache.crop(2)  # positive keeps that many
    assert cache.lengths == [2]
    with pytest.raises(RuntimeError, match="fewer than"):
        cache.rollback(3)


def test_rows_write_at_their_own_lengths() -> None:
    cache = RollbackCache([None], rows=2)
    _write(cache, _kv(rows=2, length=4), _kv(rows=2, length=4))
    cache.set_lengths([1, 3])
    block = _kv(rows=2, length=2, start=1000)
    keys, _ = _write(cache, block, block)
    assert cache.lengths == [3, 5] and keys.shape[-2] == 5  # every row reads the longest row's span
    layer = cache.layers[0]
    torch.testing.assert_close(layer.key_buffer[0, :, 1:3], block[0])
    torch.testing.assert_close(layer.key_buffer[1, :, 3:5], block[1])
    cache.keep_rows([1])
    assert cache.rows == 1 and cache.lengths == [5]
    torch.testing.assert_close(cache.layers[0].key_buffer[0, :, 3:5], block[1])


def test_dropped_rows_are_filled_by_the_last_rows_kept_without_copying_the_others() -> None:
    """Finished rows leave by moving the last rows kept into their places: the kept rows' former
    indices come back in their new order, each with its K/V and length, and the buffers stay where
    they were (views of their first rows: no row that stays in place is copied)."""
    cache = RollbackCache([None, 2], rows=5)
    block = _kv(rows=5, length=4)
    _write(cache, block, block)
    cache.set_lengths([4, 1, 2, 3, 4])
    pointers = [layer.key_buffer.data_ptr() for layer in cache.layers]
    order = cache.drop_rows([1, 2])
    assert order == [0, 3, 4]  # rows 3 and 4 moved into the places of 1 and 2
    assert cache.rows == 3 and cache.lengths == [4, 3, 4]
    for layer, pointer in zip(cache.layers, pointers, strict=True):
        assert layer.key_buffer.data_ptr() == pointer and layer.key_buffer.shape[0] == 3
        for new, old in enumerate(order):
            torch.testing.assert_close(layer.key_buffer[new, :, :4], block[old])
            torch.testing.assert_close(layer.value_buffer[new, :, :4], block[old])
    assert cache.drop_rows([2]) == [0, 1]  # the last row: nothing moves
    assert cache.lengths == [4, 3]
    torch.testing.assert_close(cache.layers[0].key_buffer[1, :, :4], block[3])


def test_growth_keeps_contents_and_the_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cache_module, "_MIN_CAPACITY", 8)
    cache = RollbackCache([None, None], rows=2, dtype=torch.float32)
    chunks = []
    while cache.longest <= 40:
        chunk = _kv(rows=2, length=7, start=float(cache.longest * 100))
        chunks.append(chunk)
        _write(cache, chunk.to(torch.bfloat16), chunk.to(torch.bfloat16))  # a bf16 draft's K/V
    expected = torch.cat(chunks, dim=-2).to(torch.bfloat16).float()
    for layer in cache.layers:
        assert layer.key_buffer.dtype == torch.float32 and layer.key_buffer.shape[-2] >= cache.longest > 8
        torch.testing.assert_close(layer.keys, expected)


def test_keep_paths_gathers_each_row_and_refuses_what_was_not_written() -> None:
    cache = RollbackCache([None], rows=2)
    _write(cache, _kv(rows=2, length=3), _kv(rows=2, length=3))
    cache.set_lengths([2, 3])
    block = _kv(rows=2, length=4, start=1000)
    _write(cache, block, block)
    cache.keep_paths([2, 3], [[0, 2, 3], [0, 1]])
    assert cache.lengths == [5, 5]
    buffer = cache.layers[0].key_buffer
    torch.testing.assert_close(buffer[0, :, 2:5], block[0][:, [0, 2, 3]])
    torch.testing.assert_close(buffer[1, :, 3:5], block[1][:, [0, 1]])
    with pytest.raises(RuntimeError, match="reaches row"):
        cache.keep_paths([2, 3], [[0, 3], [0, 2]])  # row 0 holds 5 tokens: 2 + 3 is the last written


def test_a_row_view_shares_the_buffers() -> None:
    cache = RollbackCache([None], rows=2)
    with pytest.raises(RuntimeError, match="first forward"):
        cache.row_view(0)
    _write(cache, _kv(rows=2, length=3), _kv(rows=2, length=3))
    cache.reserve(16)
    view = cache.row_view(1)
    assert view.lengths == [3]
    token = _kv(length=1, start=-7)
    _write(view, token, token)
    torch.testing.assert_close(cache.layers[0].key_buffer[1, :, 3:4], token[0])
    assert cache.lengths == [3, 3] and view.lengths == [4]


def test_cache_drives_a_model_forward() -> None:
    """Used as ``past_key_values``, the cache reproduces a no-cache forward, also after a rollback."""
    model = tiny_model("llama")
    ids = torch.tensor([random_prompt(length=12)])
    with torch.inference_mode():
        full = stack_forward(model, ids)[0]
        cache = RollbackCache(adapters.sliding_windows(model))
        block_hidden(model, ids[:, :8], cache)
        block_hidden(model, torch.tensor([[1, 2, 3]]), cache)  # to be rolled back
        cache.rollback(8)
        tail = block_hidden(model, ids[:, 8:], cache)[0]
    torch.testing.assert_close(tail, full[8:], rtol=1e-4, atol=1e-4)
