"""Several rows in one cache, each with its own length: the batched verify's cache and masks.

After each speculative step the rows of a batch have accepted different numbers of tokens, so
their committed lengths differ. Every row keeps its K/V contiguous from buffer position 0 (no
padding, no holes): a forward over a block of ``q`` positions writes row ``b``'s K/V at
``lengths[b] .. lengths[b] + q - 1``, and the keys every row attends to are the buffer's first
``max(lengths) + q`` positions. The 4D mask (``ragged_masks``) lets row ``b``'s query ``i`` see
key ``j`` only where ``j <= lengths[b] + i``, so positions past a shorter row's block (stale or
never written) are never read; positions are per row (``lengths[b] + i``), so each row computes
what it would compute alone. Rolling a row back moves its length, O(1).

A row's single-row drafter drafts through ``row_view(b)``: a ``RollbackCache`` whose layers are
views of row ``b`` of these buffers, so the draft's K/V land where the verify will overwrite them.
"""

from __future__ import annotations

from collections.abc import Sequence
from time import perf_counter

import torch
from torch import nn
from transformers.cache_utils import DynamicCache, DynamicLayer

from layerskip.hf import adapters
from layerskip.hf.cache import RollbackCache
from layerskip.hf.tree import model_masks

_MIN_CAPACITY = 256


class RaggedLayer(DynamicLayer):
    """K/V of one layer for every row: buffers ``[B, kv_heads, capacity, head_dim]``, lengths per row."""

    _layer_type = None  # never register in transformers' layer-type mapping

    def __init__(self, sliding_window: int | None, owner: RaggedCache) -> None:
        super().__init__()
        self.is_sliding = sliding_window is not None
        self.sliding_window = sliding_window
        self.owner = owner  # the lengths are the cache's: every layer writes at the same offsets
        self.key_buffer: torch.Tensor | None = None
        self.value_buffer: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype = self.owner.dtype or key_states.dtype
        self.device = key_states.device
        shape = (*key_states.shape[:2], self.owner.capacity, key_states.shape[-1])
        self.key_buffer = key_states.new_zeros(shape, dtype=self.dtype)
        self.value_buffer = value_states.new_zeros((*shape[:-1], value_states.shape[-1]), dtype=self.dtype)
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``[B, kv, q, d]`` at each row's length; return every row's first ``max + q`` keys."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.owner.reserve(self.owner.longest + key_states.shape[-2])
        rows, where = self.owner.write_index(key_states.shape[-2])  # [B, 1], [B, q]
        # Advanced indexing puts the indexed dims first: [B, q, kv, d] on both sides.
        self.key_buffer[rows, :, where] = key_states.transpose(1, 2).to(self.dtype)
        self.value_buffer[rows, :, where] = value_states.transpose(1, 2).to(self.dtype)
        end = self.owner.longest + key_states.shape[-2]
        self.keys = self.key_buffer[:, :, :end]
        self.values = self.value_buffer[:, :, :end]
        return self.keys, self.values

    def grow(self, capacity: int) -> None:
        if not self.is_initialized:
            return
        for name in ("key_buffer", "value_buffer"):
            old = getattr(self, name)
            new = old.new_zeros((*old.shape[:2], capacity, old.shape[-1]))
            new[:, :, : old.shape[-2]] = old
            setattr(self, name, new)

    def keep(self, rows: torch.Tensor) -> None:
        if self.is_initialized:
            self.key_buffer = self.key_buffer.index_select(0, rows)
            self.value_buffer = self.value_buffer.index_select(0, rows)

    def get_seq_length(self) -> int:
        return self.owner.longest

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.longest + query_length, 0

    def get_max_length(self) -> int:
        return -1


class RaggedCache(DynamicCache):
    """The cache of a batch whose rows hold different lengths (see the module doc).

    ``lengths`` are the committed tokens of each row; a forward appends ``q`` positions to every
    row (``advance``), and the caller then sets each row's length back to what it keeps (``set_lengths``).
    """

    def __init__(self, sliding_windows: Sequence[int | None], rows: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.dtype = dtype
        self.capacity = _MIN_CAPACITY
        self.growth_seconds = 0.0  # time spent growing the buffers (a step that grew is not its kind's usual cost)
        self.lengths = [0] * rows
        self._write_index: tuple[int, torch.Tensor, torch.Tensor] | None = None  # (q, rows, positions)
        self.layers = [RaggedLayer(window, self) for window in sliding_windows]
        self.layer_class_to_replicate = None

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def longest(self) -> int:
        return max(self.lengths, default=0)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.longest

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.longest + query_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.longest

    def reserve(self, positions: int) -> None:
        """Room for ``positions`` per row (buffers doubled when short; their dtype never changes)."""
        if positions <= self.capacity:
            return
        self.capacity = max(2 * self.capacity, positions)
        start = perf_counter()
        for layer in self.layers:
            layer.grow(self.capacity)
        self.growth_seconds += perf_counter() - start

    def write_index(self, q: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row indices ``[B, 1]`` and buffer positions ``[B, q]`` a block of ``q`` is written at
        (made once per forward: every layer writes at the same places)."""
        if self._write_index is None or self._write_index[0] != q:
            device = self._device()
            rows = torch.arange(self.rows, device=device)[:, None]
            where = torch.tensor(self.lengths, device=device)[:, None] + torch.arange(q, device=device)
            self._write_index = (q, rows, where)
        return self._write_index[1], self._write_index[2]

    def _device(self) -> torch.device:
        for layer in self.layers:
            if layer.is_initialized:
                return layer.device
        return torch.device("cpu")

    def set_lengths(self, lengths: Sequence[int]) -> None:
        """Each row's committed length after a step (a roll back or forward over written K/V)."""
        if len(lengths) != self.rows:
            raise ValueError(f"{len(lengths)} lengths for {self.rows} rows")
        self.lengths = [int(n) for n in lengths]
        self._write_index = None

    def keep_rows(self, rows: Sequence[int]) -> None:
        """Drop every row not in ``rows`` (finished rows leave the batch); the others keep their order."""
        index = torch.tensor(list(rows), device=self._device())
        for layer in self.layers:
            layer.keep(index)
        self.lengths = [self.lengths[r] for r in rows]
        self._write_index = None

    def row_view(self, row: int, view: RollbackCache | None = None) -> RollbackCache:
        """Row ``row`` as a single-row ``RollbackCache`` over these buffers (updated in place when
        ``view`` is given). A draft writes its K/V through it; the verify overwrites them."""
        if view is None:
            view = RollbackCache([layer.sliding_window for layer in self.layers], dtype=self.dtype)
        length = self.lengths[row]
        for mine, theirs in zip(self.layers, view.layers, strict=True):
            if not mine.is_initialized:
                continue
            theirs.dtype, theirs.device = mine.dtype, mine.device
            theirs._key_buffer = mine.key_buffer[row : row + 1]
            theirs._value_buffer = mine.value_buffer[row : row + 1]
            theirs.is_initialized = True
            theirs.length = theirs.written = length
            theirs._refresh_views()
        return view


def ragged_positions(lengths: Sequence[int], q: int, device: torch.device, limit: int | None) -> torch.Tensor:
    """``[B, q]`` position ids ``lengths[b] + i`` (kept below the model's ``limit``: only filler
    rows, which no real row sees, could pass it)."""
    positions = torch.tensor(list(lengths), device=device)[:, None] + torch.arange(q, device=device)
    return positions if limit is None else positions.clamp(max=limit - 1)


def ragged_masks(
    model: nn.Module, lengths: Sequence[int], q: int, device: torch.device
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The masks of a ``q``-position block over rows holding ``lengths`` committed tokens:
    ``[B, 1, q, max(lengths) + q]`` (``tree.model_masks``: per layer type where windows differ)."""
    starts = torch.tensor(list(lengths), device=device)[:, None, None]  # [B, 1, 1]
    query = starts + torch.arange(q, device=device)[None, :, None]  # [B, q, 1]: positions
    key = torch.arange(max(lengths) + q, device=device)[None, None, :]  # [1, 1, kv]: positions too

    def visible(window: int | None) -> torch.Tensor:
        allowed = key <= query  # [B, q, kv]
        if window is not None:
            allowed = allowed & ((query - key) < window)
        return allowed

    return model_masks(model, visible)


def ragged_hidden(model: nn.Module, block: torch.Tensor, cache: RaggedCache) -> torch.Tensor:
    """Final hidden states ``[B, q, H]`` of ``block [B, q]``, row ``b`` at positions from
    ``cache.lengths[b]``; the block's K/V are written after each row's committed tokens."""
    device = block.device
    lengths = list(cache.lengths)
    positions = ragged_positions(lengths, block.shape[1], device, adapters.max_positions(model))
    masks = ragged_masks(model, lengths, block.shape[1], device)
    hidden = adapters.stack_hidden(model, block, cache, positions, attention_mask=masks)
    return hidden


def model_ragged_cache(model: nn.Module, rows: int) -> RaggedCache:
    """An empty ragged cache of ``rows`` rows for ``model``, storing the model's dtype."""
    return RaggedCache(adapters.sliding_windows(model), rows, dtype=next(model.parameters()).dtype)
