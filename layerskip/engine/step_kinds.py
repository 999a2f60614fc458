"""Which kind of step a batch takes next, and what each kind is priced at.

The kinds: a plain step (every row verifies just its pending token: what a batched ``generate``
does), prompt lookup only (free to draft; the rows' matches cut to the verify width that pays for
the whole batch, ``step.paying_width``, so at worst a plain step), the batched skip draft
of a fixed length (``skip:N``: one lean product for all rows per drafted token), or each row's own
drafter (the policy's: for ``auto``, lookup, the int4 skip draft or nothing, each step priced by
the row itself).

A kind's rate is the tokens its recent steps kept over their seconds. Under ``auto`` those seconds
are priced, not read off the clock: each step's shape (rows, verify width, draft forwards) costs
what ``auto``'s calibration says (``StepPrices``), so two kinds are compared at one context length
and in one sitting, however busy the machine was while each ran; wall-clock rates on a shared CPU
swing by a fifth between identical runs, and a kind measured early in a batch (short contexts)
looked faster than one measured late. Only the tokens are measured. Without a calibration (a
policy file) the rates are wall-clock ones.

Before a kind has run, its price stands for it (the first batch starts with the kind priced best),
a batched draft's scaled by what the nearest length that ran delivered of its own price.
A kind known only by its price is tried once early, a few times its priced seconds into the batch:
prices take drafted tokens as accepted independently, which underrates long drafts on text that
comes in runs. Each kind measured is tried again once the time since its last trial is ten times
that trial's cost, and as many times more as its rate is below the best's, so exploring one kind
costs under 3 % (a trial at half the best rate loses half its seconds, once per twenty of them);
a kind that could not beat the best even if every drafted token were accepted is never tried, and
a longer batched draft waits until the shorter one has run near the best rate.

A step's tokens count as its rows times how far it moved the batch's end (the most tokens any row
still has to make): a batch ends when its last row does, and a step that moves some rows far ahead
and the last by one leaves the batch's end almost where it was (the rows ahead finish early, and
steps with fewer rows cost nearly as much on a CPU).

A plain step is always on the menu, so a batch is not slower than plain batched decoding beyond
that.

A batch of one row takes its row's own drafter every step: that drafter prices each of its steps
itself (``auto``: lookup, the skip draft or nothing, its length by cost), which the batch's kinds,
measured over several steps, only approximate; with more rows, the rows share one verify and the
batch's choice is what decides.

Prices count tokens the same way. With ``R`` rows, per-token acceptance ``a`` of the skip draft
and ``M(a, g)`` how far a draft of ``g`` moves the batch's end (``drafts.rules.costs.end_move``:
the end moves by ``j`` only where every row furthest behind keeps ``j - 1`` drafted tokens; ``R``
rows level, ``E(a ** R, g)``, where one row's draft yields ``E(a, g)``):

    plain, lookup  R tokens in V(R, 1) (lookup at its narrowest: no match kept)
    skip:N         R * M(a, N) tokens in N * D(R) + V(R, N + 1)
    draft          rows' own drafters, one row after another, at their best length g:
                   R * M(a, g) tokens in R * g * c + V(R, g + 1)

Priced per row (``R * E(a, g)``), sixteen level rows' drafts looked worth a trial however often
they lost: on SmolLM2 a 3-token draft cost about four plain steps and moved the end by one or two,
and the 6-token one (eight plain steps) was tried after it. Priced by the end's move, a draft that
could not pay even with every token accepted (``MAX_ACCEPTANCE``) is not tried (``hopeless``);
rows that drifted apart (one row far behind the rest) make a draft worth its price again.

``V(R, 1)`` and ``V(R, 4)`` are the calibrated plain and wide batched verifies of ``R`` rows; other
widths lie on the line through them (one row's verify curve, scaled from ``R`` positions to
``R * n``, underpriced eight rows' wide verify on SmolLM2 and sent the batch into skip steps that
lost to plain ones). ``D(R)`` is the calibrated batched draft step of ``R`` rows scaled to the batch's head size
by the one-row draft step ``c`` of that size. Row counts between the calibrated ones are
interpolated, beyond them extrapolated (``drafts.rules.costs.block_cost``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from layerskip.drafts.builder import MAX_ACCEPTANCE, Price, StepPrices

PLAIN, LOOKUP, DRAFT = "plain", "lookup", "draft"

# The batched skip draft's lengths on the menu (kind "skip:N"): a longer draft pays where the
# draft is right more often; which one does on this model, text and machine is measured.
SKIP_LENGTHS = (3, 6)
# A kind's rate is its last few steps' tokens over their seconds. Not a median of per-step rates:
# a drafting step yields two tokens or twenty, so the typical step's rate is far below the rate
# the kind delivers, and a median would keep choosing plain steps over faster drafting ones.
RECENT_STEPS = 8
# A kind not chosen is tried again once this many times its last trial's seconds have passed (times
# how far its rate is behind the best's): a 128-token batch of eight rows then tries a kind whose
# early steps lost (the first tokens of an answer are the hardest to draft) again within the batch.
# Times the square of how far behind, it saved little at sixteen rows and cost Gemma-3's four rows
# ~0.15 of their gain over plain steps (a 3-token draft that lost early came back too late).
EXPLORE_AFTER = 10.0
# A kind known only by its price is tried once this many times its priced seconds into a batch: the
# price takes each drafted token as accepted independently at the running rate, while text comes in
# runs that a longer draft rides (on Gemma-3, eight rows' 6-token batched draft kept 6.4 tokens a row
# where its price said 3), so a price alone would keep a kind that wins from ever running.
EXPLORE_FIRST = 4.0
# A drafting kind is chosen over the plain step only where it is rated this much faster.
DRAFT_MARGIN = 1.05
# A longer batched draft is tried only once the next shorter one has run at this share of the best
# kind's rate or more: its trial costs more and rides the same acceptance, so where the shorter
# draft lost by more the longer one loses too (sixteen rows of SmolLM2 tried both, and both lost).
LONGER_AFTER = 0.8


def skip_length(kind: str) -> int | None:
    """The tokens a batched skip draft of ``kind`` ("skip:N") drafts; None for any other kind."""
    return int(kind.split(":")[1]) if kind.startswith("skip:") else None


def price(
    prices: StepPrices, kind: str, rows: int, acceptance: float | None = None, gaps: Sequence[int] = ()
) -> Price | None:
    """Expected tokens and seconds of one step of ``kind`` for ``rows`` rows (None: a kind not priced),
    at the running acceptance or at ``acceptance``, the rows ``gaps`` ahead of the furthest behind
    (level where empty)."""
    if kind in (PLAIN, LOOKUP):
        return prices.plain_step(rows)
    if (length := skip_length(kind)) is not None:
        return prices.batched_skip(rows, length, acceptance, gaps)
    if kind == DRAFT:
        return prices.own_drafts(rows, acceptance, gaps)
    return None


def priced(prices: StepPrices, kinds: Sequence[str], rows: int) -> dict[str, Price]:
    """Each of ``kinds`` that ``prices`` prices, for a batch of ``rows`` rows."""
    found = {kind: price(prices, kind, rows) for kind in kinds}
    return {kind: offer for kind, offer in found.items() if offer is not None}


@dataclass
class StepKinds:
    """The batch's running tokens per second of each kind of step, and which to run next."""

    kinds: tuple[str, ...]
    recent: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # (tokens, seconds) of the last steps
    last_seconds: dict[str, float] = field(default_factory=dict)
    since: dict[str, float] = field(default_factory=dict)  # seconds of other kinds since each was tried
    steps: dict[str, int] = field(default_factory=dict)
    # (expected tokens, seconds) of a step of each kind priced before it ran (``StepPrices``):
    # a kind's rate until it has been measured.
    prices: dict[str, tuple[float, float]] = field(default_factory=dict)
    # Where set, every step's seconds are priced from its shape (``step_seconds``), not timed, and
    # a drafting kind that could not beat the best even with every token accepted is not explored.
    pricer: StepPrices | None = None
    rows: int = 0
    # (the clock's seconds, the priced seconds) of the recent steps, but those run at a thread count
    # on trial (``engine.threads``)
    wall: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    # How far each row is ahead of the row furthest behind, as of the next step (the stepper's;
    # empty: level). A draft moves the batch's end only as far as the rows furthest behind keep it.
    gaps: tuple[int, ...] = ()

    def step_seconds(self, wall: float, width: int, batched_forwards: int, own_forwards: int) -> float:
        """A step's seconds as the rates count them: priced from its shape under a pricer, else ``wall``."""
        if self.pricer is None:
            return wall
        return self.pricer.step_seconds(self.rows, width, batched_forwards, own_forwards)

    def verify_units(self, width: int) -> float:
        """A verify of ``width`` positions per row in plain steps (priced; 1 without a pricer): the
        thread tuner's unit, so a lookup step's wider verify does not read as a slower count."""
        if self.pricer is None or self.rows < 1:
            return 1.0
        return self.pricer.verify_rows(self.rows, width) / max(self.pricer.verify_rows(self.rows, 1), 1e-12)

    def rate(self, kind: str) -> float:
        recent = self.recent.get(kind)
        if not recent:
            return self.price_rate(kind) * self.sibling_share(kind)
        seconds = sum(seconds for _, seconds in recent) * self.misprice(kind)
        return sum(tokens for tokens, _ in recent) / max(seconds, 1e-9)

    def price_rate(self, kind: str) -> float:
        """The rate ``kind``'s price says, at the rows' present gaps where priced by a pricer."""
        offer = price(self.pricer, kind, self.rows, gaps=self.gaps) if self.pricer is not None and self.gaps else None
        tokens, seconds = offer or self.prices[kind]
        return tokens / max(seconds, 1e-9)

    def sibling_share(self, kind: str) -> float:
        """For a batched draft not yet run: the share of its price's rate that the nearest length
        that ran delivered (1 for any other kind, or before any ran). The two ride the same text and
        the same forwards: a fresh menu of sixteen rows ran its 3-token draft at a quarter of its
        price, then took the 6-token one, priced best, at ~5 plain steps a step."""
        nearest = self.nearest_draft(kind, {k: v for k, v in self.recent.items() if k in self.prices})
        if nearest is None:
            return 1.0
        return self.rate(nearest) / max(self.price_rate(nearest), 1e-12)

    def nearest_draft(self, kind: str, measured: dict[str, list[tuple[float, float]]]) -> str | None:
        """For a batched draft (``kind``), the batched draft of the nearest length with entries in
        ``measured``; None for any other kind, or where none has."""
        length = skip_length(kind)
        ran = [k for k in self.kinds if skip_length(k) is not None and measured.get(k)]
        if length is None or not ran:
            return None
        return min(ran, key=lambda k: abs(skip_length(k) - length))

    def misprice(self, kind: str) -> float:
        """How much dearer ``kind``'s recent steps ran than priced, relative to the plain step's (1
        without a pricer or before ``kind`` ran): the calibration prices a wide batched verify from
        one row's verify curve, which some shapes outrun. A ratio of ratios: a busy spell or a
        longer context slows both alike and cancels (a plain step measured earlier, at shorter
        contexts, makes the drafting kinds look dearer, the safe side). Before any plain step ran,
        the plain step is taken to run at its price, the safe side again: a fresh batch of sixteen
        starts with the kind priced best, a 3-token draft, and went on drafting for seven steps at
        ~4.4 plain steps each (priced at 2.9) while no plain step stood beside them."""
        like = self.timed_like(kind)
        if self.pricer is None or kind == PLAIN or like is None:
            return 1.0

        def ratio(name: str) -> float:
            return sum(wall for wall, _ in self.wall[name]) / max(sum(seconds for _, seconds in self.wall[name]), 1e-9)

        plain = ratio(PLAIN) if self.wall.get(PLAIN) else 1.0
        return ratio(like) / max(plain, 1e-9)

    def timed_like(self, kind: str) -> str | None:
        """The kind whose clock times stand for ``kind``'s: its own, else, for a batched draft not
        yet run, the nearest length that ran (the same forwards, more or fewer of them: where the
        calibration's short context underprices sixteen rows' draft forwards, skip:3's trials show
        it, and skip:6 was tried anyway, priced as if they did not)."""
        if self.wall.get(kind):
            return kind
        return self.nearest_draft(kind, self.wall)

    def choose(self) -> str:
        for kind in self.kinds:  # each kind without a price once, the plain step first
            if kind not in self.recent and kind not in self.prices:
                return kind
        best = max(self.kinds, key=self.rated)
        for kind in self.kinds:
            if kind in self.recent:
                # A kind rated far below the best is tried again that many times less often.
                behind = self.rate(best) / max(self.rate(kind), 1e-9)
                wait = EXPLORE_AFTER * self.last_seconds[kind] * max(1.0, behind)
            else:
                wait = EXPLORE_FIRST * self.prices[kind][1]
            if self.since.get(kind, 0.0) > wait and not self.hopeless(kind) and not self.after_shorter(kind, best):
                return kind
        return best

    def after_shorter(self, kind: str, best: str) -> bool:
        """Whether ``kind`` is a batched draft whose next shorter one has not yet run at
        ``LONGER_AFTER`` of the best kind's rate (a shorter one that is hopeless holds nothing back)."""
        length = skip_length(kind)
        if length is None:
            return False
        shorter = [k for k in self.kinds if (n := skip_length(k)) is not None and n < length]
        if not shorter:
            return False
        below = max(shorter, key=skip_length)
        if self.hopeless(below):
            return False
        return below not in self.recent or self.rate(below) < LONGER_AFTER * self.rate(best)

    def rated(self, kind: str) -> float:
        """``rate``, a drafting kind's less ``DRAFT_MARGIN`` where the plain step is on the menu:
        what a draft's verdicts do to the rows' ends (some rows ahead, the batch's end not) is
        priced only on average, so a near tie goes to the plain step."""
        rate = self.rate(kind)
        return rate if kind == PLAIN or PLAIN not in self.kinds else rate / DRAFT_MARGIN

    def hopeless(self, kind: str) -> bool:
        """Whether ``kind`` drafts and could not beat the best other kind's rate even if its every
        drafted token were accepted, at the price its trials ran at (priced only: many rows make a
        wide verify dear)."""
        if self.pricer is None or kind in (PLAIN, LOOKUP):
            return False
        best_case = price(self.pricer, kind, self.rows, acceptance=MAX_ACCEPTANCE, gaps=self.gaps)
        if best_case is None:
            return False
        others = [self.rate(other) for other in self.kinds if other != kind]
        return bool(others) and best_case[0] / (best_case[1] * self.misprice(kind)) < max(others)

    def carry(self, other: StepKinds) -> None:
        """What ``other`` (a menu of a few more rows, the batch before some rows left) measured of
        each kind this menu has not run: its recent steps, their tokens and seconds scaled by how
        this menu's price of the kind differs from ``other``'s, and their clock times. Priced
        menus only. A fresh menu would else start from prices alone: sixteen SmolLM2 rows became
        fifteen near the end and opened with the 6-token draft priced best, while the sixteen had
        measured drafting at a quarter of the plain step's rate."""
        if self.pricer is None or other.pricer is None or other.rows > 2 * self.rows:
            return  # (many more rows drafted for a different batch end: their rates say little)
        for kind in self.kinds:
            if kind in self.recent or not other.recent.get(kind) or kind not in self.prices or kind not in other.prices:
                continue
            (tokens, seconds), (their_tokens, their_seconds) = self.prices[kind], other.prices[kind]
            scale_tokens, scale_seconds = tokens / max(their_tokens, 1e-9), seconds / max(their_seconds, 1e-9)
            self.recent[kind] = [(t * scale_tokens, s * scale_seconds) for t, s in other.recent[kind]]
            self.last_seconds[kind] = other.last_seconds[kind] * scale_seconds
            if other.wall.get(kind) and not self.wall.get(kind):
                self.wall[kind] = list(other.wall[kind])

    def observe(self, kind: str, tokens: float, seconds: float, wall: float | None = None) -> None:
        """One step of ``kind``: the tokens it counts for and its seconds (priced, under a pricer,
        then ``wall`` is the clock's)."""
        recent = self.recent.setdefault(kind, [])
        recent.append((tokens, seconds))
        del recent[:-RECENT_STEPS]
        if wall is not None:
            walls = self.wall.setdefault(kind, [])
            walls.append((wall, seconds))
            del walls[:-RECENT_STEPS]
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
