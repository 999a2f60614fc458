"""What one generation keeps: its settings, and the accepted tokens with every stop condition.

Each row of a batch (``engine.step``) keeps one.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from layerskip.errors import LayerskipError
from layerskip.hf.cache import RollbackCache
from layerskip.sampling import Sampling

TokenCallback = Callable[[list[int]], None]
CacheObserver = Callable[[RollbackCache, int], None]
# history (prompt + tokens so far) -> stop after the last one; checked after every accepted token.
StopCheck = Callable[[list[int]], bool]


@dataclass(frozen=True)
class DecodeSettings:
    max_new_tokens: int = 128
    sampling: Sampling | None = None  # None = greedy
    seed: int | None = None
    # None: stop at the model's own EOS ids (its generation config's, as HF's generate does),
    # resolved by the Decoder; () never stops before max_new_tokens.
    eos_token_ids: tuple[int, ...] | None = None
    stop_strings: tuple[str, ...] = ()

    def validate(self) -> None:
        if self.max_new_tokens <= 0:
            raise LayerskipError(f"max_new_tokens must be > 0 (got {self.max_new_tokens})")


class TokenOutput:
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
        assert settings.eos_token_ids is not None, "the Decoder resolves the model's EOS ids first"
        self.eos_token_ids: tuple[int, ...] = settings.eos_token_ids
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
            if token in self.eos_token_ids or self.remaining <= 0 or self._hit_stop_string() or stopped:
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


def prompt_ids(input_ids: Sequence[int] | torch.Tensor) -> list[int]:
    if isinstance(input_ids, torch.Tensor):
        if input_ids.is_floating_point() or input_ids.is_complex():
            raise LayerskipError(f"prompt token ids are of dtype {input_ids.dtype}; pass integer token ids")
        ids = input_ids.reshape(-1).tolist()
    else:
        try:
            ids = [operator.index(t) for t in input_ids]  # ints and numpy's integers; not str, float or None
        except TypeError:
            raise LayerskipError(
                "a prompt of token ids holds something other than integers; pass a list of ints"
            ) from None
    if not ids:
        raise LayerskipError("the prompt is empty; pass some text to continue")
    return ids
