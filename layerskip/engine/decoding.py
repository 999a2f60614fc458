"""The decoder: self-speculative with a prepared draft, plain with none; greedy or sampling.

Every generation is a batch (``engine.step.Stepper``: propose, verify, accept, keep); one prompt
is a batch of one row. Greedy output is the full model's argmax chain; sampling uses rejection
sampling, so the output distribution is the full model's. Plain decoding is the same loop with a
drafter that proposes nothing (blocks of one token).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence, Sized
from dataclasses import replace

import torch
from torch import nn

from layerskip.drafts.base import Drafter, NoDrafter
from layerskip.drafts.builder import (
    AUTO,
    PLAIN,
    DraftCosts,
    DraftModel,
    DraftModels,
    DraftRun,
    PreparedDraft,
    SelectionState,
    SkipPolicy,
    load_policy,
    prepare_draft,
)
from layerskip.engine.calibration import prepare_calibration
from layerskip.engine.output import CacheObserver, DecodeSettings, StopCheck, TokenCallback, TokenOutput, prompt_ids
from layerskip.engine.step import Row, StepObserver, Stepper
from layerskip.engine.step_kinds import StepKinds, priced, step_kinds
from layerskip.engine.threads import ThreadTuner
from layerskip.engine.verifiers import LogitsHook, verifier_for
from layerskip.engine.verify_head import VerifyHead, engine_verify_head
from layerskip.errors import LayerskipError
from layerskip.hf import adapters
from layerskip.hf.cache import model_cache
from layerskip.hf.prompting import encode_prompt, eos_token_ids
from layerskip.sampling import Sampling
from layerskip.stats import DeviceClock, GenerationResult, GenerationStats


def check_batch(prompts: Sized) -> None:
    """A batch holds at least one prompt (an empty one used to end in ``max()`` of nothing)."""
    if len(prompts) == 0:  # len(): a tensor of prompts has no truth value
        raise LayerskipError("no prompts given: the batch is empty; pass at least one prompt")


def check_fits(model: nn.Module, prompt_tokens: int, new_tokens: int, what: str = "the prompt") -> None:
    """Refuse a prompt that, with the tokens to generate, runs past the model's positions: past
    them, rotary models write garbage (plain ``generate`` only warns) and learned-position models
    (GPT-2) fail with an IndexError. Every decode checks it; tools that also run HF's ``generate``
    on the same prompt (``--compare``, the bench) call it first."""
    limit = adapters.max_positions(model)
    if limit is not None and prompt_tokens + new_tokens > limit:
        raise LayerskipError(
            f"{what} has {prompt_tokens} tokens; with {new_tokens} new tokens that is {prompt_tokens + new_tokens}, "
            f"past the model's {limit} positions; shorten the prompt or lower the number of new tokens"
        )


class Decoder:
    """Decodes with ``model``: self-speculatively with a prepared draft, plainly without one
    (``Decoder(model)``; ``Decoder.for_policy(model)`` prepares ``auto``'s draft).

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
        # Each batch size's step kinds and their measured rates, carried from one batch to the next
        # (a dataset decoded batch after batch starts each batch from what the last one measured).
        self.batch_rates: dict[tuple[int, bool, tuple[str, ...]], StepKinds] = {}

    @classmethod
    def for_policy(
        cls,
        model: nn.Module,
        policy: SkipPolicy | str | None = AUTO,
        vocab_rows: torch.Tensor | None = None,
        threads: int | str = "auto",
        certified_head: bool | None = None,
        models: DraftModels | None = None,
        progress: bool = False,
        costs: DraftCosts | None = None,
    ) -> Decoder:
        """A decoder with ``policy``'s draft prepared for ``model``. ``policy`` may be a
        ``--policy`` value: ``"auto"`` (the default, as on the command line), ``"on-the-fly"``, a
        file's path, or ``"plain"`` (or None) for plain decoding. An ``auto`` policy is priced by
        ``costs``, a calibration of this machine prepared apart
        (``engine.calibration.prepare_calibration``); without one it is prepared here first,
        measured or read from the cache, and then handed to the draft."""
        if policy == PLAIN:
            policy = None
        elif isinstance(policy, str):
            policy = load_policy(policy, next(model.parameters()).device, "policy=")[1]
        models = models if models is not None else DraftModels(model)
        if costs is None:
            costs = prepare_calibration(model, policy, models, progress)
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

    def _drafter(
        self, prompt_length: int, settings: DecodeSettings, generator: torch.Generator | None, dense: bool
    ) -> Drafter:
        if self.draft is None:
            return NoDrafter()
        run = DraftRun(prompt_length, settings.max_new_tokens, settings.sampling, generator, dense)
        return self.draft.start(run)

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
        """Generate up to ``settings.max_new_tokens`` after ``input_ids``, stopping at an EOS id
        (``DecodeSettings.eos_token_ids``): ``decode_batch`` of one prompt. Returns (new tokens, stats).

        ``cache_observer(cache, committed)`` is called after every step (tests check lengths);
        ``drafter`` replaces the prepared draft's. ``logits_hook`` processes the full model's
        logits before a token is chosen (HF logits processors); ``stop_check`` ends the
        generation after a token (HF stopping criteria).
        """
        observer = None if cache_observer is None else lambda cache, lengths: cache_observer(cache, lengths[0])
        (result,) = self.decode_batch(
            [input_ids],
            settings,
            tokenizer=tokenizer,
            logits_hooks=[logits_hook],
            stop_checks=[stop_check],
            on_tokens=[on_tokens],
            drafters=None if drafter is None else [drafter],
            step_observer=observer,
        )
        return result

    @torch.inference_mode()
    def decode_batch(
        self,
        prompts: Sequence[Sequence[int] | torch.Tensor],
        settings: DecodeSettings,
        *,
        tokenizer: object | None = None,
        logits_hooks: Sequence[LogitsHook | None] | None = None,
        stop_checks: Sequence[StopCheck | None] | None = None,
        on_tokens: Sequence[TokenCallback | None] | None = None,
        drafters: Sequence[Drafter] | None = None,
        step_observer: StepObserver | None = None,
    ) -> list[tuple[list[int], GenerationStats]]:
        """Generate after each of ``prompts`` together (``engine.step``): one verify forward per step
        for all rows. Returns (new tokens, stats) per prompt, in order; each row's output is what it
        would be alone. With a seed, row ``i`` samples from its own generator seeded ``seed + i``.
        ``on_tokens[i]`` receives row i's tokens as they are accepted; ``drafters`` replace the
        prepared draft's, one per row; ``step_observer(cache, committed lengths)`` is called after
        every step."""
        settings.validate()
        if settings.eos_token_ids is None:  # the model's own, as HF's generate stops at (its generation config's)
            settings = replace(settings, eos_token_ids=eos_token_ids(self.model))
        check_batch(prompts)
        ids = [prompt_ids(prompt) for prompt in prompts]
        # Every row before any decodes (a batch's row i is "prompt i + 1", as the CLI counts them).
        for index, row in enumerate(ids):
            what = "the prompt" if len(ids) == 1 else f"prompt {index + 1}"
            check_fits(self.model, len(row), settings.max_new_tokens, what)

        def each(values: Sequence[object] | None) -> list[object]:
            return list(values) if values is not None else [None] * len(ids)

        rows = list(zip(ids, each(logits_hooks), each(stop_checks), each(on_tokens), strict=True))
        return self._decode_rows(rows, settings, tokenizer, drafters, step_observer)

    def _decode_rows(
        self,
        prompts: list[tuple[list[int], LogitsHook | None, StopCheck | None, TokenCallback | None]],
        settings: DecodeSettings,
        tokenizer: object | None,
        drafters: Sequence[Drafter] | None,
        step_observer: StepObserver | None,
    ) -> list[tuple[list[int], GenerationStats]]:
        """``prompts`` (ids, logits hook, stop check, token callback each) decoded as one batch."""
        with self.threads.session():  # the caller's thread count comes back afterwards
            clock = DeviceClock(self.device)
            start = clock.now()  # everything this call does is timed, set-up included
            fallbacks_before = self.head.stats.fallbacks
            ids = [prompt for prompt, *_ in prompts]
            seed = settings.seed
            generators = [
                None if seed is None else torch.Generator(self.device).manual_seed(seed + index)
                for index in range(len(ids))
            ]
            verifiers = [
                verifier_for(self.head, settings.sampling, generator, hook)
                for generator, (_, hook, _, _) in zip(generators, prompts, strict=True)
            ]
            # One row reading every logit makes the batch's verify read them for all (verify_rows).
            dense = any(verifier.needs_logits for verifier in verifiers)
            rows = [
                Row(
                    index,
                    TokenOutput(prompt, settings, tokenizer, stream, stop),
                    drafters[index] if drafters is not None else self._drafter(len(prompt), settings, generator, dense),
                    verifier,
                    generator,
                )
                for index, ((prompt, _, stop, stream), verifier, generator) in enumerate(
                    zip(prompts, verifiers, generators, strict=True)
                )
            ]
            lookup = None if self.draft is None else self.draft.lookup_drafter()
            run = DraftRun(max(len(p) for p in ids), settings.max_new_tokens, settings.sampling, None)
            # One lean product drafting for every row: built where there are rows to share it, and
            # not for a tree policy (it drafts chains; the rows' own drafters draft the trees).
            shared = self.draft is not None and len(rows) > 1 and not self.draft.policy.draft.uses_trees
            batch_draft = self.draft.batch_draft(run, ids) if shared else None
            has_draft = self.draft is not None or drafters is not None

            def menu_for(size: int) -> StepKinds:
                return self._step_kinds(size, settings, has_draft, lookup is not None, batch_draft is not None, dense)

            cache = model_cache(self.model, self.cache_windows(), rows=len(rows))
            stepper = Stepper(
                self.model,
                cache,
                rows,
                menu_for,
                lookup,
                self.threads,
                clock,
                self.device,
                batch_draft=batch_draft,
                prepared=self.draft,
                started=start,
                observer=step_observer,
            )
            results = []
            for row in stepper.run():
                row.drafter.report(row.stats)
                row.stats.thread_runs = dict(self.threads.used)
                row.stats.paths.update(dict.fromkeys(self.paths(), 1))
                row.stats.head_fallback_rows = self.head.stats.fallbacks - fallbacks_before
                row.stats.new_tokens = len(row.output.generated)
                if len(rows) > 1:
                    row.stats.batch_steps = dict(stepper.steps)
                results.append((row.output.generated, row.stats))
            return results

    def _step_kinds(
        self, rows: int, settings: DecodeSettings, has_draft: bool, has_lookup: bool, batch_draft: bool, dense: bool
    ) -> StepKinds:
        """The menu of a batch of ``rows``, with the rates the last batch of that size measured
        (``dense``: some row's verify reads every logit, which prices every verify dearer)."""
        menu = step_kinds(rows, has_draft, has_lookup, batch_draft)
        key = (rows, settings.sampling is None, dense, menu.kinds)
        if key not in self.batch_rates and self.draft is not None and self.draft.auto is not None:
            prices = self.draft.auto.step_prices(dense)  # at the head size batch_draft chose
            if prices is not None:
                menu.prices, menu.pricer, menu.rows = priced(prices, menu.kinds, rows), prices, rows
        return self.batch_rates.setdefault(key, menu)  # the rates the last such batch measured


def decode(
    model: nn.Module,
    input_ids: Sequence[int] | torch.Tensor,
    policy: SkipPolicy | str | None,
    settings: DecodeSettings,
    *,
    tokenizer: object | None = None,
    on_tokens: TokenCallback | None = None,
    vocab_rows: torch.Tensor | None = None,
    cache_observer: CacheObserver | None = None,
) -> tuple[list[int], GenerationStats]:
    """One generation from token ids: self-speculative with ``policy`` (a ``Decoder.for_policy``
    value), plain with ``"plain"`` or None. Returns (new tokens, stats).

    Prepares the draft on every call; to decode many prompts with one policy, build a
    ``Decoder`` once and call its ``decode``.
    """
    return Decoder.for_policy(model, policy, vocab_rows).decode(
        input_ids, settings, tokenizer=tokenizer, on_tokens=on_tokens, cache_observer=cache_observer
    )


def generate(
    model: nn.Module,
    tokenizer: object,
    prompt: str | Sequence[str],
    policy: SkipPolicy | str | None = AUTO,
    *,
    max_new_tokens: int = 128,
    chat: bool = False,
    sampling: Sampling | None = None,
    seed: int | None = None,
    stop_strings: Sequence[str] = (),
    stream: TokenCallback | None = None,
    decoder: Decoder | None = None,
) -> GenerationResult | list[GenerationResult]:
    """Generate from text, self-speculatively with ``policy``: ``"auto"`` by default (as the command
    line and the plug-in), a ``SkipPolicy``, or any ``--policy`` value; ``"plain"`` (or None) decodes
    plainly. Stops at the model's or the tokenizer's EOS.

    Greedy unless ``sampling`` is given. ``stream`` receives token ids as they are accepted.
    Pass a ``decoder`` (``Decoder.for_policy(model, policy)``) to reuse its prepared draft across
    calls. A list of prompts is decoded together (``Decoder.decode_batch``) and gives a list of
    results, in order; streaming takes one prompt.
    """
    settings = DecodeSettings(max_new_tokens, sampling, seed, eos_token_ids(model, tokenizer), tuple(stop_strings))
    one = isinstance(prompt, str)
    texts = [prompt] if one else _texts(prompt)
    check_batch(texts)
    if stream is not None and not one:
        raise LayerskipError("stream= takes one prompt; pass a string, or drop stream= for a list")
    # Every refusal of the input comes before a draft is prepared: auto's may calibrate first.
    settings.validate()
    ids = [encode_prompt(tokenizer, text, chat) for text in texts]
    for index, row in enumerate(ids):
        check_fits(model, len(row), max_new_tokens, "the prompt" if one else f"prompt {index + 1}")
    decoder = decoder or Decoder.for_policy(model, policy)
    results = decoder.decode_batch(ids, settings, tokenizer=tokenizer, on_tokens=[stream] * len(ids))
    outputs = [
        GenerationResult(
            tokens=tokens, text=tokenizer.decode(tokens, skip_special_tokens=True), prompt_tokens=len(row), stats=stats
        )
        for row, (tokens, stats) in zip(ids, results, strict=True)
    ]
    return outputs[0] if one else outputs


def _texts(prompts: object) -> list[str]:
    """A list of prompts as texts. Anything but a str reaches no tokenizer: bytes or a number there
    is a transformers traceback, and a None was taken for an empty prompt."""
    if isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Iterable):
        raise LayerskipError(f"the prompt is {_kind(prompts)}, not text; pass a str, or a list of str")
    texts = list(prompts)
    for index, text in enumerate(texts):
        if not isinstance(text, str):
            raise LayerskipError(f"prompt {index + 1} is {_kind(text)}, not text; pass every prompt as a str")
    return texts


def _kind(value: object) -> str:
    return "None" if value is None else f"of type {type(value).__name__}"
