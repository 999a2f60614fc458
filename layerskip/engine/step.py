"""One speculative step: propose, verify, accept, roll back; it returns what was accepted.

The cache holds every token of the history but the last one (``pending``), ``committed`` tokens:

    propose:   the drafter proposes a token tree of n candidates (a chain is a tree with one
               branch; a skip draft writes K/V in the layers it runs; lookup reads the history;
               plain decoding proposes nothing)
    rollback   every layer to ``committed``
    verify:    the full model over [pending, node 0..n-1 (, fillers)] -> hidden [n+1, H]
    accept:    the verifier follows the accepted path and adds the full model's own token after it
    keep       the path's K/V (along a chain: a rollback to committed + 1 + accepted)

The prefill is the first forward, over the prompt, with nothing drafted. The decode loop
(``engine.decoding``) keeps the bookkeeping: output, stop conditions and stats.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from layerskip.drafts.base import (
    LOOKUP,
    NONE,
    SKIP,
    Drafter,
    DraftRequest,
    Proposal,
    TokenTree,
    Verdict,
    off_first_branch,
)
from layerskip.drafts.builder import PreparedDraft
from layerskip.engine.output import TokenOutput
from layerskip.engine.threads import ThreadTuner
from layerskip.engine.verifiers import Verifier
from layerskip.hf.cache import RollbackCache
from layerskip.hf.forward import full_hidden
from layerskip.hf.tree import block_hidden
from layerskip.stats import DeviceClock, GenerationStats


@dataclass
class StepOutcome:
    proposal: Proposal
    verdict: Verdict
    block: int  # positions the verify ran over (fillers included)
    draft_seconds: float
    verify_seconds: float  # verify forward, acceptance and rollback

    @property
    def tokens(self) -> list[int]:
        """The candidates the full model kept, then its own token."""
        return self.verdict.tokens(self.proposal)


@dataclass
class Stepper:
    """What every step of one generation shares: the model, its cache, the drafter and the verifier."""

    model: nn.Module
    cache: RollbackCache
    drafter: Drafter
    verifier: Verifier
    prepared: PreparedDraft | None
    threads: ThreadTuner
    clock: DeviceClock
    device: torch.device

    def prefill(self, prompt: list[int]) -> Verdict:
        """The prompt's forward: fills the cache with all of it and gives the first new token."""
        ids = torch.tensor([prompt], device=self.device)  # [1, prompt]
        with (
            self.threads.phase("verify") as run,
            self.drafter.watch_verify(len(prompt)),
            self.drafter.around_verify(self.cache, 0, ids),
        ):
            run.units = 0  # the prefill teaches nothing about a step
            hidden = full_hidden(self.model, ids, self.cache, 0, 1)  # [1, H]: only the last position
            return self.verifier.verify(hidden, Proposal.nothing(), prompt)

    def step(self, history: list[int], committed: int, budget: int) -> StepOutcome:
        """One step after ``history`` (its last token pending), drafting at most ``budget`` tokens."""
        start = self.clock.now()
        proposal = self._propose(history, budget)
        drafted = self.clock.now()
        self.cache.rollback(committed)
        verdict, block = self._verify(proposal, history, committed)
        draft_seconds = drafted - start if proposal.source != NONE else 0.0
        return StepOutcome(proposal, verdict, block, draft_seconds, self.clock.now() - drafted)

    def run(
        self,
        output: TokenOutput,
        stats: GenerationStats,
        committed: int,
        after_step: Callable[[RollbackCache, int], None] | None = None,
    ) -> int:
        """Steps until ``output`` is done, from ``committed`` tokens in the cache; each step's
        figures go to ``stats`` (the drafter learns its verdicts). ``after_step(cache, committed)``
        is called after each. Returns the steps taken."""
        steps = 0
        while not output.done:
            outcome = self.step(output.history, committed, budget=output.remaining - 1)
            committed += 1 + outcome.verdict.accepted
            record_outcome(stats, self.drafter, outcome, kept=output.emit(outcome.tokens))
            steps += 1
            if after_step is not None:
                after_step(self.cache, committed)
        return steps

    def _propose(self, history: list[int], budget: int) -> Proposal:
        if budget <= 0:
            return Proposal.nothing()
        with self.threads.phase("draft") as run:
            proposal = self.drafter.propose(DraftRequest(history, self.cache, budget, self.device))
            # Forwards run ~ tokens proposed (a draft that stopped at once still ran one); a
            # lookup or an empty plain draft ran none and teaches nothing.
            run.units = max(1, len(proposal)) if proposal.source == SKIP else 0
        return proposal

    def _verify(self, proposal: Proposal, history: list[int], committed: int) -> tuple[Verdict, int]:
        """The verdict on ``proposal``, and how many positions the verify ran over."""
        tree = proposal.tree
        rows = len(tree) + 1  # the real rows: fillers after them are dropped
        size = rows if self.prepared is None else self.prepared.verify_block(rows, committed)
        # Filler positions after the last node, each the child of the one before: no real row sees
        # them (they come last), and a chain stays a chain. Their rows and K/V are dropped.
        fillers = size - rows
        block = [history[-1], *tree.tokens, *[(tree.tokens or history[-1:])[-1]] * fillers]
        parents = [*tree.parents, *range(len(tree) - 1, len(tree) - 1 + fillers)]
        ids = torch.tensor([block], device=self.device)  # [1, n+1 (+ fillers)]
        with (
            self.threads.phase("verify") as run,
            self.drafter.watch_verify(len(block)),
            self.drafter.around_verify(self.cache, committed, ids),
        ):
            run.units = 1
            hidden = block_hidden(self.model, ids, parents, self.cache, committed)[:rows]  # [n+1, H]
            verdict = self.verifier.verify(hidden, proposal, history)
        # The accepted path's K/V moved into place, the rest cut (along a chain: a rollback).
        self.cache.keep_path(committed, TokenTree.block_rows(verdict.path))
        return verdict, len(block)


def record_outcome(stats: GenerationStats, drafter: Drafter | None, outcome: StepOutcome, kept: int) -> None:
    """One step's figures; the drafter that proposed (None: not the row's own) learns the verdict
    as far as it was used."""
    proposal = outcome.proposal
    verdict = outcome.verdict.cut(kept)  # candidates past an EOS or the budget were not used
    stats.draft_seconds += outcome.draft_seconds
    stats.verify_seconds += outcome.verify_seconds
    stats.record_step(len(proposal), verdict.accepted)
    stats.record_draft(len(proposal))
    stats.record_block(outcome.block)
    if proposal.source == LOOKUP and len(proposal):
        stats.lookup_steps += 1
    if not proposal.tree.is_chain:
        stats.tree_steps += 1
        stats.off_branch_steps += off_first_branch(outcome.verdict)
    if drafter is not None:
        drafter.learn(proposal, verdict)
