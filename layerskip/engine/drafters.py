"""How candidate tokens are proposed: skip draft, prompt lookup, or both (hybrid).

Every drafter has two methods, after Hugging Face's candidate generators: ``propose`` returns
up to ``max_tokens`` candidates (with their proposal distribution q when sampling), and
``update`` learns from how many of them the full model accepted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from layerskip.engine.cache import RollbackCache
from layerskip.engine.forward import draft_logits
from layerskip.engine.policy import DraftSettings, SkipPolicy
from layerskip.engine.sampling import Sampling, sample
from layerskip.hf import adapters


@dataclass
class Draft:
    tokens: list[int]
    q: torch.Tensor | None = None  # [k, V] proposal probabilities (sampling only)
    from_lookup: bool = False


@dataclass
class DraftRequest:
    """What a drafter may look at: the sequence so far and the cache, which holds all of it but ``pending``."""

    history: list[int]  # prompt + generated tokens; the last one is ``pending``
    cache: RollbackCache
    max_tokens: int

    @property
    def pending(self) -> int:
        return self.history[-1]

    @property
    def position(self) -> int:
        return len(self.history) - 1


class Drafter(Protocol):
    def propose(self, request: DraftRequest) -> Draft: ...

    def update(self, drafted: int, accepted: int) -> None: ...


class SkipDrafter:
    """Drafts with the same model, some sublayers bypassed, sharing the verify cache.

    With ``settings.adaptive`` it stops drafting once the draft's top-1 probability falls below
    a threshold that is nudged after every verify so the acceptance rate tracks a target
    (Draft & Verify's rule: +step when acceptance is under target, -step otherwise).
    """

    THRESHOLD_STEP = 0.01
    ACCEPTANCE_MOMENTUM = 0.5

    def __init__(
        self,
        model: nn.Module,
        policy: SkipPolicy,
        sampling: Sampling | None,
        generator: torch.Generator | None,
        vocab_rows: torch.Tensor | None = None,
    ) -> None:
        self.model = model
        self.policy = policy
        self.settings: DraftSettings = policy.draft
        self.sampling = sampling
        self.generator = generator
        self.head = adapters.draft_head(model, vocab_rows)  # full or truncated to [K] rows
        self.vocab_rows = vocab_rows
        self.vocab_size = adapters.lm_head(model).weight.shape[0]
        self.threshold = self.settings.initial_threshold
        self.smoothed_acceptance = self.settings.target_acceptance

    def _to_full_vocab(self, probs: torch.Tensor) -> torch.Tensor:
        if self.vocab_rows is None:
            return probs
        full = probs.new_zeros(self.vocab_size)
        return full.index_copy_(0, self.vocab_rows, probs)

    def propose(self, request: DraftRequest) -> Draft:
        device = request.cache.layers[0].keys.device if request.cache.layers else None
        token = torch.tensor([[request.pending]], device=device)  # [1, 1]
        tokens: list[torch.Tensor] = []
        q_rows: list[torch.Tensor] = []
        with adapters.bypass(self.model, self.policy.skip_attention, self.policy.skip_mlp):
            for i in range(min(request.max_tokens, self.settings.max_draft_tokens)):
                logits = draft_logits(self.model, token, request.cache, request.position + i, self.head)
                if self.sampling is None:
                    index = logits.argmax()
                    if self.settings.adaptive:
                        confidence = logits.float().softmax(-1)[index]
                else:
                    probs = self.sampling.probs(logits)
                    index = sample(probs, self.generator)
                    confidence = probs[index]
                    q_rows.append(self._to_full_vocab(probs))
                chosen = self.head.token_ids(index)
                tokens.append(chosen)
                if self.settings.adaptive and float(confidence) < self.threshold:
                    break
                token = chosen.view(1, 1)
        ids = torch.stack(tokens).tolist() if tokens else []
        return Draft(tokens=ids, q=torch.stack(q_rows) if q_rows else None)

    def update(self, drafted: int, accepted: int) -> None:
        if not self.settings.adaptive or drafted == 0:
            return
        momentum = self.ACCEPTANCE_MOMENTUM
        self.smoothed_acceptance = momentum * self.smoothed_acceptance + (1 - momentum) * accepted / drafted
        step = (
            self.THRESHOLD_STEP if self.smoothed_acceptance < self.settings.target_acceptance else -self.THRESHOLD_STEP
        )
        self.threshold = min(1.0, max(0.0, self.threshold + step))


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


class LookupRunLength:
    """Cuts lookup runs where they stop paying, learning within one generation.

    A verify block costs a little more per extra token (a few % of a step on CPU), so a long
    run of unlikely tokens is a loss while a short run of likely ones is almost free. For each
    matched n-gram length ``n`` and run position ``i`` this counts how often position ``i`` was
    reached (every earlier token accepted) and accepted; ``p(n, i) = (accepted + 1) / (reached + 2)``
    (a uniform prior, so unseen positions are tried). A run keeps token ``i`` while
    ``prod_{j <= i} p(n, j) >= confidence``. ``confidence = 0`` keeps every run whole.
    """

    def __init__(self, confidence: float) -> None:
        self.confidence = confidence
        self.reached: dict[tuple[int, int], int] = {}
        self.accepted: dict[tuple[int, int], int] = {}

    def cut(self, match: LookupMatch) -> list[int]:
        if self.confidence <= 0.0:
            return match.tokens
        chance = 1.0
        for i in range(len(match.tokens)):
            key = (match.ngram, i)
            chance *= (self.accepted.get(key, 0) + 1) / (self.reached.get(key, 0) + 2)
            if chance < self.confidence:
                return match.tokens[:i]
        return match.tokens

    def update(self, ngram: int, drafted: int, accepted: int) -> None:
        for i in range(min(drafted, accepted + 1)):
            key = (ngram, i)
            self.reached[key] = self.reached.get(key, 0) + 1
            if i < accepted:
                self.accepted[key] = self.accepted.get(key, 0) + 1


class LookupDrafter:
    """Proposes the continuation of a matching n-gram from the prompt or the text so far (no model call)."""

    def __init__(self, settings: DraftSettings, vocab_size: int, sampling: Sampling | None) -> None:
        self.settings = settings
        self.vocab_size = vocab_size
        self.sampling = sampling
        self.run_length = LookupRunLength(settings.lookup_confidence)
        self._last_ngram = 0

    def propose(self, request: DraftRequest) -> Draft:
        s = self.settings
        match = match_lookup(
            request.history, s.lookup_min_ngram, s.lookup_max_ngram, min(s.lookup_max_tokens, request.max_tokens)
        )
        tokens = self.run_length.cut(match)
        self._last_ngram = match.ngram
        q = None
        if tokens and self.sampling is not None:
            # A deterministic proposal: q is one-hot on the proposed token.
            device = request.cache.layers[0].keys.device
            q = torch.zeros(len(tokens), self.vocab_size, device=device)
            q[torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
        return Draft(tokens=tokens, q=q, from_lookup=True)

    def update(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.run_length.update(self._last_ngram, drafted, accepted)


class HybridDrafter:
    """Lookup when the context repeats an earlier n-gram, otherwise the skip draft."""

    def __init__(self, lookup: LookupDrafter, skip: SkipDrafter | None) -> None:
        self.lookup = lookup
        self.skip = skip
        self._last_from_lookup = False

    def propose(self, request: DraftRequest) -> Draft:
        draft = self.lookup.propose(request)
        if not draft.tokens and self.skip is not None:
            draft = self.skip.propose(request)
        self._last_from_lookup = draft.from_lookup
        return draft

    def update(self, drafted: int, accepted: int) -> None:
        if self._last_from_lookup:
            self.lookup.update(drafted, accepted)
        elif self.skip is not None:
            self.skip.update(drafted, accepted)


def make_drafter(
    model: nn.Module,
    policy: SkipPolicy,
    sampling: Sampling | None,
    generator: torch.Generator | None,
    vocab_rows: torch.Tensor | None = None,
) -> Drafter:
    settings = policy.draft
    skip = SkipDrafter(model, policy, sampling, generator, vocab_rows) if settings.use_skip_draft else None
    if not settings.lookup_max_ngram:
        assert skip is not None
        return skip
    vocab_size = adapters.lm_head(model).weight.shape[0]
    return HybridDrafter(LookupDrafter(settings, vocab_size, sampling), skip)
