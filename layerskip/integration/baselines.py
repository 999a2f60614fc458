"""Hugging Face ``generate`` as the baseline every figure is measured against, and through our plug-in."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from layerskip.drafts.policy import SkipPolicy
from layerskip.integration.plugin import custom_generate_path
from layerskip.sampling import Sampling
from layerskip.stats import GenerationStats


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


@torch.inference_mode()
def hf_greedy_logits(model: nn.Module, input_ids: Sequence[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """HF greedy ``generate`` as ``hf_generate`` runs it (no EOS stop): the new tokens and the raw
    logits it chose each from, ``[n, V]`` float32 (the model's own values, upcast). Nothing else
    differs from the baseline's call, so the logits are the ones the baseline decided on."""
    device = next(model.parameters()).device
    ids = torch.tensor([list(input_ids)], device=device)
    kwargs = _generate_arguments(ids, max_new_tokens, (), None, None)
    out = model.generate(ids, output_logits=True, return_dict_in_generate=True, **kwargs)
    return out.sequences[0, ids.shape[1] :].tolist(), torch.cat(out.logits, dim=0).float()


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
    argument handling and the plug-in's, measured by bench's ``hf-custom`` method.
    """
    device = next(model.parameters()).device
    ids = torch.tensor([list(input_ids)], device=device)
    kwargs = _generate_arguments(ids, max_new_tokens, eos_token_ids, sampling, seed)
    kwargs.update(extra)  # generation arguments that add processors, as hf_generate takes them
    out = model.generate(
        ids,
        custom_generate=custom_generate_path(),
        trust_remote_code=True,
        skip_policy=policy,
        return_dict_in_generate=True,
        **kwargs,
    )
    return out.sequences[0, ids.shape[1] :].tolist(), out.stats


@torch.inference_mode()
def batched_continuations(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    pad_token_id: int,
    temperature: float = 0.0,
    batch_size: int = 16,
    seed: int = 0,
    progress: bool = False,
) -> list[list[int]]:
    """The model's own continuations of many prompts, ``batch_size`` at a time (left-padded):
    greedy, or sampled at ``temperature``. No EOS stop, so every continuation is full length
    (the data for self-distillation; batching makes it many times faster than one at a time)."""
    device = next(model.parameters()).device
    torch.manual_seed(seed)
    results: list[list[int]] = []
    for start in tqdm(range(0, len(prompts), batch_size), desc="own continuations", unit="batch", disable=not progress):
        group = [list(p) for p in prompts[start : start + batch_size]]
        width = max(len(p) for p in group)
        ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p in group], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group], device=device)
        sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else {}
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            pad_token_id=pad_token_id,
            eos_token_id=None,
            **({"do_sample": False, "temperature": None, "top_p": None, "top_k": None} | sampling),
        )
        results += out[:, width:].tolist()
    return results
