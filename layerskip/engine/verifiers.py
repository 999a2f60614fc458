"""How the full model's verify forward decides: one small type per way, one method each.

A verifier gets the final hidden states of the verified block's real rows (``[n+1, H]``: the
pending token and the proposal's n candidates, block position ``i + 1`` for node ``i``) and the
proposal, and returns the ``Verdict``: the accepted path and the token the full model adds
itself. Every proposal is a token tree (a chain is one with one branch), so there is one way to
decide per verifier. The prefill is a verify with nothing proposed.

* ``GreedyVerifier``: each row's argmax, from the certified head where the engine uses one; the
  path follows the argmax down the tree.
* ``SampledVerifier``: rejection sampling against how each candidate was drawn (the output keeps
  the model's distribution); along a chain it is the standard chain rule, draw for draw.
* ``HookedVerifier``: the logits processed first (HF logits processors), then greedy or sampled.
  A greedy one whose hook touches few tokens of each row (``hook.edits``: masks, penalties, biases)
  takes the processed argmax from the certified head; any other reads the full logits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from layerskip.drafts.base import Proposal, Proposals, Verdict
from layerskip.engine.verify_head import TokenEdits, VerifyHead
from layerskip.sampling import Sampling, accept_tree_greedy, verify_tree_sampled

# (context, logits [k+1, V]) -> processed logits [k+1, V]; row i follows context[: len(context) - k + i].
# Applied to the verify's logits only: the draft proposes from its own, so the output stays exact.
# A hook may also have ``edits(contexts, vocab) -> [TokenEdits] | None``: what it does to the row
# after each context as edits of few tokens (None: it needs every logit), so a greedy verify keeps
# the certified head.
LogitsHook = Callable[[list[int], torch.Tensor], torch.Tensor]

__all__ = ["GreedyVerifier", "HookedVerifier", "LogitsHook", "SampledVerifier", "Verdict", "Verifier"]


NO_EDITS = TokenEdits((), lambda values: values)  # a row without processors, in a batch with some


class Verifier(Protocol):
    needs_logits: bool  # whether its verify reads every logit (dearer than the greedy head)

    def verify(self, hidden: torch.Tensor, proposal: Proposal, history: list[int]) -> Verdict:
        """``hidden [n+1, H]`` of the block after ``history`` (prompt and tokens so far) -> the verdict."""
        ...

    def from_logits(self, logits: torch.Tensor, proposal: Proposal, history: list[int]) -> Verdict:
        """The same verdict from the block's full logits ``[n+1, V]``."""
        ...


def greedy_verdict(proposal: Proposal, targets: list[int]) -> Verdict:
    """The verdict from the full model's argmax at each block position (``targets [n+1]``)."""
    path, token = accept_tree_greedy(proposal.tree.tokens, proposal.tree.parents, targets)
    return Verdict(tuple(path), token)


class GreedyVerifier:
    """Greedy needs each row's argmax only: the certified head gives it without the fp32 product."""

    needs_logits = False

    def __init__(self, head: VerifyHead) -> None:
        self.head = head

    def verify(self, hidden: torch.Tensor, proposal: Proposal, history: list[int]) -> Verdict:
        return greedy_verdict(proposal, self.head.argmax(hidden))

    def from_logits(self, logits: torch.Tensor, proposal: Proposal, history: list[int]) -> Verdict:
        """The verdict from the block's full logits ``[n+1, V]``, where a batch computed them anyway."""
        return greedy_verdict(proposal, logits.argmax(dim=-1).tolist())


class SampledVerifier:
    needs_logits = True

    def __init__(self, head: VerifyHead, sampling: Sampling, generator: torch.Generator | None) -> None:
        self.head = head
        self.sampling = sampling
        self.generator = generator

    def verify(self, hidden: torch.Tensor, proposal: Proposal, history: list[int]) -> Verdict:
        return self.choose(self.head.logits(hidden), proposal)

    def from_logits(self, logits: torch.Tensor, proposal: Proposal, history: list[int]) -> Verdict:
        return self.choose(logits, proposal)

    def choose(self, logits: torch.Tensor, proposal: Proposal) -> Verdict:
        """The verdict from the full model's logits ``[n+1, V]`` of the block."""
        probs = self.sampling.probs(logits)  # [n+1, V], the same transform the draft's q had
        tree = proposal.tree
        path, token = verify_tree_sampled(tree.tokens, tree.attempts, probs, tree.q, self.generator)
        return Verdict(tuple(path), token)


class HookedVerifier:
    """The full model's logits through ``hook`` before choosing; ``sampled`` None chooses greedily."""

    def __init__(self, head: VerifyHead, hook: LogitsHook, sampled: SampledVerifier | None) -> None:
        self.head = head
        self.hook = hook
        self.sampled = sampled
        edits = getattr(hook, "edits", None)
        sparse = edits is not None and head.certified and edits([[]], head.weight.shape[0]) is not None
        self.needs_logits = sampled is not None or not sparse

    def edits(self, proposal: Proposal, history: list[int]) -> list[TokenEdits] | None:
        """Each block row's edits, where a greedy verify can take them to the certified head."""
        edits = getattr(self.hook, "edits", None)
        if self.sampled is not None or edits is None or not self.head.certified:
            return None
        tree = proposal.tree
        contexts = [history, *([*history, *tree.path_tokens(node)] for node in range(len(tree)))]
        return edits(contexts, self.head.weight.shape[0])

    def next_edits(self, history: list[int]) -> TokenEdits | None:
        """What the processors do to the token right after ``history``, where they touch few
        tokens (None where they cannot say cheaply)."""
        edits = getattr(self.hook, "edits", None)
        found = None if edits is None else edits([history], self.head.weight.shape[0])
        return found[0] if found else None

    def verify(self, hidden: torch.Tensor, proposal: Proposal, history: list[int]) -> Verdict:
        edits = self.edits(proposal, history)
        if edits is not None:
            return greedy_verdict(proposal, self.head.argmax(hidden, edits))
        return self.from_logits(self.head.logits(hidden), proposal, history)

    def from_logits(self, logits: torch.Tensor, proposal: Proposal, history: list[int]) -> Verdict:
        logits = self._hooked(logits, proposal, history)
        if self.sampled is not None:
            return self.sampled.choose(logits, proposal)
        return greedy_verdict(proposal, logits.argmax(dim=-1).tolist())

    def _hooked(self, logits: torch.Tensor, proposal: Proposal, history: list[int]) -> torch.Tensor:
        """Each row's logits processed after the text that row continues: its root-to-node path."""
        tree = proposal.tree
        if tree.is_chain:  # every row continues the one before it: the hook takes them in one call
            return self.hook([*history, *tree.tokens], logits)
        contexts = [history, *([*history, *tree.path_tokens(node)] for node in range(len(tree)))]
        return torch.cat([self.hook(context, logits[i : i + 1]) for i, context in enumerate(contexts)])


def verifier_for(
    head: VerifyHead, sampling: Sampling | None, generator: torch.Generator | None, hook: LogitsHook | None = None
) -> Verifier:
    """The verifier of one generation: greedy or sampled, behind a logits hook or not."""
    sampled = None if sampling is None else SampledVerifier(head, sampling, generator)
    if hook is not None:
        return HookedVerifier(head, hook, sampled)
    return sampled if sampled is not None else GreedyVerifier(head)


def verify_rows(
    verifiers: Sequence[Verifier], hidden: Sequence[torch.Tensor], proposals: Proposals, histories: Sequence[list[int]]
) -> list[Verdict]:
    """The verdicts of a batch's rows (``hidden[r] [n_r+1, H]``), their head applied once for all
    rows where they share one: one product reads the head once, where a product per row would read
    it once per row (Gemma-3's full head is 262,144 x 640). The certified head's argmax serves
    where every row is greedy with at most sparse processor edits; else the full logits of every
    row, each row deciding from its own."""
    sizes = [h.shape[0] for h in hidden]
    heads = {id(getattr(v, "head", None)) for v in verifiers}
    rows = proposals.rows
    # Each row's processor edits, worked out only where every row can take the one greedy product
    # (a row that cannot sends the batch row by row, where each verifier works them out itself).
    edits: list[list[TokenEdits] | None] = [None] * len(verifiers)
    greedy = len(heads) == 1 and all(type(v) in (GreedyVerifier, HookedVerifier) for v in verifiers)
    for r, (v, proposal, history) in enumerate(zip(verifiers, rows, histories, strict=True)):
        if not greedy or type(v) is GreedyVerifier:
            continue
        edits[r] = v.edits(proposal, history)
        greedy = edits[r] is not None
    if greedy:
        flat = None  # each block row's edits, where some row has processors
        if any(edits):
            flat = [e for row, size in zip(edits, sizes, strict=True) for e in (row or [NO_EDITS] * size)]
        targets = verifiers[0].head.argmax(torch.cat(list(hidden)), flat)
        verdicts, start = [], 0
        for size, proposal in zip(sizes, rows, strict=True):
            verdicts.append(greedy_verdict(proposal, targets[start : start + size]))
            start += size
        return verdicts
    if len(heads) == 1:  # some row needs the full logits: one product for every row's
        logits = verifiers[0].head.logits(torch.cat(list(hidden))).split(sizes)
        each = zip(verifiers, logits, rows, histories, strict=True)
        return [v.from_logits(part, proposal, history) for v, part, proposal, history in each]
    each = zip(verifiers, hidden, rows, histories, strict=True)
    return [v.verify(h, proposal, history) for v, h, proposal, history in each]
