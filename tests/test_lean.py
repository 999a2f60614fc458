"""The lean one-token draft step against HF's forward with the same skip set, on every tiny architecture."""

from __future__ import annotations

import pytest
import torch
from tiny_models import ARCHS, random_prompt, tiny_model

from layerskip.drafts.model.draft_model import DraftModel
from layerskip.hf import adapters
from layerskip.hf.cache import RollbackCache
from layerskip.hf.forward import full_logits
from layerskip.hf.lean import LEAN_FAMILIES

SKIP_SETS = [((), ()), ((1,), ()), ((), (2,)), ((0,), (0,)), ((0, 3), (1,))]
COVERED = [arch for arch in ARCHS if arch in LEAN_FAMILIES]


def _draft_hidden(
    model: torch.nn.Module, draft: DraftModel, skip: tuple, prompt: list[int], steps: int
) -> torch.Tensor:
    """``[steps, H]``: the draft's final hidden states over ``steps`` tokens fed one at a time after
    the prompt (prefilled by the full model), each writing its K/V for the next."""
    cache = RollbackCache(adapters.sliding_windows(model))
    hidden, token = [], prompt[-1]
    with torch.inference_mode():
        full_logits(model, torch.tensor([prompt]), cache, 1)
        with draft.active(*skip):
            for _ in range(steps):
                hidden.append(draft.hidden(torch.tensor([[token]]), cache)[0, -1])
                token = (token * 7 + 3) % 128
    return torch.stack(hidden)


@pytest.mark.parametrize("arch", COVERED)
def test_lean_step_matches_the_hf_forward(arch: str) -> None:
    model = tiny_model(arch)
    lean, reference = DraftModel(model), DraftModel(model, lean=False)
    assert lean.step_kind == "lean" and reference.step_kind.startswith("hf")
    prompt = random_prompt(length=10)  # longer than the tiny sliding window (4): windows are exercised
    for skip in SKIP_SETS:
        got = _draft_hidden(model, lean, skip, prompt, 6)
        want = _draft_hidden(model, reference, skip, prompt, 6)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"{arch} skip {skip}")


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_lean_step_in_low_precision_stays_near_the_hf_forward(arch: str) -> None:
    """The same bf16 copies through both paths: only where the casts fall differs."""
    model = tiny_model(arch)
    lean, reference = DraftModel(model, "bfloat16"), DraftModel(model, "bfloat16", lean=False)
    prompt = random_prompt(length=10)
    for skip in SKIP_SETS[:3]:
        got = _draft_hidden(model, lean, skip, prompt, 4)
        want = _draft_hidden(model, reference, skip, prompt, 4)
        assert float((got - want).abs().max() / want.abs().max()) < 3e-2, f"{arch} skip {skip}"


def test_fused_low_precision_copies_serve_the_hf_forward_too() -> None:
    """Q/K/V and gate/up are one fused copy each; the HF forward's members slice one product."""
    model = tiny_model("llama")
    draft = DraftModel(model, "bfloat16")
    groups = [group for _, group in draft.projections[(0, "attention")]]
    assert [len(group.modules) for group in groups] == [3, 1]
    assert [len(group.modules) for _, group in draft.projections[(0, "mlp")]] == [2, 1]


@pytest.mark.parametrize("arch", [arch for arch in ARCHS if arch not in LEAN_FAMILIES])
def test_uncovered_architectures_say_why_and_use_the_hf_forward(arch: str) -> None:
    draft = DraftModel(tiny_model(arch))
    assert draft.lean is None and draft.step_kind.startswith("hf (")


def test_an_exit_draft_keeps_the_hf_forward() -> None:
    from layerskip.drafts.model.exit_adapter import ExitAdapter, ExitSpec

    model = tiny_model("llama")
    adapter = ExitAdapter.fresh(model, ExitSpec(layer=1, kind="linear"))
    assert DraftModel(model, exit=adapter).step_kind.startswith("hf (an exit adapter")


def test_compiled_lean_step_matches_the_eager_one() -> None:
    """``compile=True`` runs the same lean step through torch.compile (one graph per skip set); it
    must give the eager step's hidden states and leave the cache where the eager step leaves it.
    The "eager" backend captures the same whole graph (fullgraph, dynamic cache length) without
    inductor's code generation, which would add half a minute to the suite."""
    model = tiny_model("llama")
    compiled, eager = DraftModel(model, compile="eager"), DraftModel(model)
    assert compiled.compile and not eager.compile
    prompt = random_prompt(length=10)
    skip = ((1,), (2,))
    got = _draft_hidden(model, compiled, skip, prompt, 3)
    want = _draft_hidden(model, eager, skip, prompt, 3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
