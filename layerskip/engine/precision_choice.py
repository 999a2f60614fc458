"""Which low-precision copy ``auto`` drafts from, int4 or int8: both priced on the model at hand.

Weights dequantised from a 4-bit GGUF file already sit on int4's grid (groups of 32, a scale and
a minimum), so the draft's int4 copy of them is nearly exact and agrees with the model almost
always. A full-precision model's weights move by up to half a 4-bit step when rounded to int4,
and that draft then disagrees more often; an int8 copy (one scale per output row, 256 levels)
barely moves them but streams about twice the bytes per draft token. Neither wins everywhere, so
the calibration measures both and keeps the one expected to give more tokens per second:

* ``agreement``: the share of positions of the model's own greedy text (a few short texts from
  seeded starts, generated in one batch) where the copy's top token, nothing bypassed and the
  full head, is the model's: a per-token acceptance;
* ``draft_step``: seconds of one draft token from the copy with the full head;
* ``rate``: the best over draft lengths ``g`` of ``expected_tokens(a, g) / (g * c + v(g + 1))``
  (``drafts.auto.best_skip_rate``), with the verify curve ``v`` of the same calibration.

The policy's own precision is kept unless another is priced ``SWITCH_MARGIN`` times faster.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from layerskip.drafts.builder import DraftModel
from layerskip.hf import adapters
from layerskip.hf.cache import model_cache
from layerskip.hf.forward import block_hidden
from layerskip.hf.prompting import first_token_id

# What an int4 draft is priced against where the policy lets the calibration choose.
CHOICES = {"int4": ("int4", "int8")}
TEXT_ROWS = 8  # texts generated together: one batched forward per token
TEXT_TOKENS = 16  # each text's greedy tokens after its two-token start
SKIPPED_POSITIONS = 2  # the first predictions follow a random start token: not text the model writes
# Another copy replaces the policy's only where it is priced at least this much faster. Agreement
# on short texts from odd starts overstates what a finer copy buys: on Gemma-3 (Intel Xeon, 2
# cores) it priced int8 1.11-1.13x above int4 where decoding measured 0.97-1.00x; on an off-grid
# SmolLM2 it priced int8 1.30x above int4 and decoding measured 1.18x. (Both with the int4 copy
# rounded by each group's min and max; the fitted rounding since raised int4's agreement on that
# twin from 0.60 to 0.62, docs/results/int4_rounding.csv.)
SWITCH_MARGIN = 1.2


@dataclass(frozen=True)
class PrecisionPrice:
    """One candidate copy: its agreement with the model, its draft token's seconds, its rate."""

    precision: str
    agreement: float
    draft_step: float
    tokens_per_second: float

    def to_dict(self) -> dict[str, float]:
        return {
            "agreement": round(self.agreement, 4),
            "draft_step": self.draft_step,
            "tokens_per_second": round(self.tokens_per_second, 2),
        }


def candidates(precision: str, choose: bool) -> tuple[str, ...]:
    """The precisions the calibration prices for a policy drafting in ``precision``."""
    return CHOICES.get(precision, (precision,)) if choose else (precision,)


@torch.inference_mode()
def own_texts(model: nn.Module, rows: int = TEXT_ROWS, tokens: int = TEXT_TOKENS, seed: int = 0) -> torch.Tensor:
    """``[rows, 2 + tokens]``: the model's greedy continuations of its first token followed by a
    seeded random token per row (so the texts differ), generated as one batch."""
    device = next(model.parameters()).device
    vocab = adapters.lm_head(model).weight.shape[0]
    starts = torch.randint(vocab, (rows,), generator=torch.Generator().manual_seed(seed))
    ids = torch.stack([torch.full((rows,), first_token_id(model)), starts], dim=1).to(device)  # [R, 2]
    cache = model_cache(model, rows=rows)
    block = ids
    for _ in range(tokens):
        hidden = block_hidden(model, block, cache)[:, -1]  # [R, H]
        block = adapters.logits_from_hidden(model, hidden).argmax(-1, keepdim=True)  # [R, 1]
        ids = torch.cat([ids, block], dim=1)
    return ids


@torch.inference_mode()
def agreement(draft_model: DraftModel, texts: torch.Tensor) -> float:
    """The share of the texts' greedy positions where the draft's top token (nothing bypassed,
    the full head) is the model's: the texts teacher-forced through the draft in one forward."""
    with draft_model.active((), ()):
        hidden = draft_model.hidden(texts[:, :-1], None)  # [R, T-1, H]: position t predicts token t+1
    predicted = draft_model.head(None)(hidden[:, SKIPPED_POSITIONS - 1 :]).argmax(-1)  # [R, T-S]
    return float((predicted == texts[:, SKIPPED_POSITIONS:]).float().mean())


def chosen(prices: Sequence[PrecisionPrice]) -> PrecisionPrice:
    """The first candidate (the policy's own precision) unless the fastest other one is priced at
    least ``SWITCH_MARGIN`` times faster."""
    own = prices[0]
    best = max(prices, key=lambda price: price.tokens_per_second)
    return best if best.tokens_per_second >= SWITCH_MARGIN * own.tokens_per_second else own
