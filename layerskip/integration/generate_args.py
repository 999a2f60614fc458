"""What HF ``generate`` prepared, as one call of our engine: settings, a logits hook, a stop check.

``generate`` turns its arguments and ``GenerationConfig`` into a ``LogitsProcessorList`` and a
``StoppingCriteriaList`` before it calls a ``custom_generate`` callable. They are the exact
contract of plain ``generate``, so they are honoured here as they are, not re-derived from
the config:

- the tail of the processor list that is temperature -> top-k -> top-p becomes our
  ``Sampling``, applied alike to the target and the draft (so drafts are accepted as often as
  the engine's own API gets); every other processor (repetition penalty, min_new_tokens, bad
  words, a user's ``logits_processor`` ...) runs on the verify's logits, row by row, each row
  with the token ids that precede it. The draft proposes from unprocessed logits; greedy
  acceptance and rejection sampling check it against the processed ones, so the output is
  exactly plain ``generate``'s (greedy) or follows its distribution (sampling). HF's processors
  that touch few tokens (masks, penalties, biases: ``integration.token_edits``) keep a greedy
  verify on the certified head (no full-vocabulary product); any other makes it read every logit;
- ``MaxLengthCriteria`` and ``EosTokenCriteria`` become the engine's token budget and EOS ids;
  every other criterion (stop strings, ``max_time``, a user's ``stopping_criteria``) is asked
  after each accepted token, as plain ``generate`` asks after each token, with what plain
  ``generate`` passes: the ids so far and ``scores``, the tuple of processed scores of every
  token so far when ``output_scores`` is recorded (``return_dict_in_generate=True``), else None.
  Its answer may be a tensor or a Python bool, as plain ``generate`` accepts.

A batch (or ``num_return_sequences`` copies of one prompt) is one engine call per row; the rows
are decoded together (``Decoder.decode_batch``). The processors run on one row at a time, so a
processor that ``generate`` built for the whole batch (the repetition penalty's per-row padding
lengths, ``prefix_allowed_tokens_fn``'s batch index) is given each row as a batch of one
(``_for_row``). Anything whose output we cannot reproduce exactly is refused in one line naming
the argument.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.generation.logits_process import PrefixConstrainedLogitsProcessor, RepetitionPenaltyLogitsProcessor

from layerskip.engine.decoding import DecodeSettings, StopCheck
from layerskip.engine.verifiers import LogitsHook
from layerskip.engine.verify_head import TokenEdits
from layerskip.errors import LayerskipError
from layerskip.integration.token_edits import row_edits
from layerskip.sampling import Sampling

# model_kwargs that ``generate`` prepares for its own loop; our engine keeps its own cache,
# positions and full-block logits, so these are read (attention mask, cache) or dropped.
UNSUPPORTED = "is not supported by layerskip's custom_generate"
_PREPARED_KWARGS = {"attention_mask", "position_ids", "logits_to_keep", "cache", "past_key_values", "use_cache"}
# new tokens so far -> the ``scores`` plain generate would hand a stopping criterion after that many
ScoresSoFar = Callable[[int], tuple[torch.Tensor, ...]]


@dataclass
class EngineCall:
    """One ``Decoder.decode`` call: what ``generate`` was asked for, for one row of its input."""

    prompt: list[int]  # the prompt tokens the engine continues (left padding removed)
    padding: list[int]  # left-padding tokens removed from the input; processors still see them
    settings: DecodeSettings
    logits_hook: LogitsHook | None
    criteria: list[object]  # stopping criteria asked after every token (not max length, not EOS)
    warpers: list[object]  # generate's sampling warpers that ``settings.sampling`` stands for
    device: torch.device = torch.device("cpu")  # where the ids handed to the criteria live

    def stop_check(self, scores: ScoresSoFar | None = None) -> StopCheck | None:
        """The engine's stop check for this row's criteria; ``scores``, where ``output_scores`` is
        recorded, gives them the scores so far as plain ``generate`` does (else they get None)."""
        if not self.criteria:
            return None
        criteria, padding, prompt_length = self.criteria, self.padding, len(self.prompt)

        def check(history: list[int]) -> bool:
            ids = torch.tensor([[*padding, *history]], device=self.device)
            so_far = None if scores is None else scores(len(history) - prompt_length)
            # Every criterion is asked, as plain generate's list asks them all (some keep state). An answer
            # may be a bool tensor of shape [1] (HF's own criteria), or a Python or numpy bool (as many
            # user criteria return, and plain generate accepts).
            return any([bool(torch.as_tensor(criterion(ids, so_far)).any()) for criterion in criteria])

        return check


def _refuse_config(config: Any) -> None:
    """One line per argument of ``GenerationConfig`` that changes the output in a way we cannot match."""
    if (config.num_beams or 1) > 1:
        raise LayerskipError(f"num_beams={config.num_beams} (beam search) {UNSUPPORTED}")
    for name in ("prompt_lookup_num_tokens", "assistant_early_exit"):
        if getattr(config, name, None):
            raise LayerskipError(f"{name} is HF's own speculative decoding; drop it: layerskip drafts by itself")
    if config.guidance_scale is not None and config.guidance_scale != 1:
        raise LayerskipError(f"guidance_scale (classifier-free guidance) {UNSUPPORTED}")
    if config.return_dict_in_generate:
        for name in ("output_attentions", "output_hidden_states"):
            if getattr(config, name, False):
                raise LayerskipError(f"{name}=True {UNSUPPORTED}; it returns sequences, scores and its stats")


def _prompts(input_ids: torch.Tensor, model_kwargs: dict[str, Any]) -> list[tuple[list[int], list[int]]]:
    """(prompt, left padding) of each row; refuses a mask with holes."""
    unknown = sorted(set(model_kwargs) - _PREPARED_KWARGS)
    if unknown:
        raise LayerskipError(f"{unknown[0]} {UNSUPPORTED}; drop it")
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if cache is not None and cache.get_seq_length() > 0:
        raise LayerskipError(f"a filled past_key_values cache {UNSUPPORTED}")
    mask = model_kwargs.get("attention_mask")
    if mask is None:  # generate drops an all-ones mask
        return [(row, []) for row in input_ids.tolist()]
    prompts = []
    for row, kept in zip(input_ids.tolist(), mask.tolist()):
        start = kept.index(1) if 1 in kept else len(kept)
        if any(v != 1 for v in kept[start:]) or any(v != 0 for v in kept[:start]):
            raise LayerskipError(
                "attention_mask must be ones after optional left padding for layerskip's custom_generate"
            )
        prompts.append((row[start:], row[:start]))
    return prompts


# generate's sampling warpers, in the order it applies them: the Sampling field each stands for, and its type
_WARPERS = {
    "TemperatureLogitsWarper": ("temperature", float),
    "TopKLogitsWarper": ("top_k", int),
    "TopPLogitsWarper": ("top_p", float),
}
_WARPER_ORDER = tuple(_WARPERS)


def _is_plain_warper(processor: object) -> bool:
    """A temperature / top-k / top-p warper that ``Sampling`` reproduces (tests/test_sampling.py)."""
    name = type(processor).__name__
    if name not in _WARPER_ORDER:
        return False
    return getattr(processor, "filter_value", -float("inf")) == -float("inf") and (
        name != "TopPLogitsWarper" or getattr(processor, "min_tokens_to_keep", 1) == 1
    )


def _split_processors(
    processors: Sequence[object], do_sample: bool
) -> tuple[list[object], list[object], Sampling | None]:
    """(processors run on the verify's logits, the warpers after them, the sampling transform that
    stands for those warpers, for target and draft alike)."""
    items = list(processors)
    if not do_sample:
        return items, [], None
    cut = len(items)
    while cut > 0 and _is_plain_warper(items[cut - 1]):
        rank = _WARPER_ORDER.index(type(items[cut - 1]).__name__)
        if cut < len(items) and rank >= _WARPER_ORDER.index(type(items[cut]).__name__):
            break
        cut -= 1
    values: dict[str, Any] = {}
    for warper in items[cut:]:
        name, kind = _WARPERS[type(warper).__name__]
        values[name] = kind(getattr(warper, name))
    return items[:cut], items[cut:], Sampling(**values)


# Processors whose output we cannot reproduce, by the generate argument that adds them: guidance runs
# the model itself, with state; SynthID counts its calls (one per token in plain generate).
_REFUSED_PROCESSORS = {
    "UnbatchedClassifierFreeGuidanceLogitsProcessor": "negative_prompt_ids / guidance_scale",
    "SynthIDTextWatermarkLogitsProcessor": "SynthID watermarking_config",
}


def _for_row(processor: object, row: int, rows: int) -> object:
    """``processor`` as it acts on row ``row`` of generate's ``rows``, called with that row alone:
    the logits hook hands processors one row (``[1, L]`` ids), where generate built some of them
    with per-row state for the whole batch."""
    if isinstance(processor, RepetitionPenaltyLogitsProcessor):
        ignored = processor.prompt_ignore_length  # generate's: each row's left padding, not penalised
        if isinstance(ignored, torch.Tensor) and ignored.shape[0] == rows:
            alone = copy.copy(processor)
            alone.prompt_ignore_length = ignored[row : row + 1]
            return alone
    if isinstance(processor, PrefixConstrainedLogitsProcessor):
        # The user's function is told the prompt's index: rows are num_beams (num_return_sequences) copies.
        allowed, copies = processor._prefix_allowed_tokens_fn, processor._num_beams
        alone = copy.copy(processor)
        alone._prefix_allowed_tokens_fn, alone._num_beams = (lambda _, ids: allowed(row // copies, ids)), 1
        return alone
    return processor


@dataclass(frozen=True)
class RowProcessors:
    """HF processors as a ``LogitsHook``: over ``logits [k+1, V]``, each row with the ids before it."""

    processors: tuple[object, ...]
    padding: tuple[int, ...]

    def edits(self, contexts: list[list[int]], vocab: int) -> list[TokenEdits] | None:
        """What the processors do to the row after each context, as edits of few tokens; None where
        one of them needs every logit (``integration.token_edits``)."""
        rows = []
        for context in contexts:
            edits = row_edits(self.processors, [*self.padding, *context], vocab)
            if edits is None:
                return None
            rows.append(edits)
        return rows

    def __call__(self, context: list[int], logits: torch.Tensor) -> torch.Tensor:
        first = len(context) - logits.shape[0] + 1  # row i scores the token after context[:first + i]
        rows = []
        for i in range(logits.shape[0]):
            ids = torch.tensor([[*self.padding, *context[: first + i]]], device=logits.device)
            scores = logits[i : i + 1].to(torch.float32)  # HF hands processors float32 scores
            for processor in self.processors:
                scores = processor(ids, scores)
            rows.append(scores)
        return torch.cat(rows)


def engine_calls(
    input_ids: torch.Tensor,
    logits_processor: Sequence[object],
    stopping_criteria: Sequence[object],
    generation_config: Any,
    model_kwargs: dict[str, Any],
    stop_strings: str | Sequence[str] | None = None,
    tokenizer: object | None = None,
) -> list[EngineCall]:
    """The engine calls, one per row of ``input_ids``, for what ``generate`` prepared (its
    processors, criteria and config). A batch (or ``num_return_sequences`` copies of one prompt)
    gives each row the output it would get alone."""
    _refuse_config(generation_config)
    prompts = _prompts(input_ids, model_kwargs)
    max_length = None
    eos: tuple[int, ...] = ()
    others: list[object] = []
    for criterion in stopping_criteria:
        name = type(criterion).__name__
        if name == "MaxLengthCriteria":
            max_length = int(criterion.max_length)
        elif name == "EosTokenCriteria":
            eos = tuple(int(i) for i in torch.as_tensor(criterion.eos_token_id).reshape(-1).tolist())
        else:
            others.append(criterion)
    if max_length is None:
        raise LayerskipError("generate set no max_length; pass max_new_tokens= or max_length=")
    if stop_strings:
        if tokenizer is None:
            raise LayerskipError(
                "stop_strings needs tokenizer=; transformers does not pass it to a custom_generate callable, "
                "so use custom_generate=layerskip.custom_generate_path() with trust_remote_code=True"
            )
        from transformers import StopStringCriteria

        others.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
    processors, warpers, sampling = _split_processors(logits_processor, bool(generation_config.do_sample))
    for processor in processors:
        if (refused := _REFUSED_PROCESSORS.get(type(processor).__name__)) is not None:
            raise LayerskipError(f"{refused} {UNSUPPORTED}")
    if len(prompts) > 1 and generation_config.return_dict_in_generate:
        for name in ("output_scores", "output_logits"):  # generate scores a finished row's padding too
            if getattr(generation_config, name, False):
                raise LayerskipError(f"{name}=True with a batch of {len(prompts)} {UNSUPPORTED}; pass one prompt")
    settings = DecodeSettings(
        max_new_tokens=max_length - input_ids.shape[1],  # generate's max_length counts the padded input
        sampling=sampling,
        eos_token_ids=eos,
    )
    calls = []
    for row, (prompt, padding) in enumerate(prompts):
        alone = tuple(_for_row(p, row, len(prompts)) for p in processors)
        hook = RowProcessors(alone, tuple(padding)) if alone else None
        calls.append(EngineCall(prompt, padding, settings, hook, others, warpers, input_ids.device))
    return calls
