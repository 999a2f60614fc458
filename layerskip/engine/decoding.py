"""The decode loops: plain autoregressive and self-speculative, greedy and sampling, batch size 1.

Self-speculative step (cache holds every token but ``pending``, the last one chosen):

    draft:   bypassed model proposes d1..dk, feeding pending, d1, .. (writes K/V only in
             layers it does not bypass)
    rollback every layer to ``committed`` (= tokens in the cache before drafting)
    verify:  full model over [pending, d1..dk] -> logits [k+1, V]
    accept:  the longest prefix d1..dn the full model agrees with, plus its own token at n
    rollback every layer to committed + 1 + n; the new pending is the full model's token

Greedy output is the full model's argmax chain; sampling uses rejection sampling, so the
output distribution is the full model's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from layerskip.engine.cache import RollbackCache
from layerskip.engine.drafters import DraftRequest, make_drafter
from layerskip.engine.forward import full_logits
from layerskip.engine.policy import SkipPolicy
from layerskip.engine.sampling import Sampling, sample, verify_sampled
from layerskip.engine.stats import DeviceClock, GenerationResult, GenerationStats
from layerskip.engine.vocab import DraftVocabulary
from layerskip.errors import LayerskipError
from layerskip.hf import adapters
from layerskip.hf.prompting import encode_prompt, eos_token_ids

TokenCallback = Callable[[list[int]], None]


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
        self, prompt: list[int], settings: DecodeSettings, tokenizer: object | None, on_tokens: TokenCallback | None
    ) -> None:
        self.history = list(prompt)
        self.prompt_length = len(prompt)
        self.settings = settings
        self.tokenizer = tokenizer
        self.on_tokens = on_tokens
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

    def emit(self, tokens: list[int]) -> bool:
        """Append accepted tokens, cut at the first stop condition; returns True when finished."""
        kept: list[int] = []
        for token in tokens:
            kept.append(token)
            self.history.append(token)
            if token in self.settings.eos_token_ids or self.remaining <= 0 or self._hit_stop_string():
                self.done = True
                break
        if kept and self.on_tokens is not None:
            self.on_tokens(kept)
        return self.done

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


def _choose(logits: torch.Tensor, sampling: Sampling | None, generator: torch.Generator | None) -> int:
    """One token from ``[V]`` logits."""
    if sampling is None:
        return int(logits.argmax())
    return int(sample(sampling.probs(logits), generator))


def _as_ids(input_ids: Sequence[int] | torch.Tensor) -> list[int]:
    ids = input_ids.reshape(-1).tolist() if isinstance(input_ids, torch.Tensor) else [int(t) for t in input_ids]
    if not ids:
        raise LayerskipError("the prompt is empty; pass some text to continue")
    return ids


def _model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


class _Begun(NamedTuple):
    prompt: list[int]
    device: torch.device
    clock: DeviceClock
    stats: GenerationStats
    output: _Output
    generator: torch.Generator | None
    cache: RollbackCache


def _begin(
    model: nn.Module,
    input_ids: Sequence[int] | torch.Tensor,
    settings: DecodeSettings,
    tokenizer: object | None,
    on_tokens: TokenCallback | None,
    policy: SkipPolicy | None = None,
) -> _Begun:
    """What both decode loops start from: checked settings (and policy), the prompt, a fresh shared cache."""
    settings.validate()
    if policy is not None:
        policy.validate_for(model)
    prompt = _as_ids(input_ids)
    device = _model_device(model)
    return _Begun(
        prompt,
        device,
        DeviceClock(device),
        GenerationStats(),
        _Output(prompt, settings, tokenizer, on_tokens),
        _generator(settings.seed, device),
        RollbackCache(adapters.sliding_windows(model)),
    )


@torch.inference_mode()
def decode_autoregressive(
    model: nn.Module,
    input_ids: Sequence[int] | torch.Tensor,
    settings: DecodeSettings,
    *,
    tokenizer: object | None = None,
    on_tokens: TokenCallback | None = None,
) -> tuple[list[int], GenerationStats]:
    """Plain decoding: one full forward per token. Returns (new tokens, stats)."""
    prompt, device, clock, stats, output, generator, cache = _begin(model, input_ids, settings, tokenizer, on_tokens)

    start = clock.now()
    ids = torch.tensor([prompt], device=device)  # [1, prompt_len]
    position = 0
    while True:
        logits = full_logits(model, ids, cache, position, keep=1)  # [1, V]
        token = _choose(logits[-1], settings.sampling, generator)
        stats.record_step(0, 0)
        if stats.steps == 1:
            stats.prefill_seconds = clock.now() - start
        else:
            stats.record_block(1)
        if output.emit([token]):
            break
        position += ids.shape[1]
        ids = torch.tensor([[token]], device=device)
    stats.total_seconds = clock.now() - start
    stats.verify_seconds = stats.total_seconds - stats.prefill_seconds
    stats.new_tokens = len(output.generated)
    return output.generated, stats


@torch.inference_mode()
def decode_speculative(
    model: nn.Module,
    input_ids: Sequence[int] | torch.Tensor,
    policy: SkipPolicy,
    settings: DecodeSettings,
    *,
    tokenizer: object | None = None,
    on_tokens: TokenCallback | None = None,
    vocab_rows: torch.Tensor | None = None,
    cache_observer: Callable[[RollbackCache, int], None] | None = None,
) -> tuple[list[int], GenerationStats]:
    """Self-speculative decoding with ``policy``. Returns (new tokens, stats).

    ``vocab_rows`` are the token ids a truncated draft head scores (None = full head);
    ``cache_observer(cache, committed)`` is called after every step (tests check lengths).
    """
    prompt, device, clock, stats, output, generator, cache = _begin(
        model, input_ids, settings, tokenizer, on_tokens, policy
    )
    drafter = make_drafter(model, policy, settings.sampling, generator, vocab_rows)
    sampling = settings.sampling
    pad_to = policy.draft.min_verify_block
    limit = adapters.max_positions(model)

    start = clock.now()
    logits = full_logits(model, torch.tensor([prompt], device=device), cache, 0, keep=1)
    first = _choose(logits[-1], sampling, generator)
    stats.record_step(0, 0)
    stats.prefill_seconds = clock.now() - start
    done = output.emit([first])
    committed = len(prompt)  # tokens in the cache; the history's last token is pending
    if cache_observer is not None:
        cache_observer(cache, committed)

    while not done:
        # The verify always adds one token of its own, so draft at most remaining - 1.
        budget = output.remaining - 1
        t0 = clock.now()
        draft = drafter.propose(DraftRequest(output.history, cache, budget)) if budget > 0 else None
        drafted = draft.tokens if draft is not None else []
        t1 = clock.now()

        cache.rollback(committed)
        block_ids = [output.history[-1], *drafted]
        if drafted and len(block_ids) < pad_to and (limit is None or committed + pad_to <= limit):
            # Filler positions after the draft: causal attention keeps them out of every
            # earlier position's logits, their own logits are dropped, their K/V rolled back.
            block_ids += [block_ids[-1]] * (pad_to - len(block_ids))
        block = torch.tensor([block_ids], device=device)  # [1, k+1 (+ fillers)]
        logits = full_logits(model, block, cache, committed, keep=block.shape[1])[: len(drafted) + 1]  # [k+1, V]
        stats.record_block(block.shape[1])
        if sampling is None:
            targets = logits.argmax(dim=-1).tolist()  # the full model's token after each block position
            accepted = 0
            while accepted < len(drafted) and drafted[accepted] == targets[accepted]:
                accepted += 1
            next_token = targets[accepted]
        else:
            q = draft.q if draft is not None else None  # no draft when one token remains
            accepted, next_token = verify_sampled(drafted, sampling.probs(logits), q, generator)
        committed += 1 + accepted
        cache.rollback(committed)
        t2 = clock.now()

        stats.draft_seconds += t1 - t0
        stats.verify_seconds += t2 - t1
        stats.record_step(len(drafted), accepted)
        if draft is not None and draft.from_lookup and drafted:
            stats.lookup_steps += 1
        drafter.update(len(drafted), accepted)
        done = output.emit([*drafted[:accepted], next_token])
        if cache_observer is not None:
            cache_observer(cache, committed)

    stats.total_seconds = clock.now() - start
    stats.new_tokens = len(output.generated)
    return output.generated, stats


def decode(
    model: nn.Module,
    input_ids: Sequence[int] | torch.Tensor,
    policy: SkipPolicy | None,
    settings: DecodeSettings,
    *,
    vocabulary: DraftVocabulary | None = None,
    vocab_rows: torch.Tensor | None = None,
    tokenizer: object | None = None,
    on_tokens: TokenCallback | None = None,
) -> tuple[list[int], GenerationStats]:
    """Plain decoding without a policy, self-speculative with one.

    A truncated draft head scores ``vocab_rows``, or else the rows ``vocabulary`` picks for the
    policy and this prompt.
    """
    if policy is None:
        return decode_autoregressive(model, input_ids, settings, tokenizer=tokenizer, on_tokens=on_tokens)
    if vocab_rows is None and vocabulary is not None:
        vocab_rows = vocabulary.rows_for(policy, _as_ids(input_ids))
    return decode_speculative(
        model, input_ids, policy, settings, tokenizer=tokenizer, on_tokens=on_tokens, vocab_rows=vocab_rows
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
    vocab_rows: torch.Tensor | None = None,
) -> GenerationResult:
    """Generate from text: self-speculatively with ``policy``, plainly without one.

    Greedy unless ``sampling`` is given. ``stream`` receives token ids as they are accepted.
    """
    ids = encode_prompt(tokenizer, prompt, chat)
    settings = DecodeSettings(
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        seed=seed,
        eos_token_ids=eos_token_ids(model, tokenizer),
        stop_strings=tuple(stop_strings),
    )
    vocabulary = None
    if policy is not None and vocab_rows is None and policy.draft.draft_vocab_size:
        vocabulary = DraftVocabulary.builtin(tokenizer, model)
    tokens, stats = decode(
        model,
        ids,
        policy,
        settings,
        vocabulary=vocabulary,
        vocab_rows=vocab_rows,
        tokenizer=tokenizer,
        on_tokens=stream,
    )
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    return GenerationResult(tokens=tokens, text=text, prompt_tokens=len(ids), stats=stats)
