"""``auto``: every drafting choice made while generating, priced by costs measured on this machine.

No study and no policy file. Before the draft is prepared, what the choices cost here is
measured or read from the cache (``engine.calibration``: a plain step, the verify curve, an int4
draft step per head size) and handed to it as a value; then, at every step, ``AutoDrafter``
chooses among the offers of the existing drafters the one expected to give the most tokens per
second:

* the lookup drafter's (``lookup``), when the context repeats its last n-gram, cut to the run
  length whose expected tokens per second is highest (per-position acceptance learned as the
  text grows), its other matches as branches;
* otherwise the int4 skip draft, its siblings (``branching``) and this step's matches as branches
  where they pay (``tree_shape``), its length decided token by token by cost
  (``DraftLengthByCost``), its skip set re-chosen on the fly (``onthefly``), its head size chosen
  from the calibrated draft cost of each size and how often each size would have held the
  model's next token;
* nothing, when neither is expected to beat a plain step (tried again now and then).

With per-token acceptance ``a``, ``g`` tokens drafted at ``c`` seconds each and a verify of
``v(g + 1)``, a step yields ``(1 - a^(g+1)) / (1 - a)`` tokens on average and costs
``g * c + v(g + 1)``; lookup's ``c`` is the time its match takes. Every estimator is a running
figure with a short memory, carried from one generation to the next by ``AutoState``.

Only the draft changes: the verify is the full model, so greedy output is exact and rejection
sampling keeps the model's distribution.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from layerskip.drafts.base import (
    LOOKUP,
    NONE,
    SKIP,
    DraftRequest,
    NoDrafter,
    Proposal,
    Verdict,
    WrappingDrafter,
    chain_run,
)
from layerskip.drafts.drafters.branching import sibling_paths
from layerskip.drafts.drafters.lookup import LookupDrafter, RankedRunLengths, RunCounts
from layerskip.drafts.drafters.skip import ChainDraft, ChainDrafter
from layerskip.drafts.policy.skip_policy import DraftSettings
from layerskip.drafts.rules.costs import WIDE_BLOCK, DraftCosts, block_cost, end_move, expected_tokens
from layerskip.drafts.rules.draft_length import DraftLengthByCost, LengthPrior
from layerskip.drafts.rules.tree_shape import Paths, Shape, merged_paths, shape_tree
from layerskip.sampling import ROOT
from layerskip.stats import DeviceClock, GenerationStats

# What ``auto`` chooses changes from version to version; a result file records the revision that
# ran (``measure.bench.environment``) and README's first table quotes only runs of this one.
# Bump it with every change to what ``auto`` decides for one prompt at a time (the table's runs);
# the batch's step chooser is recorded by the run's commit. 1: a batch's kinds known only by their
# price are tried early, and measured ones again after ten times their trial; 2: the draft's
# precision priced at the head size it would draft with, no margin for the policy's.
AUTO_REVISION = 2

VERIFY_SMOOTHING = 0.2  # weight of the newest verify timing in the running curve
PAD_MARGIN = 0.97  # a longer block is padded to only when it is at least this much cheaper
SKIP_PRIOR = 0.8  # skip-draft acceptance assumed before any is measured
SKIP_PRIOR_WEIGHT = 10  # as that many drafted tokens
CARRY_OVER = 0.5  # weight of earlier generations' counts when a new one starts (a short memory)
EXPLORE_EVERY = 16  # steps without a skip draft after which one is tried anyway (its estimates age)
PROMPT_PRIOR_WEIGHT = 16.0  # pseudo-observations a prompt's coverage counts for, before any text
# Before any text, a truncated head is assumed to hold most next tokens (its rows are the most
# frequent ones plus every token of the context): as many observations of this share. A prompt's
# own tokens (chat markup, rare words the answer may never use) are a weak witness, so without
# this prior one odd prompt would send the first generation to the full head's cost.
COVERAGE_PRIOR = 0.95
COVERAGE_PRIOR_WEIGHT = 16.0
COVERAGE_DECAY = 0.995  # per token: coverage follows the text being generated
# Before any tree has been verified, the draft's second choice is taken to be the model's token
# in this share of the positions where its first choice was not (as this many observations):
# the narrow top-2 margins a sibling is offered at split about evenly, less the cases where
# the model wanted a third token.
SIBLING_PRIOR = 0.3
SIBLING_PRIOR_WEIGHT = 4.0
LOOKUP_TIME_SMOOTHING = 0.3  # weight of the newest lookup scan's time in its running figure
LOOKUP_TIME_START = 1e-4  # seconds of a lookup scan before one is timed (a Python scan of the history)
MAX_ACCEPTANCE = 0.98  # per-token acceptance never assumed above this: a rate priced at 1 has no bound
MIN_COVERAGE = 1e-3  # a head's coverage divided by is never taken below this


@dataclass
class HeadCoverage:
    """How often each candidate head size would have scored the model's next token.

    A truncated head scores the ``h`` highest-ranked rows plus every token of the prompt and of
    the text so far; a token outside them cannot be drafted. For each size this keeps a decayed
    count of the tokens the model produced that such a head held (``h`` 0 is the full head).
    """

    sizes: tuple[int, ...]
    covered: dict[int, float] = field(default_factory=dict)
    seen: float = 0.0

    def share(self, size: int) -> float:
        if size == 0:
            return 1.0
        prior = COVERAGE_PRIOR * COVERAGE_PRIOR_WEIGHT
        return (self.covered.get(size, 0.0) + prior) / (self.seen + COVERAGE_PRIOR_WEIGHT)

    def observe(self, token: int, earlier: set[int]) -> None:
        """One token the model produced after the tokens in ``earlier``."""
        self.seen = COVERAGE_DECAY * self.seen + 1.0
        for size in self.sizes:
            self.covered[size] = COVERAGE_DECAY * self.covered.get(size, 0.0) + _held(token, size, earlier)

    def seed(self, prompt: Sequence[int]) -> None:
        """Before any generated text: the prompt's own tokens as a prior, weighed lightly."""
        if self.seen > 0 or len(prompt) < 2:
            return
        earlier: set[int] = set()
        held = dict.fromkeys(self.sizes, 0)
        for token in prompt:
            for size in self.sizes:
                held[size] += _held(token, size, earlier)
            earlier.add(token)
        weight = min(PROMPT_PRIOR_WEIGHT, len(prompt)) / len(prompt)
        self.seen = weight * len(prompt)
        self.covered = {size: weight * count for size, count in held.items()}


def _held(token: int, size: int, earlier: set[int]) -> bool:
    """Whether a head of ``size`` rows (0: the full head) scores ``token``: one of the lowest ids,
    which BPE vocabularies give their most frequent merges, or a token of the text before it."""
    return size == 0 or token in earlier or token < size


@dataclass
class AutoState:
    """What ``auto`` knows about one model on this machine: the calibrated costs, and the running
    estimators carried between generations (skip and lookup acceptance, head coverage)."""

    costs: DraftCosts
    settings: DraftSettings  # caps: max_draft_tokens, lookup n-gram range and lookup_max_tokens
    coverage: HeadCoverage
    # What the skip drafts' length rule learned: acceptance by confidence, and the rate it reached.
    length_prior: LengthPrior = field(default_factory=LengthPrior)
    # Lookup runs by the rank of their match, and siblings: counts carried between generations.
    lookup_counts: list[RunCounts] = field(default_factory=list)
    sibling_reached: float = 0.0
    sibling_right: float = 0.0
    head_rows: int = -1  # the head size in use (0 = full); -1 before the first choice
    measured_at_rows: int = -1  # the head size the acceptance counts were gathered with
    # Seconds of a verify per block length, unpadded: the calibration's, then every verify timed
    # while generating folded in (a calibration made during a busy spell is corrected as it runs).
    verify: dict[int, float] = field(default_factory=dict)

    @classmethod
    def start(cls, costs: DraftCosts, settings: DraftSettings) -> AutoState:
        state = cls(costs, settings, HeadCoverage(tuple(sorted(costs.draft_step))))
        state.verify = {b: block_cost(costs.verify, b) for b in range(1, settings.node_budget + 2)}
        return state

    # --- the verify curve ------------------------------------------------------------------

    def observe_verify(self, block: int, seconds: float, dense: bool = False) -> None:
        """A verify timed while generating (``dense``: its head read every logit, which the curve,
        kept in the greedy head's terms, does not hold)."""
        if dense:
            seconds -= self.costs.dense_extra(block)
        if block in self.verify:
            self.verify[block] = (1 - VERIFY_SMOOTHING) * self.verify[block] + VERIFY_SMOOTHING * seconds

    def padded(self, block: int) -> int:
        """The block length to verify ``block`` positions as: the cheapest known length from
        ``block`` up (some CPUs run a 2-3-row product slower than a 4-row one); ties go short."""
        if block < 2 or block not in self.verify:
            return block
        own = self.verify[block]
        cheaper = [(s, b) for b, s in self.verify.items() if b > block and s < PAD_MARGIN * own]
        return min(cheaper)[1] if cheaper else block

    def verify_seconds(self, block: int, dense: bool = False) -> float:
        """A verify of ``block`` positions as the engine runs it (padded); ``dense``: a generation
        whose verify reads every logit (a user's own processor, sampling), dearer per position."""
        padded = self.padded(block)
        seconds = self.verify[padded] if padded in self.verify else block_cost(self.verify, padded)
        return seconds + (self.costs.dense_extra(padded) if dense else 0.0)

    def step_prices(self, dense: bool = False) -> StepPrices | None:
        """A batch's step prices from the calibration and the running estimates, at the head size
        chosen last (None where the calibration holds no batch steps); ``dense``: some row reads
        every logit."""
        costs = self.costs
        if not costs.batch_plain or not costs.batch_draft:
            return None
        rows = max(self.head_rows, 0)
        acceptance = min(MAX_ACCEPTANCE, self.full_head_acceptance() * self.coverage.share(rows))
        return StepPrices(
            costs.batch_plain,
            costs.batch_draft,
            self.verify_seconds,
            costs.draft_step[rows],
            acceptance,
            self.settings.max_draft_tokens,
            costs.batch_wide,
            costs.dense_extra if dense else None,
        )

    # --- choices ---------------------------------------------------------------------------

    def choose_head(self, prompt: Sequence[int], dense: bool = False) -> int:
        """The head size expected to give the most tokens per second: each size's calibrated draft
        step against the acceptance its coverage allows."""
        self.coverage.seed(prompt)
        verify = functools.partial(self.verify_seconds, dense=dense)
        steps = {size: self.costs.draft_step[size] for size in self.coverage.sizes}
        _, self.head_rows = best_head_rate(
            self.full_head_acceptance(), steps, verify, self.settings.max_draft_tokens, self.coverage
        )
        return self.head_rows

    def full_head_acceptance(self) -> float:
        """Per-token acceptance of skip drafts as a full head would see it: the measured one over
        the coverage of the head it was measured with (``SKIP_PRIOR`` before any)."""
        right, reached = sum(self.length_prior.right), sum(self.length_prior.reached)
        measured = (right + SKIP_PRIOR * SKIP_PRIOR_WEIGHT) / (reached + SKIP_PRIOR_WEIGHT)
        held = self.coverage.share(self.measured_at_rows) if self.measured_at_rows >= 0 else 1.0
        return min(MAX_ACCEPTANCE, measured / max(held, MIN_COVERAGE))

    # --- carrying estimators between generations -------------------------------------------

    def length_rule(self, draft_seconds: float, dense: bool = False) -> DraftLengthByCost:
        """A draft-length rule priced by the calibration, its acceptance bins from earlier
        generations (before any skip draft: a prior of ``SKIP_PRIOR`` acceptance, as a few
        confident drafts; an int4 copy bypassing little agrees with its model most of the time,
        and the prior decides only the first steps of the first generation)."""
        blocks = range(2, self.settings.node_budget + 2)
        verify = {b: self.verify_seconds(b, dense) for b in blocks}
        cap, assumed = self.settings.max_draft_tokens, (SKIP_PRIOR, SKIP_PRIOR_WEIGHT)
        return DraftLengthByCost.from_prior(cap, draft_seconds, verify, self.length_prior, CARRY_OVER, assumed)

    def run_lengths(self) -> RankedRunLengths:
        """Lookup run statistics by match rank, from earlier generations' (auto cuts runs by cost itself)."""
        return RankedRunLengths.carried(self.settings.tree_matches, self.lookup_counts, CARRY_OVER)

    def sibling_chance(self) -> float:
        """Chance that a sibling (the draft's next choice) is the model's token where the draft's
        own was not: measured on earlier trees, ``SIBLING_PRIOR`` before any."""
        prior = SIBLING_PRIOR * SIBLING_PRIOR_WEIGHT
        return (self.sibling_right + prior) / (self.sibling_reached + SIBLING_PRIOR_WEIGHT)

    def keep(self, length: DraftLengthByCost | None, ranks: RankedRunLengths) -> None:
        """A generation's counts become the next one's prior."""
        if length is not None:
            self.length_prior = length.learned(CARRY_OVER)
            self.measured_at_rows = self.head_rows
        self.lookup_counts = ranks.counts()
        self.sibling_reached *= CARRY_OVER
        self.sibling_right *= CARRY_OVER


Price = tuple[float, float]  # (expected tokens, seconds) of one step


def best_skip_offer(acceptance: float, draft_seconds: float, verify: Callable[[int], float], cap: int) -> Price:
    """Expected tokens and seconds of a step with the skip draft's best length up to ``cap``: the
    most tokens per second (``verify``: seconds per block)."""
    offers = [(expected_tokens(acceptance, g), g * draft_seconds + verify(g + 1)) for g in range(1, cap + 1)]
    return max(offers, key=lambda offer: offer[0] / offer[1])


def best_skip_rate(acceptance: float, draft_seconds: float, verify: Callable[[int], float], cap: int) -> float:
    """Expected tokens per second of the best skip-draft length up to ``cap`` (``verify``: seconds per block)."""
    tokens, seconds = best_skip_offer(acceptance, draft_seconds, verify, cap)
    return tokens / seconds


@dataclass
class StepPrices:
    """What one step of a batch of rows yields and costs, priced from ``auto``'s calibration
    (``AutoState.step_prices``); engine/step_kinds.py gives the formulas and how the batch's choice
    of step uses them. One row's own skip draft is priced by the rule its own choice uses
    (``best_skip_offer``), at the batch's verify and one draft forward per row."""

    plain: dict[int, float]  # seconds of a plain batched step by row count
    draft_rows: dict[int, float]  # seconds of a batched draft step by row count (the calibration's head)
    verify: Callable[[int], float]  # seconds of one row's verify of n positions
    draft_step: float  # seconds of one row's draft step with the batch's head
    acceptance: float  # per-token acceptance of the skip draft
    max_draft: int  # the longest draft a row's own drafter makes
    wide: dict[int, float] = field(default_factory=dict)  # a batched verify of WIDE_BLOCK positions by row count
    # Seconds the full head adds to a verify of n positions, where some row reads every logit.
    dense: Callable[[int], float] | None = None

    def verify_rows(self, rows: int, width: int) -> float:
        """Seconds of one verify forward over ``rows`` rows of ``width`` positions: linear in the
        width through the timed plain and wide steps of that many rows (a calibration without wide
        steps scales the plain step as one row's verify curve grows from ``rows`` positions to
        ``rows * width``)."""
        plain = block_cost(self.plain, rows)
        extra = self.dense(rows * width) if self.dense is not None else 0.0
        if not self.wide:
            return plain * self.verify(rows * width) / self.verify(rows) + extra
        wide = max(block_cost(self.wide, rows), plain)
        return plain + (width - 1) * (wide - plain) / (WIDE_BLOCK - 1) + extra

    def draft_rows_step(self, rows: int) -> float:
        """Seconds of one batched draft step of ``rows`` rows with the batch's head."""
        # One row's batched draft step, extrapolated where the calibration starts at 2 rows (never
        # below half the cheapest timed: a steep curve must not send it to 0).
        one = max(block_cost(self.draft_rows, 1), 0.5 * min(self.draft_rows.values()))
        return self.draft_step * block_cost(self.draft_rows, rows) / one

    def step_seconds(self, rows: int, width: int, batched_forwards: int, own_forwards: int) -> float:
        """Seconds of a step of this shape: ``batched_forwards`` draft forwards of all rows at once,
        ``own_forwards`` one-row draft forwards (the rows' own drafters, one after another), and a
        verify of ``rows`` rows of ``width`` positions."""
        return (
            batched_forwards * self.draft_rows_step(rows)
            + own_forwards * self.draft_step
            + self.verify_rows(rows, width)
        )

    def plain_step(self, rows: int) -> Price:
        """Every row verifies its pending token (and a lookup step's rows without a match)."""
        return float(rows), self.verify_rows(rows, 1)

    def batched_skip(self, rows: int, steps: int, acceptance: float | None = None, gaps: Sequence[int] = ()) -> Price:
        """All rows draft ``steps`` tokens in one product per token, then verify together: the
        tokens are the rows times how far the batch's end moves (``end_move``; ``gaps``: how far
        each row is ahead of the furthest behind, level where empty), as the batch rates a step."""
        a = self.acceptance if acceptance is None else acceptance
        moved = end_move(a, steps, gaps or (0,) * rows)
        return rows * moved, self.step_seconds(rows, steps + 1, steps, 0)

    def own_drafts(self, rows: int, acceptance: float | None = None, gaps: Sequence[int] = ()) -> Price:
        """Each row's own skip draft, one row after another, at the length that pays best (the
        tokens as ``batched_skip`` counts them)."""
        a = self.acceptance if acceptance is None else acceptance
        offers = [
            (rows * end_move(a, g, gaps or (0,) * rows), rows * g * self.draft_step + self.verify_rows(rows, g + 1))
            for g in range(1, self.max_draft + 1)
        ]
        return max(offers, key=lambda offer: offer[0] / offer[1])


def best_head_rate(
    acceptance: float,
    draft_steps: Mapping[int, float],
    verify: Callable[[int], float],
    cap: int,
    coverage: HeadCoverage | None = None,
) -> tuple[float, int]:
    """The skip draft's best expected tokens per second over head sizes, and the size that gives it
    (``draft_steps``: seconds of one draft token by head size, 0 the full head; always one of them):
    each size's acceptance is the full head's ``acceptance`` times the share of next tokens
    ``coverage`` says that size holds (without one, before any text: each size's prior share)."""
    coverage = coverage if coverage is not None else HeadCoverage(tuple(draft_steps))
    base = min(MAX_ACCEPTANCE, acceptance)
    rates = {size: best_skip_rate(base * coverage.share(size), step, verify, cap) for size, step in draft_steps.items()}
    finite = [size for size, rate in rates.items() if math.isfinite(rate)]
    size = max(finite, key=rates.__getitem__, default=next(iter(draft_steps)))
    return rates[size], size


# Builds the skip drafter once the head size (rows; 0 = the full head) is chosen, its length
# decided by the given rule: at the first proposal, when the prompt is known.
SkipFactory = Callable[[int, DraftLengthByCost], ChainDrafter]


class AutoDrafter(WrappingDrafter):
    """One generation's drafter under ``auto``: each step, the offer (lookup's, the skip draft's, or
    nothing) with the most expected tokens per second, as the module's docstring tells. The rest
    of the drafter interface is the skip drafter's, once it is made.
    """

    def __init__(self, state: AutoState, make_skip: SkipFactory, dense: bool = False) -> None:
        super().__init__(NoDrafter())
        self.state = state
        self.dense = dense  # the verify reads every logit: priced so (AutoState.verify_seconds)
        self.make_skip = make_skip
        self.lookup = LookupDrafter(state.settings, state.run_lengths())
        self.skip: ChainDrafter | None = None
        self.clock: DeviceClock | None = None
        self.length: DraftLengthByCost | None = None
        self.lookup_seconds = LOOKUP_TIME_START  # running time of one lookup scan
        self.since_skip = 0
        self._earlier: set[int] = set()
        self._known = 0  # history tokens already counted for coverage
        self.kinds: dict[str, int] = {}
        self.last_chain: ChainDraft | None = None  # the skip chain of this step (None: not a skip step)

    # --- the choice ----------------------------------------------------------------------------

    def propose(self, request: DraftRequest) -> Proposal:
        if self.skip is None:
            self.clock = DeviceClock(request.device)
            rows = self.state.choose_head(request.history, self.dense)
            self.length = self.state.length_rule(self.state.costs.draft_step[rows], self.dense)
            self.skip = self.inner = self.make_skip(rows, self.length)
        self._observe(request.history)
        self.last_chain = None
        runs, plan = self._lookup_offer(request)
        kind = self._choose(plan, self._skip_rate(request.max_tokens))
        self.kinds[kind] = self.kinds.get(kind, 0) + 1
        self.since_skip = 0 if kind == SKIP else self.since_skip + 1
        if kind == LOOKUP:  # the chosen run, whole, with the other matches as branches where they pay
            assert plan is not None
            budget = self.state.settings.node_budget
            tree = plan.tree if len(runs) < 2 else self._shape(runs, self.lookup_seconds, budget, len(plan.tree)).tree
            return Proposal(tree, LOOKUP)
        if kind == NONE:
            return Proposal.nothing()
        return self._skip_offer(request, runs)

    def _choose(self, plan: Shape | None, skip_rate: float) -> str:
        """ "lookup", "skip" or "none": the highest expected tokens per second (a skip draft now
        and then whatever the estimates say, so that they follow the text)."""
        if self.since_skip >= EXPLORE_EVERY:
            return SKIP
        if plan is not None and plan.rate >= skip_rate:
            return LOOKUP
        plain_rate = 1.0 / self.state.verify_seconds(1, self.dense)
        return SKIP if skip_rate >= plain_rate else NONE

    def _skip_rate(self, budget: int) -> float:
        """The skip draft's offer: tokens per second at its best length, as its length rule prices it."""
        assert self.length is not None
        cap = max(1, min(budget, self.state.settings.max_draft_tokens))
        draft_seconds = self.length.draft_cost or self.state.costs.draft_step[self.state.head_rows]
        return best_skip_rate(self.length.pooled_acceptance, draft_seconds, self.length.verify_price, cap)

    def _lookup_offer(self, request: DraftRequest) -> tuple[Paths, Shape | None]:
        """This step's lookup matches with their chances, and the best one's run cut where the
        expected tokens per second peak: what lookup is weighed by against the skip draft (as a
        chain would be; the other matches join as branches once a kind is chosen)."""
        cap = min(self.state.settings.lookup_max_tokens, request.max_tokens)
        start = time.perf_counter()
        runs = self.lookup.runs(request, cap)
        seconds = time.perf_counter() - start
        self.lookup_seconds = (1 - LOOKUP_TIME_SMOOTHING) * self.lookup_seconds + LOOKUP_TIME_SMOOTHING * seconds
        if not runs:
            return runs, None
        shape = self._shape(runs[:1], self.lookup_seconds, cap)
        return runs, (shape if len(shape.tree) else None)

    def _shape(self, paths: Paths, spent: float, budget: int, required: int = 0) -> Shape:
        """``paths`` merged into the tree that pays best at the length rule's verify prices."""
        assert self.length is not None
        return shape_tree(merged_paths(paths), self.length.verify_price, spent, budget, required=required)

    def _skip_offer(self, request: DraftRequest, runs: Paths) -> Proposal:
        """The skip chain, with the draft's next choices as siblings and this step's lookup matches
        as branches where they pay (a token tree; the chain stays its first branch, whole unless
        the node budget is shorter)."""
        assert self.skip is not None and self.length is not None
        chain = self.skip.draft_chain(request)
        self.last_chain = chain
        if chain.top_tokens is None or chain.top_probs is None or not chain.confidence:
            return chain.proposal()
        accept = [self.length.acceptance(c) for c in chain.confidence]  # each token, its earlier ones right
        reach = [1.0]
        for a in accept:
            reach.append(reach[-1] * a)
        paths = [(list(chain.tokens), reach[1:])]
        paths += sibling_paths(chain, reach, accept, self.state.sibling_chance(), self.state.settings.tree_margin)
        paths += runs  # free to propose, cheap to verify
        # The chain's length was decided token by token as it was drafted: the tree keeps all of it
        # (merged_paths puts it first) and adds only the branches that pay.
        tree = self._shape(paths, chain.seconds, self.state.settings.node_budget, len(chain.tokens)).tree
        if not min(tree.first_branch_length, len(chain.tokens)):  # the budget kept none of the chain
            return chain.proposal()
        return Proposal(tree, SKIP)

    def _observe(self, history: list[int]) -> None:
        """Score head sizes against the tokens produced since (the lookup drafter scores its matches)."""
        if not self._known:
            self._earlier.update(history)
            self._known = len(history)
            return
        for token in history[self._known :]:
            self.state.coverage.observe(token, self._earlier)
            self._earlier.add(token)
        self._known = len(history)

    def learn(self, proposal: Proposal, verdict: Verdict) -> None:
        super().learn(proposal, verdict)
        chain, self.last_chain = self.last_chain, None
        if chain is None or proposal.tree.is_chain:
            return
        verified, run = chain_run(proposal, verdict, chain.tokens)
        if run < verified and len(proposal.tree.children(run - 1 if run else ROOT)) > 1:
            self.state.sibling_reached += 1  # the chain failed where the tree had a sibling
            self.state.sibling_right += verdict.accepted > run

    @contextlib.contextmanager
    def watch_verify(self, block: int) -> Iterator[None]:
        if self.clock is None:  # the prefill: nothing drafted yet
            yield
            return
        start = self.clock.now()
        with self.inner.watch_verify(block):
            yield
        self.state.observe_verify(block, self.clock.now() - start, self.dense)

    def report(self, stats: GenerationStats) -> None:
        super().report(stats)
        self.state.keep(self.length, self.lookup.ranks)
        skip_steps = self.kinds.get(SKIP, 0)
        if skip_steps:
            stats.head_rows[self.state.head_rows] = stats.head_rows.get(self.state.head_rows, 0) + skip_steps
        stats.calibration = dict(self.state.costs.info)
