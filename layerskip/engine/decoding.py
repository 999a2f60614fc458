"""The decode loop, batch size 1: self-speculative with a drafter, plain with none; greedy or sampling.

One step (the cache holds every token but ``pending``, the last one chosen):

    draft:   the drafter proposes d1..dk (a skip draft feeds pending, d1, .. through the
             bypassed model, writing K/V only in layers it does not bypass; lookup reads the
             history; plain decoding proposes nothing)
    rollback every layer to ``committed`` (= tokens in the cache before drafting)
    verify:  full model over [pending, d1..dk] -> logits [k+1, V]
    accept:  the longest prefix d1..dn the full model agrees with, plus its own token at n
    rollback every layer to committed + 1 + n; the new pending is the full model's token

Greedy output is the full model's argmax chain; sampling uses rejection sampling, so the
output distribution is the full model's. Plain decoding is the same loop with a drafter that
proposes nothing (blocks of one token).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from layerskip.drafts.base import Draft, Drafter, DraftRequest, NoDrafter
from layerskip.drafts.builder import DraftRun, PreparedDraft, prepare_draft
from layerskip.drafts.model import DraftModel
from layerskip.drafts.onthefly import SelectionState
from layerskip.drafts.policy import SkipPolicy
from layerskip.engine.threads import ThreadTuner
from layerskip.engine.verify_head import VerifyHead, shared_verify_head
from layerskip.errors import LayerskipError
from layerskip.hf import adapters
from layerskip.hf.cache import RollbackCache
from layerskip.hf.forward import full_hidden
from layerskip.hf.prompting import encode_prompt, eos_token_ids
from layerskip.sampling import Sampling, accept_greedy, verify_greedy, verify_sampled
from layerskip.stats import DeviceClock, GenerationResult, GenerationStats

TokenCallback = Callable[[list[int]], None]
CacheObserver = Callable[[RollbackCache, int], None]
# (context, logits [k+1, V]) -> processed logits [k+1, V]; row i follows context[: len(context) - k + i].
# Applied to the verify's logits only: the draft proposes from its own, so the output stays exact.
LogitsHook = Callable[[list[int], torch.Tensor], torch.Tensor]
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


def engine_verify_head(model: nn.Module, certified: bool | None = None) -> VerifyHead:
    """The verify head the engine uses for ``model``: by default certified on the CPU (where the
    fp32 head is a large part of every step), the model's own head elsewhere."""
    if certified is None:
        certified = next(model.parameters()).device.type == "cpu"
    return shared_verify_head(model, certified)


class Decoder:
    """Decodes with ``model``: self-speculatively with ``policy``, plainly without one.

    Built once per model and policy: ``drafts.prepare_draft`` checks the policy against the
    model and prepares the draft (a low-precision copy of the projections it keeps, if the
    policy asks for one); the decoder then serves any number of ``decode`` calls. ``vocab_rows``
    overrides the truncated draft head's starting rows (default: the policy's). A policy with
    ``on_the_fly`` settings gets its skip sets re-chosen while generating; what that learns
    (``selection``) carries over between calls. ``threads`` (CPU only): "auto" picks the
    draft's and the verify's thread counts by their measured time (see ``engine.threads``;
    robust when the machine is busy), an int fixes both; the caller's thread count is restored
    after each call.
    """

    def __init__(
        self,
        model: nn.Module,
        policy: SkipPolicy | None = None,
        vocab_rows: torch.Tensor | None = None,
        threads: int | str = "auto",
        certified_head: bool | None = None,
    ):
        self.model = model
        self.policy = policy
        self.device = next(model.parameters()).device
        self.threads = ThreadTuner(threads, self.device)
        self.draft: PreparedDraft | None = prepare_draft(model, policy, vocab_rows)
        # Greedy verifies take their argmax from a bf16 head certified against fp32 (engine/
        # verify_head.py): by default on the CPU, where the fp32 head is a large part of a step.
        self.head: VerifyHead = engine_verify_head(model, certified_head)

    @property
    def draft_model(self) -> DraftModel | None:
        return None if self.draft is None else self.draft.draft_model

    @property
    def selection(self) -> SelectionState | None:
        return None if self.draft is None else self.draft.selection

    def paths(self) -> list[str]:
        """How this decoder's phases run (``GenerationStats.paths``)."""
        head = "verify head: certified bf16" if self.head.certified else "verify head: model's own"
        if self.draft_model is None:
            return [head]
        compiled = "yes" if self.draft_model.compile else "no"
        return [f"draft step: {self.draft_model.step_kind}", f"draft compiled: {compiled}", head]

    def cache_windows(self) -> list[int | None]:
        """Per cache layer, its sliding window (a layer exit adapter adds one of its own)."""
        return adapters.sliding_windows(self.model) if self.draft is None else self.draft.cache_windows()

    def _drafter(self, prompt_length: int, settings: DecodeSettings, generator: torch.Generator | None) -> Drafter:
        if self.draft is None:
            return NoDrafter()
        return self.draft.drafter(DraftRun(prompt_length, settings.max_new_tokens, settings.sampling, generator))

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
        ``drafter`` replaces the policy's (on-the-fly selection passes its own). ``logits_hook``
        processes the full model's logits before a token is chosen (HF logits processors);
        ``stop_check`` ends the generation after a token (HF stopping criteria).
        """
        with self.threads.session():  # the caller's thread count comes back afterwards
            clock = DeviceClock(self.device)
            start = clock.now()  # everything this call does is timed, set-up included
            settings.validate()
            prompt = _as_ids(input_ids)
            stats = GenerationStats()
            output = _Output(prompt, settings, tokenizer, on_tokens, stop_check)
            generator = _generator(settings.seed, self.device)
            cache = RollbackCache(self.cache_windows())
            fallbacks_before = self.head.stats.fallbacks
            drafter = drafter or self._drafter(len(prompt), settings, generator)
            sampling = settings.sampling
            pad_to = self.policy.draft.min_verify_block if self.policy is not None else 0
            limit = adapters.max_positions(self.model)

            committed = 0  # tokens in the cache; the history's last token is pending
            block_ids = prompt  # the prefill is the first verify, with nothing drafted
            draft = None
            while True:
                t0 = clock.now()
                block = torch.tensor([block_ids], device=self.device)  # [1, prompt] or [1, k+1 (+ fillers)]
                drafted = draft.tokens if draft is not None else []
                keep = 1 if draft is None else len(block_ids)
                with (
                    self.threads.phase("verify") as run,
                    drafter.watch_verify(len(block_ids)),
                    drafter.around_verify(cache, committed, block),
                ):
                    run.units = 0 if draft is None else 1  # the prefill teaches nothing about a step
                    hidden = full_hidden(self.model, block, cache, committed, keep)[: len(drafted) + 1]  # [k+1, H]
                    if sampling is None and logits_hook is None:
                        # Greedy needs only each row's argmax: the certified head gives it.
                        accepted, next_token = accept_greedy(drafted, self.head.argmax(hidden))
                    else:
                        logits = self.head.logits(hidden)  # [k+1, V]
                if logits_hook is not None:
                    logits = logits_hook([*output.history, *drafted], logits)
                if sampling is None and logits_hook is not None:
                    accepted, next_token = verify_greedy(drafted, logits)
                elif sampling is not None:
                    q = draft.q if draft is not None else None
                    accepted, next_token = verify_sampled(drafted, sampling.probs(logits), q, generator)
                committed += (len(prompt) if draft is None else 1) + accepted
                cache.rollback(committed)
                t1 = clock.now()
                kept = output.emit([*drafted[:accepted], next_token])
                accepted = min(accepted, kept)  # drafts past an EOS or the budget were not used
                if draft is None:
                    stats.prefill_seconds = t1 - start
                    stats.record_step(0, 0)
                else:
                    stats.verify_seconds += t1 - t0
                    stats.record_step(len(drafted), accepted)
                    stats.record_block(len(block_ids))
                    if draft.from_lookup and drafted:
                        stats.lookup_steps += 1
                    drafter.update(draft, accepted)
                if cache_observer is not None:
                    cache_observer(cache, committed)
                if output.done:
                    break

                # The verify always adds one token of its own, so draft at most remaining - 1.
                t2 = clock.now()
                budget = output.remaining - 1
                request = DraftRequest(output.history, cache, budget, self.device)
                if budget > 0:
                    with self.threads.phase("draft") as run:
                        draft = drafter.propose(request)
                        # forwards run ~ tokens proposed (a draft that stopped at once still ran one);
                        # a lookup or an empty plain draft ran none and teaches nothing
                        run.units = max(1, len(draft.tokens)) if draft.source == "skip" else 0
                else:
                    draft = Draft([])
                if draft.source != "none":  # plain decoding drafts nothing: its loop time is "other"
                    stats.draft_seconds += clock.now() - t2
                cache.rollback(committed)
                block_ids = [output.history[-1], *draft.tokens]
                if draft.tokens and len(block_ids) < pad_to and (limit is None or committed + pad_to <= limit):
                    # Filler positions after the draft: causal attention keeps them out of every
                    # earlier position's logits, their logits are dropped, their K/V rolled back.
                    block_ids += [block_ids[-1]] * (pad_to - len(block_ids))

            drafter.report(stats)
            stats.thread_runs = dict(self.threads.used)
            for path in self.paths():
                stats.paths[path] = 1
            stats.head_fallback_rows = self.head.stats.fallbacks - fallbacks_before
            stats.total_seconds = clock.now() - start
            stats.new_tokens = len(output.generated)
            return output.generated, stats


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
    return Decoder(model, policy, vocab_rows).decode(
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
    policy: SkipPolicy | None = None,
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
    Pass a prepared ``decoder`` (``Decoder(model, policy)``) to reuse its draft across calls.
    """
    ids = encode_prompt(tokenizer, prompt, chat)
    settings = DecodeSettings(
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        seed=seed,
        eos_token_ids=eos_token_ids(model, tokenizer),
        stop_strings=tuple(stop_strings),
    )
    decoder = decoder or Decoder(model, policy)
    tokens, stats = decoder.decode(ids, settings, tokenizer=tokenizer, on_tokens=stream)
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    return GenerationResult(tokens=tokens, text=text, prompt_tokens=len(ids), stats=stats)
