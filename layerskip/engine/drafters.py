"""How candidate tokens are proposed: skip draft, prompt lookup, both (hybrid), or none (plain decoding).

Every drafter has two methods, after Hugging Face's candidate generators: ``propose`` returns
up to ``max_tokens`` candidates (with their proposal distribution q when sampling), and
``update(draft, accepted)`` learns from how many of them the full model accepted. What a
drafter needs to learn from a draft travels in the ``Draft`` itself (its source, the n-gram
that matched), so no drafter remembers its previous call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch

from layerskip.engine.cache import RollbackCache
from layerskip.engine.draft import DraftModel
from layerskip.engine.draft_length import DraftLengthByCost
from layerskip.engine.head import DraftHead
from layerskip.engine.policy import DraftSettings, SkipPolicy
from layerskip.engine.sampling import Sampling, sample
from layerskip.engine.stats import DeviceClock, GenerationStats


@dataclass
class Draft:
    tokens: list[int]
    q: torch.Tensor | None = None  # [k, V] proposal probabilities (sampling only)
    source: str = "none"  # "skip", "lookup" or "none"
    ngram: int = 0  # lookup: length of the n-gram that matched
    # Skip drafts with draft length by cost: each token's top-2 confidence, and the draft's time.
    confidence: list[float] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def from_lookup(self) -> bool:
        return self.source == "lookup"


@dataclass
class DraftRequest:
    """What a drafter may look at: the sequence so far and the cache, which holds all of it but ``pending``."""

    history: list[int]  # prompt + generated tokens; the last one is ``pending``
    cache: RollbackCache
    max_tokens: int
    device: torch.device

    @property
    def pending(self) -> int:
        return self.history[-1]

    @property
    def position(self) -> int:
        return len(self.history) - 1


class Drafter(Protocol):
    def propose(self, request: DraftRequest) -> Draft: ...

    def update(self, draft: Draft, accepted: int) -> None: ...

    def watch_verify(self, block: int) -> contextlib.AbstractContextManager[object]:
        """Entered around every verify forward of ``block`` positions (on-the-fly selection reads
        the full model there; draft length by cost times it)."""
        ...

    def report(self, stats: GenerationStats) -> None:
        """Adds what the drafter tracked to the generation's stats at the end."""
        ...

    def around_verify(
        self, cache: RollbackCache, start: int, block: torch.Tensor
    ) -> contextlib.AbstractContextManager[object]:
        """Entered around every verify forward of ``block [1, q]`` at positions ``start..``: an exit
        draft may let the verify reuse what it computed, or fill its adapter's cache after it."""
        ...


class BaseDrafter:
    """Defaults for the optional drafter methods: nothing to watch, nothing to report."""

    def watch_verify(self, block: int) -> contextlib.AbstractContextManager[object]:
        return contextlib.nullcontext()

    def report(self, stats: GenerationStats) -> None:
        pass

    def around_verify(
        self, cache: RollbackCache, start: int, block: torch.Tensor
    ) -> contextlib.AbstractContextManager[object]:
        return contextlib.nullcontext()


class NoDrafter(BaseDrafter):
    """Plain decoding: nothing proposed, so every step verifies just the pending token."""

    def propose(self, request: DraftRequest) -> Draft:
        return Draft([])

    def update(self, draft: Draft, accepted: int) -> None:
        pass


def top2_confidence(logits: torch.Tensor) -> torch.Tensor:
    """How clearly the draft's top token beats its runner-up: ``(p1 - p2) / (p1 + p2)``, in [0, 1).

    It equals ``tanh((top1 - top2) / 2)`` of ``[..., n]`` logits, so unlike a softmax over the
    head's rows it does not depend on how many rows a truncated head scores: one threshold
    means the same with any head size.
    """
    top = torch.topk(logits.float(), 2, dim=-1).values
    return torch.tanh((top[..., 0] - top[..., 1]) / 2)


class AdaptiveStop:
    """Draft & Verify's rule: stop drafting when the draft's confidence falls below a threshold
    that moves after every verify so the smoothed acceptance rate tracks a target (+step when
    acceptance is under target, -step otherwise). The search's replay uses the same class."""

    THRESHOLD_STEP = 0.01
    ACCEPTANCE_MOMENTUM = 0.5

    def __init__(self, initial_threshold: float, target_acceptance: float) -> None:
        self.threshold = initial_threshold
        self.target = target_acceptance
        self.smoothed_acceptance = target_acceptance

    def stop(self, confidence: float) -> bool:
        return confidence < self.threshold

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        momentum = self.ACCEPTANCE_MOMENTUM
        self.smoothed_acceptance = momentum * self.smoothed_acceptance + (1 - momentum) * accepted / drafted
        step = self.THRESHOLD_STEP if self.smoothed_acceptance < self.target else -self.THRESHOLD_STEP
        self.threshold = min(1.0, max(0.0, self.threshold + step))


class SkipDrafter(BaseDrafter):
    """Drafts with the same model, some sublayers bypassed, sharing the verify cache.

    ``attention`` / ``mlp`` are the bypassed sublayers; they may change between calls (on-the-fly
    selection does that). The head learns every token the generation emits before each draft.
    How a draft ends: at ``max_draft_tokens``, at a low-confidence token (``adaptive``), or where
    one more token is not expected to pay for its measured time (``length_by_cost``).
    """

    def __init__(
        self,
        draft_model: DraftModel,
        attention: tuple[int, ...],
        mlp: tuple[int, ...],
        settings: DraftSettings,
        head: DraftHead,
        sampling: Sampling | None,
        generator: torch.Generator | None,
    ) -> None:
        self.draft_model = draft_model
        self.attention = attention
        self.mlp = mlp
        self.settings = settings
        self.head = head
        self.sampling = sampling
        self.generator = generator
        self.stop = AdaptiveStop(settings.initial_threshold, settings.target_acceptance) if settings.adaptive else None
        self.length = (
            DraftLengthByCost(settings.max_draft_tokens, settings.min_verify_block) if settings.length_by_cost else None
        )
        self.clock = DeviceClock(draft_model.device)
        self._last_verify_seconds = 0.0
        self._known = 0  # how much of the history the head has been given

    def propose(self, request: DraftRequest) -> Draft:
        start = self.clock.now() if self.length is not None else 0.0
        self.head.add(request.history[self._known :])
        self._known = len(request.history)
        token = torch.tensor([[request.pending]], device=request.device)  # [1, 1]
        tokens: list[torch.Tensor] = []
        q_rows: list[torch.Tensor] = []
        confidences: list[float] = []
        with self.draft_model.active(self.attention, self.mlp):
            for i in range(min(request.max_tokens, self.settings.max_draft_tokens)):
                logits = self.draft_model.logits(token, request.cache, request.position + i, self.head)  # [n]
                if self.sampling is None:
                    index = logits.argmax()
                else:
                    probs = self.sampling.probs(logits)
                    index = sample(probs, self.generator)
                    q_rows.append(self.head.to_full_vocab(probs))
                chosen = self.head.token_ids(index)
                tokens.append(chosen)
                if self.stop is not None and self.stop.stop(float(top2_confidence(logits))):
                    break
                if self.length is not None:
                    confidences.append(float(top2_confidence(logits)))
                    if not self.length.draft_more(confidences):
                        break
                token = chosen.view(1, 1)
        ids = torch.stack(tokens).tolist() if tokens else []
        draft = Draft(tokens=ids, q=torch.stack(q_rows) if q_rows else None, source="skip", confidence=confidences)
        if self.length is not None:
            draft.seconds = self.clock.now() - start  # the confidences were read back: device work is done
            self.length.observe_draft(len(ids), draft.seconds)
        return draft

    @contextlib.contextmanager
    def watch_verify(self, block: int) -> Iterator[None]:
        if self.length is None:
            yield
            return
        start = self.clock.now()
        yield
        self._last_verify_seconds = self.clock.now() - start
        self.length.observe_verify(block, self._last_verify_seconds)

    def update(self, draft: Draft, accepted: int) -> None:
        if self.stop is not None and draft.source == "skip":
            self.stop.update(len(draft.tokens), accepted)
        if self.length is not None and draft.source == "skip" and draft.tokens:
            self.length.observe_step(draft.confidence, accepted, draft.seconds + self._last_verify_seconds)


@dataclass
class LookupMatch:
    tokens: list[int]  # the continuation proposed ([] when nothing matches)
    ngram: int = 0  # length of the n-gram that matched


def match_lookup(history: list[int], min_ngram: int, max_ngram: int, max_tokens: int) -> LookupMatch:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the history's last n-gram.

    Tries the longest n first.
    """
    length = len(history)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        tail = history[length - n :]
        # Scan from the most recent earlier start backwards: recent context predicts best.
        for start in range(length - n - 1, -1, -1):
            if history[start : start + n] == tail:
                follow = history[start + n : start + n + max_tokens]
                if follow:
                    return LookupMatch(follow, n)
    return LookupMatch([])


def find_lookup(history: list[int], min_ngram: int, max_ngram: int, max_tokens: int) -> list[int]:
    return match_lookup(history, min_ngram, max_ngram, max_tokens).tokens


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
    A run keeps token ``i`` while ``prod_{j <= i} p(n, j) >= confidence``; 0 keeps every run whole.

    Every match is scored against the tokens the generation really produced (``observe``), not
    only the part that was proposed: a run cut to nothing still teaches, so a cut can never
    switch an n-gram length off for the rest of the generation.
    """

    confidence: float
    reached: dict[tuple[int, int], int] = field(default_factory=dict)
    right: dict[tuple[int, int], int] = field(default_factory=dict)
    pending: list[_Pending] = field(default_factory=list)

    def cut(self, match: LookupMatch) -> list[int]:
        if self.confidence <= 0.0:
            return match.tokens
        chance = 1.0
        for i in range(len(match.tokens)):
            key = (match.ngram, i)
            chance *= (self.right.get(key, 0) + 1) / (self.reached.get(key, 0) + 2)
            if chance < self.confidence:
                return match.tokens[:i]
        return match.tokens

    def track(self, match: LookupMatch, start: int) -> None:
        """Score ``match`` (its first token at history index ``start``) as the history grows."""
        if self.confidence > 0.0 and match.tokens:
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


class LookupDrafter(BaseDrafter):
    """Proposes the continuation of a matching n-gram from the prompt or the text so far (no model call)."""

    def __init__(self, settings: DraftSettings, vocab_size: int, sampling: Sampling | None) -> None:
        self.settings = settings
        self.vocab_size = vocab_size
        self.sampling = sampling
        self.run_length = LookupRunLength(settings.lookup_confidence)

    def propose(self, request: DraftRequest) -> Draft:
        s = self.settings
        self.run_length.observe(request.history)
        match = match_lookup(
            request.history, s.lookup_min_ngram, s.lookup_max_ngram, min(s.lookup_max_tokens, request.max_tokens)
        )
        self.run_length.track(match, len(request.history))
        tokens = self.run_length.cut(match)
        q = None
        if tokens and self.sampling is not None:
            # A deterministic proposal: q is one-hot on the proposed token.
            q = torch.zeros(len(tokens), self.vocab_size, device=request.device)
            q[torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
        return Draft(tokens=tokens, q=q, source="lookup", ngram=match.ngram)

    def update(self, draft: Draft, accepted: int) -> None:
        pass  # it learns from the history itself (``LookupRunLength.observe``)


class HybridDrafter(BaseDrafter):
    """Lookup when the context repeats an earlier n-gram, otherwise the skip draft."""

    def __init__(self, lookup: LookupDrafter, skip: Drafter | None) -> None:
        self.lookup = lookup
        self.skip = skip

    def propose(self, request: DraftRequest) -> Draft:
        draft = self.lookup.propose(request)
        if not draft.tokens and self.skip is not None:
            draft = self.skip.propose(request)
        return draft

    def update(self, draft: Draft, accepted: int) -> None:
        if self.skip is not None:  # it learns from skip drafts only, but sees every verify
            self.skip.update(draft, accepted)

    def watch_verify(self, block: int) -> contextlib.AbstractContextManager[object]:
        return self.skip.watch_verify(block) if self.skip is not None else contextlib.nullcontext()

    def report(self, stats: GenerationStats) -> None:
        if self.skip is not None:
            self.skip.report(stats)

    def around_verify(
        self, cache: RollbackCache, start: int, block: torch.Tensor
    ) -> contextlib.AbstractContextManager[object]:
        return self.skip.around_verify(cache, start, block) if self.skip is not None else contextlib.nullcontext()


def make_drafter(
    policy: SkipPolicy,
    draft_model: DraftModel | None,
    head: DraftHead | None,
    vocab_size: int,
    sampling: Sampling | None,
    generator: torch.Generator | None,
) -> Drafter:
    """The drafter a policy describes; ``draft_model`` and ``head`` are needed when it uses a skip draft."""
    settings = policy.draft
    skip = None
    if settings.use_skip_draft:
        assert draft_model is not None and head is not None
        args = (draft_model, policy.skip_attention, policy.skip_mlp, settings, head, sampling, generator)
        if policy.exit is not None:
            from layerskip.engine.exit_draft import ExitDrafter  # it builds on this module

            skip = ExitDrafter(*args, reuse_kv=policy.exit.reuse_kv)
        else:
            skip = SkipDrafter(*args)
    if not settings.lookup_max_ngram:
        assert skip is not None
        return skip
    return HybridDrafter(LookupDrafter(settings, vocab_size, sampling), skip)
