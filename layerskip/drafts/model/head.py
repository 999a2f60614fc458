"""The draft's LM head: every vocabulary row, or a subset of rows that grows during generation.

A truncated head multiplies ``[hidden] x [hidden, K]`` instead of ``[hidden, V]``: on models
with large vocabularies (Gemma 3: 262k rows, ~63% of a token's MACs) it is most of what makes a
draft step cheap. The subset starts from a ranking (the policy's rows) plus the prompt's
tokens, and every token the generation emits is added as it is emitted, so text that repeats
its own words stays draftable. The verify always uses the full head: the output is exact
whatever the subset.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import torch
from torch import nn


class LogitEdits(Protocol):
    """Few-token logits edits (``engine.verify_head.TokenEdits``), which the draft applies to its
    own logits: ``masked`` tokens get -inf; ``tokens`` get ``apply(their logits [n]) -> [n]``."""

    tokens: tuple[int, ...]
    masked: tuple[int, ...]

    def apply(self, logits: torch.Tensor) -> torch.Tensor: ...


class DraftHead:
    """``hidden [..., H] -> logits [..., n]`` over the current rows (all ``V`` when not truncated).

    ``weight`` is the full head's ``[V, H]``; with ``rows`` the head keeps a buffer of gathered
    rows (in ``dtype``, default the weight's) with room for ``growth`` more, filled as tokens are
    ``add``-ed.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        softcap: float | None,
        rows: torch.Tensor | None = None,
        growth: int = 0,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.full_weight = weight
        self.full_bias = bias
        self.softcap = softcap
        self.vocab_size = weight.shape[0]
        self.truncated = rows is not None and len(rows) < self.vocab_size
        if not self.truncated:
            self.weight, self.bias, self.rows, self.members, self.count = weight, bias, None, None, self.vocab_size
            return
        rows = torch.unique(rows.to(weight.device))  # sorted, no duplicates
        capacity = min(self.vocab_size, len(rows) + max(0, growth))
        self.rows = torch.empty(capacity, dtype=torch.long, device=weight.device)
        self.weight = weight.new_empty(capacity, weight.shape[1], dtype=dtype or weight.dtype)
        self.bias = None if bias is None else bias.new_empty(capacity, dtype=dtype or bias.dtype)
        self.members: set[int] = set()
        self.position: dict[int, int] = {}  # token id -> its row in the buffer
        self.count = 0
        self._append(rows)

    def _append(self, ids: torch.Tensor) -> None:
        take = min(len(ids), self.rows.shape[0] - self.count)
        ids = ids[:take]
        end = self.count + take
        self.rows[self.count : end] = ids
        self.weight[self.count : end] = self.full_weight.index_select(0, ids)  # cast to the buffer's dtype
        if self.bias is not None:
            self.bias[self.count : end] = self.full_bias.index_select(0, ids)
        added = ids.tolist()
        self.members.update(added)
        self.position.update((token, self.count + k) for k, token in enumerate(added))
        self.count = end

    def add(self, tokens: Iterable[int]) -> None:
        """Score these token ids from now on (no-op for the full head or ids already scored)."""
        if not self.truncated:
            return
        new = sorted({t for t in tokens if t not in self.members and 0 <= t < self.vocab_size})
        if new:
            self._append(torch.tensor(new, dtype=torch.long, device=self.rows.device))

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.weight[: self.count]
        bias = None if self.bias is None else self.bias[: self.count]
        logits = nn.functional.linear(hidden.to(weight.dtype), weight, bias)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def positions_of(self, tokens: Sequence[int]) -> list[int] | None:
        """Positions in this head's output of ``tokens``, in their order; None where it scores
        not all of them."""
        if self.rows is None:
            ok = all(0 <= t < self.vocab_size for t in tokens)
            return list(tokens) if ok else None
        found = [self.position.get(t, -1) for t in tokens]
        return None if -1 in found else found

    def editor(self, edits: LogitEdits | None) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """What applies the processors' ``edits`` to one row of this head's logits ``[n]`` (in
        place): masked tokens to -inf, edited ones through ``edits.apply`` where the head scores
        them all (a truncated head scores every token of the text, which is what penalties touch).
        None: nothing to apply."""
        if edits is None or not (edits.masked or edits.tokens):
            return None
        masked = [p for p in (self.positions_of([t]) for t in edits.masked) if p is not None]
        device = self.full_weight.device
        masked_rows = torch.tensor([p[0] for p in masked], dtype=torch.long, device=device)
        edited = self.positions_of(edits.tokens) if edits.tokens else None
        edited_rows = None if edited is None else torch.tensor(edited, dtype=torch.long, device=device)
        if not masked and edited_rows is None:
            return None

        def apply(logits: torch.Tensor) -> torch.Tensor:
            if edited_rows is not None:
                logits[edited_rows] = edits.apply(logits[edited_rows].float()).to(logits.dtype)
            if masked:
                logits[masked_rows] = -torch.inf
            return logits

        return apply

    def token_ids(self, index: torch.Tensor) -> torch.Tensor:
        """Map positions in this head's output to vocabulary ids."""
        return index if self.rows is None else self.rows[index]

    def to_full_vocab(self, probs: torch.Tensor) -> torch.Tensor:
        """``[..., n]`` probabilities over the current rows -> ``[..., V]``, zero elsewhere."""
        if self.rows is None:
            return probs
        full = probs.new_zeros(*probs.shape[:-1], self.vocab_size)
        return full.index_copy_(-1, self.rows[: self.count], probs)
