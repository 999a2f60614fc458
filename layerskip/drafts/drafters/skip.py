"""The skip draft: the same model with some sublayers bypassed, sharing the verify's cache."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from layerskip.drafts.base import SKIP, Drafter, DraftRequest, EditsAfter, Proposal, Proposals, Verdict, chain_run
from layerskip.drafts.model.draft_model import DraftModel
from layerskip.drafts.model.head import DraftHead
from layerskip.drafts.policy.skip_policy import DraftSettings
from layerskip.drafts.rules.draft_length import DraftLengthByCost
from layerskip.hf.cache import RollbackCache
from layerskip.sampling import Sampling, sample
from layerskip.stats import DeviceClock


def top2_confidence(logits: torch.Tensor) -> torch.Tensor:
    """How clearly the draft's top token beats its runner-up: ``(p1 - p2) / (p1 + p2)``, in [0, 1).

    It equals ``tanh((top1 - top2) / 2)`` of ``[..., n]`` logits, so unlike a softmax over the
    head's rows it does not depend on how many rows a truncated head scores: one threshold
    means the same with any head size.
    """
    top = torch.topk(logits.float(), 2, dim=-1).values
    return torch.tanh((top[..., 0] - top[..., 1]) / 2)


@dataclass(frozen=True)
class ChainDraft:
    """A skip draft's chain and what its drafter noted while drafting it: the drafters' own record
    (a wrapper may make a tree of it, ``auto`` may price it), never handed to the engine."""

    tokens: list[int]
    q: torch.Tensor | None = None  # [k, V] proposal probabilities (sampling only)
    confidence: list[float] = field(default_factory=list)  # each token's top-2 confidence (by cost)
    seconds: float = 0.0  # the draft's time (draft length by cost)
    # Greedy drafts asked for alternatives: the draft's best tokens and probabilities per position,
    # [k, K] best first.
    top_tokens: torch.Tensor | None = None
    top_probs: torch.Tensor | None = None
    # An exit draft that reuses its K/V: layer L's outputs of [pending, tokens], [1, k+1, H]
    # (``Proposal.entry``).
    entry: torch.Tensor | None = None

    def proposal(self) -> Proposal:
        return Proposal.chain(self.tokens, SKIP, self.q, self.entry)


class ChainDrafter(Drafter, Protocol):
    """A drafter that drafts a skip chain: ``draft_chain`` gives the chain with its notes (wrappers
    that branch or price it read them); ``propose`` is that chain as a proposal."""

    def draft_chain(self, request: DraftRequest) -> ChainDraft: ...


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


class SkipDrafter(Drafter):
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
        length: DraftLengthByCost | None = None,
        alternatives: int = 0,
    ) -> None:
        self.draft_model = draft_model
        self.attention = attention
        self.mlp = mlp
        self.settings = settings
        self.head = head
        self.sampling = sampling
        self.generator = generator
        self.stop = AdaptiveStop(settings.initial_threshold, settings.target_acceptance) if settings.adaptive else None
        if length is None and settings.length_by_cost:
            length = DraftLengthByCost(settings.max_draft_tokens, settings.min_verify_block)
        self.length = length  # ``auto`` passes one priced by its calibration
        # Greedy drafts for a token tree record their best ``1 + alternatives`` tokens per position.
        self.alternatives = alternatives if sampling is None else 0
        self.clock = DeviceClock(draft_model.device)
        self._last_verify_seconds = 0.0
        self._known = 0  # how much of the history the head has been given
        self._last: ChainDraft | None = None  # the chain proposed, until its verdict is learned

    def propose(self, request: DraftRequest) -> Proposal:
        return self.draft_chain(request).proposal()

    def draft_chain(self, request: DraftRequest) -> ChainDraft:
        start = self.clock.now() if self.length is not None else 0.0
        self.head.add(request.history[self._known :])
        self._known = len(request.history)
        limit = min(request.max_tokens, self.settings.max_draft_tokens)
        stop = self._stop if self.stop is not None or self.length is not None else None
        (chain,) = self._draft(request.cache, [request.pending], [limit], [self.generator], [request.edits], stop)
        if self.length is not None:
            seconds = self.clock.now() - start  # the confidences were read back: device work is done
            self.length.observe_draft(len(chain.tokens), seconds)
            chain = replace(chain, seconds=seconds)
        self._last = chain
        return chain

    def propose_rows(
        self,
        cache: RollbackCache,
        histories: Sequence[list[int]],
        budgets: Sequence[int],
        steps: int,
        generators: Sequence[torch.Generator | None],
        edits: Sequence[EditsAfter | None],
    ) -> Proposals:
        """Every row of a batch drafts ``steps`` tokens in one lean product per token: row ``r``
        after ``histories[r]`` (its last token pending, the rest in the cache's row ``r``), keeping
        at most ``budgets[r]``, its logits through its processors' edits (``edits[r]``). The head is
        shared by the rows (it learns every row's text); the cache's lengths come back as they were.
        A fixed length for every row: one row's stop would not shorten the product."""
        for history in histories:
            self.head.add(history)
        limits = [max(0, min(budget, steps)) for budget in budgets]
        pending = [history[-1] for history in histories]
        committed = list(cache.lengths)
        chains = self._draft(cache, pending, limits, generators, edits, None, steps)
        cache.set_lengths(committed)
        return Proposals(tuple(chain.proposal() for chain in chains))

    def _stop(self, confidences: list[float]) -> bool:
        """Whether one row's draft ends after its latest token (its confidences so far)."""
        if self.stop is not None and self.stop.stop(confidences[-1]):
            return True
        return self.length is not None and not self.length.draft_more(confidences)

    def _draft(
        self,
        cache: RollbackCache,
        pending: list[int],
        limits: list[int],
        generators: Sequence[torch.Generator | None],
        edits: Sequence[EditsAfter | None],
        stop: Callable[[list[float]], bool] | None,
        steps: int | None = None,
    ) -> list[ChainDraft]:
        """The draft loop of R rows: each lean forward drafts one token for every row still drafting
        (``[R, 1]`` in, ``[R, n]`` logits out). Row ``r`` keeps at most ``limits[r]`` tokens and ends
        early where ``stop`` says so of its confidences; the loop runs ``steps`` tokens (default: the
        longest limit) or until every row has ended. The cache's rows move on by the tokens run (an exit
        draft that reuses its K/V carries on from there)."""
        rows = len(pending)
        token = torch.tensor(pending, device=self.draft_model.device)  # [R]
        chosen: list[torch.Tensor] = []  # per drafted position: [R] ids
        q_rows: list[list[torch.Tensor]] = [[] for _ in range(rows)]
        confidences: list[list[float]] = [[] for _ in range(rows)]
        tops: list[tuple[torch.Tensor, torch.Tensor]] = []  # per position: best tokens, probs [R, K]
        drafted: list[list[int]] = [[] for _ in range(rows)]  # the ids so far, for the processors
        edited = [(r, after) for r, after in enumerate(edits) if after is not None]
        ended = [limit <= 0 for limit in limits]
        total = max(limits) if steps is None else steps
        with self.draft_model.active(self.attention, self.mlp):
            for position in range(total):
                if all(ended):
                    break
                logits = self.draft_model.logits(token[:, None], cache, self.head)  # [R, n]; rows move on by one
                for r, after in edited:  # the user's processors, as the verify applies them
                    edit = self.head.editor(after(drafted[r]))
                    if edit is not None:
                        logits[r] = edit(logits[r])
                if self.sampling is None:
                    index = logits.argmax(-1)  # [R]
                else:
                    probs = self.sampling.probs(logits)  # [R, n]
                    index = torch.stack([sample(probs[r], g) for r, g in enumerate(generators)]).reshape(-1)
                    for r in range(rows):
                        if not ended[r]:
                            q_rows[r].append(self.head.to_full_vocab(probs[r]))
                token = self.head.token_ids(index).reshape(-1)  # [R]
                chosen.append(token)
                if edited:
                    for r, t in enumerate(token.tolist()):
                        drafted[r].append(t)
                if self.alternatives:
                    top = torch.topk(logits.float().softmax(-1), min(1 + self.alternatives, logits.shape[-1]))
                    tops.append((self.head.token_ids(top.indices), top.values))
                if stop is not None:
                    for r, confidence in enumerate(top2_confidence(logits).tolist()):
                        if not ended[r]:
                            confidences[r].append(confidence)
                            ended[r] = stop(confidences[r])
                ended = [done or position + 1 >= limit for done, limit in zip(ended, limits)]
        ids = torch.stack(chosen, dim=1).tolist() if chosen else [[] for _ in range(rows)]  # [R, drafted]
        chains = []
        for r, row_ids in enumerate(ids):
            keep = min(limits[r], len(q_rows[r]) if self.sampling is not None else len(row_ids))
            if stop is not None:
                keep = min(keep, len(confidences[r]))
            chains.append(
                ChainDraft(
                    tokens=row_ids[:keep],
                    q=torch.stack(q_rows[r][:keep]) if q_rows[r] and keep else None,
                    confidence=confidences[r][:keep],
                    top_tokens=torch.stack([t[r] for t, _ in tops[:keep]]) if tops and keep else None,  # [k, K]
                    top_probs=torch.stack([p[r] for _, p in tops[:keep]]) if tops and keep else None,
                )
            )
        return chains

    @contextlib.contextmanager
    def watch_verify(self, block: int) -> Iterator[None]:
        if self.length is None:
            yield
            return
        start = self.clock.now()
        yield
        self._last_verify_seconds = self.clock.now() - start
        self.length.observe_verify(block, self._last_verify_seconds)

    def learn(self, proposal: Proposal, verdict: Verdict) -> None:
        """Learns from its own last chain only (a lookup step's proposal was not its own); a tree
        may have accepted a sibling's path, and ``auto`` may have verified a prefix of the chain."""
        chain, self._last = self._last, None
        if chain is None or not chain.tokens:
            return
        verified, run = chain_run(proposal, verdict, chain.tokens)
        if self.stop is not None:
            self.stop.update(verified, run)
        if self.length is not None and verified:
            self.length.observe_step(chain.confidence[:verified], run, chain.seconds + self._last_verify_seconds)
