"""Ranking the vocabulary for a truncated draft head: which K token ids the draft starts from.

Ranking: tokens seen in some text (tokenised by the model's own tokenizer) by count, then every
other id in ascending order — BPE and SentencePiece vocabularies are built roughly in frequency
order, so low ids are the common ones. The search ranks on its calibration prompts and writes
the top rows into the policy (``SkipPolicy.draft_vocabulary``), so generation uses exactly the
head the search scored. At generation time the head also learns the prompt's tokens and every
token emitted (``engine.head``). Verify always uses the full head, so the output is exact
whatever the subset.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch
from torch import nn

from layerskip.hf import adapters


class DraftVocabulary:
    def __init__(self, ranking: torch.Tensor) -> None:
        self.ranking = ranking  # [V] every token id, most frequent first

    @classmethod
    def from_texts(cls, tokenizer: object, texts: Sequence[str], model: nn.Module) -> DraftVocabulary:
        size = adapters.lm_head(model).weight.shape[0]
        counts: Counter[int] = Counter()
        for text in texts:
            counts.update(tokenizer(text)["input_ids"])
        seen = [token for token, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0])) if token < size]
        rest = sorted(set(range(size)) - set(seen))
        return cls(torch.tensor(seen + rest, dtype=torch.long))

    def top(self, size: int) -> tuple[int, ...]:
        """The ``size`` best-ranked ids (empty for 0, the full head)."""
        return tuple(self.ranking[: max(0, size)].tolist())
