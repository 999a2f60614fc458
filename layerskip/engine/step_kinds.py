"""Which kind of step a batch takes next: the batch's own choice between kinds of proposal.

The kinds: a plain step (every row verifies just its pending token: what a batched ``generate``
does), prompt lookup only (free to draft, so it always fits in the verify), the batched skip draft
of a fixed length (``skip:N``: one lean product for all rows per drafted token), or each row's own
drafter (the policy's: for ``auto``, lookup, the int4 skip draft or nothing, each step priced by
the row itself). Their tokens per second are measured as the batch runs (and carried to the
decoder's next batch of that size), and the fastest is chosen; before a kind has run, ``auto``'s
calibration prices it (``engine.batch_prices``: the plain and draft steps of a batch timed per row
count), so the first batch starts with the kind priced best. Each other kind is tried again once
the time since its last trial (or its priced seconds) is many times that trial's cost, so exploring
costs a few percent at most. A plain step is always on the menu, so a batch is not slower than
plain batched decoding beyond that.

A batch of one row takes its row's own drafter every step: that drafter prices each of its steps
itself (``auto``: lookup, the skip draft or nothing, its length by cost), which the batch's kinds,
measured over several steps, only approximate; with more rows, the rows share one verify and the
batch's choice is what decides.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PLAIN, LOOKUP, DRAFT = "plain", "lookup", "draft"
# The batched skip draft's lengths on the menu (kind "skip:N"): a longer draft pays where the
# draft is right more often; which one does on this model, text and machine is measured.
SKIP_LENGTHS = (3, 6)
# A kind's rate is its last few steps' tokens over their seconds. Not a median of per-step rates:
# a drafting step yields two tokens or twenty, so the typical step's rate is far below the rate
# the kind delivers, and a median would keep choosing plain steps over faster drafting ones.
RECENT_STEPS = 8
# A kind not chosen is tried again once this many times its last trial's seconds have passed:
# exploring then costs about 1 / (1 + this) of the time, and a kind whose price fell is found.
EXPLORE_AFTER = 25.0


@dataclass
class StepKinds:
    """The batch's running tokens per second of each kind of step, and which to run next."""

    kinds: tuple[str, ...]
    recent: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # (tokens, seconds) of the last steps
    last_seconds: dict[str, float] = field(default_factory=dict)
    since: dict[str, float] = field(default_factory=dict)  # seconds of other kinds since each was tried
    steps: dict[str, int] = field(default_factory=dict)
    # (expected tokens, seconds) of a step of each kind priced before it ran (engine.batch_prices):
    # a kind's rate until it has been measured.
    prices: dict[str, tuple[float, float]] = field(default_factory=dict)

    def rate(self, kind: str) -> float:
        recent = self.recent.get(kind)
        if not recent:
            tokens, seconds = self.prices[kind]
            return tokens / max(seconds * self.price_scale(), 1e-9)
        return sum(tokens for tokens, _ in recent) / max(sum(seconds for _, seconds in recent), 1e-9)

    def price_scale(self) -> float:
        """How much longer this batch's steps take than priced, over the priced kinds it measured
        (1 before any): the calibration times short contexts, a batch's rows hold longer ones, and
        that slows every kind of step alike, so an unmeasured kind's price is scaled by it."""
        measured = priced = 0.0
        for kind, recent in self.recent.items():
            if kind in self.prices and recent:
                measured += sum(seconds for _, seconds in recent)
                priced += len(recent) * self.prices[kind][1]
        return measured / priced if priced > 0 else 1.0

    def choose(self) -> str:
        for kind in self.kinds:  # each kind without a price once, the plain step first
            if kind not in self.recent and kind not in self.prices:
                return kind
        for kind in self.kinds:
            last = self.last_seconds[kind] if kind in self.last_seconds else self.prices[kind][1]
            if self.since.get(kind, 0.0) > EXPLORE_AFTER * last:
                return kind
        return max(self.kinds, key=self.rate)

    def observe(self, kind: str, tokens: int, seconds: float) -> None:
        recent = self.recent.setdefault(kind, [])
        recent.append((tokens, seconds))
        del recent[:-RECENT_STEPS]
        self.last_seconds[kind] = seconds
        self.steps[kind] = self.steps.get(kind, 0) + 1
        for other in self.kinds:
            self.since[other] = 0.0 if other == kind else self.since.get(other, 0.0) + seconds


# Rows' own drafters run one row after another: their cost grows with the rows, so beyond this
# many rows the batched draft (one product for all rows) is the only skip draft offered.
ROW_DRAFTERS_UP_TO = 2


def step_kinds(rows: int, has_draft: bool, has_lookup: bool, batch_draft: bool) -> StepKinds:
    """The kinds of step a batch of ``rows`` chooses from: one row, its own drafter (plain without a
    draft); more, the plain step always, then what the draft offers."""
    if rows <= 1:
        return StepKinds((DRAFT if has_draft else PLAIN,))
    kinds = [PLAIN]
    if has_lookup:
        kinds.append(LOOKUP)
    if batch_draft:
        kinds.extend(f"skip:{n}" for n in SKIP_LENGTHS)
    if has_draft and (rows <= ROW_DRAFTERS_UP_TO or not batch_draft):
        kinds.append(DRAFT)
    return StepKinds(tuple(kinds))
