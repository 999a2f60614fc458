"""What an exit draft would buy: its measured cost per depth against its acceptance.

Expected tokens per verify with per-token acceptance ``a`` and draft length ``k`` are
``(1 - a^(k+1)) / (1 - a)``; a step costs ``k * c + v(k + 1)`` plain steps, ``c`` the draft
step's and ``v(n)`` a verify over ``n`` tokens' measured cost. The projected speedup is the best
ratio over ``k``: the frontier table train-exit writes (docs/exit-adapters.md) reads it for every exit depth.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from layerskip.drafts.builder import head_rows
from layerskip.drafts.model.draft_model import DraftModel
from layerskip.drafts.policy.skip_policy import SkipPolicy
from layerskip.drafts.rules.costs import expected_tokens
from layerskip.engine.latency import draft_step_seconds, verify_seconds
from layerskip.engine.verify_head import engine_verify_head


@dataclass(frozen=True)
class ExitCost:
    draft_cost: float  # one draft step / one plain step
    verify_cost: dict[int, float]  # block length -> verify / plain step
    plain_ms: float


def projected_speedup(acceptance: float, draft_cost: float, verify_cost: Callable[[int], float]) -> tuple[float, int]:
    """(best projected speedup, its draft length) over k = 1..8."""
    return max((expected_tokens(acceptance, k) / (k * draft_cost + verify_cost(k + 1)), k) for k in range(1, 9))


def measure_exit_cost(
    draft_model: DraftModel, policy: SkipPolicy, context: Sequence[int], vocab_size: int, repeats: int = 7
) -> ExitCost:
    """Time one draft step of ``policy`` (its draft model carries the exit adapter) and verifies of 1..9 tokens."""
    model = draft_model.model
    plain = verify_seconds(model, context, 1, repeats)
    rows = head_rows(policy, vocab_size)
    draft = draft_step_seconds(draft_model, context, policy.skip_attention, policy.skip_mlp, rows, repeats)
    greedy = engine_verify_head(model)  # the verify as the engine runs it (its head certified on CPU)
    verify = {n: verify_seconds(model, context, n, repeats, greedy) / plain for n in range(1, 10)}
    return ExitCost(draft / plain, verify, 1000 * plain)
