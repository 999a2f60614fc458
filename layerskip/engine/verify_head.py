"""The verify's LM head: full logits, or the greedy argmax certified from a bf16 product.

On a CPU the LM head is a large share of every full forward (SmolLM2: 28M of 135M parameters,
Gemma-3-270M: 168M of 268M), and in fp32 its cost grows with the rows of a verify block. Greedy
decoding needs only the argmax of each row. So the rows are scored with a bf16 copy of the head
(half the bytes; on CPUs with bf16 dot products nearly flat in the rows), and the fp32 winner is
then *certified*: every token whose bf16 logit, widened by a rigorous bound on its rounding
error, could still reach the best lower bound is recomputed in fp32 from the fp32 hidden state
and the fp32 head row, and the best of those wins. A token outside that set provably scores below
the winner in fp32, so the argmax is the fp32 head's (up to fp32's own summation-order rounding,
the same as any two fp32 kernels). A row with too many candidates falls back to the fp32 head.

The bound for token j with hidden x (standard dot-product error analysis, u = 2^-8 for bf16,
g = K 2^-24 for an fp32 sum of K terms): rounding x and w_j to bf16 moves each product by at most
(2u + u^2)|w_ji x_i|; the fp32 sum adds g (1 + 2u + u^2) sum|w_ji x_i|; the fp32 recomputation
itself carries g sum|w_ji x_i|; and Cauchy-Schwarz bounds sum|w_ji x_i| by |w_j| |x|. The bf16
output rounding adds u/(1 - u) |z_j|. A 1 % margin covers the lower-order terms.

Logits processors that touch few tokens (``TokenEdits``: masks, penalties, biases) keep the
certificate: masked tokens leave the candidates, the edited ones are computed exactly in fp32 and
edited, and the rest are certified against the best of them as above. Sampling and any other
processor need every logit: ``logits``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from layerskip.hf import adapters

BF16_UNIT_ROUNDOFF = 2.0**-8
FP32_UNIT_ROUNDOFF = 2.0**-24
# A row whose candidate set is larger than this is scored by the fp32 head instead: a flat
# distribution, where the gather would cost more than the product it saves.
MAX_CANDIDATES = 64


@dataclass(frozen=True)
class TokenEdits:
    """What logits processors do to one row, where they touch few tokens: ``masked`` tokens get
    -inf; ``tokens`` (ascending) get ``apply(their exact logits [n]) -> [n]``; the rest keep theirs."""

    tokens: tuple[int, ...]
    apply: Callable[[torch.Tensor], torch.Tensor]
    masked: tuple[int, ...] = ()


@dataclass
class VerifyHeadStats:
    rows: int = 0  # rows whose argmax was taken
    certified: int = 0  # ... from the bf16 product and an fp32 recheck of its candidates
    candidates: int = 0  # fp32 rechecks made
    fallbacks: int = 0  # ... by the fp32 head (too many candidates)


class VerifyHead:
    """The full model's head over final hidden states ``[q, H]``.

    ``certified=True`` keeps a bf16 copy of the head (half the fp32 head's memory) for ``argmax``;
    ``logits`` always uses the model's own head.
    """

    def __init__(self, model: nn.Module, certified: bool = True) -> None:
        self.model = model
        head = adapters.lm_head(model)
        self.weight = head.weight.detach()  # [V, H]
        self.bias = None if head.bias is None else head.bias.detach().float()
        self.softcap = adapters.final_logit_softcap(model)
        self.certified = certified and self.weight.dtype == torch.float32
        self.stats = VerifyHeadStats()
        if self.certified:
            width = self.weight.shape[1]
            u, g = BF16_UNIT_ROUNDOFF, width * FP32_UNIT_ROUNDOFF / (1 - width * FP32_UNIT_ROUNDOFF)
            self.coefficient = 1.01 * ((2 * u + u * u) * (1 + g) + g * (1 + 2 * u + u * u) + g)
            self.output_coefficient = 1.01 * u / (1 - u)
            self.low = self.weight.to(torch.bfloat16).contiguous()  # [V, H]
            self.row_norms = torch.linalg.vector_norm(self.weight, dim=1)  # [V] fp32
            self.max_row_norm = float(self.row_norms.max())

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[q, H] -> [q, V]``, as the model's forward computes them (fp32 for an fp32 model)."""
        return adapters.logits_from_hidden(self.model, hidden)

    def argmax(self, hidden: torch.Tensor, edits: Sequence[TokenEdits] | None = None) -> list[int]:
        """The greedy token of each row of ``hidden [q, H]``: the argmax of ``logits(hidden)``, each
        row after its ``edits`` where given (logits processors that touch few tokens)."""
        if not self.certified:
            if edits is None:
                return self.logits(hidden).argmax(dim=-1).tolist()
            return [self._dense(hidden[r : r + 1], edits[r]) for r in range(hidden.shape[0])]
        x = hidden.float()
        scores = F.linear(x.to(torch.bfloat16), self.low)  # [q, V] bf16
        if self.bias is not None:
            scores = scores.float() + self.bias
        norms = torch.linalg.vector_norm(x, dim=1).tolist()  # [q]
        tops = scores.amax(dim=1).float().tolist()
        lows = scores.amin(dim=1).float().tolist()
        winners = []
        for r, row in enumerate(scores):
            self.stats.rows += 1
            biggest = max(abs(tops[r]), abs(lows[r]))
            winner = self._certified_row(x[r], row, norms[r], tops[r], biggest, edits[r] if edits else None)
            if winner is None:
                self.stats.fallbacks += 1
                winner = self._dense(hidden[r : r + 1], edits and edits[r])
            else:
                self.stats.certified += 1
            winners.append(winner)
        return winners

    def _dense(self, hidden: torch.Tensor, edits: TokenEdits | None) -> int:
        """The argmax of one row's full logits (``hidden [1, H]``), after its edits."""
        logits = self.logits(hidden)[0].float()  # [V]
        if edits is not None:
            logits[list(edits.masked)] = -float("inf")
            index = list(edits.tokens)
            logits[index] = edits.apply(logits[index])
        return int(logits.argmax())

    def _exact(self, index: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The fp32 logits of tokens ``index [n]`` for one hidden state ``x [H]``, as the fp32 head
        computes each of them."""
        exact = self.weight[index] @ x  # [n]
        if self.bias is not None:
            exact = exact + self.bias[index]
        if self.softcap:
            exact = torch.tanh(exact / self.softcap) * self.softcap
        return exact

    def _certified_row(
        self, x: torch.Tensor, row: torch.Tensor, norm: float, top: float, biggest: float, edits: TokenEdits | None
    ) -> int | None:
        if not (math.isfinite(norm) and math.isfinite(top) and math.isfinite(biggest)):
            return None
        # Every bound is at most ``widest``.
        widest = self.coefficient * norm * self.max_row_norm + self.output_coefficient * biggest
        edited = torch.zeros(0, dtype=torch.long)
        edited_values = torch.zeros(0)
        floor = -math.inf  # a value some token surely reaches
        if edits is not None and (edits.tokens or edits.masked):
            edited = torch.tensor(edits.tokens, dtype=torch.long)
            edited_values = edits.apply(self._exact(edited, x))  # exact, as the processors compute them
            if edited.numel() and bool(torch.isfinite(edited_values).any()):
                floor = float(edited_values.max())
                if self.softcap:  # the row is compared before the cap, the edits act after it: uncap
                    if abs(floor) >= self.softcap * (1 - 1e-6):
                        return None
                    floor = self.softcap * math.atanh(floor / self.softcap)
                    floor -= 1e-6 * (1 + abs(floor))  # the inverse's own rounding: only widens the candidates
            # The other tokens keep their logits: drop the edited and the masked ones from the row.
            row = row.index_fill(0, torch.tensor([*edits.tokens, *edits.masked], dtype=torch.long), -math.inf)
            top = float(row.max())
        if math.isfinite(top):
            # Coarse filter: a token can beat the best lower bound only if its bf16 score is within
            # two bounds of the top score, and within one of a value surely reached.
            index = (row >= max(top - 2 * widest, floor - widest)).nonzero().squeeze(1)  # [n]
            if index.numel() > 4 * MAX_CANDIDATES:
                return None
            scores = row[index].float()
            bound = self.coefficient * norm * self.row_norms[index] + self.output_coefficient * scores.abs()
            lower = float((scores - bound).max()) if index.numel() else -math.inf
            keep = scores + bound >= max(lower, floor)
            index = index[keep]
            if index.numel() > MAX_CANDIDATES:
                return None
            self.stats.candidates += index.numel()
            exact = self._exact(index, x)
        else:
            index, exact = edited[:0], edited_values[:0]
        tokens, values = torch.cat([index, edited]), torch.cat([exact, edited_values])
        if not tokens.numel() or not bool(torch.isfinite(values).any()):
            return None
        best = values.max()
        return int(tokens[values == best].min())  # ties go to the lower id, as argmax's do


def engine_verify_head(model: nn.Module, certified: bool | None = None) -> VerifyHead:
    """The verify head the engine uses for ``model``: by default certified on the CPU (where the
    fp32 head is a large part of every step), the model's own head elsewhere.

    Shared by every decoder of the model (the bf16 copy is made once): kept on the model object
    itself, keyed by the head's storage, dtype and device, so a cast or moved model gets a new
    one, and nothing outlives the model."""
    if certified is None:
        certified = next(model.parameters()).device.type == "cpu"
    weight = adapters.lm_head(model).weight
    key = (certified, weight.data_ptr(), weight.dtype, str(weight.device), tuple(weight.shape))
    heads: dict[tuple[object, ...], VerifyHead] = model.__dict__.setdefault("_layerskip_verify_heads", {})
    if key not in heads:
        for stale in [k for k in heads if k[1:] != key[1:]]:  # a head of an older storage
            del heads[stale]
        heads[key] = VerifyHead(model, certified)
    return heads[key]
