"""The one stepper: B >= 1 rows decoded together, a single prompt being a batch of one row.

Every row keeps what a generation keeps (its output and stop conditions, its drafter, its verifier,
its stats); the rows share one ``RollbackCache`` (``hf.cache``: a length per row), which holds each
row's history but its last token (``pending``). A step is

    propose:   each row's candidates, by the kind of step the batch chose (``engine.step_kinds``, priced by
               ``auto``'s calibration where it has one):
               nothing, prompt lookup, the batched skip draft, or each row's own drafter (a token
               tree or a chain, drafted through the row's view of the cache)
    verify:    one forward over ``[B, width]``: row b is [pending, its candidates, fillers] at
               positions from its own committed length (a token tree's rows see their ancestors only);
               the policy's draft may shape it for every row (``PreparedDraft.around_verify``: an
               exit draft enters after its exit layer, or fills its adapter's own K/V)
    accept:    each row's verifier keeps its accepted path and adds the full model's own token
    keep:      each row's accepted path's K/V (along a chain: a rollback to committed + 1 + accepted);
               finished rows leave the batch

Fillers pad a row's block to the width the verify runs at: to the longest row's block, and to the
policy's preferred verify size; each is the child of the one before, so no real row sees them.
Greedy output of every row is the full model's argmax chain; sampled rows keep the model's
distribution (rejection sampling per row).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from layerskip.drafts import base
from layerskip.drafts.base import (
    Drafter,
    DraftRequest,
    EditsAfter,
    Proposal,
    Proposals,
    TokenTree,
    Verdict,
    off_first_branch,
)
from layerskip.drafts.builder import LookupDrafter, LookupRunLength, PreparedDraft, SkipDrafter, StepPrices
from layerskip.engine.output import TokenOutput
from layerskip.engine.step_kinds import DRAFT, LOOKUP, SKIP_LENGTHS, StepKinds, skip_length
from layerskip.engine.threads import ThreadTuner
from layerskip.engine.verifiers import Verifier, verify_rows
from layerskip.hf.cache import RollbackCache
from layerskip.hf.forward import block_hidden, full_hidden
from layerskip.stats import DeviceClock, GenerationStats

# Prompts go in one padded forward unless padding them to the longest adds more than this share
# of their real tokens; then each is prefilled alone at its own length.
PREFILL_PADDING = 1.25

# A row whose text repeats its last n-gram proposes the repeat instead of its batched draft where
# longer, up to this many times the draft (``Stepper._longer_lookup``).
REPEAT_PER_DRAFT = 2

# After every step: the cache and each row's committed length (tests check them).
StepObserver = Callable[[RollbackCache, list[int]], None]


@dataclass
class Row:
    """One prompt of the batch: what its generation keeps while the batch runs."""

    index: int  # the prompt's place in the caller's list
    output: TokenOutput
    drafter: Drafter
    verifier: Verifier
    generator: torch.Generator | None = None  # the row's draws, shared by its verifier
    stats: GenerationStats = field(default_factory=GenerationStats)
    view: RollbackCache | None = None  # the row's view of the cache, for its own drafter
    # How often each position of this row's lookup matches (by n-gram length) held, for the batch's
    # lookup steps: learnt from the row's own text as it grows.
    lookup_runs: LookupRunLength = field(default_factory=lambda: LookupRunLength(0.0, score_every_run=True))


@dataclass
class Stepper:
    """What every step of one batch shares: the model, the cache, the rows and the step's choice."""

    model: nn.Module
    cache: RollbackCache
    rows: list[Row]
    menu_for: Callable[[int], StepKinds]  # the menu of a batch of that many rows (``step_kinds``)
    lookup: LookupDrafter | None  # the policy's lookup, for the batch's lookup steps (None: it has none)
    threads: ThreadTuner
    clock: DeviceClock
    device: torch.device
    batch_draft: SkipDrafter | None = None  # every row drafting in one product (its propose_rows)
    prepared: PreparedDraft | None = None  # the policy's draft (its verify padding)
    started: float = 0.0  # the clock when the batch began (set-up included)
    observer: StepObserver | None = None
    kinds: StepKinds = field(init=False)
    finished: list[Row] = field(default_factory=list)
    steps: dict[str, int] = field(default_factory=dict)  # steps of each kind this batch took
    _batched_forwards: int = 0  # draft forwards of this step's batched skip draft

    def run(self) -> list[Row]:
        """Prefill, then steps until every row has finished; the rows in the caller's order."""
        self.kinds = self.menu_for(len(self.rows))
        self.prefill()
        while self.rows:
            self.step()
        return sorted(self.finished, key=lambda row: row.index)

    def prefill(self) -> None:
        """Every prompt into the cache, and each row's first token. Prompts of similar lengths go
        in one forward (right padded: each row's tokens from position 0); where padding would
        add more than ``PREFILL_PADDING`` of the real tokens, row by row, each at its own length
        (a batched ``generate`` pads every row to the longest; nothing here needs to)."""
        prompts = [row.output.history for row in self.rows]
        longest = max(len(p) for p in prompts)
        block = torch.tensor([[*p, *[p[-1]] * (longest - len(p))] for p in prompts], device=self.device)
        committed = list(self.cache.lengths)
        # Room for the whole budget at once, and for the widest block a step verifies past it (every
        # row writes the step's width, fillers included, however few tokens it has left): growing
        # later doubles the buffers and copies them (sixteen SmolLM2 rows of ~770 positions spent
        # 1.4 s of a 20 s batch allocating and copying 1.1 GB; a 6-token draft near the budget's end,
        # with room for 2 positions past it, spent 1.9 s).
        self.cache.reserve_ahead(longest + max(row.output.remaining for row in self.rows) + self.widest_block())
        with self.threads.phase("verify", len(self.rows), learn=False), self._around_verify(committed, block):
            # (A layer exit adapter fills its own K/V from the one forward's layer-L outputs.)
            alone = self.prepared is None or not self.prepared.fills_adapter_cache
            if alone and len(prompts) * longest > PREFILL_PADDING * sum(len(p) for p in prompts):
                lasts = self._prefill_rows(prompts)
            else:
                hidden = block_hidden(self.model, block, self.cache)  # [B, longest, H]
                lasts = [hidden[b, len(p) - 1 : len(p)] for b, p in enumerate(prompts)]  # [1, H] each
        self.cache.set_lengths([len(p) for p in prompts])
        nothing = Proposals((Proposal.nothing(),) * len(prompts))
        verdicts = verify_rows([row.verifier for row in self.rows], lasts, nothing, prompts)
        seconds = self.clock.now() - self.started
        for row, verdict in zip(self.rows, verdicts, strict=True):
            row.stats.prefill_seconds = seconds
            row.stats.record_step(0, 0)
            row.output.emit([verdict.next_token])
        self._observe()
        self._leave()

    def widest_block(self) -> int:
        """The most positions a step's verify writes per row: the pending token and the longest
        proposal of any kind (the policy's token tree or padded block; a batched draft, or the repeat
        that may replace it, up to twice the longest batched draft)."""
        draft = None if self.prepared is None else self.prepared.policy.draft
        own = 0 if draft is None else max(draft.node_budget, draft.min_verify_block)
        return 1 + max(own, REPEAT_PER_DRAFT * max(SKIP_LENGTHS))

    def _prefill_rows(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """Each prompt alone through its row's view of the cache; the last hidden state of each."""
        # Position 0 of every row in one forward first: the buffers take their shapes from it.
        first = block_hidden(self.model, torch.tensor([[p[0]] for p in prompts], device=self.device), self.cache)
        self.cache.reserve(max(len(p) for p in prompts) + 1)  # the row views write in place, never grow
        lasts = []
        for b, prompt in enumerate(prompts):
            if len(prompt) == 1:
                lasts.append(first[b, :1])
                continue
            ids = torch.tensor([prompt[1:]], device=self.device)  # [1, P-1] at positions 1..P-1
            lasts.append(full_hidden(self.model, ids, self.cache.row_view(b), 1))  # [1, H]
        return lasts

    def step(self) -> None:
        left = [row.output.remaining for row in self.rows]
        self.kinds.gaps = tuple(max(left) - row_left for row_left in left)
        kind = self.kinds.choose()
        grown = self.cache.growth_seconds
        start = self.clock.now()
        proposals = self._proposals(kind).rows
        drafted = self.clock.now()
        committed = list(self.cache.lengths)
        # Each row's block: [pending, its tree's nodes], then fillers up to the width the verify runs.
        sizes = [len(p.tree) + 1 for p in proposals]
        width = max(sizes)
        if self.prepared is not None:
            # The policy's verify padding is about the rows of the verify's products (some CPUs run
            # a few-row product slower than a 4-row one): B rows of width w are B * w of them. A
            # batch pads only as far as whole columns reach the padded count: where SmolLM2's
            # one-row curve timed 5 positions cheaper than 2 to 4, rounding up made two rows' plain
            # step three columns wide (6 products) and four rows' two columns (8 products).
            rows = len(self.rows)
            width = max(width, self.prepared.verify_block(rows * width, max(committed)) // rows)
        blocks, parents = [], []
        for row, proposal, size in zip(self.rows, proposals, sizes, strict=True):
            tree, fillers = proposal.tree, width - size
            blocks.append(
                [row.output.history[-1], *tree.tokens, *[(tree.tokens or row.output.history[-1:])[-1]] * fillers]
            )
            parents.append([*tree.parents, *range(len(tree) - 1, len(tree) - 1 + fillers)])
        ids = torch.tensor(blocks, device=self.device)  # [B, width]
        own = kind == DRAFT  # the rows' own drafters proposed: they watch the verify (their length by cost)
        shaped = self._around_verify(committed, ids, own, width, tuple(proposals))
        with self.threads.phase("verify", len(self.rows)) as run, shaped:
            run.units = self.kinds.verify_units(width)
            hidden = block_hidden(self.model, ids, self.cache, parents)  # [B, width, H]
            verdicts = verify_rows(
                [row.verifier for row in self.rows],
                [hidden[b, :size] for b, size in enumerate(sizes)],  # each row's real positions
                Proposals(tuple(proposals)),
                [row.output.history for row in self.rows],
            )
        # Each row's accepted path's K/V moved into place, the rest cut (along a chain: a rollback).
        self.cache.keep_paths(committed, [TokenTree.block_rows(v.path) for v in verdicts])
        seconds = self.clock.now() - start
        own_forwards = sum(len(p) for p in proposals if p.source == base.SKIP) if kind == DRAFT else 0
        batched = self._batched_forwards if skip_length(kind) is not None else 0
        remaining = [row.output.remaining for row in self.rows]
        for row, proposal, verdict in zip(self.rows, proposals, verdicts, strict=True):
            kept = row.output.emit(verdict.tokens(proposal))  # the candidates kept, then the model's own token
            stats = row.stats
            stats.draft_seconds += drafted - start if proposal.source != base.NONE else 0.0
            stats.verify_seconds += seconds - (drafted - start)  # verify forward, acceptance and rollback
            record_outcome(stats, row.drafter if own else None, proposal, verdict, kept, width)
        # A step that grew the cache's buffers rates its kind without that: growth comes a few
        # times per batch (the buffers double) and would brand whichever kind happened to run. A
        # step at a thread count on trial keeps no clock time beside its price, for the same reason.
        wall = seconds - (self.cache.growth_seconds - grown)
        # A batch ends when its last row does: a step brings that end closer by how much the most
        # tokens any row still has to make fell (a row that ran ahead finishes early and leaves the
        # others to steps that cost nearly as much with fewer rows), so a kind is rated by that, per
        # row. Summed over a batch's steps this is exactly the budget; a mean over the rows furthest
        # behind overrated drafts, whose rows take turns being last: sixteen rows of SmolLM2 each
        # kept ~4 of a 3-token draft while the batch's end moved by one or two.
        left = [0 if row.output.done else row.output.remaining for row in self.rows]
        useful = len(self.rows) * (max(remaining) - max(left))
        priced = self.kinds.step_seconds(wall, width, batched, own_forwards)
        self.kinds.observe(kind, useful, priced, None if run.trial else wall)
        self.steps[kind] = self.steps.get(kind, 0) + 1
        self._observe()
        self._leave()

    def _around_verify(
        self,
        committed: list[int],
        block: torch.Tensor,
        own: bool = True,
        width: int | None = None,
        proposals: tuple[Proposal, ...] = (),
    ) -> contextlib.ExitStack:
        """Around the verify forward: the rows' own drafters, where they proposed, time it (their
        draft length by cost); the policy's draft may shape it for every row at once (an exit
        draft enters the stack after its exit layer, or fills its adapter's K/V after it)."""
        stack = contextlib.ExitStack()
        if own:
            for row in self.rows:
                stack.enter_context(row.drafter.watch_verify(width or block.shape[1]))
        if self.prepared is not None:
            stack.enter_context(self.prepared.around_verify(self.cache, committed, block, proposals))
        return stack

    def _proposals(self, kind: str) -> Proposals:
        length = skip_length(kind)
        if length is not None and self.batch_draft is not None:
            budgets = [row.output.remaining - 1 for row in self.rows]
            steps = min(length, max(budgets))
            self._batched_forwards = max(steps, 0)
            if steps > 0:
                histories = [row.output.history for row in self.rows]
                generators = [row.generator for row in self.rows]
                edits = [self._edits(row) for row in self.rows]
                with self.threads.phase("draft", len(self.rows)) as run:
                    run.units = steps
                    drafts = self.batch_draft.propose_rows(self.cache, histories, budgets, steps, generators, edits)
                rows = zip(self.rows, drafts.rows, strict=True)
                return Proposals(tuple(self._longer_lookup(row, draft, steps) for row, draft in rows))
        if kind == LOOKUP:
            return self._lookup_proposals()
        return Proposals(tuple(self._propose(b, row, kind) for b, row in enumerate(self.rows)))

    def _lookup_proposals(self) -> Proposals:
        """Each row's lookup match, cut to the verify width that pays best for the whole batch (under
        a pricer; else whole): a position more widens every row's verify, and is worth the chance that
        it moves the batch's end (each row's own chances, learnt from its text; ``paying_width``)."""
        assert self.lookup is not None
        runs: list[tuple[list[int], list[float]]] = []
        for row in self.rows:
            history = row.output.history
            cap = min(row.output.remaining - 1, self.lookup.settings.max_draft_tokens)
            row.lookup_runs.observe(history)
            if cap <= 0:
                runs.append(([], []))
                continue
            match = self.lookup.match(history, cap)
            row.lookup_runs.track(match, len(history))
            runs.append((match.tokens, row.lookup_runs.chances(match)))
        width = paying_width(runs, [row.output.remaining for row in self.rows], self.kinds.pricer)
        return Proposals(tuple(Proposal.chain(tokens[: width - 1], base.LOOKUP) for tokens, _ in runs))

    def _longer_lookup(self, row: Row, draft: Proposal, steps: int) -> Proposal:
        """A row whose text repeats its last n-gram (the longest the policy matches) proposes the
        repeat instead of its skip draft where the repeat is longer: up to twice the draft, so one
        row's long match does not widen every row's verify far."""
        if self.lookup is None:
            return draft
        cap = min(row.output.remaining - 1, REPEAT_PER_DRAFT * steps)
        repeat = Proposal.chain(self.lookup.match(row.output.history, cap, longest_only=True).tokens, base.LOOKUP)
        return repeat if len(repeat) > len(draft) else draft

    def _propose(self, b: int, row: Row, kind: str) -> Proposal:
        budget = row.output.remaining - 1
        if kind != DRAFT or budget <= 0:
            return Proposal.nothing()
        # The row's own drafter, through its view of the cache (room for its draft reserved first).
        self.cache.reserve(self.cache.longest + budget + 2)
        row.view = self.cache.row_view(b, row.view)
        with self.threads.phase("draft", 1) as run:  # one row's draft
            request = DraftRequest(row.output.history, row.view, budget, self.device, self._edits(row))
            proposal = row.drafter.propose(request)
            # Forwards run ~ tokens proposed (a draft that stopped at once still ran one); a
            # lookup or an empty plain draft ran none and teaches nothing.
            run.units = max(1, len(proposal)) if proposal.source == base.SKIP else 0
        return proposal

    @staticmethod
    def _edits(row: Row) -> EditsAfter | None:
        """What the row's processors do to each token its draft proposes: the draft applies it too."""
        next_edits = getattr(row.verifier, "next_edits", None)
        if next_edits is None:
            return None
        history = row.output.history
        return lambda drafted: next_edits([*history, *drafted])

    def _observe(self) -> None:
        if self.observer is not None:
            self.observer(self.cache, list(self.cache.lengths))

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
            # The rows kept may change places (the cache moves the last ones into freed rows).
            staying = self.cache.drop_rows([b for b, row in enumerate(self.rows) if row.output.done])
            # The menu of the rows left, priced for that many (one row: its own drafter), with
            # the rates the last batch of that size measured, and this batch's where it has none
            # (``StepKinds.carry``).
            menu = self.menu_for(len(staying))
            menu.carry(self.kinds)
            self.kinds = menu
        self.rows = [self.rows[b] for b in staying]


def paying_width(runs: list[tuple[list[int], list[float]]], left: list[int], prices: StepPrices | None) -> int:
    """The verify width (1: each row's pending token alone) whose expected move of the batch's end
    (``Stepper.step``) per priced second is highest, for rows with ``left`` tokens still to make
    and lookup ``runs`` (tokens, each token's chance of being kept, its earlier ones included);
    the narrowest of equals; the longest run's without prices.

    The end moves by ``j`` or more only where every row keeps enough: a row ``g`` tokens ahead of
    the furthest behind needs ``j - g``. So an extra position pays where the rows furthest behind
    all keep it, not where one row does: one row's long match in a batch of eight made a verify
    cost three plain steps for nothing."""
    longest = max((len(tokens) for tokens, _ in runs), default=0)
    if prices is None:
        return longest + 1
    rows, furthest = len(runs), max(left)

    def holds(chances: list[float], needed: int) -> float:
        """Chance that a row keeps at least ``needed`` tokens (its own next token always)."""
        return 1.0 if needed <= 1 else (chances[needed - 2] if needed - 2 < len(chances) else 0.0)

    # The end's expected move at each width: 1, plus each further position's chance that every row
    # keeps enough to reach it.
    moved, best, best_rate = 1.0, 1, rows / prices.verify_rows(rows, 1)
    for width in range(2, longest + 2):
        moved += math.prod(
            holds(chances, width - (furthest - row_left)) for (_, chances), row_left in zip(runs, left, strict=True)
        )
        rate = rows * moved / prices.verify_rows(rows, width)
        if rate > best_rate:
            best, best_rate = width, rate
    return best


def record_outcome(
    stats: GenerationStats, drafter: Drafter | None, proposal: Proposal, verdict: Verdict, kept: int, block: int
) -> None:
    """One step's figures (``block``: the positions the verify ran over, fillers included); the
    drafter that proposed (None: not the row's own) learns the verdict as far as it was used."""
    used = verdict.cut(kept)  # candidates past an EOS or the budget were not used
    stats.record_step(len(proposal), used.accepted, block)
    if proposal.source == base.LOOKUP and len(proposal):
        stats.lookup_steps += 1
    if not proposal.tree.is_chain:
        stats.tree_steps += 1
        stats.off_branch_steps += off_first_branch(verdict)
    if drafter is not None:
        drafter.learn(proposal, used)
