"""What tests check the engine against, kept out of the package because only tests use them: the
textbook chain rule of speculative sampling, the engine's own sampled verify in that rule's shape,
a defective greedy rule tests inject, and probes of a model's and a cache's state."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from layerskip.drafts.base import SKIP, Proposal
from layerskip.engine.verifiers import SampledVerifier
from layerskip.hf.adapters import decoder_layers
from layerskip.hf.cache import RollbackCache
from layerskip.sampling import accept_tree_greedy, sample


def chain_rule(
    drafted: list[int], p: torch.Tensor, q: torch.Tensor, generator: torch.Generator | None
) -> tuple[int, int]:
    """Speculative rejection sampling of a chain as the papers state it: ``p [k+1, V]`` target and
    ``q [k, V]`` draft probabilities (a one-hot row for a token chosen deterministically). Token i
    is kept with probability min(1, p_i(x)/q_i(x)); at the first rejection the next token is drawn
    from norm(max(0, p_i - q_i)); after all k, from p_k. Returns (accepted, next token).

    One uniform per token, drawn up front as the engine draws them, so a seed gives the engine's
    draws: a test can compare the two draw for draw."""
    uniform = torch.rand(len(drafted), generator=generator).tolist() if drafted else []
    for i, token in enumerate(drafted):
        if uniform[i] * float(q[i, token]) >= float(p[i, token]):
            residual = (p[i].float() - q[i].float()).clamp_min(0)
            return i, int(sample(residual / residual.sum(), generator))
    return len(drafted), int(sample(p[len(drafted)], generator))


def engine_chain_verify(
    drafted: list[int], p: torch.Tensor, q: torch.Tensor | None, generator: torch.Generator | None
) -> tuple[int, int]:
    """The engine's sampled verify (``SampledVerifier.choose``) of a chain drafted from ``q [k, V]``
    (None: chosen deterministically, as a lookup match is), in ``chain_rule``'s shape."""
    # p as it is, where the engine would transform logits first: the transform has tests of its own,
    # and softmax(log p) is p only up to rounding. choose reads no head.
    exact = SimpleNamespace(probs=lambda probs: probs)
    verifier = SampledVerifier(None, exact, generator)  # type: ignore[arg-type]
    verdict = verifier.choose(p, Proposal.chain(drafted, SKIP, q))
    return verdict.accepted, verdict.next_token


def one_past_the_mismatch(drafted: list[int], parents: list[int], targets: list[int]) -> tuple[list[int], int]:
    """Defective greedy acceptance, in ``accept_tree_greedy``'s place: it also keeps the first
    draft token the full model rejected (chain policies: the accepted path is a prefix)."""
    path, token = accept_tree_greedy(drafted, parents, targets)
    if len(path) < len(drafted):
        path = [*path, len(path)]
        token = targets[len(path)]
    return path, token


def is_bypassed(model: nn.Module) -> bool:
    """True if any layer, sublayer or projection is patched now: every bypass must be restored."""
    return any("forward" in module.__dict__ for module in decoder_layers(model).modules())


def row_lengths(cache: RollbackCache) -> list[int]:
    """The tokens each row of ``cache`` holds (every layer holds them: one length per row)."""
    return list(cache.lengths)
