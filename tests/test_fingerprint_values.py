"""A policy (or exit adapter) names the weights it was tuned on, not only their shapes.

A fine-tune has the base model's names and shapes, so the shape fingerprint alone would hand it
the base model's policy without a word (exact output, but choices and speed measured on other
weights). The identity also records a digest of a sample of the weights' values; another model of
the same shape is refused in one line. Files written before that field existed hold the shape
fingerprint only and still load, checked by shapes.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from tiny_models import random_prompt, tiny_model

import layerskip
from layerskip.drafts.builder import check_policy_fits
from layerskip.drafts.model.exit_adapter import ExitAdapter, ExitSpec
from layerskip.drafts.policy.skip_policy import DraftSettings, SkipPolicy
from layerskip.errors import LayerskipError
from layerskip.hf import adapters

POLICY = SkipPolicy.skip_layers([1, 2], draft=DraftSettings(max_draft_tokens=3))
POLICIES = Path(__file__).resolve().parents[1] / "policies"


@pytest.fixture(scope="module")
def base() -> torch.nn.Module:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def tuned(base: torch.nn.Module) -> torch.nn.Module:
    """The base model after a small fine-tune: every weight moved by about 1% of its spread."""
    model = copy.deepcopy(base)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for parameter in model.parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            parameter.add_(0.01 * parameter.std().nan_to_num(1.0) * noise)
    return model


def _refused(call) -> str:
    with pytest.raises(LayerskipError) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_the_digest_tells_weights_apart_but_not_dtypes(base: torch.nn.Module, tuned: torch.nn.Module) -> None:
    assert adapters.weights_fingerprint(tuned) == adapters.weights_fingerprint(base)  # the same shapes
    assert adapters.weights_sample_digest(tuned) != adapters.weights_sample_digest(base)
    assert adapters.weights_sample_digest(copy.deepcopy(base)) == adapters.weights_sample_digest(base)
    # One checkpoint loaded in float32 or bfloat16 is one model.
    half = copy.deepcopy(base).to(torch.bfloat16)
    assert adapters.weights_sample_digest(half) == adapters.weights_sample_digest(base)


def test_a_policy_for_the_same_shape_with_other_weights_is_refused(
    base: torch.nn.Module, tuned: torch.nn.Module, tmp_path: Path
) -> None:
    policy = POLICY.with_model(base, "base")
    assert policy.model.weights_sample == adapters.weights_sample_digest(base)
    check_policy_fits(base, policy)
    check_policy_fits(copy.deepcopy(base).to(torch.bfloat16), policy)
    message = _refused(lambda: check_policy_fits(tuned, policy))
    assert "same shape" in message and "weights differ" in message and "base" in message
    # The field is saved and read back, so the file is as strict as the policy.
    loaded = SkipPolicy.load(policy.save(tmp_path / "p.json"))
    assert loaded == policy
    _refused(lambda: check_policy_fits(tuned, loaded))


def test_the_plugin_refuses_another_models_policy(
    base: torch.nn.Module, tuned: torch.nn.Module, tmp_path: Path
) -> None:
    path = POLICY.with_model(base, "base").save(tmp_path / "base.json")
    ids = torch.tensor([random_prompt()])
    arguments = dict(custom_generate=layerskip.custom_generate_path(), trust_remote_code=True, max_new_tokens=8)
    ours = base.generate(ids, skip_policy=str(path), **arguments)
    assert ours.tolist() == base.generate(ids, max_new_tokens=8).tolist()
    message = _refused(lambda: tuned.generate(ids, skip_policy=str(path), **arguments))
    assert "weights differ" in message


def test_a_file_without_the_values_is_checked_by_shapes(
    base: torch.nn.Module, tuned: torch.nn.Module, tmp_path: Path
) -> None:
    data = POLICY.with_model(base, "base").to_dict()
    del data["model"]["weights_sample"]  # as files written before the field existed
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    old = SkipPolicy.load(path)
    assert old.model.weights_sample == "" and old.model.fingerprint
    check_policy_fits(tuned, old)  # nothing to tell the weights apart by: accepted, as before
    wider = tiny_model("llama", intermediate_size=96)
    assert "weight shapes differ" in _refused(lambda: check_policy_fits(wider, old))


def test_the_committed_policies_still_load() -> None:
    files = sorted(POLICIES.rglob("*.json"))
    assert files
    for path in files:
        policy = SkipPolicy.load(path)
        assert policy.model.weights_sample == "" or len(policy.model.weights_sample) == 16, path


def test_an_exit_adapter_for_other_weights_is_refused(
    base: torch.nn.Module, tuned: torch.nn.Module, tmp_path: Path
) -> None:
    from safetensors.torch import load, save

    from layerskip.drafts.model.exit_adapter import _metadata

    path = tmp_path / "exit.safetensors"
    payload = ExitAdapter.fresh(base, ExitSpec(layer=1, kind="linear", rank=4)).to_bytes()
    path.write_bytes(payload)
    assert ExitAdapter.load(path, base).weights_sample == adapters.weights_sample_digest(base)
    message = _refused(lambda: ExitAdapter.load(path, tuned))
    assert "same shape" in message and "weights differ" in message
    metadata = _metadata(payload)
    del metadata["weights_sample"]  # an adapter file written before the field existed
    path.write_bytes(save(load(payload), metadata=metadata))
    ExitAdapter.load(path, tuned)
