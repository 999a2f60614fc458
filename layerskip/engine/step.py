"""One speculative step: propose, verify, accept, roll back; it returns what was accepted.

The cache holds every token of the history but the last one (``pending``), ``committed`` tokens:

    propose:   the drafter proposes d1..dk (a skip draft writes K/V in the layers it runs;
               lookup reads the history; plain decoding proposes nothing)
    rollback   every layer to ``committed``
    verify:    the full model over [pending, d1..dk (, fillers)] -> hidden [k+1, H]
    accept:    the verifier keeps d1..dn and adds the full model's own token at n
    rollback   every layer to committed + 1 + n

The prefill is the first verify, over the prompt, with nothing drafted. The decode loop
(``engine.decoding``) keeps the bookkeeping: output, stop conditions and stats.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from layerskip.drafts.base import Draft, Drafter, DraftRequest
from layerskip.drafts.builder import PreparedDraft
from layerskip.drafts.token_tree import TokenTree
from layerskip.engine.threads import ThreadTuner
from layerskip.engine.verifiers import Verdict, Verifier
from layerskip.hf.cache import RollbackCache
from layerskip.hf.forward import full_hidden
from layerskip.hf.tree import ROOT, tree_hidden
from layerskip.stats import DeviceClock, GenerationStats


@dataclass
class StepOutcome:
    draft: Draft
    verdict: Verdict
    block: int  # positions the verify ran over (fillers included)
    draft_seconds: float
    verify_seconds: float  # verify forward, acceptance and rollback

    @property
    def tokens(self) -> list[int]:
        """The drafts the full model kept, then its own token."""
        tree, path = self.draft.tree, self.verdict.path
        kept = self.draft.tokens[: self.verdict.accepted] if tree is None else [tree.tokens[n] for n in path or ()]
        return [*kept, self.verdict.next_token]


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
        """The prompt's verify: fills the cache with all of it and gives the first new token."""
        return self._verify(prompt, Draft([]), prompt, committed=0, learn=False)

    def step(self, history: list[int], committed: int, budget: int) -> StepOutcome:
        """One step after ``history`` (its last token pending), drafting at most ``budget`` tokens."""
        start = self.clock.now()
        draft = self._propose(history, budget)
        drafted = self.clock.now()
        self.cache.rollback(committed)
        block = [history[-1], *draft.tokens]
        if self.prepared is not None:
            # Filler positions after the draft: causal attention (a tree: children of the root seen
            # by nothing else) keeps them out of every real row; their rows and K/V are dropped.
            block += [block[-1]] * (self.prepared.verify_block(len(block), committed) - len(block))
        verdict = self._verify(block, draft, history, committed, learn=True)
        draft.path = None if verdict.path is None else list(verdict.path)
        draft_seconds = drafted - start if draft.source != "none" else 0.0
        return StepOutcome(draft, verdict, len(block), draft_seconds, self.clock.now() - drafted)

    def _propose(self, history: list[int], budget: int) -> Draft:
        if budget <= 0:
            return Draft([])
        with self.threads.phase("draft") as run:
            draft = self.drafter.propose(DraftRequest(history, self.cache, budget, self.device))
            # Forwards run ~ tokens proposed (a draft that stopped at once still ran one); a
            # lookup or an empty plain draft ran none and teaches nothing.
            run.units = max(1, len(draft.tokens)) if draft.source == "skip" else 0
        return draft

    def _verify(self, block: list[int], draft: Draft, history: list[int], committed: int, learn: bool) -> Verdict:
        ids = torch.tensor([block], device=self.device)  # [1, prompt] or [1, k+1 (+ fillers)]
        rows = len(draft.tokens) + 1  # the real rows: fillers after them are dropped
        keep = len(block) if learn else 1  # the prefill needs only its last position
        with (
            self.threads.phase("verify") as run,
            self.drafter.watch_verify(len(block)),
            self.drafter.around_verify(self.cache, committed, ids),
        ):
            run.units = 1 if learn else 0  # the prefill teaches nothing about a step
            if draft.tree is None:
                hidden = full_hidden(self.model, ids, self.cache, committed, keep)[:rows]  # [k+1, H]
            else:
                parents = [*draft.tree.parents, *[ROOT] * (len(block) - rows)]  # fillers hang off the root
                hidden = tree_hidden(self.model, ids, parents, self.cache, committed)[:rows]  # [n+1, H]
            verdict = self.verifier.verify(hidden, draft, history)
        if verdict.path is not None:  # the accepted path's K/V moved into place, the rest cut
            self.cache.keep_path(committed, TokenTree.block_rows(verdict.path))
        else:
            self.cache.rollback(committed + (len(block) if not learn else 1 + verdict.accepted))
        return verdict


def record_outcome(stats: GenerationStats, drafter: Drafter | None, outcome: StepOutcome, kept: int) -> None:
    """One step's figures; the drafter that proposed the draft (None: not the row's own) learns
    how many of its tokens were used."""
    draft = outcome.draft
    accepted = min(outcome.verdict.accepted, kept)  # drafts past an EOS or the budget were not used
    stats.draft_seconds += outcome.draft_seconds
    stats.verify_seconds += outcome.verify_seconds
    stats.record_step(len(draft.tokens), accepted)
    stats.record_draft(len(draft.tokens))
    stats.record_block(outcome.block)
    if draft.from_lookup and draft.tokens:
        stats.lookup_steps += 1
    if draft.tree is not None:
        stats.tree_steps += 1
        path = outcome.verdict.path or ()
        stats.off_branch_steps += any(node != depth for depth, node in enumerate(path))
    if drafter is not None:
        drafter.update(draft, accepted)
