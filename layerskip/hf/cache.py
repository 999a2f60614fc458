"""One KV cache shared by draft and verify, rolled back per layer without copying.

While drafting, bypassed attention sublayers write no K/V, so layers' lengths diverge. Before
verifying, every layer is rolled back to the committed length; verification runs all layers
over the block; afterwards everything is rolled back to the accepted length. Rolling back is
O(1): each layer keeps its K/V in a preallocated buffer (grown geometrically, like a vector)
and a length; cropping only moves the length.

Sliding-window layers keep their full history too and rely on the sliding attention mask, so
a rollback past the window is always possible and the attention is exactly what a windowed
cache would give.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from transformers.cache_utils import DynamicCache, DynamicLayer

from layerskip.hf import adapters

_MIN_CAPACITY = 256  # positions a layer's buffer starts with (a test passes a few to cross growths)


class RollbackLayer(DynamicLayer):
    """K/V of one layer in a buffer ``[batch, kv_heads, capacity, head_dim]`` plus a length."""

    _layer_type = None  # never register in transformers' layer-type mapping

    def __init__(
        self,
        sliding_window: int | None = None,
        dtype: torch.dtype | None = None,
        initial_capacity: int | None = None,
    ) -> None:
        super().__init__()
        self.is_sliding = sliding_window is not None
        self.sliding_window = sliding_window
        # What the buffer stores, fixed for its life: the model's dtype. A draft in another
        # precision (bf16 or int4 products) writes into it too; its K/V are cast on write, and
        # growing the buffer never changes what it holds (None: the first writer's dtype).
        self.dtype = dtype
        self.initial_capacity = max(1, initial_capacity or _MIN_CAPACITY)
        self.length = 0
        # Tokens whose K/V in the buffer are still valid: rolling back keeps them, so a layer
        # hidden for one forward can be revealed again (``reveal``); a write past ``length``
        # makes everything after the write stale.
        self.written = 0
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype = self.dtype or key_states.dtype
        self.device = key_states.device
        # A prompt longer than the initial capacity fills its buffer exactly: the first token after
        # it grows the buffer (doubling), once, like any later growth.
        self._allocate(key_states, value_states, max(self.initial_capacity, key_states.shape[-2]))
        self.is_initialized = True

    def _allocate(self, key_states: torch.Tensor, value_states: torch.Tensor, capacity: int) -> None:
        def grow(old: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
            shape = (*like.shape[:-2], capacity, like.shape[-1])
            new = like.new_empty(shape, dtype=self.dtype)
            if old is not None and self.length:
                new[..., : self.length, :] = old[..., : self.length, :]
            return new

        self._key_buffer = grow(self._key_buffer, key_states)
        self._value_buffer = grow(self._value_buffer, value_states)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new_length = self.length + key_states.shape[-2]
        if new_length > self._key_buffer.shape[-2]:
            self._allocate(key_states, value_states, 2 * new_length)
        self._key_buffer[..., self.length : new_length, :] = key_states
        self._value_buffer[..., self.length : new_length, :] = value_states
        self.length = new_length
        self.written = new_length
        self._refresh_views()
        return self.keys, self.values

    def _refresh_views(self) -> None:
        # Views, not copies: attention reads ``[..., :length, :]`` of the buffer.
        self.keys = self._key_buffer[..., : self.length, :]
        self.values = self._value_buffer[..., : self.length, :]

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def truncate(self, length: int) -> None:
        if length > self.length:
            raise RuntimeError(f"cannot roll a layer of length {self.length} forward to {length}")
        if self.is_initialized:
            self.length = length
            self._refresh_views()

    def reveal(self, length: int) -> None:
        """Move the length forward again over K/V written earlier and only rolled back since."""
        if length > self.written:
            raise RuntimeError(f"cannot reveal {length} tokens of a layer with {self.written} valid")
        if self.is_initialized:
            self.length = length
            self._refresh_views()

    def crop(self, tokens_to_remove: int) -> None:
        # transformers 5.x convention: a negative count removes that many tokens.
        if tokens_to_remove > 0:
            self.truncate(tokens_to_remove)
        else:
            self.truncate(self.length + tokens_to_remove)

    def keep_rows(self, start: int, rows: torch.Tensor, moved_from: int) -> None:
        """Keep block rows ``start + rows`` (``rows [m]``, ascending, on the buffer's device) as rows
        ``start..start+m-1``; cut the rest.

        ``rows[:moved_from]`` are already in place (``rows[i] == i``), so only the tail is
        gathered: an index_select of ``m - moved_from`` rows, O(path), never the whole cache.
        """
        kept = len(rows)
        if moved_from < kept:
            source = start + rows[moved_from:]
            # index_select copies the source rows out first, so writing them back over rows
            # they may overlap is safe. [B, kv_heads, m', head_dim] each.
            for buffer in (self._key_buffer, self._value_buffer):
                buffer[..., start + moved_from : start + kept, :] = buffer.index_select(-2, source)
        self.length = start + kept
        # The rows after the path held other branches' K/V: nothing there can be revealed.
        self.written = self.length
        self._refresh_views()

    def reset(self) -> None:
        self.length = 0
        self.written = 0
        if self.is_initialized:
            self._refresh_views()


class RollbackCache(DynamicCache):
    """A DynamicCache whose layers can each be rolled back to a length in O(1).

    Every length the model asks for (past length, mask sizes, query offset) is the *longest*
    layer's: during drafting the layers that are not bypassed all share that length, while
    bypassed ones lag and are never read. This keeps masks and positions right even when
    layer 0's attention is bypassed.
    """

    def __init__(
        self,
        sliding_windows: list[int | None],
        dtype: torch.dtype | None = None,
        initial_capacity: int | None = None,
    ) -> None:
        super().__init__()
        self.layers = [RollbackLayer(window, dtype, initial_capacity) for window in sliding_windows]
        self.layer_class_to_replicate = None

    @property
    def length(self) -> int:
        return max((layer.length for layer in self.layers), default=0)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.length

    def rollback(self, length: int) -> None:
        """Cut every layer to ``length`` tokens. Layers shorter than that are a bug upstream."""
        for layer in self.layers:
            if layer.length > length:
                layer.truncate(length)
            elif layer.length < length and layer.is_initialized:
                raise RuntimeError(f"layer holds {layer.length} tokens, fewer than the {length} committed")

    def crop(self, tokens_to_remove: int) -> None:
        target = tokens_to_remove if tokens_to_remove > 0 else self.length + tokens_to_remove
        self.rollback(target)

    def keep_path(self, start: int, rows: Sequence[int]) -> None:
        """After a token-tree verify wrote block rows ``start..start+n`` in every layer, keep the
        accepted path: block rows ``rows`` (ascending, the root 0 first, then the accepted nodes'
        block positions) move to ``start..start+len(rows)-1`` and everything after is cut.

        Rows already in place (a path along the first branch of a depth-first block, every path
        of a chain) are not copied, so a path that moves none costs what a rollback does; the
        others are gathered with one index_select per layer, so the cost is O(path).
        """
        if not rows or rows[0] < 0 or any(b <= a for a, b in zip(rows, rows[1:], strict=False)):
            raise ValueError(f"rows {list(rows)} must be ascending block positions")
        moved_from = next((i for i, row in enumerate(rows) if row != i), len(rows))
        indices: dict[torch.device, torch.Tensor] = {}  # one index tensor per device the layers live on
        for layer in self.layers:
            if not layer.is_initialized:
                continue
            if layer.length < start + rows[-1] + 1:
                last = start + rows[-1]
                raise RuntimeError(f"a layer holds {layer.length} tokens; the tree block reaches row {last}")
            if layer.device not in indices:
                indices[layer.device] = torch.tensor(rows, device=layer.device)
            layer.keep_rows(start, indices[layer.device], moved_from)

    def reveal(self, length: int, layers: list[int]) -> None:
        """Move ``layers`` forward to ``length`` over K/V they wrote before a rollback hid it.

        An exit draft that reuses its shallow layers' K/V writes them while drafting; the
        verify after it runs only the deeper layers, so the shallow ones are hidden (rolled
        back, their buffers kept) for the verify and revealed after it.
        """
        for index in layers:
            self.layers[index].reveal(length)


def model_cache(model: nn.Module, windows: list[int | None] | None = None) -> RollbackCache:
    """An empty cache for ``model``: one layer per window (the model's own by default), storing
    the model's dtype whatever precision a draft writes in."""
    windows = adapters.sliding_windows(model) if windows is None else windows
    return RollbackCache(windows, dtype=next(model.parameters()).dtype)
