"""HF's logits processors that touch few tokens, as sparse edits the certified head can verify with.

Plain ``generate`` applies every processor to a full ``[1, V]`` row once per token; a verify
would apply them to every drafted position, and read the full-vocabulary logits to do it (on
Gemma-3 a 262,144 x 640 product per position). Most processors touch few tokens of a row:

* masks: min new tokens / min length (EOS), suppressed tokens, begin-suppressed tokens, bad words
  and ``no_repeat_ngram_size`` (tokens that would complete a banned sequence);
* edits of few tokens' logits: the repetition penalty (the row's own tokens: ``x < 0 ? x * p : x / p``)
  and sequence bias (``x + b``).

``row_edits`` turns a row's processors into ``TokenEdits``: the tokens masked, and the few edited
ones with the function that edits their exact logits, applied in the processors' order with the
float32 arithmetic the processors use, so the edited values are the processors' own. The
certified head then needs the exact logits of the edited tokens and of its usual candidates only
(``engine.verify_head``). A processor not listed here (a user's own, a watermark, forced tokens,
``prefix_allowed_tokens_fn``) leaves the row to the full logits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from layerskip.engine.verify_head import TokenEdits


def _ids(tensor_or_list: object) -> list[int]:
    return [int(t) for t in torch.as_tensor(tensor_or_list).reshape(-1).tolist()]


def _ngram_bans(ids: Sequence[int], size: int) -> set[int]:
    """Tokens that would repeat an n-gram of ``ids`` (NoRepeatNGramLogitsProcessor's rule)."""
    length = len(ids)
    if length < size:
        return set()
    prefix = list(ids[length + 1 - size :])  # the n-1 last tokens (none for size 1)
    return {ids[s + size - 1] for s in range(length - size + 1) if list(ids[s : s + size - 1]) == prefix}


def _bias(processor: object, ids: Sequence[int]) -> dict[int, torch.Tensor]:
    """Each biased token's float32 bias for this row, summed as SequenceBiasLogitsProcessor sums it:
    the one-token biases first, then the longer sequences whose prefix ends the row, by prefix length."""
    biases: dict[int, torch.Tensor] = {}
    by_prefix: dict[int, list[tuple[tuple[int, ...], float]]] = {}
    for sequence, value in processor.sequence_bias.items():
        if len(sequence) == 1:
            biases[sequence[0]] = torch.tensor(value, dtype=torch.float32)
        else:
            by_prefix.setdefault(len(sequence) - 1, []).append((tuple(sequence), value))
    zero = torch.zeros((), dtype=torch.float32)
    for length, group in by_prefix.items():
        if length > len(ids):
            continue
        for sequence, value in group:
            if tuple(ids[-length:]) == sequence[:-1]:
                token = sequence[-1]
                biases[token] = biases.get(token, zero) + torch.tensor(value, dtype=torch.float32)
    return biases


def row_edits(processors: Sequence[object], ids: Sequence[int], vocab: int) -> TokenEdits | None:
    """What ``processors`` do to the row after ``ids`` (its padding included, as generate passes
    it), as sparse edits; None where one of them is not a sparse kind (the row needs every logit)."""
    steps: list[tuple[str, set[int], object]] = []  # (kind, tokens, argument), in the processors' order
    for processor in processors:
        name = type(processor).__name__  # exact types: a subclass may do more
        if name in ("MinNewTokensLengthLogitsProcessor", "MinLengthLogitsProcessor"):
            done = len(ids) - processor.prompt_length_to_skip if "New" in name else len(ids)
            limit = processor.min_new_tokens if "New" in name else processor.min_length
            if done < limit:
                steps.append(("mask", set(_ids(processor.eos_token_id)), None))
        elif name == "SuppressTokensLogitsProcessor":
            steps.append(("mask", set(_ids(processor.suppress_tokens)), None))
        elif name == "SuppressTokensAtBeginLogitsProcessor":
            if len(ids) == processor.begin_index:
                steps.append(("mask", set(_ids(processor.begin_suppress_tokens)), None))
        elif name == "NoRepeatNGramLogitsProcessor":
            steps.append(("mask", _ngram_bans(ids, processor.ngram_size), None))
        elif name == "RepetitionPenaltyLogitsProcessor":
            if processor.logits_indices is not None:
                return None
            ignored = processor.prompt_ignore_length
            first = int(torch.as_tensor(ignored).reshape(-1)[0]) if ignored is not None else 0
            steps.append(("penalty", set(ids[first:]), float(processor.penalty)))
        elif name in ("SequenceBiasLogitsProcessor", "NoBadWordsLogitsProcessor"):
            biases = _bias(processor, ids)
            steps.append(("bias", set(biases), biases))
        else:
            return None
    masked: set[int] = set()
    edited: set[int] = set()
    for kind, tokens, _ in steps:
        (masked if kind == "mask" else edited).update(t for t in tokens if 0 <= t < vocab)
    order = sorted(edited)
    where = {token: i for i, token in enumerate(order)}

    def apply(values: torch.Tensor) -> torch.Tensor:
        """The edited tokens' exact logits ``[n]`` float32 -> their processed logits."""
        values = values.clone()
        for kind, tokens, argument in steps:
            index = torch.tensor(sorted(where[t] for t in tokens if t in where), dtype=torch.long)
            if not len(index):
                continue
            part = values[index]
            if kind == "mask":
                part = torch.full_like(part, -float("inf"))
            elif kind == "penalty":
                part = torch.where(part < 0, part * argument, part / argument)
            else:
                part = part + torch.stack([argument[order[i]] for i in index.tolist()])
            values[index] = part
        return values

    return TokenEdits(tuple(order), apply, tuple(sorted(masked - edited)))
