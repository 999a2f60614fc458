"""The skip draft: the same model with some sublayers bypassed, sharing the verify's cache."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch

from layerskip.drafts.base import SKIP, BaseDrafter, Drafter, DraftRequest, Proposal, Verdict, chain_run
from layerskip.drafts.draft_length import DraftLengthByCost
from layerskip.drafts.head import DraftHead
from layerskip.drafts.model import DraftModel
from layerskip.drafts.policy import DraftSettings
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

    def proposal(self) -> Proposal:
        return Proposal.chain(self.tokens, SKIP, self.q)


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
        token = torch.tensor([[request.pending]], device=request.device)  # [1, 1]
        tokens: list[torch.Tensor] = []
        q_rows: list[torch.Tensor] = []
        confidences: list[float] = []
        tops: list[tuple[torch.Tensor, torch.Tensor]] = []  # per position: best tokens [K], probs [K]
        drafted: list[int] = []  # the ids so far, for the processors (read back only where asked)
        with self.draft_model.active(self.attention, self.mlp):
            for _ in range(min(request.max_tokens, self.settings.max_draft_tokens)):
                logits = self.draft_model.logits(token, request.cache, self.head)[0]  # [n]
                if request.edits is not None:  # the user's processors, as the verify applies them
                    edit = self.head.editor(request.edits(drafted))
                    logits = edit(logits) if edit is not None else logits
                if self.sampling is None:
                    index = logits.argmax()
                else:
                    probs = self.sampling.probs(logits)
                    index = sample(probs, self.generator)
                    q_rows.append(self.head.to_full_vocab(probs))
                chosen = self.head.token_ids(index)
                tokens.append(chosen)
                if request.edits is not None:
                    drafted.append(int(chosen))
                if self.alternatives:
                    top = torch.topk(logits.float().softmax(-1), min(1 + self.alternatives, logits.shape[-1]))
                    tops.append((self.head.token_ids(top.indices), top.values))
                if self.stop is not None and self.stop.stop(float(top2_confidence(logits))):
                    break
                if self.length is not None:
                    confidences.append(float(top2_confidence(logits)))
                    if not self.length.draft_more(confidences):
                        break
                token = chosen.view(1, 1)
        ids = torch.stack(tokens).tolist() if tokens else []
        seconds = 0.0
        if self.length is not None:
            seconds = self.clock.now() - start  # the confidences were read back: device work is done
            self.length.observe_draft(len(ids), seconds)
        chain = ChainDraft(
            tokens=ids,
            q=torch.stack(q_rows) if q_rows else None,
            confidence=confidences,
            seconds=seconds,
            top_tokens=torch.stack([t for t, _ in tops]) if tops else None,  # [k, K]
            top_probs=torch.stack([p for _, p in tops]) if tops else None,
        )
        self._last = chain
        return chain

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
