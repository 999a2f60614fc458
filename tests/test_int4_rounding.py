"""The int4 copy's rounding: each group's scale and minimum fitted by least squares, each input
weighed by what the model feeds it.

Weights already on a 4-bit grid (a Q4_1 file's, or Q4_K blocks using 15 of the 16 levels) stay
exact, weighed or not; off it, no group's error exceeds what rounding by its min and max made; a
weighed fit moves the error off the heavy inputs; the input moments are what the projections saw,
and reading them leaves no hook behind; the kernel holds what ``int4_grid(stored=True)``
describes; and an int4 draft stays lossless.
"""

from __future__ import annotations

import pytest
import torch
from compare import assert_same_tokens, hf_greedy
from tiny_models import random_prompt, tiny_model

from layerskip.drafts.model.draft_model import DraftModel, input_moments
from layerskip.drafts.model.precision import (
    INT4_GROUP,
    LowPrecisionProjection,
    importance,
    int4_grid,
    int4_rounding_error,
)
from layerskip.drafts.policy.skip_policy import DraftSettings, SkipPolicy
from layerskip.engine.decoding import DecodeSettings, decode
from layerskip.hf.lean import projection_groups

ROWS, COLUMNS = 48, 4 * INT4_GROUP


def _on_grid(levels: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``levels [rows, groups, 32]`` on per-group grids whose scale and zero are bf16 values."""
    shape = levels.shape[:2]
    scale = (torch.rand(shape, generator=generator) * 0.01 + 0.001).to(torch.bfloat16).float()
    zero = (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16).float()
    return ((levels - 8) * scale[..., None] + zero[..., None]).reshape(levels.shape[0], -1)


def _dequantised(weight: torch.Tensor, stored: bool = False, weights: torch.Tensor | None = None) -> torch.Tensor:
    levels, scale, low = int4_grid(weight, stored=stored, input_weights=weights)
    return (levels * scale[..., None] + low[..., None]).reshape(weight.shape)


@pytest.mark.parametrize("lowest", [0, 1], ids=["16-levels", "15-levels"])
def test_weights_on_a_4bit_grid_stay_exact(lowest: int) -> None:
    generator = torch.Generator().manual_seed(0)
    levels = torch.randint(lowest, 16, (ROWS, COLUMNS // INT4_GROUP, INT4_GROUP), generator=generator).float()
    levels[..., 0], levels[..., 1] = lowest, 15  # every group spans its levels, as a GGUF block does
    weight = _on_grid(levels, generator)
    assert (_dequantised(weight) - weight).norm() / weight.norm() < 1e-6
    heavy = importance(torch.rand(COLUMNS, generator=generator) ** 8)  # a few inputs carry most
    assert (_dequantised(weight, weights=heavy) - weight).norm() / weight.norm() < 1e-6
    assert int4_rounding_error([weight]) < 1e-6
    if not lowest:  # a grid spanning 15 levels may be fitted one level lower, its zero then not bf16
        assert torch.equal(_dequantised(weight, stored=True), weight)  # bf16 scale and zero: as stored


def test_the_fit_is_never_worse_than_min_max_per_group() -> None:
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(ROWS, COLUMNS, generator=generator) * 0.02
    weight[torch.rand(weight.shape, generator=generator) < 0.01] *= 8  # a few outliers
    groups = weight.reshape(-1, INT4_GROUP)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    step = (high - low) / 15
    min_max = ((groups - low) / step).round() * step + low
    old = ((min_max - groups) ** 2).sum(-1)
    new = ((_dequantised(weight).reshape(-1, INT4_GROUP) - groups) ** 2).sum(-1)
    assert (new <= old + 1e-6 * (groups**2).sum(-1)).all()  # fp32 sums: a relative 1e-6 slack
    assert new.sum() < 0.9 * old.sum()  # and lower overall (0.80 of it on this draw)


def test_a_weighed_fit_moves_the_error_off_the_heavy_inputs() -> None:
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(ROWS, COLUMNS, generator=generator) * 0.02
    moments = torch.ones(COLUMNS)
    moments[torch.randperm(COLUMNS, generator=generator)[: COLUMNS // 16]] = 400.0  # two heavy inputs per group
    heavy = importance(moments)
    assert heavy is not None

    def weighed_error(dequantised: torch.Tensor) -> torch.Tensor:
        return (heavy * (dequantised - weight) ** 2).reshape(-1, INT4_GROUP).sum(-1)  # [groups]

    groups = weight.reshape(-1, INT4_GROUP)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    step = (high - low) / 15
    min_max = (((groups - low) / step).round() * step + low).reshape(weight.shape)
    weighed, alike = weighed_error(_dequantised(weight, weights=heavy)), weighed_error(_dequantised(weight))
    assert (weighed <= weighed_error(min_max) * (1 + 1e-5)).all()  # never worse than min/max, per group
    assert weighed.sum() < 0.7 * alike.sum()  # and well below the fit that weighs every input alike
    assert importance(None) is None and importance(torch.zeros(COLUMNS)) is None  # nothing to weigh by


def test_input_moments_are_what_the_projections_saw_and_leave_no_hook() -> None:
    model = tiny_model("llama")
    groups = [modules for kind in ("attention", "mlp") for modules in projection_groups(model, 0, kind)]
    seen: dict[int, torch.Tensor] = {}

    def record(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        seen[id(module)] = args[0].detach().reshape(-1, args[0].shape[-1])

    handles = [modules[0].register_forward_pre_hook(record) for modules in groups]
    try:
        moments = input_moments(model, groups)
    finally:
        for handle in handles:
            handle.remove()
    assert set(moments) == {id(modules[0]) for modules in groups}
    for key, inputs in seen.items():
        assert torch.allclose(moments[key], (inputs.float() ** 2).mean(0), rtol=1e-5)
    DraftModel(model, "int4")
    assert not any(module._forward_pre_hooks for module in model.modules())


def test_the_kernel_holds_the_stored_grid() -> None:
    weight = torch.randn(ROWS, COLUMNS, generator=torch.Generator().manual_seed(2)) * 0.02
    projection = LowPrecisionProjection(weight, None, "int4")
    assert projection.precision == "int4"
    kernel = projection.matmul(torch.eye(COLUMNS, dtype=torch.bfloat16)).t().float()  # [out, in]
    expected = _dequantised(weight, stored=True)
    assert torch.allclose(kernel, expected, rtol=2**-8, atol=1e-6)  # the kernel's bf16 output
    assert (kernel - weight).norm() / weight.norm() < 0.075  # min/max made 0.079 here


def test_an_int4_draft_is_lossless() -> None:
    model = tiny_model("llama")
    policy = SkipPolicy(skip_attention=(1,), skip_mlp=(3,), draft=DraftSettings(precision="int4"))
    tokens, stats = decode(model, random_prompt(), policy, DecodeSettings(max_new_tokens=24))
    reference, logits = hf_greedy(model, random_prompt(), 24)
    assert_same_tokens(tokens, reference, ref_logits=logits, label="int4 draft")
    assert stats.accepted > 0
