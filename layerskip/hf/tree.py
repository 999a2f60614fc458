"""The masks of a verify block over B rows, each a chain or a flattened token tree at its own length.

``hf.forward.block_hidden`` runs the model's own Hugging Face forward with them. A verify block
for a tree is ``[pending, node 0, ..., node n-1]``: the pending token (the root,
block position 0) and the tree's nodes in depth-first order (node ``i`` at block position
``i + 1``), each with a parent earlier in the block. Every block row must see exactly what it
would see in a plain causal forward of its own root-to-node path:

* the whole committed prefix of its row (cache positions ``0..start-1``, positions ``0..start-1``),
* its ancestors, the root and itself, and no other node;
* position id ``start + depth`` (the root has depth 0), so rotary / learned position
  embeddings are those of the path;
* on a sliding-window layer, only keys whose *position* is within the window
  (``q_pos - k_pos < window``, HF's rule), not those within ``window`` block *rows*.

Transformers (5.x) passes a 4D mask ``[batch, 1, q, kv]`` through its mask builders unchanged
(``masking_utils._preprocess_mask_arguments`` returns any 4D tensor as it is). Models whose
layers all share one attention kind (Llama, Mistral and Phi-3 with one window for every layer,
Qwen2/3, GPT-NeoX, GPT-2) take one tensor. Models that mix full and sliding layers (Gemma 2/3)
build one mask per ``config.layer_types`` entry and accept that mapping already built, as a
dict ``{layer type: 4D mask}``; a single tensor there would silently drop the window.

The mask's format follows the attention implementation: ``sdpa`` takes a boolean mask (True =
attend), ``eager`` adds the mask to the scores, so it is 0 / the dtype's minimum. Flash and
flex attention cannot take an arbitrary 4D mask this way and are refused.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from layerskip.errors import LayerskipError
from layerskip.hf import adapters

# The parent index of the root's children: the pending token, block position 0. The same value
# as ``layerskip.sampling.ROOT`` (hf/ imports nothing of layerskip but its errors).
ROOT = -1

# Attention implementations whose 4D mask we know how to write: True = boolean mask, False =
# additive float mask (0 where attended, the dtype's minimum elsewhere).
_BOOLEAN_MASK = {"sdpa": True, "eager": False}


def check_parents(parents: Sequence[int]) -> None:
    """Parents must come earlier in the block (depth-first order guarantees it)."""
    for node, parent in enumerate(parents):
        if not ROOT <= parent < node:
            raise ValueError(f"node {node} has parent {parent}: a parent must be -1 (the root) or an earlier node")


def block_depths(parents: Sequence[int]) -> list[int]:
    """Depth of every block position: ``[0 (root), depth of node 0, ...]``; the root's children have depth 1."""
    check_parents(parents)
    depths = [0]
    for parent in parents:
        depths.append(depths[parent + 1] + 1)  # block position of a parent = its node index + 1
    return depths


def block_visibility(parents: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """``[n+1, n+1]`` bool: row ``a`` (block position) may attend to column ``b`` iff ``b`` is ``a``,
    the root or an ancestor of ``a``."""
    check_parents(parents)
    size = len(parents) + 1
    visible = torch.eye(size, dtype=torch.bool)
    visible[:, 0] = True
    for node, parent in enumerate(parents):
        # Parents come first, so the parent's row is complete: inherit it.
        visible[node + 1] |= visible[parent + 1]
    return visible.to(device)


def _mask_format(model: nn.Module) -> bool:
    implementation = getattr(model.config, "_attn_implementation", None) or "eager"
    if implementation not in _BOOLEAN_MASK:
        raise LayerskipError(
            f"token-tree verification needs 'sdpa' or 'eager' attention, but the model uses '{implementation}'; "
            "load it with attn_implementation='sdpa'"
        )
    return _BOOLEAN_MASK[implementation]


def _as_model_mask(allowed: torch.Tensor, boolean: bool, dtype: torch.dtype) -> torch.Tensor:
    """``[B, q, kv]`` bool -> the ``[B, 1, q, kv]`` mask the attention implementation expects."""
    allowed = allowed[:, None]
    if boolean:
        return allowed
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)


def model_masks(
    model: nn.Module, visible: Callable[[int | None], torch.Tensor]
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The attention mask(s) the model takes, from ``visible(window) -> [B, q, kv]`` bool (what
    each query may see on a layer with that sliding window, None for full attention).

    One ``[B, 1, q, kv]`` tensor when every layer has the same window (or none); else a dict from
    each ``config.layer_types`` entry to its tensor (how Gemma 2/3 take masks).
    """
    boolean = _mask_format(model)
    dtype = model.get_input_embeddings().weight.dtype
    windows = adapters.sliding_windows(model)
    masks = {w: _as_model_mask(visible(w), boolean, dtype) for w in set(windows)}
    if len(masks) == 1:
        return next(iter(masks.values()))
    config = model.config.get_text_config(decoder=True)
    types = getattr(config, "layer_types", None)
    if types is None:
        raise LayerskipError(
            f"'{adapters.architecture_of(model)}' mixes attention windows {sorted(map(str, masks))} "
            "without config.layer_types: no per-layer mask can be passed to it"
        )
    by_type: dict[str, torch.Tensor] = {}
    for kind, window in zip(types[: config.num_hidden_layers], windows, strict=True):
        if by_type.setdefault(kind, masks[window]) is not masks[window]:
            raise LayerskipError(f"layers of type '{kind}' use different windows; cannot build one mask for them")
    return by_type


def block_masks(
    model: nn.Module, lengths: Sequence[int], parents: Sequence[Sequence[int] | None], q: int, device: torch.device
) -> tuple[torch.Tensor | dict[str, torch.Tensor], torch.Tensor]:
    """The masks and position ids of a verify block of ``q`` positions per row: row ``b`` holds
    ``lengths[b]`` committed tokens and its block ``[pending, node 0..q-2]`` has ``parents[b]``
    (None: a chain). Returns the masks ``[B, 1, q, max(lengths) + q]`` (``model_masks``) and the
    positions ``[B, q]`` (``lengths[b] + depth``).

    Row ``b``'s query ``i`` sees every committed key of its own row, its block's root, its
    ancestors and itself (written at buffer positions ``lengths[b] + k``), and nothing past them
    (another row's longer block, stale K/V); on a sliding-window layer only keys whose position is
    within the window of the query's."""
    rows = len(lengths)
    start = torch.tensor(list(lengths), device=device)[:, None]  # [B, 1]
    chain = torch.ones(q, q, dtype=torch.bool, device=device).tril()
    seen = torch.stack(
        [chain if p is None else block_visibility(p, device) for p in parents]
    )  # [B, q, q]: block row i sees block row k
    depths = torch.stack(
        [torch.arange(q, device=device) if p is None else torch.tensor(block_depths(p), device=device) for p in parents]
    )  # [B, q]
    query = start + depths  # [B, q] positions
    key = torch.arange(max(lengths) + q, device=device)[None, :]  # [1, K] buffer positions
    offset = key - start  # [B, K]: a key's place in its row's block (negative: the committed prefix)
    in_block = (offset >= 0) & (offset < q)
    inside = offset.clamp(0, q - 1)  # [B, K]
    block_seen = seen.gather(2, inside[:, None, :].expand(rows, q, -1))  # [B, q, K]
    allowed = (offset < 0)[:, None, :] | (in_block[:, None, :] & block_seen)
    key_position = torch.where(offset < 0, key, start + depths.gather(1, inside))  # [B, K]

    def visible(window: int | None) -> torch.Tensor:
        if window is None:
            return allowed
        return allowed & ((query[:, :, None] - key_position[:, None, :]) < window)

    limit = adapters.max_positions(model)
    # Only filler rows, which no real row sees, could pass the model's last position.
    positions = query if limit is None else query.clamp(max=limit - 1)
    return model_masks(model, visible), positions


def is_chain(parents: Sequence[int]) -> bool:
    """Whether every node's parent is the node before it: the block is a plain causal one."""
    return all(parent == node - 1 for node, parent in enumerate(parents))
