"""Draft length chosen by cost: after each drafted token, draft one more only if it is expected to pay.

A step that drafts ``i`` tokens yields its accepted run plus the full model's own token, and
costs ``i`` draft forwards plus one verify over the block. What decoding maximises is tokens per
second over many steps (a renewal-reward ratio), so a further token is worth its time when what
it is expected to add beats what that time earns at the rate reached so far, ``lam``
(Dinkelbach's rule for ratio objectives):

    gain(m) = P_i * (p + p^2 + ... + p^m)       m more tokens; P_i = chance the i drafted so far
                                                are all accepted, p = acceptance of a next token
    cost(m) = m * c_draft + V(block(i + 1 + m)) - V(block(i + 1))
    draft on  iff  max over m of  gain(m) - lam * cost(m) > 0

``P_i`` multiplies, over the drafted tokens, the acceptance learned for each token's
confidence (the top-2 margin of its draft logits, in bins): a confident draft runs on, a
hesitant one stops early. ``V(b)`` is the verify cost of a block of ``b`` positions as measured
(padding included); it need not grow with ``b`` (on CPU a 2-3-row matmul can cost more than a
4-row one), hence the look-ahead over every ``m`` rather than one token at a time. ``lam`` is the
tokens per unit cost of the skip-drafted steps so far. Everything is learned within one
generation; the first few steps draft to the cap, which measures a draft, a verify and a rate.

Units are whatever the caller feeds: the engine feeds seconds from its clock, the search's
replay feeds costs in plain decoding steps. Lossless either way: it only decides how many
tokens to propose.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

CONFIDENCE_BINS = 10
PRIOR_WEIGHT = 2.0  # pseudo-observations of the pooled acceptance in each confidence bin
WARM_UP_STEPS = 3  # steps drafted to the cap before the rule decides (its first prices and rate)
SMOOTHING = 0.3  # weight of the newest timing in the running estimates
LONGEST_TIMED_BLOCK = 64  # longer verifies (prompt prefills) say nothing about draft blocks


@dataclass(frozen=True)
class LengthPrior:
    """What earlier skip drafts taught a length rule: acceptance counts per confidence bin, and
    the skip-drafted steps' tokens and cost (the rate a further token must beat)."""

    reached: Sequence[float] = (0.0,) * CONFIDENCE_BINS
    right: Sequence[float] = (0.0,) * CONFIDENCE_BINS
    steps: int = 0
    step_tokens: float = 0.0
    step_cost: float = 0.0


@dataclass
class DraftLengthByCost:
    cap: int  # max_draft_tokens
    pad_to: int = 0  # min_verify_block: blocks of 2..pad_to-1 positions are verified as pad_to
    reached: list[int] = field(default_factory=lambda: [0] * CONFIDENCE_BINS)
    right: list[int] = field(default_factory=lambda: [0] * CONFIDENCE_BINS)
    draft_cost: float | None = None  # one draft forward
    verify_cost: dict[int, float] = field(default_factory=dict)  # block positions -> one verify forward
    steps: int = 0  # skip-drafted steps so far, the tokens they produced and what they cost
    step_tokens: float = 0.0
    step_cost: float = 0.0

    @classmethod
    def priced(cls, cap: int, pad_to: int, draft_cost: float, verify_cost: Callable[[int], float]) -> DraftLengthByCost:
        """A rule with fixed prices (the search's replay: costs in plain steps, not measured here)."""
        blocks = range(2, max(cap + 1, pad_to) + 1)
        return cls(cap, pad_to, draft_cost=draft_cost, verify_cost={b: verify_cost(b) for b in blocks})

    @classmethod
    def from_prior(
        cls,
        cap: int,
        draft_cost: float,
        verify_cost: dict[int, float],
        prior: LengthPrior,
        weight: float,
        assumed: tuple[float, int],
    ) -> DraftLengthByCost:
        """A rule priced by ``draft_cost`` and ``verify_cost`` that starts from ``prior``'s counts
        weighed by ``weight`` (a short memory of earlier generations); where they round to
        nothing, from ``assumed = (acceptance, drafts)``: that acceptance as that many drafts of
        the most confident bin. A prior with a rate skips the warm-up at the cap."""
        reached = [round(weight * n) for n in prior.reached]
        right = [min(round(weight * r), n) for r, n in zip(prior.right, reached, strict=True)]
        if not any(reached):
            acceptance, drafts = assumed
            reached[-1], right[-1] = drafts, round(acceptance * drafts)
        rule = cls(cap, 0, reached, right, draft_cost=draft_cost, verify_cost=dict(verify_cost))
        if prior.step_cost > 0:
            rule.steps = max(WARM_UP_STEPS, round(weight * prior.steps))
            rule.step_tokens, rule.step_cost = prior.step_tokens, prior.step_cost
        return rule

    def learned(self, weight: float) -> LengthPrior:
        """What this rule learned, as the next generation's prior: its counts, and its rate's
        tokens and cost weighed by ``weight`` (no rate before a skip-drafted step was costed)."""
        counts = tuple(map(float, self.reached)), tuple(map(float, self.right))
        if self.step_cost <= 0:
            return LengthPrior(*counts)
        return LengthPrior(*counts, self.steps, weight * self.step_tokens, weight * self.step_cost)

    # --- what is measured ---

    def observe_draft(self, forwards: int, cost: float) -> None:
        if forwards > 0:
            self.draft_cost = _smooth(self.draft_cost, cost / forwards)

    def observe_verify(self, block: int, cost: float) -> None:
        if 2 <= block <= LONGEST_TIMED_BLOCK:
            self.verify_cost[block] = _smooth(self.verify_cost.get(block), cost)

    def observe_step(self, confidences: Sequence[float], accepted: int, cost: float) -> None:
        """A skip-drafted step: its drafts' confidences, how many were accepted, what it cost."""
        for position, confidence in enumerate(confidences[: accepted + 1]):
            b = _bin(confidence)
            self.reached[b] += 1
            self.right[b] += position < accepted
        self.steps += 1
        self.step_tokens += accepted + 1
        self.step_cost += cost

    # --- the decision ---

    @property
    def pooled_acceptance(self) -> float:
        """Chance that a drafted token is accepted when its earlier ones were, any confidence."""
        return (sum(self.right) + 1) / (sum(self.reached) + 2)

    def acceptance(self, confidence: float) -> float:
        """Learned chance that a drafted token of this confidence is accepted (its earlier ones
        were); a bin seen rarely leans on the pooled figure, so one early miss does not end drafts."""
        b = _bin(confidence)
        return (self.right[b] + PRIOR_WEIGHT * self.pooled_acceptance) / (self.reached[b] + PRIOR_WEIGHT)

    def draft_more(self, confidences: Sequence[float]) -> bool:
        """After drafting ``len(confidences)`` tokens: is one more (or a few more) expected to pay?"""
        drafted = len(confidences)
        if drafted >= self.cap:
            return False
        if self.draft_cost is None or not self.verify_cost or self.steps < WARM_UP_STEPS:
            return True  # not measured yet: draft to the cap, as a fixed length would
        rate = self.step_tokens / self.step_cost
        all_so_far = 1.0
        for confidence in confidences:
            all_so_far *= self.acceptance(confidence)
        next_token = self.pooled_acceptance
        now = self.verify_price(drafted + 1)
        gain = 0.0
        chance = all_so_far
        for more in range(1, self.cap - drafted + 1):
            chance *= next_token
            gain += chance
            cost = more * self.draft_cost + self.verify_price(drafted + 1 + more) - now
            if gain - rate * cost > 0:
                return True
        return False

    def verify_price(self, block: int) -> float:
        """Measured cost of verifying ``block`` positions; an unmeasured length costs as the
        nearest measured one (the longer on a tie), so a longer block gets tried and measured."""
        block = max(block, self.pad_to)
        if block in self.verify_cost:
            return self.verify_cost[block]
        nearest = min(self.verify_cost, key=lambda b: (abs(b - block), -b))
        return self.verify_cost[nearest]


def _bin(confidence: float) -> int:
    return min(CONFIDENCE_BINS - 1, max(0, int(confidence * CONFIDENCE_BINS)))


def _smooth(previous: float | None, value: float) -> float:
    return value if previous is None else (1 - SMOOTHING) * previous + SMOOTHING * value
