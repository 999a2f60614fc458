"""What drafting costs on this machine, and the expected tokens a draft buys.

``DraftCosts`` holds seconds measured at load (``engine.calibration``): a plain step, a verify
forward per block length, a draft step per head size. ``auto`` prices its choices with them and
``expected_tokens`` (drafts/drafters/auto.py).
"""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from layerskip.drafts.model.precision import PRECISIONS
from layerskip.errors import few


def block_cost(seconds: dict[int, float], block: int) -> float:
    """Seconds of a forward over ``block`` tokens, linearly interpolated between measured sizes
    (past either end, the nearest segment's slope continues)."""
    if block in seconds:
        return seconds[block]
    sizes = sorted(seconds)
    if len(sizes) == 1:
        return seconds[sizes[0]] * block / sizes[0]
    above = min(max(bisect.bisect(sizes, block), 1), len(sizes) - 1)  # the segment around block, or the nearest end's
    lower, upper = sizes[above - 1], sizes[above]
    weight = (block - lower) / (upper - lower)
    return seconds[lower] + weight * (seconds[upper] - seconds[lower])


def expected_tokens(acceptance: float, drafted: int) -> float:
    """Mean tokens a step yields when each of ``drafted`` tokens is kept with ``acceptance`` while
    the ones before it were: the accepted run plus the full model's own token."""
    if acceptance >= 1.0:
        return drafted + 1.0
    return (1.0 - acceptance ** (drafted + 1)) / (1.0 - acceptance)


def end_move(acceptance: float, drafted: int, gaps: Sequence[int]) -> float:
    """Mean tokens a batch's end moves by in a step where each row drafts ``drafted`` tokens, each
    kept with ``acceptance`` while the ones before it were (``gaps``: how far each row is ahead of
    the row furthest behind). The end is the most tokens any row still has to make: it moves by
    ``j`` or more only where every row keeps ``j - gap`` tokens, its own next one included. One
    row, or rows far apart: ``expected_tokens``; ``R`` rows level: ``expected_tokens(a ** R, g)``."""
    return sum(
        math.prod(acceptance ** (j - gap - 1) if j - gap > 1 else 1.0 for gap in gaps) for j in range(1, drafted + 2)
    )


# The verify width a batch's wide step is timed at (``DraftCosts.batch_wide``): a skip draft of 3
# and its pending token. How a batched verify grows with its width depends on the row count (a few
# rows' wide block can cost no more than their plain step; sixteen rows' can cost several), so it
# is timed, not scaled.
WIDE_BLOCK = 4
# The most rows a wide verify is timed at: the dearest step of a calibration (sixteen rows' wide
# verify alone took 1.8 s of a 20 s budget on 2 cores); more rows' lie on the line through the
# last two timed (``block_cost``), within a tenth of a timed one on SmolLM2.
WIDE_ROWS_UP_TO = 8

# A batch's curves, then the dense head's: each absent from the file where empty.
BATCH_CURVES = ("batch_plain", "batch_draft", "batch_wide")
OPTIONAL_CURVES = (*BATCH_CURVES, "dense_head")


@dataclass
class DraftCosts:
    """Seconds of one plain step, of one verify forward per block length (the engine's verify),
    and of one draft step per head size (head rows; 0 = the full head), measured on this machine."""

    plain_step: float
    verify: dict[int, float]
    draft_step: dict[int, float]
    info: dict[str, Any] = field(default_factory=dict)  # how and where it was measured
    precision: str = ""  # the draft copy the draft steps were timed on, where the calibration chose it
    # A batch's steps by row count (engine.step_kinds): a plain batched step, a batched draft step
    # of the smallest head size and a batched verify of a few positions per row (empty where the
    # draft cannot draft rows together).
    batch_plain: dict[int, float] = field(default_factory=dict)
    batch_draft: dict[int, float] = field(default_factory=dict)
    batch_wide: dict[int, float] = field(default_factory=dict)
    # What a verify's head costs beyond the greedy one where a row needs every logit (a user's own
    # processor, sampling), by count of positions (engine.latency.dense_head_timings).
    dense_head: dict[int, float] = field(default_factory=dict)

    def dense_extra(self, positions: int) -> float:
        """Seconds the full head adds to a verify of ``positions`` positions (0 without a timing)."""
        return max(block_cost(self.dense_head, positions), 0.0) if self.dense_head else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "plain_step": self.plain_step,
            "verify": _keyed(self.verify),
            "draft_step": _keyed(self.draft_step),
            "info": self.info,
            **({"precision": self.precision} if self.precision else {}),
            **{name: _keyed(getattr(self, name)) for name in OPTIONAL_CURVES if getattr(self, name)},
        }

    @classmethod
    def from_dict(
        cls,
        data: Any,
        head_sizes: Sequence[int] | None = None,
        blocks: Sequence[int] | None = None,
        batch_rows: Sequence[int] | None = None,
    ) -> DraftCosts:
        """Back from ``to_dict``, checked before anything prices a draft with it: every cost a
        finite number of seconds above 0 (and below ``MAX_SECONDS``), verify block lengths positive
        integers, head sizes integers >= 0 (0: the full head); with ``head_sizes``, ``blocks`` and
        ``batch_rows`` (what the calibration was made for) exactly those (a batch curve may be
        absent: a draft that cannot draft rows together has none). ValueError says what is wrong: a cost
        of 0 or a block of 0 would divide by zero where auto prices a step, a negative block would
        send its interpolation off the curve, and a head size the key does not hold was never
        measured for this model."""
        if not isinstance(data, dict):
            raise ValueError("the costs are not an object")
        info = data.get("info", {})
        if not isinstance(info, dict):
            raise ValueError("info is not an object")
        costs = cls(
            _seconds("plain_step", data.get("plain_step")),
            _curve("verify", data.get("verify"), low=1),
            _curve("draft_step", data.get("draft_step"), low=0),
            dict(info),
            _precision(data.get("precision", "")),
            **{name: _curve(name, data[name], low=1) for name in OPTIONAL_CURVES if name in data},
        )
        if blocks is not None and set(costs.verify) != set(blocks):
            raise ValueError(f"its verify blocks {few(sorted(costs.verify))} are not the calibrated {sorted(blocks)}")
        for name in BATCH_CURVES:
            curve = getattr(costs, name)
            rows = [r for r in batch_rows or () if name != "batch_wide" or r <= WIDE_ROWS_UP_TO]
            if batch_rows is not None and curve and set(curve) != set(rows):
                raise ValueError(f"its {name} rows {few(sorted(curve))} are not the calibrated {sorted(rows)}")
        if head_sizes is not None and set(costs.draft_step) != set(head_sizes):
            measured = few(sorted(costs.draft_step))
            raise ValueError(f"its head sizes {measured} are not the calibrated {sorted(head_sizes)}")
        return costs


def _keyed(curve: dict[int, float]) -> dict[str, float]:
    return {str(k): v for k, v in sorted(curve.items())}


def _precision(value: Any) -> str:
    """A chosen draft precision back from the cache: one the draft can run ("" where none was chosen)."""
    if value != "" and value not in PRECISIONS:
        raise ValueError(f"precision {value!r} is not a draft precision")
    return value


MAX_SECONDS = 600.0  # one forward of one block: anything longer is not a measurement to price drafts by


def _seconds(name: str, value: Any) -> float:
    """``value`` as seconds: a number (not a bool) in (0, MAX_SECONDS]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} is not a number of seconds")
    if not (math.isfinite(value) and 0 < value <= MAX_SECONDS):
        raise ValueError(f"{name} is {value} s, not in (0, {MAX_SECONDS:g}]")
    return float(value)


def _curve(name: str, values: Any, low: int) -> dict[int, float]:
    """``{"n": seconds}`` back as ``{n: seconds}``: at least one entry, each key a decimal integer >= ``low``."""
    if not isinstance(values, dict) or not values:
        raise ValueError(f"{name} is not a non-empty object")
    curve = {}
    for key, value in values.items():
        if not (isinstance(key, str) and re.fullmatch(r"[0-9]{1,9}", key)) or int(key) < low:
            raise ValueError(f"{name} has key {key!r}, not an integer >= {low}")
        curve[int(key)] = _seconds(f"{name}[{key}]", value)
    return curve
