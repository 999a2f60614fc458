"""Hugging Face ``generate`` as the baseline every figure is measured against, and through our plug-in."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from layerskip.drafts.policy.skip_policy import SkipPolicy
from layerskip.integration.plugin import custom_generate_path
from layerskip.sampling import Sampling
from layerskip.stats import GenerationStats


def _generate(
    model: nn.Module,
    input_ids: Sequence[int],
    max_new_tokens: int,
    eos_token_ids: Sequence[int],
    sampling: Sampling | None,
    seed: int | None,
    extra: dict[str, Any],
) -> tuple[Any, int]:
    """``model.generate`` on one prompt, greedy or with ``sampling`` (seeding torch's global RNG),
    ``extra`` last; returns its output and the prompt's length."""
    ids = torch.tensor([list(input_ids)], device=next(model.parameters()).device)
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
    return model.generate(ids, **kwargs | extra), ids.shape[1]


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
    out, start = _generate(model, input_ids, max_new_tokens, eos_token_ids, sampling, seed, extra)
    return out[0, start:].tolist()


@torch.inference_mode()
def hf_greedy_logits(model: nn.Module, input_ids: Sequence[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """HF greedy ``generate`` as ``hf_generate`` runs it (no EOS stop): the new tokens and the raw
    logits it chose each from, ``[n, V]`` float32 (the model's own values, upcast). Nothing else
    differs from the baseline's call, so the logits are the ones the baseline decided on."""
    extra = {"output_logits": True, "return_dict_in_generate": True}
    out, start = _generate(model, input_ids, max_new_tokens, (), None, None, extra)
    return out.sequences[0, start:].tolist(), torch.cat(out.logits, dim=0).float()


def hf_custom_generate(
    model: nn.Module,
    input_ids: Sequence[int],
    max_new_tokens: int,
    policy: SkipPolicy | str,
    eos_token_ids: Sequence[int] = (),
    sampling: Sampling | None = None,
    seed: int | None = None,
    **extra: Any,
) -> tuple[list[int], GenerationStats]:
    """``model.generate`` through our ``custom_generate`` plug-in, as a user calls it (directory form).

    Returns (new tokens, the engine's stats): what it costs over ``Decoder.decode`` is HF's
    argument handling and the plug-in's, measured by bench's ``hf-custom`` method. ``extra``:
    generation arguments that add processors, as ``hf_generate`` takes them.
    """
    plugin = dict(custom_generate=custom_generate_path(), trust_remote_code=True, skip_policy=policy)
    plugin["return_dict_in_generate"] = True
    out, start = _generate(model, input_ids, max_new_tokens, eos_token_ids, sampling, seed, extra | plugin)
    return out.sequences[0, start:].tolist(), out.stats
