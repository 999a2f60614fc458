"""Hugging Face ``generate`` as the baseline every figure is measured against, and through our plug-in."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from layerskip.engine.policy import SkipPolicy
from layerskip.engine.sampling import Sampling
from layerskip.engine.stats import GenerationStats
from layerskip.hf import custom_generate_path


def _generate_arguments(
    ids: torch.Tensor,
    max_new_tokens: int,
    eos_token_ids: Sequence[int],
    sampling: Sampling | None,
    seed: int | None,
) -> dict[str, Any]:
    """``generate`` keywords for one prompt, greedy or with ``sampling``; seeds torch's global RNG."""
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
    return kwargs


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
    kwargs = _generate_arguments(ids, max_new_tokens, eos_token_ids, sampling, seed)
    kwargs.update(extra)
    out = model.generate(ids, **kwargs)
    return out[0, ids.shape[1] :].tolist()


def hf_custom_generate(
    model: nn.Module,
    input_ids: Sequence[int],
    max_new_tokens: int,
    policy: SkipPolicy,
    eos_token_ids: Sequence[int] = (),
    sampling: Sampling | None = None,
    seed: int | None = None,
) -> tuple[list[int], GenerationStats]:
    """``model.generate`` through our ``custom_generate`` plug-in, as a user calls it (directory form).

    Returns (new tokens, the engine's stats): what it costs over ``Decoder.decode`` is HF's
    argument handling and the plug-in's, measured by bench's ``hf-custom`` method.
    """
    device = next(model.parameters()).device
    ids = torch.tensor([list(input_ids)], device=device)
    kwargs = _generate_arguments(ids, max_new_tokens, eos_token_ids, sampling, seed)
    out = model.generate(
        ids,
        custom_generate=custom_generate_path(),
        trust_remote_code=True,
        skip_policy=policy,
        return_dict_in_generate=True,
        **kwargs,
    )
    return out.sequences[0, ids.shape[1] :].tolist(), out.stats
