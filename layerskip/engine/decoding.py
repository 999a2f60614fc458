"""The decode loop, batch size 1: self-speculative with a prepared draft, plain with none; greedy or sampling.

The loop keeps the bookkeeping (output, stop conditions, stats); each step is one call of
``engine.step.Stepper.step`` (propose, verify, accept, roll back). Greedy output is the full
model's argmax chain; sampling uses rejection sampling, so the output distribution is the full
model's. Plain decoding is the same loop with a drafter that proposes nothing (blocks of one token).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from layerskip.drafts.base import Drafter, NoDrafter
from layerskip.drafts.builder import DraftModels, DraftRun, PreparedDraft, prepare_draft
from layerskip.drafts.model import DraftModel
from layerskip.drafts.onthefly import SelectionState
from layerskip.drafts.policy import SkipPolicy
from layerskip.drafts.policy_spec import load_policy
from layerskip.engine.calibration import calibrate
from layerskip.engine.step import StepOutcome, Stepper
from layerskip.engine.threads import ThreadTuner
from layerskip.engine.verifiers import LogitsHook, verifier_for
from layerskip.engine.verify_head import VerifyHead, engine_verify_head
from layerskip.errors import LayerskipError
from layerskip.hf import adapters
from layerskip.hf.cache import RollbackCache, model_cache
from layerskip.hf.prompting import encode_prompt, eos_token_ids
from layerskip.sampling import Sampling
from layerskip.stats import DeviceClock, GenerationResult, GenerationStats

TokenCallback = Callable[[list[int]], None]
CacheObserver = Callable[[RollbackCache, int], None]
# history (prompt + tokens so far) -> stop after the last one; checked after every accepted token.
StopCheck = Callable[[list[int]], bool]


@dataclass(frozen=True)
class DecodeSettings:
    max_new_tokens: int = 128
    sampling: Sampling | None = None  # None = greedy
    seed: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()

    def validate(self) -> None:
        if self.max_new_tokens <= 0:
            raise LayerskipError(f"max_new_tokens must be > 0 (got {self.max_new_tokens})")


class _Output:
    """Collects accepted tokens; applies EOS, stop strings and the token budget; streams."""

    def __init__(
        self,
        prompt: list[int],
        settings: DecodeSettings,
        tokenizer: object | None,
        on_tokens: TokenCallback | None,
        stop_check: StopCheck | None = None,
    ) -> None:
        self.history = list(prompt)
        self.prompt_length = len(prompt)
        self.settings = settings
        self.tokenizer = tokenizer
        self.on_tokens = on_tokens
        self.stop_check = stop_check
        self.done = False
        if settings.stop_strings and tokenizer is None:
            raise LayerskipError("stop strings need a tokenizer to decode text; pass tokenizer=")

    @property
    def generated(self) -> list[int]:
        return self.history[self.prompt_length :]

    @property
    def remaining(self) -> int:
        # Checked once per accepted token: count, don't slice a copy of the output.
        return self.settings.max_new_tokens - (len(self.history) - self.prompt_length)

    def emit(self, tokens: list[int]) -> int:
        """Append accepted tokens, cut at the first stop condition; returns how many were kept."""
        kept = 0
        for token in tokens:
            kept += 1
            self.history.append(token)
            # Asked after every token, whatever else ends the generation there: plain generate asks
            # its stopping criteria so, and a criterion may keep count.
            stopped = self.stop_check is not None and self.stop_check(self.history)
            if token in self.settings.eos_token_ids or self.remaining <= 0 or self._hit_stop_string() or stopped:
                self.done = True
                break
        if kept and self.on_tokens is not None:
            self.on_tokens(tokens[:kept])
        return kept

    def _hit_stop_string(self) -> bool:
        if not self.settings.stop_strings:
            return False
        text = self.tokenizer.decode(self.generated, skip_special_tokens=True)
        return any(stop in text for stop in self.settings.stop_strings)


def _generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def _as_ids(input_ids: Sequence[int] | torch.Tensor) -> list[int]:
    ids = input_ids.reshape(-1).tolist() if isinstance(input_ids, torch.Tensor) else [int(t) for t in input_ids]
    if not ids:
        raise LayerskipError("the prompt is empty; pass some text to continue")
    return ids


class Decoder:
    """Decodes with ``model``: self-speculatively with a prepared draft, plainly without one.

    ``draft`` (``drafts.prepare_draft(model, policy)``, or ``Decoder.for_policy``) is the only
    thing the loop asks about drafting; it serves any number of ``decode`` calls, and what it
    learns while generating (on-the-fly selection) carries over between them. ``threads`` (CPU
    only): "auto" picks the draft's and the verify's thread counts by their measured time (see
    ``engine.threads``; robust when the machine is busy), an int fixes both; the caller's thread
    count is restored after each call.
    """

    def __init__(
        self,
        model: nn.Module,
        draft: PreparedDraft | None = None,
        threads: int | str = "auto",
        certified_head: bool | None = None,
    ):
        self.model = model
        self.draft = draft
        self.device = next(model.parameters()).device
        self.threads = ThreadTuner(threads, self.device)
        # Greedy verifies take their argmax from a bf16 head certified against fp32 (engine/
        # verify_head.py): by default on the CPU, where the fp32 head is a large part of a step.
        self.head: VerifyHead = engine_verify_head(model, certified_head)

    @classmethod
    def for_policy(
        cls,
        model: nn.Module,
        policy: SkipPolicy | str | None,
        vocab_rows: torch.Tensor | None = None,
        threads: int | str = "auto",
        certified_head: bool | None = None,
        models: DraftModels | None = None,
        progress: bool = False,
    ) -> Decoder:
        """A decoder with ``policy``'s draft prepared for ``model`` (plain decoding without one).
        ``policy`` may be a ``--policy`` value: ``"auto"``, ``"on-the-fly"``, a file's path. An
        ``auto`` policy is priced by a calibration of this machine, measured here or read from
        the cache (``engine.calibration``)."""
        if isinstance(policy, str):
            policy = load_policy(policy, next(model.parameters()).device)[1]
        costs = None
        if policy is not None and policy.auto is not None:
            models = models if models is not None else DraftModels(model)
            start = time.perf_counter()
            models.for_policy(policy, all_sublayers=True)  # the int4 copy every draft of it runs from
            built = time.perf_counter() - start
            costs = calibrate(model, policy, models, progress=progress)
            costs.info["draft_build_seconds"] = round(built, 3)
        return cls(model, prepare_draft(model, policy, vocab_rows, models, costs), threads, certified_head)

    @property
    def draft_model(self) -> DraftModel | None:
        return None if self.draft is None else self.draft.draft_model

    @property
    def selection(self) -> SelectionState | None:
        return None if self.draft is None else self.draft.selection

    def paths(self) -> list[str]:
        """How this decoder's phases run (``GenerationStats.paths``)."""
        head = "verify head: certified bf16" if self.head.certified else "verify head: model's own"
        return [*(self.draft.paths() if self.draft is not None else []), head]

    def cache_windows(self) -> list[int | None]:
        """Per cache layer, its sliding window (a layer exit adapter adds one of its own)."""
        return adapters.sliding_windows(self.model) if self.draft is None else self.draft.cache_windows()

    def _drafter(self, prompt_length: int, settings: DecodeSettings, generator: torch.Generator | None) -> Drafter:
        if self.draft is None:
            return NoDrafter()
        return self.draft.start(DraftRun(prompt_length, settings.max_new_tokens, settings.sampling, generator))

    @torch.inference_mode()
    def decode(
        self,
        input_ids: Sequence[int] | torch.Tensor,
        settings: DecodeSettings,
        *,
        tokenizer: object | None = None,
        on_tokens: TokenCallback | None = None,
        cache_observer: CacheObserver | None = None,
        drafter: Drafter | None = None,
        logits_hook: LogitsHook | None = None,
        stop_check: StopCheck | None = None,
    ) -> tuple[list[int], GenerationStats]:
        """Generate up to ``settings.max_new_tokens`` after ``input_ids``. Returns (new tokens, stats).

        ``cache_observer(cache, committed)`` is called after every step (tests check lengths);
        ``drafter`` replaces the prepared draft's. ``logits_hook`` processes the full model's
        logits before a token is chosen (HF logits processors); ``stop_check`` ends the
        generation after a token (HF stopping criteria).
        """
        with self.threads.session():  # the caller's thread count comes back afterwards
            clock = DeviceClock(self.device)
            start = clock.now()  # everything this call does is timed, set-up included
            settings.validate()
            prompt = _as_ids(input_ids)
            output = _Output(prompt, settings, tokenizer, on_tokens, stop_check)
            generator = _generator(settings.seed, self.device)
            drafter = drafter or self._drafter(len(prompt), settings, generator)
            verifier = verifier_for(self.head, settings.sampling, generator, logits_hook)
            cache = model_cache(self.model, self.cache_windows())
            stepper = Stepper(self.model, cache, drafter, verifier, self.draft, self.threads, clock, self.device)
            fallbacks_before = self.head.stats.fallbacks
            stats = GenerationStats()
            first = stepper.prefill(prompt)
            committed = len(prompt)
            stats.prefill_seconds = clock.now() - start
            stats.record_step(0, 0)
            output.emit([first.next_token])
            if cache_observer is not None:
                cache_observer(stepper.cache, committed)
            while not output.done:
                outcome = stepper.step(output.history, committed, budget=output.remaining - 1)
                committed += 1 + outcome.verdict.accepted
                self._record(stats, drafter, outcome, kept=output.emit(outcome.tokens))
                if cache_observer is not None:
                    cache_observer(stepper.cache, committed)
            drafter.report(stats)
            self._finish(stats, fallbacks_before)
            stats.total_seconds = clock.now() - start
            stats.new_tokens = len(output.generated)
            return output.generated, stats

    @staticmethod
    def _record(stats: GenerationStats, drafter: Drafter, outcome: StepOutcome, kept: int) -> None:
        """One step's figures; the drafter learns how many of its tokens were used."""
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
        drafter.update(draft, accepted)

    def _finish(self, stats: GenerationStats, fallbacks_before: int) -> None:
        stats.thread_runs = dict(self.threads.used)
        for path in self.paths():
            stats.paths[path] = 1
        stats.head_fallback_rows = self.head.stats.fallbacks - fallbacks_before


def decode(
    model: nn.Module,
    input_ids: Sequence[int] | torch.Tensor,
    policy: SkipPolicy | None,
    settings: DecodeSettings,
    *,
    tokenizer: object | None = None,
    on_tokens: TokenCallback | None = None,
    vocab_rows: torch.Tensor | None = None,
    cache_observer: CacheObserver | None = None,
) -> tuple[list[int], GenerationStats]:
    """One generation: self-speculative with ``policy``, plain without. Returns (new tokens, stats).

    Prepares the draft on every call; to decode many prompts with one policy, build a
    ``Decoder`` once and call its ``decode``.
    """
    return Decoder.for_policy(model, policy, vocab_rows).decode(
        input_ids, settings, tokenizer=tokenizer, on_tokens=on_tokens, cache_observer=cache_observer
    )


def decode_autoregressive(
    model: nn.Module,
    input_ids: Sequence[int] | torch.Tensor,
    settings: DecodeSettings,
    *,
    tokenizer: object | None = None,
    on_tokens: TokenCallback | None = None,
) -> tuple[list[int], GenerationStats]:
    """Plain decoding: one full forward per token. Returns (new tokens, stats)."""
    return decode(model, input_ids, None, settings, tokenizer=tokenizer, on_tokens=on_tokens)


def decode_speculative(
    model: nn.Module,
    input_ids: Sequence[int] | torch.Tensor,
    policy: SkipPolicy,
    settings: DecodeSettings,
    *,
    tokenizer: object | None = None,
    on_tokens: TokenCallback | None = None,
    vocab_rows: torch.Tensor | None = None,
    cache_observer: CacheObserver | None = None,
) -> tuple[list[int], GenerationStats]:
    """Self-speculative decoding with ``policy``. Returns (new tokens, stats)."""
    return decode(
        model,
        input_ids,
        policy,
        settings,
        tokenizer=tokenizer,
        on_tokens=on_tokens,
        vocab_rows=vocab_rows,
        cache_observer=cache_observer,
    )


def generate(
    model: nn.Module,
    tokenizer: object,
    prompt: str,
    policy: SkipPolicy | str | None = None,
    *,
    max_new_tokens: int = 128,
    chat: bool = False,
    sampling: Sampling | None = None,
    seed: int | None = None,
    stop_strings: Sequence[str] = (),
    stream: TokenCallback | None = None,
    decoder: Decoder | None = None,
) -> GenerationResult:
    """Generate from text: self-speculatively with ``policy``, plainly without one.

    Greedy unless ``sampling`` is given. ``stream`` receives token ids as they are accepted.
    Pass a ``decoder`` (``Decoder.for_policy(model, policy)``) to reuse its prepared draft across calls.
    """
    ids = encode_prompt(tokenizer, prompt, chat)
    settings = DecodeSettings(
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        seed=seed,
        eos_token_ids=eos_token_ids(model, tokenizer),
        stop_strings=tuple(stop_strings),
    )
    decoder = decoder or Decoder.for_policy(model, policy)
    tokens, stats = decoder.decode(ids, settings, tokenizer=tokenizer, on_tokens=stream)
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    return GenerationResult(tokens=tokens, text=text, prompt_tokens=len(ids), stats=stats)
