"""Lower-precision copies of the projections the draft keeps; the full model verifies in its own dtype.

A draft step of a small model on a CPU streams every kept weight from memory once per token,
so the bytes it reads set its cost. A draft may therefore run its kept linear projections from
a copy in a narrower format while the verify keeps the model's own weights: the output stays
exactly the full model's (verify decides every token), only the acceptance may move.

* ``bfloat16``: a bf16 copy of each weight; any device.
* ``int8``: per-output-channel symmetric int8 weights (``torch.ops.aten._weight_int8pack_mm``,
  bf16 activations); CPU.
* ``int4``: groupwise (32 inputs) asymmetric int4 weights, the layout of GGUF's Q4_0/Q4_1/Q4_K
  blocks (``_weight_int4pack_mm_for_cpu``, bf16 activations); CPU. Each group's scale and
  minimum are fitted by least squares (``int4_grid``), weighing each input by what the model
  feeds it (``importance``), so weights already on such a grid stay on it and the error lands
  where the inputs are small. A projection whose input width is not a multiple of the group (or
  output width of 16) falls back to bf16.

Activations are cast to bf16 at each projection and back, so the residual stream, the norms
and the shared KV cache stay in the model's dtype. The copies cost memory: ``nbytes`` reports it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from layerskip.errors import LayerskipError

PRECISIONS = ("model", "bfloat16", "int8", "int4")
CPU_ONLY = ("int8", "int4")
INT4_GROUP = 32
INT4_OUT_MULTIPLE = 16
INT4_TOP = 15  # levels 0..15
# Where the int4 fit starts, per group: (steps from the group's min to its max, level 0 this many
# steps below the min, least-squares rounds); the fit of smallest squared error is kept. Min/max
# comes first and a round never raises a fit's error, so no group ends worse than min/max and a
# group already on a 4-bit grid stays on it. 16 steps (half a step clipped at each end) and 14
# steps from the min reach other local optima; the latter also recovers Q4_K blocks that use 15
# of the 16 levels (Gemma-3's Q4_K tensors, its output and half its down projections: relative
# error 0.044-0.048 -> 0.0003 or less). Median relative error of a projection, min/max -> this fit
# (scale and minimum in fp32, docs/results/int4_rounding.csv): SmolLM2's off-grid twin 0.080 ->
# 0.073, Gemma-3 as shipped (mostly Q5_0/Q6_K/Q8_0 blocks, off the grid) 0.081 -> 0.072, Gaussian
# weights 0.078 -> 0.071. Each round is one pass for the levels and three sums over the weights:
# on the Gaussian, two rounds from min/max alone reach 0.0735, three 0.0729, these four 0.0713, a
# fifth (a second round from 16 steps) 0.0710. The four cost about 0.5 s per ~100M weights: an
# int4 DraftModel of SmolLM2 builds in 0.75 s instead of 0.22 s (Gemma-3: 0.69 s, 0.21 s; 2
# threads of an idle 2-core AMD EPYC, min of 3).
_INT4_STARTS = ((15.0, 0.0, 2), (16.0, -0.5, 1), (14.0, 0.0, 1))
# A product's error on an input x is sum_j (W_ij - Q_ij) x_j: where a few inputs carry most of the
# activation (a handful of channels hold values 10-100x the rest in most LLMs), the rounding error on
# their columns is what the draft sees. So each group is fitted to minimise sum_j h_j (W_j - Q_j)^2,
# h_j the input's mean square over the model's own activations (``DraftModel``: one forward over
# seeded random token ids, hooks on the projections' inputs), plus this share of the projection's
# mean (an input quiet on that text may not be quiet on the user's). Int4 agreement with the model
# (nothing bypassed, full head, 12 Spec-Bench prompts x 48 tokens; docs/results/int4_weighted_rounding.csv),
# every input alike -> weighed: SmolLM2's off-grid twin 0.78 -> 0.83, Gemma-3 as shipped 0.82 -> 0.89,
# Gemma-3's twin 0.77 -> 0.85; SmolLM2 as shipped (on the grid) 0.98 -> 0.97. Moments from the model's
# own greedy text instead of random ids gained at most 0.02 more and cost its generation; int8's row
# scales chosen the same way (clipped to 0.5-1.0 of the row's largest weight) gained nothing.
IMPORTANCE_FLOOR = 0.1
# Groups per chunk of the fit: 16384 groups of 32 fp32 weights are 2 MiB, so a chunk's passes run
# from cache (the elementwise passes timed fastest at this size among 4096-65536, 2-core EPYC).
_INT4_CHUNK = 16384


def check_precision(precision: str, device: torch.device) -> None:
    if precision not in PRECISIONS:
        raise LayerskipError(f"unknown draft precision '{precision}'; use one of {', '.join(PRECISIONS)}")
    if precision in CPU_ONLY and torch.device(device).type != "cpu":
        raise LayerskipError(
            f"draft precision '{precision}' runs on the CPU only; use 'bfloat16' (or 'model') on {device}"
        )


def trained_weights_precision(precision: str) -> str:
    """The precision for weights trained here (an exit adapter's) in a draft of ``precision``.

    A checkpoint loaded from a 4-bit GGUF already sits on int4's grid, so the draft's int4 copy
    of its projections is nearly exact (relative output error 0.003 on SmolLM2's Q4_1 layers). A
    trained adapter's weights do not: rounding them to int4 (error 0.03-0.06, by each group's min
    and max then) cost SmolLM2's trained exits most of what they learnt (teacher-forced agreement
    after 20 layers 0.22 -> 0.01, after 27 layers 0.74 -> 0.57), while int8 (error 0.01) keeps it.
    So they stay in int8.
    """
    return "int8" if precision == "int4" else precision


def importance(moments: torch.Tensor | None) -> torch.Tensor | None:
    """``moments [in]`` (each input's mean square) -> the weight of each input's rounding error in
    the int4 fit (None: every input alike, as where nothing reached the projection)."""
    if moments is None:
        return None
    mean = moments.float().mean()
    if not torch.isfinite(mean) or mean <= 0:
        return None
    return moments.float() + IMPORTANCE_FLOOR * mean


class LowPrecisionProjection:
    """A callable standing in for one projection's ``forward``: ``x [..., in] -> [..., out]``
    (``input_weights``: each input's ``importance`` in the int4 fit, ``[in]``; None: every input alike)."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        precision: str,
        input_weights: torch.Tensor | None = None,
    ) -> None:
        weight = weight.detach()
        out_features, in_features = weight.shape
        if precision == "int4" and (in_features % INT4_GROUP or out_features % INT4_OUT_MULTIPLE):
            precision = "bfloat16"  # the int4 kernel's layout needs these multiples
        self.precision = precision
        self.bias = None if bias is None else bias.detach().to(torch.bfloat16)
        self._matmul = _BUILDERS[precision](weight, input_weights)
        self.nbytes = sum(t.numel() * t.element_size() for t in self._tensors)

    def __call__(self, x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)  # [tokens, in]
        out = self.matmul(flat)  # [tokens, out] bf16
        return out.reshape(*x.shape[:-1], out.shape[-1]).to(x.dtype)

    def matmul(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat [tokens, in]`` bf16 -> ``[tokens, out]`` bf16: the product alone, no casts."""
        out = self._matmul(flat)
        return out if self.bias is None else out + self.bias

    @property
    def _tensors(self) -> list[torch.Tensor]:
        tensors = list(getattr(self._matmul, "tensors", ()))
        return tensors + ([self.bias] if self.bias is not None else [])


class FusedProjections:
    """Projections that share their input (Q/K/V; gate/up) as one low-precision product.

    The weights are concatenated along the output rows before quantising, so each row is
    quantised exactly as it would be alone (``input_weights``: the shared input's ``importance``),
    and one kernel reads them all. ``matmul`` is the
    fused product (the lean draft step calls it); ``replacements`` stand in for each member's
    ``forward`` in the HF forward: the first member called with an input runs the product, the
    others slice the same result (HF passes one tensor object to all of Q/K/V, and to gate/up).
    """

    def __init__(
        self,
        modules: list[nn.Module],
        weights: list[tuple[torch.Tensor, torch.Tensor | None]],
        precision: str,
        input_weights: torch.Tensor | None = None,
    ):
        weight = torch.cat([w.detach() for w, _ in weights])
        biases = [b for _, b in weights]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([b.detach() if b is not None else w.new_zeros(w.shape[0]) for w, b in weights])
        self.modules = modules
        self.projection = LowPrecisionProjection(weight, bias, precision, input_weights)
        self.precision = self.projection.precision
        self.nbytes = self.projection.nbytes
        bounds = [0]
        for w, _ in weights:
            bounds.append(bounds[-1] + w.shape[0])
        self.slices = [slice(a, b) for a, b in zip(bounds, bounds[1:])]
        self._last_input: torch.Tensor | None = None
        self._last_output: torch.Tensor | None = None

    def matmul(self, flat: torch.Tensor) -> torch.Tensor:
        return self.projection.matmul(flat)

    def replacements(self) -> list[tuple[nn.Module, Callable[..., torch.Tensor]]]:
        if len(self.modules) == 1:
            return [(self.modules[0], self.projection)]
        return [(module, self._member(part)) for module, part in zip(self.modules, self.slices)]

    def _member(self, part: slice) -> Callable[..., torch.Tensor]:
        def forward(x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
            if x is not self._last_input:
                self._last_input, self._last_output = x, self.projection(x)
            return self._last_output[..., part]

        return forward


class _Matmul:
    """``flat [tokens, in] bf16 -> [tokens, out] bf16`` with the tensors it holds (for ``nbytes``)."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], *tensors: torch.Tensor) -> None:
        self.fn = fn
        self.tensors = tensors

    def __call__(self, flat: torch.Tensor) -> torch.Tensor:
        return self.fn(flat)


# Each builder takes the weight and each input's weight in the fit (only int4's fit uses them: bf16
# rounds each weight alone, int8 scales by each row's largest, which weighing did not improve).
def _bfloat16(weight: torch.Tensor, input_weights: torch.Tensor | None = None) -> _Matmul:
    w = weight.to(torch.bfloat16).contiguous()
    return _Matmul(lambda x: nn.functional.linear(x, w), w)


def _int8(weight: torch.Tensor, input_weights: torch.Tensor | None = None) -> _Matmul:
    w = weight.float()
    scales = (w.abs().amax(dim=1) / 127).clamp_min(1e-12)  # [out]
    quantized = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
    scales = scales.to(torch.bfloat16)
    return _Matmul(lambda x: torch.ops.aten._weight_int8pack_mm(x, quantized, scales), quantized, scales)


def int4_grid(
    weight: torch.Tensor, stored: bool = False, input_weights: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight [out, in]`` (``in`` a multiple of ``INT4_GROUP``) on the int4 copy's grid: its
    levels ``[out, groups, 32]`` (0..15, as floats), and each group's scale and minimum ``[out, groups]``
    (the copy is ``levels * scale + minimum``), fitted to the weights (``_int4_fit``;
    ``input_weights [in]``: each input's share of the squared error, ``importance``; None: alike). With
    ``stored``, the scale and zero (``minimum + 8 * scale``) are rounded to bf16 as the kernel
    stores them, and the levels chosen for those rounded values."""
    out_features, in_features = weight.shape
    groups = weight.detach().float().reshape(-1, INT4_GROUP)  # [n, 32]
    if input_weights is None:
        input_weights = torch.ones(in_features)
    per_group = input_weights.float().to(groups.device).reshape(1, -1, INT4_GROUP)  # [1, in / 32, 32]
    per_group = per_group.expand(out_features, -1, -1).reshape(-1, INT4_GROUP)  # [n, 32], as ``groups``
    levels = torch.empty_like(groups)
    scale, low = groups.new_empty(groups.shape[0]), groups.new_empty(groups.shape[0])
    for first in range(0, groups.shape[0], _INT4_CHUNK):
        part = slice(first, first + _INT4_CHUNK)
        s, m = _int4_fit(groups[part], per_group[part])
        if stored:
            zero = (m + 8 * s).to(torch.bfloat16).float()
            s = s.to(torch.bfloat16).float()
            m = zero - 8 * s
        scale[part], low[part] = s, m
        levels[part] = _int4_levels(groups[part], s, m)
    return levels.reshape(out_features, -1, INT4_GROUP), scale.reshape(out_features, -1), low.reshape(out_features, -1)


def _int4_levels(groups: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """``groups [n, 32]``: each weight's nearest level 0..15 on its group's grid ``[n]``."""
    return ((groups - low[:, None]) / scale[:, None]).round_().clamp_(0, INT4_TOP)


def _int4_fit(groups: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``groups [n, 32]`` fp32 -> the scale and minimum ``[n]`` of each group's int4 grid: the fit
    of smallest weighted squared error (``weights [n, 32]``) among the least-squares refinements of
    ``_INT4_STARTS``."""
    low, high = groups.amin(-1), groups.amax(-1)
    span = high - low
    sums = (weights.sum(-1), (weights * groups).sum(-1))  # sum h, sum h w: the same for every fit
    best: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    for steps, below, rounds in _INT4_STARTS:
        scale = (span / steps).clamp_min(1e-12)
        start = low - below * scale
        for _ in range(rounds):
            scale, start, error = _int4_refit(groups, weights, sums, scale, start)
        if best is None:
            best = scale, start, error
        else:
            better = error < best[2]
            best = (
                torch.where(better, scale, best[0]),
                torch.where(better, start, best[1]),
                torch.where(better, error, best[2]),
            )
    assert best is not None
    return best[0], best[1]


def _int4_refit(
    groups: torch.Tensor,
    weights: torch.Tensor,
    sums: tuple[torch.Tensor, torch.Tensor],
    scale: torch.Tensor,
    low: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The levels ``q`` nearest to ``groups [n, 32]`` on the grids (``scale``, ``low``) ``[n]``,
    then the scale and minimum minimising ``sum h (q * scale + low - w)^2`` for them (``h``:
    ``weights``; closed form) and that error less ``sum h w^2`` (the same for every fit of a
    group, so errors compare). The error can only fall from the grid given: the same levels fit
    at least as well, and the next rounding to the nearest levels lowers it again (each weight's
    nearest level is its best whatever its ``h``)."""
    total, total_w = sums
    q = _int4_levels(groups, scale, low)
    hq = weights * q
    sum_q, sum_qq, sum_qw = hq.sum(-1), (hq * q).sum(-1), (hq * groups).sum(-1)
    det = total * sum_qq - sum_q * sum_q  # 0 only where every level is the same
    fitted = det > 0
    det = torch.where(fitted, det, 1.0)
    new_scale = (total * sum_qw - sum_q * total_w) / det
    fitted &= new_scale > 0
    scale = torch.where(fitted, new_scale, scale)
    # Where not fitted, the scale stays and the minimum is the best one for it.
    low = torch.where(fitted, (sum_qq * total_w - sum_q * sum_qw) / det, (total_w - scale * sum_q) / total)
    error = scale * (scale * sum_qq + 2 * low * sum_q - 2 * sum_qw) + low * (total * low - 2 * total_w)
    return scale, low, error


def int4_rounding_error(weights: Iterable[torch.Tensor]) -> float:
    """The median over ``weights`` (each ``[out, in]``; inputs past the last whole group left out)
    of the relative error the int4 rounding makes, ``|W - int4(W)| / |W|`` (Frobenius; scale and
    minimum in fp32): about 0 for weights already on its grid (a Q4_1 file's), about 0.07 for
    weights off it (a full-precision model's). The kernel's bf16 scale and zero add 0.002 on the
    grid (SmolLM2's projections) and under 0.0001 off it."""
    errors = []
    for weight in weights:
        usable = weight.shape[1] - weight.shape[1] % INT4_GROUP
        if not usable:
            continue
        w = weight[:, :usable].detach().float()
        levels, scale, low = int4_grid(w)
        rounded = (levels * scale[..., None] + low[..., None]).reshape(w.shape)
        errors.append(float((rounded - w).norm() / w.norm().clamp_min(1e-12)))
    return float(torch.tensor(errors).median()) if errors else 0.0


def _int4(weight: torch.Tensor, input_weights: torch.Tensor | None = None) -> _Matmul:
    out_features, in_features = weight.shape
    q, scale, low = int4_grid(weight, stored=True, input_weights=input_weights)
    q = q.to(torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.reshape(out_features, in_features), 1)
    # The kernel dequantises (q - 8) * scale + zero, so zero = low + 8 * scale (bf16 values
    # already: the levels were chosen for them); layout [groups, out, 2].
    scales_and_zeros = torch.stack([scale.t(), (low + 8 * scale).t()], dim=-1).to(torch.bfloat16).contiguous()
    return _Matmul(
        lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, INT4_GROUP, scales_and_zeros),
        packed,
        scales_and_zeros,
    )


_BUILDERS: dict[str, Callable[[torch.Tensor, torch.Tensor | None], _Matmul]] = {
    "bfloat16": _bfloat16,
    "int8": _int8,
    "int4": _int4,
}
