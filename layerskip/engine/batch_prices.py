"""What each kind of batch step is expected to give before the batch has measured it, priced from
``auto``'s calibration.

A batch chooses its steps by their measured tokens per second (``engine.step_kinds.StepKinds``); a kind
not yet measured is ranked by its price here, so the first batch of a size starts with the kind
priced best rather than trying every kind in turn. With ``R`` rows, per-token acceptance ``a`` of
the skip draft and ``E(a, g)`` the tokens a draft of ``g`` yields (``drafts.costs.expected_tokens``):

    plain, lookup  R tokens in V(R, 1) (a row without a lookup match verifies its pending token alone)
    skip:N         R * E(a, N) tokens in N * D(R) + V(R, N + 1)
    draft          rows' own drafters, one row after another, at their best length g:
                   R * E(a, g) tokens in R * g * c + V(R, g + 1)

``V(R, 1)`` is the calibrated plain batched step of ``R`` rows; a wider block grows it as one row's
verify curve grows from ``R`` positions to ``R * n`` (a forward's cost follows the tokens it
holds). ``D(R)`` is the calibrated batched draft step of ``R`` rows scaled to the batch's head size
by the one-row draft step ``c`` of that size. Row counts between the calibrated ones are
interpolated, beyond them extrapolated (``drafts.costs.block_cost``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from layerskip.drafts.builder import MAX_ACCEPTANCE, AutoState, block_cost, expected_tokens
from layerskip.engine.step_kinds import DRAFT, LOOKUP, PLAIN

Price = tuple[float, float]  # (expected tokens, seconds) of one step of the whole batch


@dataclass
class BatchPrices:
    """A batch's step prices from calibrated costs (see the module's formulas)."""

    plain: dict[int, float]  # seconds of a plain batched step by row count
    draft_rows: dict[int, float]  # seconds of a batched draft step by row count (the calibration's head)
    verify: Callable[[int], float]  # seconds of one row's verify of n positions
    draft_step: float  # seconds of one row's draft step with the batch's head
    acceptance: float  # per-token acceptance of the skip draft
    max_draft: int  # the longest draft a row's own drafter makes

    @classmethod
    def from_auto(cls, state: AutoState) -> BatchPrices | None:
        """Prices from ``auto``'s calibration and running estimates, at the head size it chose last
        (None where the calibration holds no batch steps)."""
        costs = state.costs
        if not costs.batch_plain or not costs.batch_draft:
            return None
        rows = max(state.head_rows, 0)
        acceptance = min(MAX_ACCEPTANCE, state.full_head_acceptance() * state.coverage.share(rows))
        return cls(
            costs.batch_plain,
            costs.batch_draft,
            state.verify_seconds,
            costs.draft_step[rows],
            acceptance,
            state.settings.max_draft_tokens,
        )

    def verify_rows(self, rows: int, width: int) -> float:
        """Seconds of one verify forward over ``rows`` rows of ``width`` positions."""
        return block_cost(self.plain, rows) * self.verify(rows * width) / self.verify(rows)

    def draft_rows_step(self, rows: int) -> float:
        """Seconds of one batched draft step of ``rows`` rows with the batch's head."""
        # One row's batched draft step, extrapolated where the calibration starts at 2 rows (never
        # below half the cheapest timed: a steep curve must not send it to 0).
        one = max(block_cost(self.draft_rows, 1), 0.5 * min(self.draft_rows.values()))
        return self.draft_step * block_cost(self.draft_rows, rows) / one

    def price(self, kind: str, rows: int) -> Price | None:
        """Expected tokens and seconds of one step of ``kind`` (None: a kind not priced here)."""
        if kind in (PLAIN, LOOKUP):
            return float(rows), self.verify_rows(rows, 1)
        if kind.startswith("skip:"):
            steps = int(kind.split(":")[1])
            seconds = steps * self.draft_rows_step(rows) + self.verify_rows(rows, steps + 1)
            return rows * expected_tokens(self.acceptance, steps), seconds
        if kind == DRAFT:
            offers = [
                (rows * expected_tokens(self.acceptance, g), rows * g * self.draft_step + self.verify_rows(rows, g + 1))
                for g in range(1, self.max_draft + 1)
            ]
            return max(offers, key=lambda offer: offer[0] / offer[1])
        return None

    def priced(self, kinds: Sequence[str], rows: int) -> dict[str, Price]:
        """Each of ``kinds`` this prices, for a batch of ``rows`` rows."""
        prices = {kind: self.price(kind, rows) for kind in kinds}
        return {kind: price for kind, price in prices.items() if price is not None}
