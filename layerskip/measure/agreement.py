"""Teacher-forced agreement: the cheap estimate of how often a draft would be accepted.

The full model writes a greedy reference continuation for each prompt once. A candidate draft
(some sublayers bypassed) then runs once, in parallel, over prompt + reference; the fraction
of reference positions where its top-1 token equals the reference token estimates the
per-token acceptance rate alpha of greedy self-speculative decoding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm

from layerskip.engine.decoding import DecodeSettings, decode_autoregressive
from layerskip.engine.drafters import LookupRunLength, match_lookup
from layerskip.engine.policy import DraftSettings
from layerskip.hf import adapters


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
    with_confidence: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The draft's top-1 token at each reference position, ``[len(continuation)]``
    (and its probability, when ``with_confidence``)."""
    device = next(model.parameters()).device
    ids = torch.tensor([[*reference.prompt, *reference.continuation[:-1]]], device=device)  # [1, P+C-1]
    with adapters.bypass(model, skip_attention, skip_mlp):
        hidden = adapters.base_model(model)(input_ids=ids, use_cache=False).last_hidden_state
    # Position P-1 predicts continuation[0]; the last position predicts continuation[-1].
    hidden = hidden[0, len(reference.prompt) - 1 :]  # [C, hidden]
    head = adapters.draft_head(model, vocab_rows)
    logits = head(hidden)
    tokens = head.token_ids(logits.argmax(dim=-1))
    if with_confidence:
        return tokens, logits.float().softmax(dim=-1).max(dim=-1).values
    return tokens


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


@dataclass
class SimulatedRun:
    """Greedy self-speculative decoding of one reference, replayed from teacher-forced predictions."""

    tokens: int = 0
    blocks: list[int] = field(default_factory=list)  # verify block length (k + 1) of each step
    draft_forwards: int = 0  # skip-draft model calls (lookup steps cost none)
    drafted: int = 0
    accepted: int = 0

    def predicted_cost(self, draft_cost: float, verify_cost: Callable[[int], float]) -> float:
        """Time in units of one plain decoding step."""
        return self.draft_forwards * draft_cost + sum(verify_cost(block) for block in self.blocks)


def simulate_greedy(
    reference: Reference, predicted: Sequence[int], confidence: Sequence[float], draft: DraftSettings
) -> SimulatedRun:
    """Replay greedy self-speculative decoding over a reference continuation.

    While the draft's earlier tokens are accepted, its autoregressive proposal at a position is
    its teacher-forced prediction there, so the accepted count of each step is the run of
    matching predictions (capped at k; with the adaptive rule, cut where confidence drops
    below the initial threshold). Prompt lookup, when on, is replayed exactly. Approximate only
    in the K/V the draft reads (full-model K/V in real decoding), which favours real decoding.
    """
    run = SimulatedRun()
    continuation = list(reference.continuation)
    if not continuation:
        return run
    # As in the engine, the prompt's forward (one step, no draft) gives the first token.
    history = [*reference.prompt, continuation[0]]
    run.tokens, run.blocks = 1, [1]
    position = 1
    run_length = LookupRunLength(draft.lookup_confidence)
    while position < len(continuation):
        remaining = len(continuation) - position
        proposal: list[int] = []
        if draft.lookup_max_ngram:
            match = match_lookup(
                history, draft.lookup_min_ngram, draft.lookup_max_ngram, min(draft.lookup_max_tokens, remaining - 1)
            )
            proposal = run_length.cut(match)
        if proposal:
            accepted = 0
            while accepted < len(proposal) and proposal[accepted] == continuation[position + accepted]:
                accepted += 1
            drafted = len(proposal)
            run_length.update(match.ngram, drafted, accepted)
        elif draft.use_skip_draft and remaining > 1:
            drafted = 0
            accepted = 0
            limit = min(draft.max_draft_tokens, remaining - 1)
            # Draft forwards continue past a wrong token until k or a low-confidence stop.
            while drafted < limit:
                index = position + drafted
                drafted += 1
                if accepted == drafted - 1 and predicted[index] == continuation[index]:
                    accepted += 1
                if draft.adaptive and confidence[index] < draft.initial_threshold:
                    break
            run.draft_forwards += drafted
        else:
            drafted = accepted = 0
        step = accepted + 1
        run.tokens += step
        run.blocks.append(max(drafted + 1, draft.min_verify_block) if drafted else 1)
        run.drafted += drafted
        run.accepted += accepted
        history.extend(continuation[position : position + step])
        position += step
    return run
