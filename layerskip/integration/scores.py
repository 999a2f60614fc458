"""``output_scores`` / ``output_logits``: generate's per-token record, kept for the tokens we emit.

Each verify scores every position of its block at once. The recorder sits in the logits hook
(it sees the block's raw logits and turns them into generate's processed scores: processors,
then the sampling warpers) and in the token callback (it learns how many of the block's
positions became output tokens: row j of the block chose token j). So token t's record is the
full model's logits at the position that chose it, as plain ``generate`` records them; the
values agree with plain ``generate``'s to float rounding (a block forward is not a one-token
forward).
"""

from __future__ import annotations

import torch

from layerskip.engine.verifiers import LogitsHook
from layerskip.integration.generate_args import RowProcessors


class ScoreRecorder:
    """Wraps a call's logits hook; ``scores`` / ``logits`` hold one ``[1, V]`` float32 row per token."""

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
