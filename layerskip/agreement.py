"""Teacher-forced agreement: the cheap estimate of how often a draft would be accepted.

The full model writes a greedy reference continuation for each prompt once. A candidate draft
(some sublayers bypassed) then runs once, in parallel, over prompt + reference; the fraction
of reference positions where its top-1 token equals the reference token estimates the
per-token acceptance rate alpha of greedy self-speculative decoding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from layerskip import adapters
from layerskip.decoding import DecodeSettings, decode_autoregressive


@dataclass(frozen=True)
class Reference:
    prompt: tuple[int, ...]
    continuation: tuple[int, ...]  # the full model's greedy tokens after the prompt


def build_references(
    model: nn.Module, prompts: Sequence[Sequence[int]], new_tokens: int, progress: bool = False
) -> list[Reference]:
    """Greedy continuations of the full model (no EOS stop: every position is a sample)."""
    references = []
    for prompt in tqdm(prompts, desc="references", disable=not progress):
        tokens, _ = decode_autoregressive(model, prompt, DecodeSettings(max_new_tokens=new_tokens))
        references.append(Reference(tuple(prompt), tuple(tokens)))
    return references


@torch.inference_mode()
def draft_predictions(
    model: nn.Module,
    reference: Reference,
    skip_attention: Sequence[int] = (),
    skip_mlp: Sequence[int] = (),
    vocab_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """The draft's top-1 token at each reference position, ``[len(continuation)]``."""
    device = next(model.parameters()).device
    ids = torch.tensor([[*reference.prompt, *reference.continuation[:-1]]], device=device)  # [1, P+C-1]
    with adapters.bypass(model, skip_attention, skip_mlp):
        hidden = adapters.base_model(model)(input_ids=ids, use_cache=False).last_hidden_state
    # Position P-1 predicts continuation[0]; the last position predicts continuation[-1].
    hidden = hidden[0, len(reference.prompt) - 1 :]  # [C, hidden]
    logits = adapters.head_logits(model, hidden, vocab_rows)
    index = logits.argmax(dim=-1)
    return index if vocab_rows is None else vocab_rows[index]


def teacher_forced_agreement(
    model: nn.Module,
    references: Sequence[Reference],
    skip_attention: Sequence[int] = (),
    skip_mlp: Sequence[int] = (),
    vocab_rows: torch.Tensor | None = None,
) -> float:
    """Fraction of reference positions where the draft's top-1 equals the full model's token."""
    matches = total = 0
    for reference in references:
        predicted = draft_predictions(model, reference, skip_attention, skip_mlp, vocab_rows)
        target = torch.tensor(reference.continuation, device=predicted.device)
        matches += int((predicted == target).sum())
        total += len(reference.continuation)
    return matches / total if total else 0.0


def single_sublayer_agreement(
    model: nn.Module, references: Sequence[Reference], progress: bool = False
) -> dict[str, list[float]]:
    """Agreement with exactly one sublayer bypassed: {"attention": [per layer], "mlp": [per layer]}."""
    count = adapters.num_layers(model)
    result: dict[str, list[float]] = {"attention": [], "mlp": []}
    bar = tqdm(total=2 * count, desc="single-sublayer agreement", disable=not progress)
    for i in range(count):
        result["attention"].append(teacher_forced_agreement(model, references, skip_attention=[i]))
        bar.update()
        result["mlp"].append(teacher_forced_agreement(model, references, skip_mlp=[i]))
        bar.update()
    bar.close()
    return result


def expected_tokens_per_step(alpha: float, draft_tokens: int) -> float:
    """Expected tokens per verify with per-token acceptance alpha and k drafts: (1 - a^(k+1)) / (1 - a)."""
    if alpha >= 1.0:
        return float(draft_tokens + 1)
    return (1 - alpha ** (draft_tokens + 1)) / (1 - alpha)


def predicted_speedup(alpha: float, draft_tokens: int, draft_cost: float, verify_cost: float) -> float:
    """Speedup over plain decoding; costs are relative to one plain decoding step."""
    return expected_tokens_per_step(alpha, draft_tokens) / (draft_tokens * draft_cost + verify_cost)
