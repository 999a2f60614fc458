"""Token choice and verification: greedy acceptance, the temperature / top-k / top-p transform, and
rejection sampling.

The same ``Sampling.probs`` transform is applied to the target's logits (p) and the draft's (q);
rejection sampling then makes the output distribution exactly p whatever q is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from layerskip.errors import LayerskipError


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0
    top_k: int = 0  # 0 = no top-k filter
    top_p: float = 1.0  # 1.0 = no nucleus filter

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature <= 0:
            raise LayerskipError(
                f"temperature must be a finite number > 0, got {self.temperature} "
                "(use greedy decoding instead of temperature 0)"
            )
        if self.top_k < 0:
            raise LayerskipError("top_k must be >= 0 (0 disables it)")
        if not 0.0 < self.top_p <= 1.0:
            raise LayerskipError("top_p must be in (0, 1]")

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """``[..., V]`` logits -> ``[..., V]`` float32 probabilities after the transform."""
        logits = logits.float()
        # Shift the top logit to 0 first: a tiny temperature then sends the others to -inf (the
        # limit, greedy) instead of overflowing every logit to inf, whose softmax is NaN.
        logits = (logits - logits.amax(dim=-1, keepdim=True)) / self.temperature
        if self.top_k and self.top_k < logits.shape[-1]:
            kth = torch.topk(logits, self.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
            sorted_probs = sorted_logits.softmax(dim=-1)
            # Drop a token when the tokens ranked above it already hold more than top_p.
            drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) > self.top_p
            drop = drop_sorted.scatter(-1, order, drop_sorted)
            logits = logits.masked_fill(drop, float("-inf"))
        return logits.softmax(dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token id per row of ``[..., V]`` probabilities -> ``[...]`` long tensor."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def verify_greedy(drafted: list[int], logits: torch.Tensor) -> tuple[int, int]:
    """Greedy acceptance. ``logits [k+1, V]``: the full model's at each block position.

    Returns (number of drafts accepted n, the full model's own token after them): the longest
    prefix of ``drafted`` that equals the full model's argmax chain, then its argmax at n.
    """
    return accept_greedy(drafted, logits.argmax(dim=-1).tolist())


def accept_greedy(drafted: list[int], targets: list[int]) -> tuple[int, int]:
    """Greedy acceptance from ``targets``, the full model's token after each block position (k+1 of them)."""
    accepted = 0
    while accepted < len(drafted) and drafted[accepted] == targets[accepted]:
        accepted += 1
    return accepted, targets[accepted]


def verify_sampled(
    drafted: list[int], p: torch.Tensor, q: torch.Tensor, generator: torch.Generator | None
) -> tuple[int, int]:
    """Standard speculative rejection sampling.

    drafted: k proposed tokens; p: ``[k+1, V]`` target probabilities at each block position;
    q: ``[k, V]`` the draft's proposal probabilities. Returns (number accepted n, next token):
    token i is kept with probability min(1, p_i/q_i); at the first rejection the next token is
    drawn from normalise(max(0, p - q)); if all k are kept it is drawn from p[k].
    """
    k = len(drafted)
    if k:
        index = torch.tensor(drafted, device=p.device)
        rows = torch.arange(k, device=p.device)
        ratio = p[rows, index] / q[rows, index]
        uniform = torch.rand(k, device=p.device, generator=generator)
        rejected = (uniform >= ratio).tolist()
        for i in range(k):
            if rejected[i]:
                residual = (p[i] - q[i]).clamp_min(0)
                total = residual.sum()
                residual = residual / total if total > 0 else p[i]
                return i, int(sample(residual, generator))
    return k, int(sample(p[k], generator))
