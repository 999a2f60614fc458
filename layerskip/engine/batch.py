"""Many prompts decoded together: every step verifies all rows' blocks in one forward.

Each row keeps what a single generation keeps (its output and stop conditions, its drafter, its
verifier, its stats); the rows share one ``RaggedCache`` (``hf.ragged``: per-row lengths, a 4D
mask and per-row positions), so a step is

    propose:   each row's candidates (the step's kind decides which drafter proposes)
    verify:    one forward over ``[B, n]``: row b is [pending, d1..dk_b, fillers], at positions
               from its own committed length
    accept:    each row's verifier keeps its longest agreeing prefix and adds its own token
    rollback:  each row's length moves to committed + 1 + accepted; finished rows leave

Which kind of step runs is the batch's choice (``StepKinds``): a plain batched step (every row
verifies just its pending token: what a batched ``generate`` does), prompt lookup only (free to
draft, so it always fits in the verify), or each row's own drafter (the policy's: for ``auto``,
lookup, the int4 skip draft or nothing, per row). Their tokens per second are measured as the
batch runs (and carried to the decoder's next batch of that size), and the fastest is chosen;
before a kind has run, ``auto``'s calibration prices it (``engine.batch_prices``: the plain and
draft steps of a batch timed per row count), so the first batch starts with the kind priced best.
Each other kind is tried again once the time since its last trial (or its priced seconds) is many
times that trial's cost, so exploring costs a few percent at most. A plain step is always on the
menu, so a batch is not slower than plain batched decoding beyond that.

Greedy output of every row is the full model's argmax chain, as for one prompt; sampled rows keep
the model's distribution (rejection sampling per row).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from layerskip.drafts import base
from layerskip.drafts.base import Drafter, DraftRequest, Proposal, Proposals
from layerskip.drafts.builder import BatchSkipDraft, DraftSettings, PreparedDraft, match_lookup
from layerskip.engine.output import TokenOutput
from layerskip.engine.step import StepOutcome, Stepper, record_outcome
from layerskip.engine.threads import ThreadTuner
from layerskip.engine.verifiers import Verifier, verify_rows
from layerskip.hf.cache import RollbackCache
from layerskip.hf.forward import full_hidden
from layerskip.hf.ragged import RaggedCache, ragged_hidden
from layerskip.stats import DeviceClock, GenerationStats

PLAIN, LOOKUP, DRAFT = "plain", "lookup", "draft"
ALONE = "alone"  # steps of the last row, decoded as one generation (not a kind the batch chooses)
# The batched skip draft's lengths on the menu (kind "skip:N"): a longer draft pays where the
# draft is right more often; which one does on this model, text and machine is measured.
SKIP_LENGTHS = (3, 6)
# Prompts go in one padded forward unless padding them to the longest adds more than this share
# of their real tokens; then each is prefilled alone at its own length.
PREFILL_PADDING = 1.25
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


@dataclass
class BatchRow:
    """One prompt of the batch: what its generation keeps while the batch runs."""

    index: int  # the prompt's place in the caller's list
    output: TokenOutput
    drafter: Drafter
    verifier: Verifier
    generator: torch.Generator | None = None  # the row's draws, shared by its verifier
    stats: GenerationStats = field(default_factory=GenerationStats)
    view: RollbackCache | None = None  # the row's slice of the ragged cache, for its drafter


@dataclass
class BatchStepper:
    """What every step of one batch shares: the model, the ragged cache, the rows and the choice."""

    model: nn.Module
    cache: RaggedCache
    rows: list[BatchRow]
    kinds: StepKinds
    lookup: DraftSettings | None  # the policy's lookup settings (None: the policy has no lookup)
    threads: ThreadTuner
    clock: DeviceClock
    device: torch.device
    batch_draft: BatchSkipDraft | None = None
    started: float = 0.0  # the clock when the batch began (set-up included)
    finished: list[BatchRow] = field(default_factory=list)
    prepared: PreparedDraft | None = None  # the policy's draft (its verify padding), for the last row alone

    def prefill(self) -> None:
        """Every prompt into the cache, and each row's first token. Prompts of similar lengths go
        in one forward (right padded: each row's tokens from position 0); where padding would
        add more than ``PREFILL_PADDING`` of the real tokens, row by row, each at its own length
        (a batched ``generate`` pads every row to the longest; nothing here needs to)."""
        prompts = [row.output.history for row in self.rows]
        longest = max(len(p) for p in prompts)
        with self.threads.phase("verify") as run:
            run.units = 0  # the prefill teaches nothing about a step
            if len(prompts) * longest > PREFILL_PADDING * sum(len(p) for p in prompts):
                lasts = self._prefill_rows(prompts)
            else:
                block = torch.tensor([[*p, *[p[-1]] * (longest - len(p))] for p in prompts], device=self.device)
                hidden = ragged_hidden(self.model, block, self.cache)  # [B, longest, H]
                lasts = [hidden[b, len(p) - 1 : len(p)] for b, p in enumerate(prompts)]  # [1, H] each
        self.cache.set_lengths([len(p) for p in prompts])
        nothing = Proposals((Proposal.nothing(),) * len(prompts))
        verdicts = verify_rows([row.verifier for row in self.rows], lasts, nothing, prompts)
        for row, verdict in zip(self.rows, verdicts, strict=True):
            row.stats.record_step(0, 0)
            row.output.emit([verdict.next_token])
        self._leave()

    def _prefill_rows(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """Each prompt alone through its row's slice of the cache; the last hidden state of each."""
        # Position 0 of every row in one forward first: the buffers take their shapes from it.
        first = ragged_hidden(self.model, torch.tensor([[p[0]] for p in prompts], device=self.device), self.cache)
        self.cache.set_lengths([1] * len(prompts))
        self.cache.reserve(max(len(p) for p in prompts) + 1)  # the row views write in place, never grow
        lasts = []
        for b, prompt in enumerate(prompts):
            if len(prompt) == 1:
                lasts.append(first[b, :1])
                continue
            view = self.cache.row_view(b)
            ids = torch.tensor([prompt[1:]], device=self.device)  # [1, P-1] at positions 1..P-1
            lasts.append(full_hidden(self.model, ids, view, 1, 1))  # [1, H]
        return lasts

    def step(self) -> None:
        kind = self.kinds.choose()
        grown = self.cache.growth_seconds
        start = self.clock.now()
        proposals = self._proposals(kind)
        drafted = self.clock.now()
        rows = proposals.rows
        blocks = [[row.output.history[-1], *proposal.tokens] for row, proposal in zip(self.rows, rows, strict=True)]
        width = max(len(block) for block in blocks)
        ids = torch.tensor([[*block, *[block[-1]] * (width - len(block))] for block in blocks], device=self.device)
        committed = list(self.cache.lengths)
        with self.threads.phase("verify") as run:
            run.units = 1
            hidden = ragged_hidden(self.model, ids, self.cache)  # [B, width, H]
            verdicts = verify_rows(
                [row.verifier for row in self.rows],
                [hidden[b, : len(block)] for b, block in enumerate(blocks)],  # each row's real positions
                proposals,
                [row.output.history for row in self.rows],
            )
        self.cache.set_lengths([n + 1 + verdict.accepted for n, verdict in zip(committed, verdicts, strict=True)])
        seconds = self.clock.now() - start
        tokens = 0
        for b, row in enumerate(self.rows):
            outcome = StepOutcome(rows[b], verdicts[b], width, drafted - start, seconds - (drafted - start))
            kept = row.output.emit(outcome.tokens)
            tokens += kept
            record_outcome(row.stats, row.drafter if kind == DRAFT else None, outcome, kept)
        # A step that grew the cache's buffers rates its kind without that: growth comes a few
        # times per batch (the buffers double) and would brand whichever kind happened to run.
        self.kinds.observe(kind, tokens, seconds - (self.cache.growth_seconds - grown))
        self._leave()

    def _proposals(self, kind: str) -> Proposals:
        if kind.startswith("skip:") and self.batch_draft is not None:
            budgets = [row.output.remaining - 1 for row in self.rows]
            steps = min(int(kind.split(":")[1]), max(budgets))
            if steps > 0:
                histories = [row.output.history for row in self.rows]
                generators = [row.generator for row in self.rows]
                with self.threads.phase("draft") as run:
                    run.units = steps
                    drafts = self.batch_draft.propose(self.cache, histories, budgets, steps, generators)
                rows = zip(self.rows, drafts.rows, strict=True)
                return Proposals(tuple(self._longer_lookup(row, draft, steps) for row, draft in rows))
        return Proposals(tuple(self._propose(b, row, kind) for b, row in enumerate(self.rows)))

    def _longer_lookup(self, row: BatchRow, draft: Proposal, steps: int) -> Proposal:
        """A row whose text repeats its last n-gram (the longest the policy matches) proposes the
        repeat instead of its skip draft where the repeat is longer: up to twice the draft, so one
        row's long match does not widen every row's verify far."""
        if self.lookup is None:
            return draft
        cap = min(row.output.remaining - 1, 2 * steps)
        repeat = self._lookup_draft(row, self.lookup.lookup_max_ngram, cap)
        return repeat if len(repeat) > len(draft) else draft

    def _lookup_draft(self, row: BatchRow, min_ngram: int, cap: int) -> Proposal:
        """Prompt lookup for one row: n-grams from ``min_ngram`` to the policy's longest, at most ``cap`` tokens."""
        assert self.lookup is not None
        match = match_lookup(row.output.history, min_ngram, self.lookup.lookup_max_ngram, cap)
        return Proposal.chain(match.tokens, base.LOOKUP)

    def _propose(self, b: int, row: BatchRow, kind: str) -> Proposal:
        budget = row.output.remaining - 1
        if kind not in (LOOKUP, DRAFT) or budget <= 0:
            return Proposal.nothing()
        if kind == LOOKUP:
            assert self.lookup is not None
            return self._lookup_draft(row, self.lookup.lookup_min_ngram, min(budget, self.lookup.max_draft_tokens))
        # The row's own drafter, through its slice of the cache (room for its draft reserved first).
        self.cache.reserve(self.cache.longest + budget + 2)
        row.view = self.cache.row_view(b, row.view)
        with self.threads.phase("draft") as run:
            proposal = row.drafter.propose(DraftRequest(row.output.history, row.view, budget, self.device))
            run.units = max(1, len(proposal)) if proposal.source == base.SKIP else 0
        if not proposal.tree.is_chain:  # Decoder.batches() keeps tree policies out of batches
            raise RuntimeError("a branching token tree reached the batched verify, which keeps chains only")
        return proposal

    def finish_alone(self) -> None:
        """The batch's last row to its end as one generation (``engine.step.Stepper``): its own
        drafter, and a one-row verify through its view of the cache. The kinds' rates were
        measured with more rows, and the row's own drafter (``auto``: lookup, the skip draft or
        nothing, its length by cost) fits one row better than the batch's fixed kinds."""
        (row,) = self.rows
        view = self.cache.row_view(0)  # grows on its own buffers if the row outruns the batch's
        alone = Stepper(
            self.model, view, row.drafter, row.verifier, self.prepared, self.threads, self.clock, self.device
        )
        steps = alone.run(row.output, row.stats, self.cache.lengths[0])
        self.kinds.steps[ALONE] = self.kinds.steps.get(ALONE, 0) + steps
        self._leave()

    def _leave(self) -> None:
        """Finished rows leave the batch (the cache drops their rows); each row's time is its own."""
        if not any(row.output.done for row in self.rows):
            return
        now = self.clock.now()
        for row in self.rows:
            if row.output.done:
                row.stats.total_seconds = now - self.started
        staying = [b for b, row in enumerate(self.rows) if not row.output.done]
        self.finished.extend(row for row in self.rows if row.output.done)
        if staying:
            self.cache.keep_rows(staying)
        self.rows = [self.rows[b] for b in staying]


# Rows' own drafters run one row after another: their cost grows with the rows, so beyond this
# many rows the batched draft (one product for all rows) is the only skip draft offered.
ROW_DRAFTERS_UP_TO = 2


def step_kinds(rows: int, has_draft: bool, has_lookup: bool, batch_draft: bool) -> StepKinds:
    """The kinds of step a batch chooses from: the plain step always, then what the draft offers."""
    kinds = [PLAIN]
    if has_lookup:
        kinds.append(LOOKUP)
    if batch_draft:
        kinds.extend(f"skip:{n}" for n in SKIP_LENGTHS)
    if has_draft and (rows <= ROW_DRAFTERS_UP_TO or not batch_draft):
        kinds.append(DRAFT)
    return StepKinds(tuple(kinds))


def run_batch(stepper: BatchStepper) -> list[BatchRow]:
    """Prefill, then steps until every row has finished (the last one alone); the rows in the
    caller's order."""
    stepper.prefill()
    while stepper.rows:
        if len(stepper.rows) == 1:
            stepper.finish_alone()
        else:
            stepper.step()
    return sorted(stepper.finished, key=lambda row: row.index)
