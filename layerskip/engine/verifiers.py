"""How the full model's verify forward decides: one small type per way, one method each.

A verifier gets the final hidden states of the verified block's real rows (``[k+1, H]``: the
pending token and the k drafted ones, or a token tree's nodes) and the draft, and returns how
many drafted tokens the full model keeps (a tree: which path) and the token it adds itself. The
prefill is a verify with nothing drafted.

* ``GreedyVerifier``: each row's argmax, from the certified head where the engine uses one.
* ``SampledVerifier``: rejection sampling against the draft's proposal q (the output keeps the
  model's distribution).
* ``HookedVerifier``: the full logits processed first (HF logits processors), then greedy or sampled.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from layerskip.drafts.base import Draft
from layerskip.engine.verify_head import VerifyHead
from layerskip.sampling import (
    Sampling,
    accept_greedy,
    accept_tree_greedy,
    verify_greedy,
    verify_sampled,
    verify_tree_greedy,
    verify_tree_sampled,
)

# (context, logits [k+1, V]) -> processed logits [k+1, V]; row i follows context[: len(context) - k + i].
# Applied to the verify's logits only: the draft proposes from its own, so the output stays exact.
LogitsHook = Callable[[list[int], torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Verdict:
    accepted: int  # drafted tokens the full model keeps
    next_token: int  # the full model's own token after them
    path: tuple[int, ...] | None = None  # a token tree's accepted nodes (None for a chain)

    @classmethod
    def of_tree(cls, path: list[int], next_token: int) -> Verdict:
        return cls(len(path), next_token, tuple(path))


class Verifier(Protocol):
    def verify(self, hidden: torch.Tensor, draft: Draft, history: list[int]) -> Verdict:
        """``hidden [k+1, H]`` of the block after ``history`` (prompt and tokens so far) -> the verdict."""
        ...


class GreedyVerifier:
    """Greedy needs each row's argmax only: the certified head gives it without the fp32 product."""

    def __init__(self, head: VerifyHead) -> None:
        self.head = head

    def verify(self, hidden: torch.Tensor, draft: Draft, history: list[int]) -> Verdict:
        targets = self.head.argmax(hidden)
        if draft.tree is not None:
            return Verdict.of_tree(*accept_tree_greedy(draft.tree.tokens, draft.tree.parents, targets))
        return Verdict(*accept_greedy(draft.tokens, targets))


class SampledVerifier:
    def __init__(self, head: VerifyHead, sampling: Sampling, generator: torch.Generator | None) -> None:
        self.head = head
        self.sampling = sampling
        self.generator = generator

    def verify(self, hidden: torch.Tensor, draft: Draft, history: list[int]) -> Verdict:
        return self.choose(self.head.logits(hidden), draft)

    def choose(self, logits: torch.Tensor, draft: Draft) -> Verdict:
        """The verdict from the full model's logits ``[k+1, V]`` of the block."""
        probs = self.sampling.probs(logits)  # [k+1, V], the same transform the draft's q had
        tree = draft.tree
        if tree is not None:
            return Verdict.of_tree(*verify_tree_sampled(tree.tokens, tree.attempts, probs, tree.q, self.generator))
        return Verdict(*verify_sampled(draft.tokens, probs, draft.q, self.generator))


class HookedVerifier:
    """The full model's logits through ``hook`` before choosing; ``sampled`` None chooses greedily."""

    def __init__(self, head: VerifyHead, hook: LogitsHook, sampled: SampledVerifier | None) -> None:
        self.head = head
        self.hook = hook
        self.sampled = sampled

    def verify(self, hidden: torch.Tensor, draft: Draft, history: list[int]) -> Verdict:
        logits = self.head.logits(hidden)
        if draft.tree is None:
            logits = self.hook([*history, *draft.tokens], logits)
        else:  # each row after its own path: the hook sees the text that row continues
            tree = draft.tree
            contexts = [history, *([*history, *tree.path_tokens(node)] for node in range(len(tree)))]
            logits = torch.cat([self.hook(context, logits[i : i + 1]) for i, context in enumerate(contexts)])
        if self.sampled is not None:
            return self.sampled.choose(logits, draft)
        if draft.tree is not None:
            return Verdict.of_tree(*verify_tree_greedy(draft.tree.tokens, draft.tree.parents, logits))
        return Verdict(*verify_greedy(draft.tokens, logits))


def verifier_for(
    head: VerifyHead,
    sampling: Sampling | None,
    generator: torch.Generator | None,
    hook: LogitsHook | None = None,
) -> Verifier:
    """The verifier of one generation: greedy or sampled, behind a logits hook or not."""
    sampled = None if sampling is None else SampledVerifier(head, sampling, generator)
    if hook is not None:
        return HookedVerifier(head, hook, sampled)
    return sampled if sampled is not None else GreedyVerifier(head)


def verify_rows(
    verifiers: Sequence[Verifier],
    hidden: Sequence[torch.Tensor],
    drafts: Sequence[Draft],
    histories: Sequence[list[int]],
) -> list[Verdict]:
    """The verdicts of a batch's rows (``hidden[r] [k_r+1, H]``), their head applied once for all
    rows where every row's verifier is greedy or sampled over one head: one product reads the
    head once, where a product per row would read it once per row."""
    sizes = [h.shape[0] for h in hidden]
    heads = {id(getattr(v, "head", None)) for v in verifiers}
    if len(heads) == 1 and all(type(v) is GreedyVerifier for v in verifiers):
        targets = verifiers[0].head.argmax(torch.cat(list(hidden)))
        verdicts, start = [], 0
        for size, draft in zip(sizes, drafts, strict=True):
            verdicts.append(Verdict(*accept_greedy(draft.tokens, targets[start : start + size])))
            start += size
        return verdicts
    if len(heads) == 1 and all(type(v) is SampledVerifier for v in verifiers):
        logits = verifiers[0].head.logits(torch.cat(list(hidden))).split(sizes)
        return [v.choose(rows, draft) for v, rows, draft in zip(verifiers, logits, drafts, strict=True)]
    return [
        v.verify(h, draft, history) for v, h, draft, history in zip(verifiers, hidden, drafts, histories, strict=True)
    ]
