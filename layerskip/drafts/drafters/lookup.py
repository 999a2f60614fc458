"""Prompt lookup: propose the continuation of an earlier occurrence of the text's last n-gram; and the
hybrid drafter, prompt lookup where the context repeats and the skip draft otherwise."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from layerskip.drafts.base import LOOKUP, Drafter, DraftRequest, Proposal, WrappingDrafter
from layerskip.drafts.policy.skip_policy import DraftSettings
from layerskip.drafts.rules.tree_shape import Paths, likeliest_tree, merged_paths


@dataclass
class LookupMatch:
    tokens: list[int]  # the continuation proposed ([] when nothing matches)
    ngram: int = 0  # length of the n-gram that matched


def continuation(history: list[int], begin: int, max_tokens: int) -> list[int]:
    """Up to ``max_tokens`` tokens predicted to follow ``history`` by an earlier occurrence of its
    last n-gram whose next token sits at index ``begin``.

    The occurrence's own continuation, as far as the history holds it; where it reaches the
    present, the text is taken to repeat with the period the match implies
    (``len(history) - begin``), so a short loop ("13-13-13-") is proposed past its first period.
    """
    follow = history[begin : begin + max_tokens]
    period = len(history) - begin
    for j in range(len(follow), max_tokens if follow else 0):
        follow.append(follow[j - period])
    return follow


def match_lookup(history: list[int], min_ngram: int, max_ngram: int, max_tokens: int) -> LookupMatch:
    """The first of ``match_lookups`` (the longest n, then the most recent occurrence), or no match."""
    matches = match_lookups(history, min_ngram, max_ngram, max_tokens, max_matches=1)
    return matches[0] if matches and matches[0].tokens else LookupMatch([])


def match_lookups(
    history: list[int], min_ngram: int, max_ngram: int, max_tokens: int, max_matches: int
) -> list[LookupMatch]:
    """Up to ``max_matches`` distinct continuations of the history's last n-gram, for a token tree.

    Ranked by the longest n first, then the most recent occurrence. A continuation that an earlier
    one already starts with adds no token to a tree and is skipped (the same occurrence found again
    by a shorter n is one).
    """
    matches: list[LookupMatch] = []
    length = len(history)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        tail = history[length - n :]
        # Scan from the most recent earlier start backwards: recent context predicts best.
        for start in range(length - n - 1, -1, -1):
            if history[start : start + n] != tail:
                continue
            follow = continuation(history, start + n, max_tokens)
            if any(match.tokens[: len(follow)] == follow for match in matches):
                continue
            matches.append(LookupMatch(follow, n))
            if len(matches) == max_matches:
                return matches
    return matches


@dataclass
class _Pending:
    start: int  # history index the match's first token would take
    ngram: int
    tokens: list[int]
    next: int = 0  # first position not yet compared with the history


@dataclass
class LookupRunLength:
    """Cuts lookup runs where they stop paying, learning within one generation.

    A long run of unlikely tokens costs verify time for nothing, while a short run of likely
    ones is almost free. For each matched n-gram length ``n`` and run position ``i`` this counts
    how often position ``i`` was reached (every earlier token right) and right;
    ``p(n, i) = (right + 1) / (reached + 2)`` (a uniform prior, so unseen positions are tried).
    A run keeps token ``i`` while ``prod_{j <= i} p(n, j) >= confidence``; 0 keeps every run whole
    (and then scores no run, unless ``score_every_run``: a token tree ranks its matches by these
    chances without cutting them).

    Every match is scored against the tokens the generation really produced (``observe``), not
    only the part that was proposed: a run cut to nothing still teaches, so a cut can never
    switch an n-gram length off for the rest of the generation.
    """

    confidence: float
    score_every_run: bool = False
    reached: dict[tuple[int, int], int] = field(default_factory=dict)
    right: dict[tuple[int, int], int] = field(default_factory=dict)
    pending: list[_Pending] = field(default_factory=list)

    def cut(self, match: LookupMatch) -> list[int]:
        if self.confidence <= 0.0:
            return match.tokens
        chances = self.chances(match)
        return match.tokens[: next((i for i, chance in enumerate(chances) if chance < self.confidence), len(chances))]

    def chance(self, key: tuple[int, int]) -> float:
        """``p(n, i)`` for ``key = (n, i)``: token i of a match of an n-gram is right, its earlier ones were."""
        return (self.right.get(key, 0) + 1) / (self.reached.get(key, 0) + 2)

    def chances(self, match: LookupMatch) -> list[float]:
        """Chance that each token of ``match`` is accepted, its earlier ones included."""
        chances, chance = [], 1.0
        for i in range(len(match.tokens)):
            chance *= self.chance((match.ngram, i))
            chances.append(chance)
        return chances

    def track(self, match: LookupMatch, start: int) -> None:
        """Score ``match`` (its first token at history index ``start``) as the history grows."""
        if (self.confidence > 0.0 or self.score_every_run) and match.tokens:
            self.pending.append(_Pending(start, match.ngram, list(match.tokens)))

    def observe(self, history: list[int]) -> None:
        """Compare the tracked matches with the tokens produced since; forget the settled ones."""
        still: list[_Pending] = []
        for item in self.pending:
            settled = False
            while item.next < len(item.tokens) and item.start + item.next < len(history):
                key = (item.ngram, item.next)
                self.reached[key] = self.reached.get(key, 0) + 1
                if item.tokens[item.next] != history[item.start + item.next]:
                    settled = True
                    break
                self.right[key] = self.right.get(key, 0) + 1
                item.next += 1
            if not settled and item.next < len(item.tokens):
                still.append(item)
        self.pending = still


class LookupDrafter(Drafter):
    """Proposes the continuation of a matching n-gram from the prompt or the text so far (no model
    call); with ``tree_matches`` > 1 several matches merged into a token tree. It learns from the
    history itself (``LookupRunLength.observe``), so a verdict teaches it nothing more."""

    def __init__(self, settings: DraftSettings, ranks: RankedRunLengths | None = None) -> None:
        self.settings = settings
        self.run_length = LookupRunLength(settings.lookup_confidence)
        # Token trees: the other matches' runs, scored by rank as the first one's is.
        self.ranks = ranks if ranks is not None else RankedRunLengths(settings.tree_matches)

    def propose(self, request: DraftRequest) -> Proposal:
        s = self.settings
        self.run_length.observe(request.history)
        cap = min(s.lookup_max_tokens, request.max_tokens)
        if s.tree_matches > 1:  # several matches in a tree of the likeliest nodes (each match's runs scored by rank)
            return Proposal(likeliest_tree(merged_paths(self.runs(request, cap)), s.node_budget), LOOKUP)
        match = self.match(request.history, cap)
        self.run_length.track(match, len(request.history))
        return Proposal.chain(self.run_length.cut(match), LOOKUP)

    def match(self, history: list[int], cap: int, longest_only: bool = False) -> LookupMatch:
        """The first match of ``history``'s last n-gram, at most ``cap`` tokens: the policy's
        n-gram lengths, or only its longest (a repeat that long is a strong witness)."""
        s = self.settings
        shortest = s.lookup_max_ngram if longest_only else s.lookup_min_ngram
        return match_lookup(history, shortest, s.lookup_max_ngram, cap)

    def runs(self, request: DraftRequest, cap: int) -> Paths:
        """This step's matches of up to ``cap`` tokens, best first, each with the chance of each of
        its tokens (its earlier ones included), scored against the text as it grows."""
        s = self.settings
        matches = match_lookups(request.history, s.lookup_min_ngram, s.lookup_max_ngram, cap, s.tree_matches)
        for rule in self.ranks.by_rank:
            rule.observe(request.history)
        for rule, match in zip(self.ranks.by_rank, matches):
            rule.track(match, len(request.history))
        return [(match.tokens, rule.chances(match)) for rule, match in zip(self.ranks.by_rank, matches)]


# One rank's counts: how often run position (n, i) was reached, and right.
RunCounts = tuple[dict[tuple[int, int], float], dict[tuple[int, int], float]]


class RankedRunLengths:
    """For token trees of lookup matches: how often the run of the match ranked ``r`` holds, by
    n-gram length and position, as ``LookupRunLength`` learns it for one match."""

    def __init__(self, matches: int) -> None:
        self.by_rank = [LookupRunLength(confidence=0.0, score_every_run=True) for _ in range(matches)]

    @classmethod
    def carried(cls, matches: int, counts: Sequence[RunCounts], weight: float) -> RankedRunLengths:
        """Starting from earlier generations' ``counts`` (per rank), weighed by ``weight``."""
        ranks = cls(matches)
        for rule, (reached, right) in zip(ranks.by_rank, counts):
            rule.reached = {k: round(weight * v) for k, v in reached.items()}
            rule.right = {k: min(round(weight * v), rule.reached[k]) for k, v in right.items()}
        return ranks

    def counts(self) -> list[RunCounts]:
        """What each rank's rule counted: (reached, right) by (n-gram length, run position)."""
        return [
            ({k: float(v) for k, v in rule.reached.items()}, {k: float(v) for k, v in rule.right.items()})
            for rule in self.by_rank
        ]


class HybridDrafter(WrappingDrafter):
    """Lookup when the context repeats an earlier n-gram, otherwise the skip draft, which learns
    from its own drafts only but sees every verify."""

    def __init__(self, lookup: LookupDrafter, skip: Drafter) -> None:
        super().__init__(skip)
        self.lookup = lookup

    def propose(self, request: DraftRequest) -> Proposal:
        proposal = self.lookup.propose(request)
        return proposal if len(proposal) else self.inner.propose(request)
