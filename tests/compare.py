"""Token-for-token comparison against Hugging Face ``generate`` with a diagnosable failure message."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn


def first_divergence(got: Sequence[int], ref: Sequence[int]) -> int | None:
    """Index of the first differing token (a length difference counts), or None if equal."""
    for i, (a, b) in enumerate(zip(got, ref, strict=False)):
        if a != b:
            return i
    return None if len(got) == len(ref) else min(len(got), len(ref))


@torch.inference_mode()
def hf_greedy(model: nn.Module, prompt: Sequence[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """HF greedy ``generate`` without EOS: (new tokens, their raw logits ``[n, V]``)."""
    ids = torch.tensor([list(prompt)])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        temperature=None,
        top_p=None,
        top_k=None,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return out.sequences[0, ids.shape[1] :].tolist(), torch.cat(out.logits, dim=0).float()


@torch.inference_mode()
def teacher_forced_logits(model: nn.Module, prompt: Sequence[int], ref: Sequence[int], index: int) -> torch.Tensor:
    """The full model's logits ``[V]`` for the token at ``ref[index]`` (prompt + ref[:index] as context)."""
    ids = torch.tensor([[*prompt, *ref[:index]]], device=next(model.parameters()).device)
    return model(input_ids=ids).logits[0, -1].float().cpu()


def top2_gap(logits: torch.Tensor) -> float:
    top = logits.float().topk(2).values
    return float(top[0] - top[1])


def mismatch_message(
    got: Sequence[int],
    ref: Sequence[int],
    *,
    ref_logits: torch.Tensor | None = None,
    model: nn.Module | None = None,
    prompt: Sequence[int] | None = None,
    label: str = "",
) -> str:
    """Where ``got`` leaves ``ref`` and how close the reference's top two logits were there."""
    i = first_divergence(got, ref)
    if i is None:
        return f"{label}: identical"
    lines = [
        f"{label}: first divergence at new token {i} (got {len(got)} tokens, reference {len(ref)})",
        f"  got       {list(got[max(0, i - 3) : i + 3])} (from index {max(0, i - 3)})",
        f"  reference {list(ref[max(0, i - 3) : i + 3])}",
    ]
    logits = None
    if ref_logits is not None and i < len(ref_logits):
        logits = ref_logits[i]
    elif model is not None and prompt is not None and i < len(ref):
        logits = teacher_forced_logits(model, prompt, ref, i)
    if logits is not None:
        top = logits.topk(2)
        values = [round(v, 5) for v in top.values.tolist()]
        lines.append(
            f"  reference top-2 there: tokens {top.indices.tolist()} logits {values} gap {top2_gap(logits):.3g}"
            " (a gap near 0 means a float near-tie, not a logic bug)"
        )
    return "\n".join(lines)


def assert_same_tokens(got: Sequence[int], ref: Sequence[int], **kwargs: object) -> None:
    got, ref = list(got), list(ref)
    assert got == ref, mismatch_message(got, ref, **kwargs)


ChainRule = Callable[[list[int], torch.Tensor, torch.Tensor, "torch.Generator | None"], tuple[int, int]]


def chain_rule_as_tree(rule: ChainRule) -> Callable[..., tuple[list[int], int]]:
    """A chain's rejection rule ``rule(drafted, p, q [k, V], generator) -> (accepted, next)`` in the
    shape of ``verify_tree_sampled`` (what the engine's verifier calls), for chain proposals: a
    deterministic node (a lookup match) gets its one-hot q row. Tests put broken rules in the
    verifier's place with it."""

    def verify(tokens: list[int], attempts: list, p: torch.Tensor, q: torch.Tensor | None, generator):  # noqa: ANN001
        rows = torch.zeros(len(tokens), p.shape[-1])
        for attempt in attempts:
            if attempt.proposal.q_row is None:
                rows[attempt.node, tokens[attempt.node]] = 1.0
            else:
                assert q is not None
                rows[attempt.node] = q[attempt.proposal.q_row].to(rows.dtype)
        accepted, token = rule(tokens, p, rows, generator)
        return list(range(accepted)), token

    return verify
