"""Off-grid twins: decoder weights moved by at most the asked share of their block's 4-bit step."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_helpers import assert_bad_input, run_in_process
from tiny_models import random_prompt, tiny_model

from layerskip.cli.twin import main as twin_main
from layerskip.drafts.model.precision import int4_rounding_error
from layerskip.hf import adapters
from layerskip.hf.twin import BLOCK, LEVELS, decoder_projection_weights, off_grid_

REPO = Path(__file__).resolve().parents[1]


def _weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [
        adapters.projection_weight(m)[0].detach().clone()
        for i in range(adapters.num_layers(model))
        for kind in ("attention", "mlp")
        for m in adapters.sublayer_projections(model, i, kind)
    ]


def test_noise_stays_within_half_a_step_and_is_seeded() -> None:
    model = tiny_model("llama")
    before = _weights(model)
    changed = off_grid_(model, scale=0.5, seed=3)
    after = _weights(model)
    assert changed == sum(w.numel() for w in before)
    for old, new in zip(before, after, strict=True):
        usable = old.shape[1] - old.shape[1] % BLOCK
        blocks = old[:, :usable].reshape(old.shape[0], -1, BLOCK)
        step = ((blocks.amax(-1) - blocks.amin(-1)) / LEVELS).repeat_interleave(BLOCK, dim=1)
        moved = (new[:, :usable] - old[:, :usable]).abs()
        assert bool((moved <= 0.5 * step + 1e-6).all()) and float(moved.max()) > 0
    again = tiny_model("llama")
    off_grid_(again, scale=0.5, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(after, _weights(again), strict=True))
    head = adapters.lm_head(model).weight
    assert torch.equal(head, adapters.lm_head(tiny_model("llama")).weight)  # the head is left alone


def test_the_twin_still_computes_nearly_the_same_logits() -> None:
    model, twin = tiny_model("llama"), tiny_model("llama")
    off_grid_(twin, scale=0.5)
    ids = torch.tensor([random_prompt()])
    with torch.inference_mode():
        a, b = model(input_ids=ids).logits, twin(input_ids=ids).logits
    assert 0 < float((a - b).abs().max()) < 0.1 * float(a.abs().max())


def test_the_script_writes_a_loadable_twin_and_never_overwrites(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "twin"
    run = [sys.executable, str(REPO / "scripts" / "make_twin.py"), "--model", str(tiny_llama), "--out", str(out)]
    done = subprocess.run(run, capture_output=True, text=True, cwd=REPO)  # the script as users run it
    assert done.returncode == 0, done.stderr
    assert (out / "config.json").is_file() and (out / "twin.json").is_file()
    from layerskip.hf.models import load_model

    assert load_model(str(out)).model is not None
    assert "int4 copy" in done.stderr and "int4_rounding_error" in (out / "twin.json").read_text()
    # The same command again, in-process (no second interpreter start): refused in one line.
    again = run_in_process(twin_main, capsys, "--model", str(tiny_llama), "--out", str(out))
    assert_bad_input(again, "exists")


@torch.no_grad()
def test_the_int4_rounding_error_is_zero_on_the_grid_and_grows_off_it() -> None:
    model = tiny_model("llama")
    for i in range(adapters.num_layers(model)):  # put every projection on the int4 grid first
        for kind in ("attention", "mlp"):
            for module in adapters.sublayer_projections(model, i, kind):
                weight = adapters.projection_weight(module)[0]
                usable = weight.shape[1] - weight.shape[1] % BLOCK
                blocks = weight[:, :usable].reshape(weight.shape[0], -1, BLOCK)
                low = blocks.amin(-1, keepdim=True)
                step = (blocks.amax(-1, keepdim=True) - low) / LEVELS
                weight[:, :usable] = (((blocks - low) / step).round() * step + low).reshape(weight.shape[0], usable)
    assert int4_rounding_error(decoder_projection_weights(model)) < 1e-5
    off_grid_(model, scale=0.5)
    assert 0.02 < int4_rounding_error(decoder_projection_weights(model)) < 0.2
