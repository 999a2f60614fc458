"""The truncated draft head's vocabulary: which K token ids the draft scores.

Ranking: tokens seen in calibration text (tokenised by the model's own tokenizer) by count,
then every other id in ascending order — BPE and SentencePiece vocabularies are built roughly
in frequency order, so low ids are the common ones. At generation time the prompt's own
tokens are added, so copying from the prompt stays cheap to draft. Verify always uses the full
head, so the output is exact whatever the subset.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch
from torch import nn

from layerskip.engine.policy import SkipPolicy
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
        device = next(model.parameters()).device
        return cls(torch.tensor(seen + rest, dtype=torch.long, device=device))

    @classmethod
    def builtin(cls, tokenizer: object, model: nn.Module) -> DraftVocabulary:
        from layerskip.data import builtin_prompts

        return cls.from_texts(tokenizer, [p.text for p in builtin_prompts()], model)

    def rows(self, size: int, prompt_ids: Sequence[int] = ()) -> torch.Tensor | None:
        """Sorted token ids the draft head scores, or None for the full head."""
        if size <= 0 or size >= len(self.ranking):
            return None
        extra = torch.tensor(list(prompt_ids), dtype=torch.long, device=self.ranking.device)
        return torch.unique(torch.cat([self.ranking[:size], extra]))  # sorted, no duplicates

    def rows_for(self, policy: SkipPolicy, prompt_ids: Sequence[int] = ()) -> torch.Tensor | None:
        return self.rows(policy.draft.draft_vocab_size, prompt_ids)
