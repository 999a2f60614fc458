"""Lower-precision copies of the projections the draft keeps; the full model verifies in its own dtype.

A draft step of a small model on a CPU streams every kept weight from memory once per token,
so the bytes it reads set its cost. A draft may therefore run its kept linear projections from
a copy in a narrower format while the verify keeps the model's own weights: the output stays
exactly the full model's (verify decides every token), only the acceptance may move.

* ``bfloat16``: a bf16 copy of each weight; any device.
* ``int8``: per-output-channel symmetric int8 weights (``torch.ops.aten._weight_int8pack_mm``,
  bf16 activations); CPU.
* ``int4``: groupwise (32 inputs) asymmetric int4 weights, the layout of GGUF's Q4_0/Q4_1/Q4_K
  blocks (``_weight_int4pack_mm_for_cpu``, bf16 activations); CPU. A projection whose input
  width is not a multiple of the group (or output width of 16) falls back to bf16.

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
    trained adapter's weights do not: rounding them to int4 (error 0.03-0.06) cost SmolLM2's
    trained exits most of what they learnt (teacher-forced agreement after 20 layers 0.22 -> 0.01,
    after 27 layers 0.74 -> 0.57), while int8 (error 0.01) keeps it. So they stay in int8.
    """
    return "int8" if precision == "int4" else precision


class LowPrecisionProjection:
    """A callable standing in for one projection's ``forward``: ``x [..., in] -> [..., out]``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, precision: str) -> None:
        weight = weight.detach()
        out_features, in_features = weight.shape
        if precision == "int4" and (in_features % INT4_GROUP or out_features % INT4_OUT_MULTIPLE):
            precision = "bfloat16"  # the int4 kernel's layout needs these multiples
        self.precision = precision
        self.bias = None if bias is None else bias.detach().to(torch.bfloat16)
        self._matmul = _BUILDERS[precision](weight)
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
    quantised exactly as it would be alone, and one kernel reads them all. ``matmul`` is the
    fused product (the lean draft step calls it); ``replacements`` stand in for each member's
    ``forward`` in the HF forward: the first member called with an input runs the product, the
    others slice the same result (HF passes one tensor object to all of Q/K/V, and to gate/up).
    """

    def __init__(
        self, modules: list[nn.Module], weights: list[tuple[torch.Tensor, torch.Tensor | None]], precision: str
    ):
        weight = torch.cat([w.detach() for w, _ in weights])
        biases = [b for _, b in weights]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([b.detach() if b is not None else w.new_zeros(w.shape[0]) for w, b in weights])
        self.modules = modules
        self.projection = LowPrecisionProjection(weight, bias, precision)
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


def _bfloat16(weight: torch.Tensor) -> _Matmul:
    w = weight.to(torch.bfloat16).contiguous()
    return _Matmul(lambda x: nn.functional.linear(x, w), w)


def _int8(weight: torch.Tensor) -> _Matmul:
    w = weight.float()
    scales = (w.abs().amax(dim=1) / 127).clamp_min(1e-12)  # [out]
    quantized = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
    scales = scales.to(torch.bfloat16)
    return _Matmul(lambda x: torch.ops.aten._weight_int8pack_mm(x, quantized, scales), quantized, scales)


def int4_grid(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight [out, in]`` (``in`` a multiple of ``INT4_GROUP``) on the int4 copy's grid: its
    levels ``[out, groups, 32]`` (0..15, as floats), and each group's scale and minimum ``[out, groups]``."""
    groups = weight.float().reshape(weight.shape[0], -1, INT4_GROUP)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)  # [out, groups]
    scale = ((high - low) / 15).clamp_min(1e-12)
    return torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15), scale, low


def int4_rounding_error(weights: Iterable[torch.Tensor]) -> float:
    """The median over ``weights`` (each ``[out, in]``; inputs past the last whole group left out)
    of the relative error the int4 copy makes, ``|W - int4(W)| / |W|`` (Frobenius): about 0 for
    weights already on its grid (a Q4_1 file's), about 0.08 for weights off it (a full-precision
    model's)."""
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


def _int4(weight: torch.Tensor) -> _Matmul:
    out_features, in_features = weight.shape
    q, scale, low = int4_grid(weight)
    q = q.to(torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.reshape(out_features, in_features), 1)
    # The kernel dequantises (q - 8) * scale + zero, so zero = low + 8 * scale; layout [groups, out, 2].
    scales_and_zeros = torch.stack([scale.t(), (low + 8 * scale).t()], dim=-1).to(torch.bfloat16).contiguous()
    return _Matmul(
        lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, INT4_GROUP, scales_and_zeros),
        packed,
        scales_and_zeros,
    )


_BUILDERS: dict[str, Callable[[torch.Tensor], _Matmul]] = {"bfloat16": _bfloat16, "int8": _int8, "int4": _int4}
