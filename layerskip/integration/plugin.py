"""Self-speculative decoding from ``model.generate()``: transformers' ``custom_generate`` plug-in.

Two entry points, both ending in our engine (``Decoder.decode_batch``: one prompt is a batch of one):

- ``self_speculative_generate``, the callable form (``custom_generate=<callable>``):
  ``generate`` prepares everything (config, processors, stopping criteria, cache) and calls it
  in place of its own decoding loop. transformers 5.x passes such a callable neither the
  ``streamer`` nor the ``tokenizer`` (they are dropped for callables), so streaming and
  ``stop_strings`` need the directory form.
- ``generate``, the directory form (``custom_generate=custom_generate_path()``, loaded by
  transformers from ``custom_generate/generate.py``): it receives every ``generate`` argument
  as given and hands them back to ``generate`` with the callable, carrying the streamer and
  the tokenizer across itself. So both forms share transformers' own argument handling.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.generation import GenerateDecoderOnlyOutput

from layerskip.engine.decoding import DecodeSettings, check_batch
from layerskip.engine.output import StopCheck
from layerskip.engine.verifiers import LogitsHook
from layerskip.errors import LayerskipError
from layerskip.integration.decoders import PolicySpec, decoder_for
from layerskip.integration.generate_args import UNSUPPORTED, EngineCall, RowProcessors, engine_calls
from layerskip.stats import GenerationStats


def custom_generate_path() -> str:
    """The directory to pass as ``model.generate(custom_generate=..., trust_remote_code=True)``.

    It ships inside the package (``custom_generate/generate.py`` as transformers expects), so
    nothing has to be copied by hand.
    """
    return str(Path(__file__).parent / "custom_generate")


@dataclass
class SelfSpeculativeOutput(GenerateDecoderOnlyOutput):
    """``return_dict_in_generate=True``: ``sequences`` as plain ``generate``, plus our engine's record."""

    stats: GenerationStats | None = None
    mean_accepted: float | None = None  # tokens per full-model forward (tau)
    acceptance_rate: float | None = None  # accepted drafts / drafted
    skip_sets: dict[str, int] | None = None  # on-the-fly selection: steps drafted with each bypassed set


class ScoreRecorder:
    """``output_scores`` / ``output_logits``: generate's per-token record, kept for the tokens we emit;
    ``scores`` / ``logits`` hold one ``[1, V]`` float32 row per token.

    Each verify scores every position of its block at once. The recorder sits in the logits hook
    (it sees the block's raw logits and turns them into generate's processed scores: processors,
    then the sampling warpers) and in the token callback (it learns how many of the block's
    positions became output tokens: row j of the block chose token j). So token t's record is the
    full model's logits at the position that chose it, as plain ``generate`` records them; the
    values agree with plain ``generate``'s to float rounding (a block forward is not a one-token
    forward).
    """

    def __init__(self, hook: LogitsHook | None, warpers: list[object], padding: list[int]) -> None:
        self.hook = hook
        self.warpers = RowProcessors(tuple(warpers), tuple(padding)) if warpers else None
        self.scores: list[torch.Tensor] = []
        self.logits: list[torch.Tensor] = []
        self._block: tuple[torch.Tensor, torch.Tensor] | None = None  # (raw, scores) of the last verify

    def process(self, context: list[int], logits: torch.Tensor) -> torch.Tensor:
        """The logits hook: what the engine chooses from is unchanged; the block is kept for the record."""
        raw = logits.to(torch.float32)
        processed = raw if self.hook is None else self.hook(context, logits)
        scores = processed if self.warpers is None else self.warpers(context, processed)
        self._block = (raw, scores)
        return processed

    def so_far(self, new_tokens: int) -> tuple[torch.Tensor, ...]:
        """The scores of the first ``new_tokens`` tokens while the engine is still choosing from the
        last block: the tokens before it are recorded, the rest are the block's first rows (what a
        stopping criterion sees after each token, before the block's tokens are handed on)."""
        recorded = tuple(self.scores)
        extra = new_tokens - len(recorded)
        if extra <= 0:
            return recorded[:new_tokens]
        assert self._block is not None
        scores = self._block[1]
        return recorded + tuple(scores[j : j + 1] for j in range(extra))

    def on_tokens(self, tokens: list[int]) -> None:
        """The token callback: the first ``len(tokens)`` rows of the last block chose them."""
        assert self._block is not None
        raw, scores = self._block
        self.logits.extend(raw[j : j + 1] for j in range(len(tokens)))
        self.scores.extend(scores[j : j + 1] for j in range(len(tokens)))


def self_speculative_generate(
    model: nn.Module,
    input_ids: torch.Tensor,
    logits_processor: Sequence[object],
    stopping_criteria: Sequence[object],
    generation_config: Any,
    synced_gpus: bool = False,
    streamer: Any = None,
    skip_policy: PolicySpec | None = "auto",
    stop_strings: str | Sequence[str] | None = None,
    tokenizer: object | None = None,
    **model_kwargs: Any,
) -> torch.Tensor | SelfSpeculativeOutput:
    """``generate``'s decoding loop, replaced: self-speculatively with ``skip_policy``; a batch's rows
    are decoded together (``Decoder.decode_batch``), each giving what it would give alone.

    ``skip_policy``: ``"auto"`` (the default: no study, no file), a policy file, a ``SkipPolicy``,
    ``"on-the-fly"`` or ``"on-the-fly:PATH"``.
    The names after ``streamer`` are ours: transformers passes a callable's extra keyword
    arguments from the ``generate`` call to it.
    """
    try:
        check_batch(input_ids)  # the engine's check, before a draft is prepared for no row
        if synced_gpus:
            raise LayerskipError(f"synced_gpus {UNSUPPORTED}")
        if streamer is not None and input_ids.shape[0] > 1:
            raise LayerskipError(
                f"a streamer with {input_ids.shape[0]} sequences {UNSUPPORTED} (HF streamers take one)"
            )
        calls = engine_calls(
            input_ids,
            logits_processor,
            stopping_criteria,
            generation_config,
            model_kwargs,
            stop_strings,
            tokenizer,
        )
        decoder = decoder_for(model, skip_policy)
        record = generation_config.return_dict_in_generate and (
            generation_config.output_scores or generation_config.output_logits
        )
        recorders = [ScoreRecorder(call.logits_hook, call.warpers, call.padding) if record else None for call in calls]
        # Stopping criteria get the scores so far only where plain generate keeps them (output_scores).
        output_scores = bool(record and generation_config.output_scores)
        # A streamer and a score record take a batch of one (engine_calls refuses more rows).
        rows = [_row(call, streamer, recorder, output_scores) for call, recorder in zip(calls, recorders, strict=True)]
        results = decoder.decode_batch(
            [call.prompt for call in calls],
            calls[0].settings,
            logits_hooks=[hook for hook, _, _ in rows],
            stop_checks=[stop for _, stop, _ in rows],
            on_tokens=[listen for _, _, listen in rows],
        )
    finally:
        if streamer is not None:  # also on an error, so a reader of a TextIteratorStreamer is released
            streamer.end()
    sequences = _sequences(input_ids, [tokens for tokens, _ in results], generation_config, calls[0].settings)
    if not generation_config.return_dict_in_generate:
        return sequences
    stats = GenerationStats.combined([row_stats for _, row_stats in results])
    recorder = recorders[0]  # scores are recorded for a batch of one only (engine_calls)
    return SelfSpeculativeOutput(
        sequences=sequences,
        scores=tuple(recorder.scores) if recorder is not None and generation_config.output_scores else None,
        logits=tuple(recorder.logits) if recorder is not None and generation_config.output_logits else None,
        stats=stats,
        mean_accepted=stats.mean_accepted,
        acceptance_rate=stats.acceptance_rate,
        skip_sets=dict(stats.skip_sets),
    )


def _row(
    call: EngineCall, streamer: Any, recorder: ScoreRecorder | None, output_scores: bool
) -> tuple[LogitsHook | None, StopCheck | None, Callable[[list[int]], None] | None]:
    """One row's logits hook, stop check and token listener: accepted tokens go to the streamer
    and the score record, whose processing stands in for the row's hook."""
    listeners: list[Callable[[list[int]], None]] = []
    if recorder is not None:
        listeners.append(recorder.on_tokens)
    if streamer is not None:
        listeners.append(lambda tokens: streamer.put(torch.tensor(tokens)))

    def on_tokens(tokens: list[int]) -> None:
        for listener in listeners:
            listener(tokens)

    hook = recorder.process if recorder is not None else call.logits_hook
    stop = call.stop_check(recorder.so_far if recorder is not None and output_scores else None)
    return hook, stop, on_tokens if listeners else None


def _sequences(
    input_ids: torch.Tensor, outputs: list[list[int]], config: Any, settings: DecodeSettings
) -> torch.Tensor:
    """Each input row followed by its new tokens; a row that ended first is padded, as generate pads it."""
    longest = max(len(tokens) for tokens in outputs)
    if any(len(tokens) < longest for tokens in outputs):
        pad = getattr(config, "_pad_token_tensor", None)  # generate's own choice (the EOS id if unset)
        if not settings.eos_token_ids or pad is None:
            # Without an EOS id generate does not pad a stopped row: it keeps generating it.
            raise LayerskipError(
                f"rows that stop at different lengths without eos_token_id and pad_token_id {UNSUPPORTED}"
            )
        outputs = [tokens + [int(pad)] * (longest - len(tokens)) for tokens in outputs]
    new = torch.tensor(outputs, dtype=input_ids.dtype, device=input_ids.device).reshape(len(outputs), longest)
    return torch.cat([input_ids, new], dim=1)


def generate(model: nn.Module, **arguments: Any) -> torch.Tensor | SelfSpeculativeOutput:
    """The directory form's entry: every ``generate`` argument, as the caller gave it."""
    if arguments.get("assistant_model") is not None:
        raise LayerskipError(f"assistant_model {UNSUPPORTED}: it drafts by itself")
    if arguments.get("synced_gpus"):  # generate drops it on the way to a callable
        raise LayerskipError(f"synced_gpus {UNSUPPORTED}")
    # Carried past generate, which would drop them before calling the loop (see the module doc).
    carried: dict[str, Any] = {"streamer": arguments.get("streamer"), "tokenizer": arguments.pop("tokenizer", None)}
    config = arguments.get("generation_config") or model.generation_config
    if arguments.get("stop_strings") is None and getattr(config, "stop_strings", None):
        # Stop strings from a config: generate would look for a tokenizer it no longer has.
        config = copy.deepcopy(config)
        arguments["stop_strings"], config.stop_strings = config.stop_strings, None
        arguments["generation_config"] = config
    loop = functools.partial(self_speculative_generate, **carried)
    # The class's generate: a model class may override it, and an instance attribute may be a
    # custom_generate that transformers bound at load time (calling it would come back here).
    return type(model).generate(model, custom_generate=loop, **arguments)
