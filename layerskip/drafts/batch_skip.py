"""The skip draft for a whole batch: every row drafts together, one lean forward per drafted token.

A row's own skip drafter runs one row at a time; on these CPUs the draft's int4 products are
compute-bound, so several rows in one product cost far less than the rows one after another.
All rows share one truncated head (its ranked rows plus every token of every row's text): the
verify always uses the full head, so output stays exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from layerskip.drafts.base import SKIP, EditsAfter, Proposal, Proposals
from layerskip.drafts.head import DraftHead
from layerskip.drafts.model import DraftModel
from layerskip.hf.cache import RollbackCache
from layerskip.sampling import Sampling, sample


class BatchSkipDraft:
    """Drafts ``steps`` tokens for every row of a ragged batch (greedy, or sampled per row)."""

    def __init__(
        self,
        draft_model: DraftModel,
        attention: tuple[int, ...],
        mlp: tuple[int, ...],
        head: DraftHead,
        sampling: Sampling | None,
    ) -> None:
        self.draft_model = draft_model
        self.attention = attention
        self.mlp = mlp
        self.head = head
        self.sampling = sampling

    def propose(
        self,
        cache: RollbackCache,
        histories: Sequence[list[int]],
        budgets: Sequence[int],
        steps: int,
        generators: Sequence[torch.Generator | None],
        edits: Sequence[EditsAfter | None] = (),
    ) -> Proposals:
        """Row ``r`` drafts after ``histories[r]`` (its last token pending, the rest in the cache),
        at most ``budgets[r]`` tokens of the ``steps`` drafted, each row's logits through its
        processors' edits (``edits[r]``, given the row's drafted tokens) as the verify applies them;
        the cache's lengths come back as they
        were (the draft's K/V stay written after them, for the verify to overwrite)."""
        for history in histories:
            self.head.add(history)
        committed = list(cache.lengths)
        device = self.draft_model.device
        edited = [(r, after) for r, after in enumerate(edits) if after is not None]
        token = torch.tensor([history[-1] for history in histories], device=device)  # [R]
        chosen: list[torch.Tensor] = []
        q_rows: list[list[torch.Tensor]] = [[] for _ in histories]
        with self.draft_model.active(self.attention, self.mlp):
            for _ in range(steps):
                hidden = self.draft_model.hidden(token[:, None], cache)[:, 0]  # [R, H]; the rows move on by one
                logits = self.head(hidden)  # [R, n]
                drafted = torch.stack(chosen, dim=1).tolist() if chosen and edited else None  # [R, i]
                for r, after in edited:
                    edit = self.head.editor(after(drafted[r] if drafted else []))
                    if edit is not None:
                        edit(logits[r])  # in place
                if self.sampling is None:
                    index = logits.argmax(-1)
                else:
                    probs = self.sampling.probs(logits)  # [R, n]
                    index = torch.stack([sample(probs[r], g) for r, g in enumerate(generators)]).reshape(-1)
                    for r in range(len(histories)):
                        q_rows[r].append(self.head.to_full_vocab(probs[r]))
                token = self.head.token_ids(index).reshape(-1)
                chosen.append(token)
        cache.set_lengths(committed)
        drafted = torch.stack(chosen, dim=1).tolist() if chosen else [[] for _ in histories]  # [R, steps]
        drafts = []
        for r, tokens in enumerate(drafted):
            keep = max(0, min(budgets[r], steps))
            q = torch.stack(q_rows[r][:keep]) if self.sampling is not None and keep else None
            drafts.append(Proposal.chain(tokens[:keep], SKIP, q))
        return Proposals(tuple(drafts))
