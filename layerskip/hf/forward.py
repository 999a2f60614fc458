"""Full-model forward passes over the shared cache with explicit positions.

Positions are always passed explicitly: the cache's past length is the longest layer's, but
being explicit means no code path ever infers a position from a layer that was bypassed.
"""

from __future__ import annotations

import torch
from torch import nn

from layerskip.hf import adapters
from layerskip.hf.cache import RollbackCache


def positions(start: int, count: int, device: torch.device) -> torch.Tensor:
    return torch.arange(start, start + count, device=device).unsqueeze(0)  # [1, count]


def full_hidden(model: nn.Module, input_ids: torch.Tensor, cache: RollbackCache, start: int, keep: int) -> torch.Tensor:
    """The final hidden states ``[keep, H]`` of the last ``keep`` of ``input_ids [1, q]`` at positions start..."""
    hidden = adapters.stack_hidden(model, input_ids, cache, positions(start, input_ids.shape[1], input_ids.device))
    return hidden[0, -keep:]


def full_logits(model: nn.Module, input_ids: torch.Tensor, cache: RollbackCache, start: int, keep: int) -> torch.Tensor:
    """Run the whole model over ``input_ids [1, q]`` at positions start..start+q-1.

    Returns the logits of the last ``keep`` positions, ``[keep, V]`` (the head applied by
    ``adapters.logits_from_hidden``, which picks the fastest product for a few rows).
    """
    hidden = adapters.stack_hidden(model, input_ids, cache, positions(start, input_ids.shape[1], input_ids.device))
    return adapters.logits_from_hidden(model, hidden[0, -keep:])
