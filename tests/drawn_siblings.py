"""Sequoia-style siblings for the sampled tree tests: more draws from a draft's proposal rows,
without replacement. No drafter draws them (a sampled draft stays a chain); the sampled tree
verify accepts them, and these tests hold it to the target's law when they are there."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from layerskip.drafts.drafters.branching import Sibling, uncertain_positions


def sampled_siblings(
    chain: Sequence[int], q: torch.Tensor, margin: float, width: int, generator: torch.Generator | None
) -> list[Sibling]:
    """Up to ``width - 1`` more draws from ``q[t]`` (``[k, V]``) without replacement where its
    top-2 margin is below ``margin``; ``chain[t]`` must have been the first draw from ``q[t]``.
    How many are drawn depends on q only (never on the tokens drawn), as exactness requires."""
    siblings: list[Sibling] = []
    for t in uncertain_positions(q.topk(2, dim=-1).values, margin):
        if t >= len(chain):
            break
        rest = q[t].float().index_fill(0, torch.tensor([chain[t]], device=q.device), 0.0)  # [V]
        count = min(width - 1, int((rest > 0).sum()))
        if count > 0:
            draws = torch.multinomial(rest, count, replacement=False, generator=generator)
            siblings.extend(Sibling(t, token, drawn=True) for token in draws.tolist())
    return siblings
