"""Which low-precision copy ``auto`` drafts from, int4 or int8: both priced on the model at hand.

Weights dequantised from a 4-bit GGUF file already sit on int4's grid (groups of 32, a scale and
a minimum), so the draft's int4 copy of them is nearly exact and agrees with the model almost
always. A full-precision model's weights move by up to half a 4-bit step when rounded to int4,
and that draft then disagrees more often; an int8 copy (one scale per output row, 256 levels)
barely moves them but streams more bytes per draft token. Neither wins everywhere, so the
calibration prices both and keeps the one expected to give more tokens per second:

* ``agreement``: the share of positions of the model's own greedy text (short texts from the
  model's first token and a second one drawn from its own distribution, generated in one batch)
  where the copy's top token, nothing bypassed and the full head, is the model's: a per-token
  acceptance;
* ``draft_step``: seconds of one draft token from the copy, with the smallest truncated head and
  with the full one;
* ``rate``: the best over those heads and draft lengths ``g`` of ``expected_tokens(a, g) /
  (g * c + v(g + 1))`` (``drafts.drafters.auto.best_head_rate``: a truncated head at its prior share of the
  next tokens), with the verify curve ``v`` of the same calibration.

The price is taken at the head the draft would run with: ``auto`` drafts through a truncated head
wherever the vocabulary is large, and there the layers, which int4 halves, are most of a draft
token's cost. Priced at the full head instead (Gemma-3's is 262,144 rows), int8 looked 1.11-1.13x
faster than int4 on an Intel Xeon where decoding measured 0.97-1.00x, which an earlier rule covered
with a margin of 1.2 for the policy's own precision; that margin kept int4 on a full-precision
0.5B model where int8 was priced 1.11x faster, and decoding lost a quarter of its speed. The
fastest copy is chosen; a tie keeps the policy's own. The record keeps each copy's price and the
reason (``chosen``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from layerskip.drafts.builder import DraftModel, best_head_rate
from layerskip.engine.verify_head import engine_verify_head
from layerskip.hf import adapters
from layerskip.hf.cache import model_cache
from layerskip.hf.forward import block_hidden
from layerskip.hf.prompting import first_token_id

# What an int4 draft is priced against where the policy lets the calibration choose.
CHOICES = {"int4": ("int4", "int8")}
TEXT_ROWS = 8  # texts generated together: one batched forward per token
TEXT_TOKENS = 16  # each text's greedy tokens after its two-token start
SKIPPED_POSITIONS = 2  # the first predictions follow a drawn start token: not text the model writes


@dataclass(frozen=True)
class PrecisionPrice:
    """One candidate copy: its agreement with the model, its draft token's seconds by head size
    (0: the full head), the head it is priced best at and its rate there."""

    precision: str
    agreement: float
    draft_step: Mapping[int, float]
    head_rows: int
    tokens_per_second: float

    @classmethod
    def priced(
        cls, precision: str, agreement: float, draft_step: Mapping[int, float], verify: Callable[[int], float], cap: int
    ) -> PrecisionPrice:
        rate, head_rows = best_head_rate(agreement, draft_step, verify, cap)
        return cls(precision, agreement, dict(draft_step), head_rows, rate)

    def to_dict(self) -> dict[str, object]:
        return {
            "agreement": round(self.agreement, 4),
            "draft_step": {str(rows): seconds for rows, seconds in self.draft_step.items()},
            "head_rows": self.head_rows,
            "tokens_per_second": round(self.tokens_per_second, 2),
        }


def candidates(precision: str, choose: bool) -> tuple[str, ...]:
    """The precisions the calibration prices for a policy drafting in ``precision``."""
    return CHOICES.get(precision, (precision,)) if choose else (precision,)


def priced_heads(head_sizes: Sequence[int]) -> tuple[int, ...]:
    """The head sizes a candidate copy is timed with: the smallest truncated one and the full one
    (a truncated head's draft token costs about the same at every size the calibration offers)."""
    truncated = [size for size in head_sizes if size]
    return (min(truncated), 0) if truncated else (0,)


@torch.inference_mode()
def own_texts(model: nn.Module, rows: int = TEXT_ROWS, tokens: int = TEXT_TOKENS, seed: int = 0) -> torch.Tensor:
    """``[rows, 2 + tokens]``: the model's greedy continuations of its first token followed by a
    second one per row, drawn (seeded, without repeats) from the model's own distribution after
    the first, so the texts differ and start as the model's text does; generated as one batch."""
    device = next(model.parameters()).device
    first = torch.full((1, 1), first_token_id(model), device=device)
    logits = adapters.logits_from_hidden(model, block_hidden(model, first, model_cache(model))[:, -1])  # [1, V]
    generator = torch.Generator().manual_seed(seed)
    probs = logits[0].float().softmax(-1).clamp_min(1e-12).cpu()
    starts = torch.multinomial(probs, rows, replacement=False, generator=generator)
    return greedy_continuation(model, torch.cat([first.expand(rows, 1), starts[:, None].to(device)], dim=1), tokens)


@torch.inference_mode()
def greedy_continuation(model: nn.Module, ids: torch.Tensor, tokens: int) -> torch.Tensor:
    """``ids [R, s]`` followed by each row's ``tokens`` greedy tokens, ``[R, s + tokens]``, the rows
    decoded as one batch (the argmax by the engine's greedy head: certified, without the full head)."""
    cache = model_cache(model, rows=ids.shape[0])
    greedy = engine_verify_head(model)
    block = ids
    for _ in range(tokens):
        hidden = block_hidden(model, block, cache)[:, -1]  # [R, H]
        block = torch.tensor(greedy.argmax(hidden), device=ids.device)[:, None]  # [R, 1]
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


def chosen(prices: Sequence[PrecisionPrice]) -> tuple[PrecisionPrice, str]:
    """The fastest-priced candidate (a tie keeps the first, the policy's own) and why, in words."""
    best = max(prices, key=lambda price: price.tokens_per_second)
    others = [price for price in prices if price is not best]
    if not others:
        return best, f"{best.precision}: the only candidate"
    runner = max(others, key=lambda price: price.tokens_per_second)
    ratio = best.tokens_per_second / max(runner.tokens_per_second, 1e-9)
    head = f"head of {best.head_rows} rows" if best.head_rows else "full head"
    why = (
        f"{best.precision} priced {ratio:.2f}x {runner.precision} ({best.tokens_per_second:.1f} against "
        f"{runner.tokens_per_second:.1f} tokens/s, agreement {best.agreement:.2f} against "
        f"{runner.agreement:.2f}, {head})"
    )
    return best, why
