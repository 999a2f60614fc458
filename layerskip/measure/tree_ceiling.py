"""How much a token tree could add to a chain, with the verify for free: an upper bound.

A generation is decoded with chains while every step's draft is recorded (its chain, the draft's
best other tokens at each position, how many tokens the model kept). Greedy output does not
depend on the draft, so once the text is known each step can be replayed against it: what the
model produced after the step's position is the truth every candidate is scored against.

What a tree could have added, each in extra tokens per step:

* ``siblings`` (width ``w``): where a skip chain failed at position t, the model's token was one
  of the draft's next ``w - 1`` choices at t. A sibling leaf there is one more token (the model's
  own token then comes after the sibling instead of replacing it).
* ``other matches``: on a lookup step, another continuation of the last n-gram agreed with the
  text for longer than the chain's run did: the extra tokens.
* ``lookup under skip``: on a skip step that failed, a lookup match agreed for longer than the
  kept chain: the extra tokens.
* ``matches in a budget``: the same with only the first ``budget_matches`` continuations, merged
  in rank order into a tree of at most ``budget_nodes`` nodes (what a verify block of that size holds).
* ``every tree candidate``: per step the best of these (two kinds may fix the same failure).
* ``siblings with the next step's draft as their branch``: deeper trees. Where a sibling holds the
  model's token, the chain's next step drafted from exactly that token; a branch under the
  sibling drafted as that step drafted would have merged the two steps into one verify. Counted
  as the same tokens over one verify fewer per such hit (drafting both branches at once is the
  price, see ``scripts/tree_ceiling.py``'s draft row costs).

``longer runs`` is not a tree: the first match's run, uncut, against the run the chain was cut
to (the price of cutting runs by their expected cost).

Every gain assumes the tree's verify costs what the chain's did and that the shape would have
included that candidate: a ceiling on the extra tokens per step, not a forecast.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from layerskip.drafts.base import Drafter, DraftRequest, Proposal, Verdict, WrappingDrafter
from layerskip.drafts.drafters.lookup import LookupMatch, match_lookups
from layerskip.drafts.drafters.skip import ChainDraft
from layerskip.drafts.rules.token_tree import TreeBuilder
from layerskip.sampling import ROOT


@dataclass
class StepRecord:
    position: int  # history length when the step was drafted: its first token's index in the text
    source: str  # "skip", "lookup" or "none"
    chain: list[int]
    alternatives: list[list[int]] | None = None  # [k][K]: the draft's best tokens per chain position
    accepted: int = 0


def first_branch(proposal: Proposal) -> Proposal:
    """A tree proposal cut to its first branch: the chain it was built around (lookup's first run
    or the skip draft's kept chain), which the verify then checks as a chain."""
    tree = proposal.tree
    if tree.is_chain:
        return proposal
    return Proposal.chain(tree.tokens[: tree.first_branch_length], proposal.source)


class RecordingDrafter(WrappingDrafter):
    """Drafts as ``inner`` does, cut to chains, and records every step (``StepRecord``)."""

    def __init__(self, inner: Drafter) -> None:
        super().__init__(inner)
        self.records: list[StepRecord] = []
        self._proposed: Proposal | None = None  # the last proposal handed out, until its verdict comes

    def propose(self, request: DraftRequest) -> Proposal:
        proposal = first_branch(self.inner.propose(request))
        chain: ChainDraft | None = getattr(self.inner, "last_chain", None)  # auto's shows its step's skip chain
        alternatives = None
        if proposal.source == "skip" and chain is not None and chain.top_tokens is not None:
            alternatives = chain.top_tokens[: len(proposal)].tolist()
        self.records.append(StepRecord(len(request.history), proposal.source, list(proposal.tokens), alternatives))
        self._proposed = proposal
        return proposal

    def learn(self, proposal: Proposal, verdict: Verdict) -> None:
        # A step with no budget left never asked for a draft, but its (empty) one is reported too.
        if proposal is self._proposed:
            self.records[-1].accepted = verdict.accepted
            self._proposed = None
        self.inner.learn(proposal, verdict)


def agreement(candidate: Sequence[int], truth: Sequence[int]) -> int:
    """How many leading tokens of ``candidate`` the text really continued with."""
    return next((i for i, (a, b) in enumerate(zip(candidate, truth)) if a != b), min(len(candidate), len(truth)))


def tree_agreement(matches: Sequence[LookupMatch], budget: int, truth: Sequence[int]) -> int:
    """The longest root path of ``matches`` merged in order into a tree of ``budget`` nodes that
    the text continued with."""
    builder = TreeBuilder(budget)
    for match in matches:
        builder.add_path(match.tokens)
    tree = builder.build()
    best, depth_of = 0, {}
    for node, (token, parent) in enumerate(zip(tree.tokens, tree.parents)):
        depth = 0 if parent == ROOT else depth_of.get(parent, -1)
        if depth < 0 or depth >= len(truth) or truth[depth] != token:
            continue  # off the text: nothing under it counts
        depth_of[node] = depth + 1
        best = max(best, depth + 1)
    return best


@dataclass
class TreeCeiling:
    """Counts over the steps of one or more generations; ``gain`` holds extra tokens by candidate kind."""

    widths: tuple[int, ...] = (2, 4, 8)
    steps: int = 0
    tokens: int = 0  # tokens the chains produced (accepted + the model's own per step)
    skip_steps: int = 0
    skip_failures: int = 0  # skip steps that rejected a drafted token
    lookup_steps: int = 0
    sibling_hits: dict[int, int] = field(default_factory=dict)  # width -> failures a sibling would have fixed
    other_matches: int = 0
    lookup_under_skip: int = 0
    longer_runs: int = 0
    budget_matches: int = 4
    budget_nodes: int = 24
    matches_in_budget: int = 0
    verifies_saved: int = 0  # sibling hits whose branch, drafted out as the next step drafted, saves that step
    combined: int = 0  # per step the best of the kinds above (they may fix the same failure)

    @property
    def tau(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0

    @property
    def tau_with_sibling_branches(self) -> float:
        """Tokens per step had every sibling hit carried the next step's draft as its branch: the
        same tokens in one verify fewer per hit."""
        steps = self.steps - self.verifies_saved
        return self.tokens / steps if steps > 0 else 0.0

    def per_step(self, tokens: int) -> float:
        return tokens / self.steps if self.steps else 0.0

    def add(
        self, records: Sequence[StepRecord], text: Sequence[int], ngrams: tuple[int, int], max_tokens: int, matches: int
    ) -> None:
        """Score one generation's steps against ``text`` (prompt + every token generated)."""
        low, high = ngrams
        for index, record in enumerate(records):
            self.steps += 1
            self.tokens += record.accepted + 1
            truth = text[record.position :]
            history = list(text[: record.position])
            if record.source == "lookup":
                self.lookup_steps += 1
                found = match_lookups(history, low, high, max_tokens, matches)
                first = agreement(found[0].tokens, truth) if found else 0
                best = max((agreement(m.tokens, truth) for m in found), default=0)
                kept = max(first, record.accepted)
                self.longer_runs += max(0, first - record.accepted)
                self.other_matches += max(0, best - kept)
                held = tree_agreement(found[: self.budget_matches], self.budget_nodes, truth)
                self.matches_in_budget += max(0, held - kept)
                self.combined += max(0, best - kept)
            elif record.source == "skip":
                self.skip_steps += 1
                if record.accepted >= len(record.chain):
                    continue
                self.skip_failures += 1
                position, sibling = record.accepted, 0
                # A draft may record alternatives for fewer positions than it drafted (none known there).
                if record.alternatives is not None and position < min(len(truth), len(record.alternatives)):
                    others = [t for t in record.alternatives[position] if t != record.chain[position]]
                    for width in self.widths:
                        hit = truth[position] in others[: width - 1]
                        self.sibling_hits[width] = self.sibling_hits.get(width, 0) + hit
                        sibling = max(sibling, int(hit))
                following = records[index + 1] if index + 1 < len(records) else None
                if sibling and following is not None and following.position == record.position + position + 1:
                    self.verifies_saved += 1
                found = match_lookups(history, low, high, max_tokens, matches)
                best = max((agreement(m.tokens, truth) for m in found), default=0)
                self.lookup_under_skip += max(0, best - record.accepted)
                self.combined += max(sibling, best - record.accepted)

    def summary(self) -> dict[str, object]:
        return {
            "steps": self.steps,
            "tau_chain": self.tau,
            "skip_steps": self.skip_steps,
            "skip_failures": self.skip_failures,
            "lookup_steps": self.lookup_steps,
            "verifies_saved_by_sibling_branches": self.verifies_saved,
            "tau_with_sibling_branches": self.tau_with_sibling_branches,
            "extra_tokens_per_step": {
                **{f"siblings (width {w})": self.per_step(self.sibling_hits.get(w, 0)) for w in self.widths},
                "other lookup matches": self.per_step(self.other_matches),
                f"other lookup matches, first {self.budget_matches} in {self.budget_nodes} nodes": self.per_step(
                    self.matches_in_budget
                ),
                "lookup under a failed skip draft": self.per_step(self.lookup_under_skip),
                "every tree candidate": self.per_step(self.combined),
                "longer lookup runs (a chain)": self.per_step(self.longer_runs),
                "siblings with the next step's draft as their branch": self.tau_with_sibling_branches - self.tau,
            },
            "sibling_fixes_failure": {
                str(w): (self.sibling_hits.get(w, 0) / self.skip_failures if self.skip_failures else 0.0)
                for w in self.widths
            },
        }
