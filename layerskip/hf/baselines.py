"""Hugging Face ``generate`` as the baseline every figure is measured against."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from layerskip.engine.sampling import Sampling


@torch.inference_mode()
def hf_generate(
    model: nn.Module,
    input_ids: Sequence[int],
    max_new_tokens: int,
    eos_token_ids: Sequence[int] = (),
    sampling: Sampling | None = None,
    seed: int | None = None,
    **extra: Any,
) -> list[int]:
    """Run ``model.generate`` on one prompt; returns the new tokens (callers time it: ``measure.timing``).

    ``extra`` passes HF's own speculative options (``prompt_lookup_num_tokens``,
    ``assistant_early_exit``, ``assistant_model``) straight through.
    """
    device = next(model.parameters()).device
    ids = torch.tensor([list(input_ids)], device=device)
    kwargs: dict[str, Any] = dict(
        max_new_tokens=max_new_tokens,
        attention_mask=torch.ones_like(ids),
        eos_token_id=list(eos_token_ids) or None,
        pad_token_id=eos_token_ids[0] if eos_token_ids else 0,
    )
    if sampling is None:
        kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    else:
        kwargs.update(
            do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or None
        )
        if seed is not None:
            torch.manual_seed(seed)
    kwargs.update(extra)
    out = model.generate(ids, **kwargs)
    return out[0, ids.shape[1] :].tolist()
