"""The one KV cache: B rows (a generation is a batch of one), each with its own length, rolled back in O(1).

Every row keeps its K/V contiguous from buffer position 0 (no padding, no holes) in buffers
``[B, kv_heads, capacity, head_dim]`` per layer, grown geometrically (like a vector) and always
in the model's dtype (a draft in another precision writes into them too; its K/V are cast on
write). Row ``b`` holds ``lengths[b]`` tokens, one length for all layers:

* a forward over a block of ``q`` positions writes row ``b``'s K/V at ``lengths[b] ..
  lengths[b] + q - 1`` in every layer it runs, and then moves every row on by ``q``
  (``advance``; ``hf.forward`` and the lean step do it after each forward);
* rolling a row back moves its length (``set_lengths``, ``rollback``): O(1), nothing copied;
* a token tree's accepted path is gathered per row (``keep_paths``), O(path).

A layer a draft bypasses writes nothing, so its K/V past the committed length are stale; a draft
runs one skip set throughout, so no layer reads what it did not write, and the verify rewrites
every layer from the committed length. An exit draft that reuses its shallow layers' K/V relies on
the same rule: the verify runs only the deeper layers, and the shallow ones keep what the draft
wrote at exactly those positions.

Every row attends to the buffer's first ``max(lengths) + q`` keys; where rows' lengths differ (or
a block is a tree) the verify passes a 4D mask (``hf.tree.block_masks``) so row ``b``'s query
``i`` sees only its own prefix and block; positions are per row, so each row computes what it
would compute alone. Sliding-window layers keep their full history too and rely on the windowed
mask, so a rollback past the window is always possible.
"""

from __future__ import annotations

from collections.abc import Sequence
from time import perf_counter

import torch
from torch import nn
from transformers.cache_utils import DynamicCache, DynamicLayer

from layerskip.hf import adapters

_MIN_CAPACITY = 256  # positions a buffer starts with (tests patch it small to cross growths)


class CacheLayer(DynamicLayer):
    """K/V of one layer for every row: buffers ``[B, kv_heads, capacity, head_dim]``; the lengths are the cache's."""

    _layer_type = None  # never register in transformers' layer-type mapping

    def __init__(self, sliding_window: int | None, owner: RollbackCache) -> None:
        super().__init__()
        self.is_sliding = sliding_window is not None
        self.sliding_window = sliding_window
        self.owner = owner  # every layer writes at the same offsets: the cache's lengths
        self.key_buffer: torch.Tensor | None = None
        self.value_buffer: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype = self.owner.dtype or key_states.dtype
        self.owner.dtype = self.dtype  # the first writer's dtype where none was given, for good
        self.device = key_states.device
        # Zeros, not garbage: masked keys are never weighted, but a NaN value would still poison
        # the weighted sum (0 * NaN).
        shape = (self.owner.rows, key_states.shape[1], self.owner.capacity, key_states.shape[-1])
        self.key_buffer = key_states.new_zeros(shape, dtype=self.dtype)
        self.value_buffer = value_states.new_zeros((*shape[:-1], value_states.shape[-1]), dtype=self.dtype)
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``[B, kv, q, d]`` at each row's length; return every row's first ``max + q`` keys."""
        q = key_states.shape[-2]
        self.owner.reserve(self.owner.longest + q)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.owner.common_length
        if start is not None:  # every row at one length: a slice, no index tensors
            self.key_buffer[:, :, start : start + q] = key_states
            self.value_buffer[:, :, start : start + q] = value_states
        else:
            rows, where = self.owner.write_index(q)  # [B, 1], [B, q]
            # Advanced indexing puts the indexed dims first: [B, q, kv, d] on both sides.
            self.key_buffer[rows, :, where] = key_states.transpose(1, 2).to(self.dtype)
            self.value_buffer[rows, :, where] = value_states.transpose(1, 2).to(self.dtype)
        end = self.owner.longest + q
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

    def move_rows(self, into: torch.Tensor, source: torch.Tensor, rows: int) -> None:
        """Rows ``source`` copied into rows ``into``, then the first ``rows`` rows kept (a view)."""
        if self.is_initialized:
            for name in ("key_buffer", "value_buffer"):
                buffer = getattr(self, name)
                if len(into):
                    buffer.index_copy_(0, into, buffer.index_select(0, source))
                setattr(self, name, buffer[:rows])

    # transformers' Cache asks its layers (the first one) for these: every layer answers with the
    # cache's longest row.
    def get_seq_length(self) -> int:
        return self.owner.longest

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.longest + query_length, 0


class RollbackCache(DynamicCache):
    """A DynamicCache of ``rows`` rows, each with its own length (see the module doc)."""

    def __init__(
        self,
        sliding_windows: Sequence[int | None],
        rows: int = 1,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if rows < 1:
            raise ValueError(f"a cache holds at least one row, not {rows}")
        self.dtype = dtype
        self.capacity = _MIN_CAPACITY
        self.growth_seconds = 0.0  # time spent growing the buffers (a step that grew is not its kind's usual cost)
        self.lengths = [0] * rows
        self.common_length: int | None = 0  # the one length every row holds (None where they differ)
        self._write_index: tuple[int, torch.Tensor, torch.Tensor] | None = None  # (q, rows, positions)
        self.layers = [CacheLayer(window, self) for window in sliding_windows]
        self.layer_class_to_replicate = None

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def longest(self) -> int:
        return max(self.lengths)

    def reserve(self, positions: int) -> None:
        """Room for ``positions`` per row (buffers doubled when short; their dtype never changes)."""
        if positions <= self.capacity:
            return
        self.capacity = max(2 * self.capacity, positions)
        start = perf_counter()
        for layer in self.layers:
            layer.grow(self.capacity)
        self.growth_seconds += perf_counter() - start

    def reserve_ahead(self, positions: int) -> None:
        """Room the caller expects to fill (prompt and budget) in one allocation, sparing later
        doublings and their copies; only an optimisation (tests turn it off to cross growths)."""
        self.reserve(positions)

    def write_index(self, q: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row indices ``[B, 1]`` and buffer positions ``[B, q]`` a block of ``q`` is written at
        (made once per forward: every layer writes at the same places)."""
        if self._write_index is None or self._write_index[0] != q:
            device = self.device
            rows = torch.arange(self.rows, device=device)[:, None]
            where = torch.tensor(self.lengths, device=device)[:, None] + torch.arange(q, device=device)
            self._write_index = (q, rows, where)
        return self._write_index[1], self._write_index[2]

    @property
    def device(self) -> torch.device:
        for layer in self.layers:
            if layer.is_initialized:
                return layer.device
        return torch.device("cpu")

    def set_lengths(self, lengths: Sequence[int]) -> None:
        """Each row's length (a roll back, or forward over K/V the last forward wrote)."""
        if len(lengths) != self.rows:
            raise ValueError(f"{len(lengths)} lengths for {self.rows} rows")
        self.lengths = [int(n) for n in lengths]
        self._lengths_changed()

    def _lengths_changed(self) -> None:
        first = self.lengths[0]
        self.common_length = first if all(n == first for n in self.lengths) else None
        self._write_index = None

    def advance(self, q: int) -> None:
        """Every row on by ``q``: what a forward over a ``[B, q]`` block wrote."""
        self.set_lengths([n + q for n in self.lengths])

    def rollback(self, length: int) -> None:
        """Every row cut to ``length`` tokens (none of them may hold fewer)."""
        short = [n for n in self.lengths if n < length]
        if short:
            raise RuntimeError(f"a row holds {short[0]} tokens, fewer than the {length} to roll back to")
        self.set_lengths([length] * self.rows)

    def crop(self, tokens_to_remove: int) -> None:
        # transformers 5.x convention: a negative count removes that many tokens.
        target = tokens_to_remove if tokens_to_remove > 0 else self.longest + tokens_to_remove
        self.rollback(target)

    def keep_rows(self, rows: Sequence[int]) -> None:
        """Drop every row not in ``rows`` (finished rows leave the batch); the others keep their order."""
        index = torch.tensor(list(rows), device=self.device)
        for layer in self.layers:
            layer.keep(index)
        self.lengths = [self.lengths[r] for r in rows]
        self._lengths_changed()

    def drop_rows(self, gone: Sequence[int]) -> list[int]:
        """Drop rows ``gone`` (finished rows leave the batch) by moving the last rows kept into the
        places they free, not by copying every row kept; returns the kept rows' former indices in
        their new order. A copy of every row, as ``keep_rows`` makes, cost a batch ~0.5 s each time
        a row left near its end (sixteen rows of Gemma-3 at ~900 positions: 0.5 GB)."""
        dropped = set(gone)
        count = self.rows - len(dropped)
        holes = [r for r in range(count) if r in dropped]
        movers = [r for r in range(count, self.rows) if r not in dropped]
        order = list(range(count))
        for hole, mover in zip(holes, movers, strict=True):
            order[hole] = mover
        into = torch.tensor(holes, dtype=torch.long, device=self.device)
        source = torch.tensor(movers, dtype=torch.long, device=self.device)
        for layer in self.layers:
            layer.move_rows(into, source, count)
        self.lengths = [self.lengths[r] for r in order]
        self._lengths_changed()
        return order

    def keep_paths(self, starts: Sequence[int], paths: Sequence[Sequence[int]]) -> None:
        """After a verify wrote row ``b``'s block at ``starts[b]..``, keep its accepted path: block
        rows ``paths[b]`` (ascending, the root 0 first) move to ``starts[b]..starts[b]+len-1`` and
        the row's length ends there.

        Rows already in place (every path of a chain, a path along a depth-first block's first
        branch) are not copied, so such a path costs what a rollback does; the others are gathered
        (one index_select per layer and moved row), O(path).
        """
        if len(starts) != self.rows or len(paths) != self.rows:
            raise ValueError(f"{len(starts)} starts and {len(paths)} paths for {self.rows} rows")
        for b, (start, path) in enumerate(zip(starts, paths, strict=True)):
            if not path or path[0] < 0 or any(y <= x for x, y in zip(path, path[1:], strict=False)):
                raise ValueError(f"rows {list(path)} must be ascending block positions")
            if start + path[-1] >= self.lengths[b]:
                last = start + path[-1]
                raise RuntimeError(f"row {b} holds {self.lengths[b]} tokens; the kept block reaches row {last}")
            moved_from = next((i for i, row in enumerate(path) if row != i), len(path))
            if moved_from < len(path):
                source = torch.tensor([start + r for r in path[moved_from:]], device=self.device)
                for layer in self.layers:
                    if not layer.is_initialized:
                        continue
                    # index_select copies the source rows out first, so writing them back over
                    # positions they may overlap is safe. [kv_heads, m', head_dim] each.
                    for buffer in (layer.key_buffer, layer.value_buffer):
                        buffer[b, :, start + moved_from : start + len(path)] = buffer[b].index_select(-2, source)
        self.set_lengths([start + len(path) for start, path in zip(starts, paths, strict=True)])

    def row_view(self, row: int, view: RollbackCache | None = None) -> RollbackCache:
        """Row ``row`` as a one-row cache over these buffers (``view`` updated in place when given):
        a drafter that drafts one row at a time writes its K/V through it, where the verify will
        overwrite them. The caller reserves room first, so the view never grows away from them."""
        if not any(layer.is_initialized for layer in self.layers):
            raise RuntimeError("a row view shares buffers a first forward makes: run one over every row first")
        if view is None:
            view = RollbackCache([layer.sliding_window for layer in self.layers], 1, self.dtype)
        view.capacity = self.capacity
        for mine, theirs in zip(self.layers, view.layers, strict=True):
            if not mine.is_initialized:
                continue
            theirs.dtype, theirs.device = mine.dtype, mine.device
            theirs.key_buffer = mine.key_buffer[row : row + 1]
            theirs.value_buffer = mine.value_buffer[row : row + 1]
            theirs.is_initialized = True
        view.set_lengths([self.lengths[row]])
        return view


def model_cache(model: nn.Module, windows: Sequence[int | None] | None = None, rows: int = 1) -> RollbackCache:
    """An empty cache of ``rows`` rows for ``model``: one layer per window (the model's own by
    default), storing the model's dtype whatever precision a draft writes in."""
    windows = adapters.sliding_windows(model) if windows is None else windows
    return RollbackCache(windows, rows, dtype=next(model.parameters()).dtype)
