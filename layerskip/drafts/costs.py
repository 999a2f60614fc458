"""What drafting costs on this machine, and the expected tokens a draft buys.

``DraftCosts`` holds seconds measured at load (``engine.calibration``): a plain step, a verify
forward per block length, a draft step per head size. ``auto`` prices its choices with them:
with per-token acceptance ``a``, draft length ``g``, draft step ``c`` and verify ``v(g + 1)``, a
step yields ``(1 - a^(g+1)) / (1 - a)`` tokens on average and costs ``g * c + v(g + 1)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def block_cost(seconds: dict[int, float], block: int) -> float:
    """Seconds of a forward over ``block`` tokens, linearly interpolated between measured sizes
    (past either end, the nearest segment's slope continues)."""
    if block in seconds:
        return seconds[block]
    sizes = sorted(seconds)
    if len(sizes) == 1:
        return seconds[sizes[0]] * block / sizes[0]
    if block < sizes[0]:
        lower, upper = sizes[0], sizes[1]
    elif block > sizes[-1]:
        lower, upper = sizes[-2], sizes[-1]
    else:
        lower = max(s for s in sizes if s < block)
        upper = min(s for s in sizes if s > block)
    weight = (block - lower) / (upper - lower)
    return seconds[lower] + weight * (seconds[upper] - seconds[lower])


def expected_tokens(acceptance: float, drafted: int) -> float:
    """Mean tokens a step yields when each of ``drafted`` tokens is kept with ``acceptance`` while
    the ones before it were: the accepted run plus the full model's own token."""
    if acceptance >= 1.0:
        return drafted + 1.0
    return (1.0 - acceptance ** (drafted + 1)) / (1.0 - acceptance)


@dataclass
class DraftCosts:
    """Seconds of one plain step, of one verify forward per block length (the engine's verify),
    and of one draft step per head size (head rows; 0 = the full head), measured on this machine."""

    plain_step: float
    verify: dict[int, float]
    draft_step: dict[int, float]
    info: dict[str, Any] = field(default_factory=dict)  # how and where it was measured

    def to_dict(self) -> dict[str, Any]:
        return {
            "plain_step": self.plain_step,
            "verify": {str(k): v for k, v in sorted(self.verify.items())},
            "draft_step": {str(k): v for k, v in sorted(self.draft_step.items())},
            "info": self.info,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DraftCosts:
        """Back from ``to_dict``; KeyError, TypeError or ValueError for anything else."""
        costs = cls(
            float(data["plain_step"]),
            {int(k): float(v) for k, v in data["verify"].items()},
            {int(k): float(v) for k, v in data["draft_step"].items()},
            dict(data.get("info", {})),
        )
        values = [costs.plain_step, *costs.verify.values(), *costs.draft_step.values()]
        if not costs.verify or not costs.draft_step or not all(v > 0 for v in values):
            raise ValueError("costs must be positive and cover at least one block and one head size")
        return costs
