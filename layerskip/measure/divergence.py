"""Rounding or defect: the check at the first token where a greedy output leaves the reference's.

In a low-precision dtype (bf16, fp16) a lossless method need not match HF ``generate`` token for
token. It computes the same function in another order (a position as one row of a verify block
instead of a one-row step, a cache filled in blocks, another head product), so every logit is
rounded differently, and where the two best tokens are closer than that rounding either may
win. A defect (a draft accepted past a mismatch, a cache rolled back short, a verify that reads
the draft's logits) shows up as a divergence too. The check tells the two apart from what it
measures at the divergence itself.

Let S be the shared prefix (the prompt and the first p tokens both outputs agree on), r the
reference's token after it and m the method's. A computation X of the logits after S has the
gap D_X = L_X[r] - L_X[m] (> 0: X prefers the reference's token).

- ``fp32_gap`` D_32: an fp32 copy of the same weights (the model upcast: the same function,
  rounded ~2^16 times more finely than in bf16) over S in one forward. It stands in for exact
  arithmetic.
- ``reference_error`` |D_ref - D_32|: D_ref comes from replaying HF ``generate`` over S (same
  model, same dtype, plain decoding): the very computation that chose r.
- ``method_error``: the method's own logits cannot serve. Where a defect lives they are the
  defect's, and a method that picked m because its (wrong) logits said so would always
  "explain" itself. Instead this is the largest |D_X - D_32| over correct computations X of
  this position in the model's dtype, in the shapes speculative decoding computes it in: the
  position as a row of a block of w rows over a cache filled in blocks of q, for q in
  ``BLOCK_SIZES`` (plain steps, short and long verify blocks, HF's 10-token prompt lookup) and
  every w among them that holds the row, each through both head products in use (HF's
  ``F.linear``, our engine's ``W @ hT``), and as the last row of one forward over S (a
  prefill). It is never below the rounding of the two logits themselves to the dtype (half a
  unit in the last place each), which no computation in that dtype avoids.
- ``class``: ``rounding`` when |D_32| <= reference_error + method_error (``error_bound``),
  else ``defect``. ``witness`` names a correct computation in the dtype that itself picks the
  method's token (a tie counts where argmax's first-index rule picks it), when one did: direct
  evidence that rounding alone reaches m.

What the verdict means. If fp32 sides with the method (D_32 <= 0), the reference's own rounding
took it off the fp32 choice (D_ref >= 0, so reference_error >= |D_32|): always ``rounding``. If
fp32 sides with the reference, a correct method can only have picked m if its own rounding
moved the gap by at least D_32; ``defect`` says that no correct computation of this position in
this dtype that was measured strays that far, with the reference's error added as a margin.
It is a measurement, not a proof, both ways: the computations sampled stand for the method's
own, and a defect that strikes where the two tokens are within rounding of each other cannot be
told from rounding there. Where the caller can run the method again (``reruns``: the bench and
``generate --compare`` do), a ``defect`` verdict is checked once more against the method's own
block history: its forwards are recorded as it runs again, and that schedule, replayed as a
correct computation, joins the sampled ones. On Gemma-3 in bf16, HF's prompt lookup met an
exact tie that way that no regular block history reproduced. Only the first
divergence is checked; after it the two outputs continue from different prefixes. In fp32 the
bound is ~1e-6 of the logits, so any fp32 divergence short of a tie is a ``defect``: fp32 runs
must be identical.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from layerskip.hf import adapters
from layerskip.hf.cache import RollbackCache, model_cache
from layerskip.hf.forward import positions, stack_forward
from layerskip.integration.baselines import hf_greedy_logits

ROUNDING = "rounding"
DEFECT = "defect"
# Rows of a verify block the method path is measured in: a plain step (1), short drafts (2, 4),
# long drafts and padded verifies (8), HF's prompt lookup with its default 10 candidates (11).
BLOCK_SIZES = (1, 2, 4, 8, 11)


@dataclass
class Divergence:
    """The first token where a method's greedy output leaves the reference's, and its class.

    Gaps are logit of the reference's token minus logit of the method's; errors are how far a
    computation's gap lies from the fp32 gap. ``gaps`` holds every computation measured."""

    position: int  # index among the new tokens
    reference_token: int | None  # None: the reference had ended there
    method_token: int | None  # None: the method had ended there
    verdict: str  # ROUNDING or DEFECT ("class" in the dict form)
    reason: str
    reference_text: str | None = None
    method_text: str | None = None
    fp32_gap: float | None = None
    reference_error: float | None = None
    method_error: float | None = None
    error_bound: float | None = None
    witness: str | None = None
    # False where replaying HF generate chose another token earlier (nondeterministic kernels): the
    # reference's logits then come from plain decoding teacher-forced on its tokens.
    reference_replayed: bool = True
    dtype: str = ""
    gaps: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["class"] = data.pop("verdict")
        return data

    def describe(self, method: str = "method", reference: str = "reference") -> str:
        """One line: where, which two tokens, the measured gap and bound, the class."""

        def token(token_id: int | None, text: str | None) -> str:
            if token_id is None:
                return "(ended)"
            return f"{text!r} (id {token_id})" if text is not None else f"id {token_id}"

        line = (
            f"first divergence at new token {self.position}: {method} {token(self.method_token, self.method_text)}, "
            f"{reference} {token(self.reference_token, self.reference_text)}"
        )
        if self.fp32_gap is not None:
            line += f"; fp32 gap {self.fp32_gap:.4g}, error bound {self.error_bound:.4g}"
        return f"{line}: {self.verdict}"


def first_divergence(tokens: Sequence[int], reference: Sequence[int]) -> int | None:
    """Index of the first differing token (a length difference counts), or None if equal."""
    for i, (a, b) in enumerate(zip(tokens, reference)):
        if a != b:
            return i
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))


def half_ulp(value: float, dtype: torch.dtype) -> float:
    """Half a unit in the last place of ``value`` in ``dtype``: the most rounding to it moves it."""
    info = torch.finfo(dtype)
    if value == 0 or not math.isfinite(value):
        return float(info.tiny)
    exponent = math.frexp(abs(value))[1] - 1  # 2**exponent <= |value| < 2**(exponent + 1)
    return float(info.eps) * 2.0**exponent / 2


class DivergenceCheck:
    """Classifies first divergences against the reference (HF ``generate``, greedy, in the model's dtype).

    Holds an fp32 copy of the model's weights once one is needed (none when the model is fp32
    already): use it as a context manager, so the copy is freed with the last check.
    ``tokenizer`` only adds the tokens' text to the reports."""

    def __init__(self, model: nn.Module, tokenizer: Any | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self._fp32: nn.Module | None = None

    def __enter__(self) -> DivergenceCheck:
        return self

    def __exit__(self, *exc: object) -> None:
        self._fp32 = None

    def _fp32_model(self) -> nn.Module:
        if self.dtype == torch.float32:
            return self.model
        if self._fp32 is None:
            self._fp32 = copy.deepcopy(self.model).float().eval()  # bf16 and fp16 values are exact in fp32
        return self._fp32

    @torch.inference_mode()
    def classify_many(
        self,
        prompt: Sequence[int],
        reference: Sequence[int],
        outputs: dict[str, Sequence[int]],
        reruns: dict[str, Callable[[], Sequence[int]]] | None = None,
    ) -> dict[str, Divergence | None]:
        """Every output's first divergence from ``reference`` on one prompt; the reference is replayed once.

        ``reruns`` maps a method to a call that generates its output again. A divergence the
        sampled shapes class ``defect`` is then checked once more against the method's own forward
        schedule: the method runs again with its forwards recorded (``adapters.recorded_forwards``)
        and, if it reproduces its output, that schedule is replayed as one more correct computation
        (a correct method's irregular block history can round further than the regular ones)."""
        result = self._classify_many(prompt, reference, outputs, {})
        for name, rerun in (reruns or {}).items():
            found = result.get(name)
            if found is None or found.verdict != DEFECT or found.method_token is None or found.reference_token is None:
                continue
            with adapters.recorded_forwards(self.model) as calls:
                again = list(rerun())
            if again[: found.position + 1] != list(outputs[name])[: found.position + 1]:
                continue  # a nondeterministic rerun: its schedule is not the one that chose the token
            result[name] = self._classify_many(prompt, reference, {name: outputs[name]}, {name: calls})[name]
        return result

    def _classify_many(
        self,
        prompt: Sequence[int],
        reference: Sequence[int],
        outputs: dict[str, Sequence[int]],
        schedules: dict[str, list[tuple[int, int]]],
    ) -> dict[str, Divergence | None]:
        prompt, reference = list(prompt), list(reference)
        found = {name: first_divergence(tokens, reference) for name, tokens in outputs.items()}
        competing = [p for name, p in found.items() if p is not None and p < min(len(outputs[name]), len(reference))]
        replay = self._reference_replay(prompt, reference, max(competing)) if competing else None
        result: dict[str, Divergence | None] = {}
        for name, tokens in outputs.items():
            position = found[name]
            if position is None:
                result[name] = None
            elif position >= len(tokens) or position >= len(reference):
                result[name] = self._length_divergence(position, list(tokens), reference)
            else:
                assert replay is not None
                result[name] = self._token_divergence(
                    prompt, reference, list(tokens), position, replay, schedules.get(name)
                )
        return result

    def _text(self, token: int | None) -> str | None:
        if token is None or self.tokenizer is None:
            return None
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def _length_divergence(self, position: int, tokens: list[int], reference: list[int]) -> Divergence:
        # Equal tokens up to where one output ends: no two tokens competed, rounding has nothing to flip.
        ended = "method" if position >= len(tokens) else "reference"
        went_on = "reference" if ended == "method" else "method"
        method_token = tokens[position] if position < len(tokens) else None
        reference_token = reference[position] if position < len(reference) else None
        return Divergence(
            position,
            reference_token,
            method_token,
            DEFECT,
            f"the {ended} ended after {position} tokens where the {went_on} went on with the same tokens",
            self._text(reference_token),
            self._text(method_token),
            dtype=str(self.dtype).removeprefix("torch."),
        )

    def _reference_replay(self, prompt: list[int], reference: list[int], last: int) -> dict[int, torch.Tensor]:
        """The reference's own logits ``[V]`` at each position up to ``last``, where its replay reproduced it."""
        tokens, logits = hf_greedy_logits(self.model, prompt, last + 1)
        agreed = first_divergence(tokens[: last + 1], reference[: last + 1])
        agreed = last + 1 if agreed is None else agreed
        # Position p's logits follow reference[:p]: valid up to the first token the replay chose differently.
        return {p: logits[p] for p in range(min(agreed + 1, last + 1))}

    def _plain_decoding_logits(self, prompt: list[int], reference: list[int], position: int) -> torch.Tensor:
        """Plain decoding's logits at ``position`` teacher-forced on the reference (where a replay
        did not reproduce the reference, as nondeterministic kernels may): HF's forward, one step a token."""
        from transformers import DynamicCache

        cache = DynamicCache()
        for block in [prompt, *([token] for token in reference[:position])]:  # the prompt, then a token a step
            out = self.model(input_ids=torch.tensor([block], device=self.device), past_key_values=cache, use_cache=True)
        return out.logits[0, -1].float()

    def _token_divergence(
        self,
        prompt: list[int],
        reference: list[int],
        tokens: list[int],
        position: int,
        replay: dict[int, torch.Tensor],
        schedule: list[tuple[int, int]] | None = None,
    ) -> Divergence:
        r, m = reference[position], tokens[position]
        prefix = [*prompt, *reference[:position]]

        def gap(logits: torch.Tensor) -> float:
            return float(logits[r].float() - logits[m].float())

        fp32_logits = self._fp32_model()(
            input_ids=torch.tensor([prefix], device=self.device), use_cache=False, logits_to_keep=1
        ).logits[0, -1]
        fp32_gap = gap(fp32_logits)
        replayed = position in replay
        reference_gap = gap(replay[position] if replayed else self._plain_decoding_logits(prompt, reference, position))
        method_gaps = self._method_shape_gaps(prompt, prefix, tokens[position:], gap)
        if schedule:
            method_gaps.update(self._schedule_gaps(prompt, prefix, tokens, schedule, gap))
        reference_error = abs(reference_gap - fp32_gap)
        floor = half_ulp(float(fp32_logits[r]), self.dtype) + half_ulp(float(fp32_logits[m]), self.dtype)
        method_error = max([floor, *(abs(g - fp32_gap) for g in method_gaps.values())])
        bound = reference_error + method_error
        verdict = ROUNDING if abs(fp32_gap) <= bound else DEFECT
        # A tie goes to the lower id (argmax takes the first maximum).
        witness = next((name for name, g in method_gaps.items() if g < 0 or (g == 0 and m < r)), None)
        dtype = str(self.dtype).removeprefix("torch.")
        if verdict == ROUNDING and fp32_gap <= 0:
            reason = "fp32 prefers (or ties) the method's token: the reference's rounding took it off the fp32 choice"
        elif verdict == ROUNDING:
            reason = (
                f"fp32 prefers the reference's token by {fp32_gap:.4g}, within what {dtype} rounding moves this gap "
                f"(reference {reference_error:.4g} + method shapes {method_error:.4g})"
            )
        else:
            preferred = "reference's" if fp32_gap > 0 else "method's"
            reason = (
                f"fp32 prefers the {preferred} token by {abs(fp32_gap):.4g}, more than any correct {dtype} computation "
                f"measured here strays (reference {reference_error:.4g} + method shapes {method_error:.4g})"
            )
        return Divergence(
            position,
            r,
            m,
            verdict,
            reason,
            self._text(r),
            self._text(m),
            fp32_gap,
            reference_error,
            method_error,
            bound,
            witness,
            replayed,
            dtype,
            {"reference": reference_gap, **method_gaps},
        )

    def _schedule_gaps(
        self,
        prompt: list[int],
        prefix: list[int],
        tokens: list[int],
        schedule: list[tuple[int, int]],
        gap: Callable[[torch.Tensor], float],
    ) -> dict[str, float]:
        """The gap as the method's own forwards compute it: ``schedule`` (``(first position, rows)``
        per forward, as recorded) replayed over a fresh cache, each forward cutting the cache back
        to its first position as a rollback does; the gap is read from the last forward whose block
        holds the position's input row (the one whose logits chose the token). Rows after that
        input hold the method's own later tokens: they shape the block, never the row's value."""
        target = len(prefix) - 1
        sequence = [*prompt, *tokens]  # equal to ``prefix`` up to the target row
        cache = model_cache(self.model)
        found: dict[str, float] = {}
        for index, (start, width) in enumerate(schedule):
            if start > target:
                break
            if start > cache.longest:
                return {}  # a gap in the recorded history: not a schedule this replay can follow
            try:
                cache.rollback(start)
            except RuntimeError:
                return {}
            block = sequence[start : start + width]
            hidden = self._forward(block + [sequence[-1]] * (width - len(block)), cache, start)
            if start <= target < start + width:
                row = target - start
                found = self._head_gaps(
                    f"the method's own forwards ({index + 1}: row {row} of {width} at {start})", hidden, row, gap
                )
        return found

    def _forward(self, tokens: list[int], cache: RollbackCache | None, start: int) -> torch.Tensor:
        """The decoder stack's hidden states ``[q, H]`` of ``tokens`` at positions ``start`` on, over ``cache``."""
        ids = torch.tensor([tokens], device=self.device)
        return stack_forward(self.model, ids, cache, positions(start, len(tokens), self.device))[0]

    def _head_gaps(
        self, name: str, hidden: torch.Tensor, row: int, gap: Callable[[torch.Tensor], float]
    ) -> dict[str, float]:
        """The gap at ``row`` of a block's hidden states ``[q, H]`` through both head products in use,
        each over the whole block as a verify computes it: our engine's ``W @ hT`` and HF's ``F.linear``."""
        model = self.model
        theirs = adapters.lm_head(model)(hidden)
        cap = adapters.final_logit_softcap(model)
        if cap:
            theirs = torch.tanh(theirs / cap) * cap
        return {
            f"{name}, W@hT head": gap(adapters.logits_from_hidden(model, hidden)[row]),
            f"{name}, F.linear head": gap(theirs[row]),
        }

    def _method_shape_gaps(
        self, prompt: list[int], prefix: list[int], after: list[int], gap: Callable[[torch.Tensor], float]
    ) -> dict[str, float]:
        """The gap at the end of ``prefix`` as correct computations in the model's dtype find it:
        as the last row of one forward over the prefix, and as a row of a q-row block over a cache
        filled in q-row blocks after the prompt's prefill, through both head products."""
        model = self.model
        whole = self._forward(prefix, None, 0)  # [n, H]
        gaps = self._head_gaps("one forward over the prefix", whole[-1:], 0, gap)
        generated = len(prefix) - len(prompt)  # p: the position's input token is the p-th after the prompt
        if generated == 0:
            return gaps  # every method computes the first new token in the prompt's prefill
        limit = adapters.max_positions(model)
        windows = adapters.sliding_windows(model)
        filler = [*after, prefix[-1]]  # tokens after the position: they shape the block, never its row's value
        for q in BLOCK_SIZES:
            # The cache's history: the prompt's prefill, then the generated tokens in q-row blocks.
            cache = model_cache(model, windows)
            self._forward(prompt, cache, 0)
            start = len(prompt) + (generated - 1) // q * q  # the q-row block holding the position's input token
            for begin in range(len(prompt), start, q):
                self._forward(prefix[begin : begin + q], cache, begin)
            # The position as row ``row`` of every block width that holds it (a verify's width is
            # its draft's length plus one, padded or not): one more forward each over the same cache.
            row = len(prefix) - 1 - start
            for width in sorted({row + 1, *(w for w in BLOCK_SIZES if w > row)}):
                if limit is not None and start + width > limit:
                    continue
                tail = prefix[start:] + (filler * width)[: width - row - 1]
                cache.rollback(start)
                hidden = self._forward(tail, cache, start)
                gaps.update(self._head_gaps(f"row {row} of {width}, cache in blocks of {q}", hidden, row, gap))
        return gaps
