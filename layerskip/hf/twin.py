"""An off-grid twin of a model: its decoder weights moved off any 4-bit grid, for honest figures.

A model dequantised from a Q4_1 GGUF file (SmolLM2's) sits on a 4-bit grid in blocks of 32
inputs: an int4 draft in blocks of 32 (a scale and minimum per block) reproduces it
exactly, and its drafts agree with the model far more often than a full-precision model's would
(Gemma-3's Q4_K_M file is not on that grid: its int4 copy moves it as much as a twin's). A twin
adds to every decoder projection uniform noise of up to ``scale`` of one 4-bit step of its block
(``(max - min) / 15`` over each row's 32 inputs): with ``scale`` 0.5, what one int4 rounding of a
full-precision model changes. The model's behaviour barely moves; the draft's agreement falls to
what a user's own bf16 or fp32 model would give. Seeded, so a twin is the same twin on every
machine.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from layerskip.hf import adapters

BLOCK = 32  # inputs per 4-bit block (GGUF's Q4 blocks and the int4 draft's groups)
LEVELS = 15  # a 4-bit block spans 16 levels: 15 steps from its minimum to its maximum


@torch.no_grad()
def off_grid_(model: nn.Module, scale: float = 0.5, seed: int = 0) -> int:
    """Move every decoder projection's weights off the 4-bit grid, in place; returns how many
    weights changed. Embeddings, norms and the LM head are left as they are (the draft's head
    rows come from the model's own head, and the verify uses it whole)."""
    generator = torch.Generator().manual_seed(seed)
    return sum(_perturb(weight, scale, generator) for weight in decoder_projection_weights(model))


def decoder_projection_weights(model: nn.Module) -> Iterator[torch.Tensor]:
    """Every decoder projection's weight ``[out, in]``, layer by layer (a view for GPT-2's Conv1D)."""
    for index in range(adapters.num_layers(model)):
        for kind in ("attention", "mlp"):
            for module in adapters.sublayer_projections(model, index, kind):
                yield adapters.projection_weight(module)[0]


def _perturb(weight: torch.Tensor, scale: float, generator: torch.Generator) -> int:
    out_features, in_features = weight.shape
    usable = in_features - in_features % BLOCK  # a ragged tail keeps its own step, below
    values = weight.detach().float()
    noise = torch.empty(out_features, in_features).uniform_(-1.0, 1.0, generator=generator)
    step = torch.empty_like(values)
    if usable:
        blocks = values[:, :usable].reshape(out_features, -1, BLOCK)  # [out, blocks, 32]
        spread = (blocks.amax(-1) - blocks.amin(-1)) / LEVELS  # [out, blocks]
        step[:, :usable] = spread.repeat_interleave(BLOCK, dim=1)
    if usable < in_features:
        tail = values[:, usable:]
        step[:, usable:] = ((tail.amax(-1) - tail.amin(-1)) / LEVELS)[:, None]
    weight.copy_((values + scale * step * noise.to(values.device)).to(weight.dtype))
    return weight.numel()
