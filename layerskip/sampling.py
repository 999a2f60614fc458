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

# Both samplers divide float32 logits by the temperature (HF's generate and ``probs`` cast the
# model's logits to float32 first, whatever its dtype). HF's warper divides them as they are: from
# this temperature up, any logit below 3e8 (far past any model's) stays under float32's 3.4e38;
# below it they overflow sooner and the probabilities turn NaN. Ours shifts the top logit to 0
# first, but a temperature like 1e-300 is 0 in float32 all the same. So small a temperature is
# greedy decoding in all but name: it is refused, and the bench's HF baseline never sees it.
MIN_TEMPERATURE = 1e-30


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0
    top_k: int = 0  # 0 = no top-k filter
    top_p: float = 1.0  # 1.0 = no nucleus filter; 0.0 = only the most likely token

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature <= 0:
            raise LayerskipError(
                f"temperature must be a finite number > 0, got {self.temperature} "
                "(use greedy decoding instead of temperature 0)"
            )
        if self.temperature < MIN_TEMPERATURE:
            raise LayerskipError(
                f"temperature must be at least {MIN_TEMPERATURE:g}, got {self.temperature:g}: logits divided by it "
                "overflow float32; use greedy decoding, which so small a temperature amounts to"
            )
        if self.top_k < 0:
            raise LayerskipError("top_k must be >= 0 (0 disables it)")
        # 0 keeps only the most likely token, as transformers' top-p warper does (plain generate takes it).
        if not 0.0 <= self.top_p <= 1.0:
            raise LayerskipError("top_p must be in [0, 1] (1 keeps every token, 0 only the most likely)")

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


# -- token trees -----------------------------------------------------------------------------------
#
# A tree block is ``[pending, node 0, ..., node n-1]``: node i sits at block position i + 1 and
# its parent is an earlier node or ROOT (the pending token, block position 0). The target's
# rows ``p [n+1, V]`` / argmax ``targets [n+1]`` are indexed by block position.

ROOT = -1


@dataclass(frozen=True)
class Draw:
    """How a drafted token was chosen, which decides how a sampled verify must test it.

    * ``q_row is None``: deterministic (a prompt-lookup match, the draft's argmax or its top-k
      alternatives taken in rank order). Its q is one-hot: it is accepted with probability r(x),
      and rejecting it removes x from the residual r.
    * ``q_row = i``, ``without_replacement=False``: an independent draw from ``q[i]`` (a sampled
      draft chain token, or SpecInfer's i.i.d. siblings). Accepted with min(1, r(x)/q(x)); on
      rejection r <- norm(max(0, r - q)).
    * ``q_row = i``, ``without_replacement=True``: drawn from ``q[i]`` without the tokens drawn
      from ``q[i]`` before it at the same parent (Sequoia's siblings; the chain token is the first
      draw). It is tested against that renormalised q, as above.

    Exactness needs every proposal to be tested against the distribution it was really drawn
    from, given the ones tested before it at that parent; the order of a parent's attempts is
    the order they were drawn and added.
    """

    q_row: int | None = None
    without_replacement: bool = False


DETERMINISTIC = Draw()


@dataclass(frozen=True)
class Attempt:
    """One proposal of the child ``node`` at ``parent``: the verify tests a parent's attempts in order.

    Two attempts may propose the same node (a lookup match and a sampled draft that drew the
    same token): the second one, certain to be rejected, still moves the residual.
    """

    parent: int  # node index, ROOT for the pending token
    node: int
    proposal: Draw = DETERMINISTIC


def accept_tree_greedy(tokens: list[int], parents: list[int], targets: list[int]) -> tuple[list[int], int]:
    """Greedy acceptance of a token tree: ``targets [n+1]`` is the full model's argmax at each block position.

    Walks from the root, following the child whose token is the argmax at its parent. Returns the
    accepted path (node indices, root excluded) and the next token: the argmax at its last node.
    Node tokens are distinct among siblings (a merged tree), so at most one child matches.
    """
    children: dict[int, dict[int, int]] = {}
    for node, (token, parent) in enumerate(zip(tokens, parents, strict=True)):
        children.setdefault(parent, {}).setdefault(token, node)
    path: list[int] = []
    node = ROOT
    while (child := children.get(node, {}).get(targets[node + 1])) is not None:
        path.append(child)
        node = child
    return path, targets[node + 1]


def proposal_distribution(
    proposal: Draw, token: int, q: torch.Tensor | None, drawn: list[int], like: torch.Tensor
) -> torch.Tensor:
    """The ``[V]`` distribution ``token`` was drawn from; ``drawn``: tokens drawn from the same q row
    before it at this parent. ``like``: a ``[V]`` float tensor giving the device and dtype."""
    if proposal.q_row is None:
        return torch.zeros_like(like).index_fill_(0, torch.tensor([token], device=like.device), 1.0)
    row = q[proposal.q_row].to(like.dtype)
    if proposal.without_replacement and drawn:
        row = row.index_fill(0, torch.tensor(drawn, device=row.device), 0.0)
        row = row / row.sum()
    return row


def residual_after_rejection(r: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, r - q)): what the output must follow once a draw from q was rejected against r."""
    residual = (r - q).clamp_min(0)
    total = residual.sum()
    # total = 0 only when r <= q everywhere, i.e. r == q, where a rejection cannot happen.
    return residual / total if total > 0 else r


def verify_tree_sampled(
    tokens: list[int],
    attempts: list[Attempt],
    p: torch.Tensor,
    q: torch.Tensor | None,
    generator: torch.Generator | None,
) -> tuple[list[int], int]:
    """Multi-candidate rejection sampling over a token tree (SpecInfer; Sequoia without replacement).

    tokens: ``[n]`` node tokens; attempts: every proposal, in drawing order per parent; p:
    ``[n+1, V]`` target probabilities per block position; q: ``[m, V]`` the proposal rows that
    ``Draw.q_row`` indexes (None if every proposal is deterministic). At each node, starting
    with r = p there, the node's attempts are tried in order: child x is accepted with
    min(1, r(x)/q_x(x)), where q_x is the distribution x was drawn from (``proposal_distribution``);
    on rejection r <- norm(max(0, r - q_x)) and the next attempt is tried. An accepted child
    becomes the node; when none is accepted the next token is drawn from r. The output follows p
    exactly. On a chain (one independent attempt per node) this is the standard chain rule.

    Returns (accepted path as node indices, next token).
    """
    by_parent: dict[int, list[tuple[int, Attempt]]] = {}
    for order, attempt in enumerate(attempts):
        by_parent.setdefault(attempt.parent, []).append((order, attempt))
    # One uniform per attempt, drawn up front: one generator call for the whole tree (a chain
    # draws as many as it has tokens, as the chain rule does).
    uniform = torch.rand(len(attempts), generator=generator, device=p.device).tolist() if attempts else []
    # Each attempt's p(x) and q(x) before any rejection at its parent, read back at once: a chain
    # that is accepted reads nothing else.
    first_p, first_q = _first_chances(tokens, attempts, p, q)
    path: list[int] = []
    node = ROOT
    while True:
        r = p[node + 1].float()
        rejected = False
        drawn: dict[int, list[int]] = {}  # q row -> tokens drawn from it at this node so far
        for order, attempt in by_parent.get(node, []):
            token = tokens[attempt.node]
            row = attempt.proposal.q_row
            earlier = list(drawn.get(row, [])) if row is not None else []
            if row is not None:
                drawn.setdefault(row, []).append(token)
            q_x: torch.Tensor | None = None
            if rejected or (attempt.proposal.without_replacement and earlier):
                q_x = proposal_distribution(attempt.proposal, token, q, earlier, r)
                r_token, q_token = float(r[token]), float(q_x[token])
            else:
                r_token, q_token = first_p[order], first_q[order]
            # u < r(x)/q(x), written without the division (q(x) > 0 for a token drawn from q).
            if uniform[order] * q_token < r_token:
                path.append(attempt.node)
                node = attempt.node
                break
            if q_x is None:
                q_x = proposal_distribution(attempt.proposal, token, q, earlier, r)
            r = residual_after_rejection(r, q_x)
            rejected = True
        else:
            return path, int(sample(r, generator))


def _first_chances(
    tokens: list[int], attempts: list[Attempt], p: torch.Tensor, q: torch.Tensor | None
) -> tuple[list[float], list[float]]:
    """Per attempt, p(x) at its parent and the q(x) it was drawn with (1 for a deterministic one)."""
    if not attempts:
        return [], []
    index = torch.tensor([tokens[a.node] for a in attempts], device=p.device)
    rows = torch.tensor([a.parent + 1 for a in attempts], device=p.device)
    first_p = p[rows, index].float().tolist()
    first_q = [1.0] * len(attempts)
    drawn = [i for i, a in enumerate(attempts) if a.proposal.q_row is not None]
    if drawn:
        assert q is not None, "an attempt drawn from q needs the q rows"
        q_rows = torch.tensor([attempts[i].proposal.q_row for i in drawn], device=q.device)
        values = q[q_rows, index[drawn].to(q.device)].float().tolist()
        for i, value in zip(drawn, values, strict=True):
            first_q[i] = value
    return first_p, first_q
