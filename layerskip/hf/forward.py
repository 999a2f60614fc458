"""Full-model forward passes over the shared cache: every row at its own positions.

Positions are always passed explicitly (each row's from its own length), so no code path ever
infers a position from the cache. Every forward moves the cache's rows on by the block's width
(``RollbackCache.advance``); callers roll back what they do not keep.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence

import torch
from torch import nn

from layerskip.hf import adapters
from layerskip.hf.cache import RollbackCache
from layerskip.hf.tree import block_masks, is_chain


def positions(start: int, count: int, device: torch.device) -> torch.Tensor:
    return torch.arange(start, start + count, device=device).unsqueeze(0)  # [1, count]


def stack_forward(
    model: nn.Module,
    input_ids: torch.Tensor,
    cache: RollbackCache | None = None,
    position_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The decoder stack's final hidden states ``[B, q, H]`` of ``input_ids [B, q]``; the cache's rows
    move on by ``q`` (every layer that ran wrote there). No positions: from 0 (a forward without a cache).

    The stack's cache argument was renamed from ``past_key_values`` to ``cache`` in transformers
    5.24 (the old name warns, and goes in 5.40): pass whichever this version's forward takes.
    ``attention_mask``, when given, is a prepared 4D mask (or one per layer type) that the stack
    uses as it is (``tree.block_masks``); None lets the stack build its causal masks.
    """
    stack = adapters.base_model(model)
    kwargs: dict[str, object] = {"input_ids": input_ids, "use_cache": cache is not None}
    if position_ids is not None:
        kwargs["position_ids"] = position_ids
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    if cache is not None:
        kwargs[_cache_argument(type(stack))] = cache
    with adapters.grouped_attention(model):
        hidden = stack(**kwargs).last_hidden_state
    if cache is not None:
        cache.advance(input_ids.shape[1])
    return hidden


@functools.cache
def _cache_argument(stack_class: type) -> str:
    return "cache" if "cache" in inspect.signature(stack_class.forward).parameters else "past_key_values"


def block_hidden(
    model: nn.Module, block: torch.Tensor, cache: RollbackCache, parents: Sequence[Sequence[int] | None] | None = None
) -> torch.Tensor:
    """Final hidden states ``[B, q, H]`` of the verify block ``block [B, q]``: row ``b`` is
    ``[pending, node 0..q-2]`` after the row's ``cache.lengths[b]`` committed tokens, its nodes with
    ``parents[b]`` (None, or None for a row: a chain). Row ``j`` of each equals the last hidden state
    of a plain causal forward over the row's prefix and the root-to-node path of block position j.

    Where every row holds one length and every block is a chain, this is the model's plain causal
    forward (no mask to build, its fastest path); else one 4D mask per layer kind (``hf.tree``).
    """
    rows, q = block.shape
    if parents is not None and any(p is not None and len(p) != q - 1 for p in parents):
        raise ValueError(f"a block of {q} positions holds the root and {q - 1} nodes; parents {list(parents)} do not")
    parents = [None] * rows if parents is None else [None if p is None or is_chain(p) else p for p in parents]
    common = cache.common_length
    if common is not None and all(p is None for p in parents):
        where = positions(common, q, block.device).expand(rows, q)
        return stack_forward(model, block, cache, where)
    masks, where = block_masks(model, cache.lengths, parents, q, block.device)
    return stack_forward(model, block, cache, where, attention_mask=masks)


def full_hidden(model: nn.Module, input_ids: torch.Tensor, cache: RollbackCache, keep: int) -> torch.Tensor:
    """The final hidden states ``[keep, H]`` of the last ``keep`` of ``input_ids [1, q]``, after the cache's tokens."""
    return block_hidden(model, input_ids, cache)[0, -keep:]


def full_logits(model: nn.Module, input_ids: torch.Tensor, cache: RollbackCache, keep: int) -> torch.Tensor:
    """The logits ``[keep, V]`` of the last ``keep`` of ``input_ids [1, q]`` after the cache's tokens
    (the head applied by ``adapters.logits_from_hidden``, which picks the fastest product for a few rows)."""
    return adapters.logits_from_hidden(model, full_hidden(model, input_ids, cache, keep))
