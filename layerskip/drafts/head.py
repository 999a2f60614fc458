"""The draft's LM head: every vocabulary row, or a subset of rows that grows during generation.

A truncated head multiplies ``[hidden] x [hidden, K]`` instead of ``[hidden, V]``: on models
with large vocabularies (Gemma 3: 262k rows, ~63% of a token's MACs) it is most of what makes a
draft step cheap. The subset starts from a ranking (the policy's rows) plus the prompt's
tokens, and every token the generation emits is added as it is emitted, so text that repeats
its own words stays draftable. The verify always uses the full head: the output is exact
whatever the subset.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


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
        self.members.update(ids.tolist())
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

    def positions_of(self, tokens: Iterable[int]) -> torch.Tensor:
        """Positions in this head's output of those token ids it scores (``[m]``)."""
        ids = torch.tensor(sorted(set(tokens)), dtype=torch.long, device=self.full_weight.device)
        if self.rows is None:
            return ids[(ids >= 0) & (ids < self.vocab_size)]
        rows = self.rows[: self.count]
        return torch.isin(rows, ids).nonzero().squeeze(1)

    def token_ids(self, index: torch.Tensor) -> torch.Tensor:
        """Map positions in this head's output to vocabulary ids."""
        return index if self.rows is None else self.rows[index]

    def to_full_vocab(self, probs: torch.Tensor) -> torch.Tensor:
        """``[..., n]`` probabilities over the current rows -> ``[..., V]``, zero elsewhere."""
        if self.rows is None:
            return probs
        full = probs.new_zeros(*probs.shape[:-1], self.vocab_size)
        return full.index_copy_(-1, self.rows[: self.count], probs)
