"""The decode profile: forward-cost curve, the overhead twin, and the per-token time split."""

from __future__ import annotations

import importlib.util
import json
import subprocess

import pytest
import torch
from cli_helpers import REPO, assert_bad_input, run_in_process, run_script
from tiny_models import ARCHS, random_prompt, save_checkpoint, tiny_model

from layerskip.drafts.policy.skip_policy import DraftSettings, SkipPolicy
from layerskip.hf import adapters
from layerskip.measure.profiling import ForwardCosts, forward_costs, markdown, profile_configs, profile_report

NEW_TOKENS = 12


@pytest.mark.parametrize("arch", ARCHS)
def test_overhead_twin_keeps_depth_and_shrinks_widths(arch: str) -> None:
    model = tiny_model(arch)
    twin = adapters.overhead_twin(model)
    assert adapters.architecture_of(twin) == adapters.architecture_of(model)
    assert adapters.num_layers(twin) == adapters.num_layers(model)
    assert adapters.sliding_windows(twin) == adapters.sliding_windows(model)
    assert sum(p.numel() for p in twin.parameters()) < sum(p.numel() for p in model.parameters())
    ids = torch.tensor([random_prompt(adapters.TWIN_VOCAB)])
    assert twin(input_ids=ids).logits.shape == (1, ids.shape[1], adapters.TWIN_VOCAB)


def test_block_cost_interpolation() -> None:
    costs = ForwardCosts({1: 1.0, 3: 2.0, 5: 4.0}, twin_step_seconds=0.25)
    assert costs.cost(1) == 1.0 and costs.cost(2) == pytest.approx(1.5) and costs.cost(4) == pytest.approx(3.0)
    assert costs.cost(7) == pytest.approx(6.0)  # past the last size: the last segment's slope
    assert costs.to_dict()["block_relative"]["5"] == 4.0 and costs.to_dict()["twin_step_relative"] == 0.25


def test_profile_splits_each_configuration() -> None:
    torch.manual_seed(0)
    model = tiny_model("llama")
    prompts = [random_prompt(seed=0) * 2, random_prompt(seed=1)]  # the first repeats: lookup matches
    configs = {
        "plain": None,
        "skip": SkipPolicy(skip_attention=(0, 2), draft=DraftSettings(max_draft_tokens=3)),
        "lookup": SkipPolicy(draft=DraftSettings(use_skip_draft=False, lookup_max_ngram=2, lookup_max_tokens=4)),
    }
    costs = forward_costs(model, prompts[0], blocks=(1, 2, 5), repeats=3)
    assert set(costs.seconds) == {1, 2, 5} and costs.twin_step_seconds > 0
    profiles = profile_configs(model, prompts, configs, (), NEW_TOKENS, progress=False)
    report = profile_report(costs, profiles)
    by_name = {c["name"]: c for c in report["configs"]}
    assert set(by_name) == set(configs)
    plain = by_name["plain"]
    assert plain["blocks"] == {"1": 2 * (NEW_TOKENS - 1)}  # one single-token step per token after the first
    assert plain["steps_with_draft"] == 0.0 and plain["speedup_vs_plain"] == 1.0
    assert plain["tokens_per_verify"] == 1.0
    for name, summary in by_name.items():
        assert summary["new_tokens"] == 2 * NEW_TOKENS, name
        steps = sum(summary["blocks"].values())
        emitted = sum(int(b) * n for b, n in summary["blocks"].items())
        assert emitted >= 2 * (NEW_TOKENS - 1) >= steps, name  # a block of b tokens yields 1..b tokens
        ms = summary["ms_per_token"]
        parts = ms["prefill"] + ms["draft"] + ms["verify_forward"] + ms["verify_rest"] + ms["loop_other"]
        assert parts == pytest.approx(ms["total"], rel=1e-6), name
    assert by_name["skip"]["ms_per_token"]["draft"] > 0 and by_name["skip"]["lookup_share"] == 0.0
    assert by_name["lookup"]["lookup_share"] > 0  # the repeated prompt gave lookup matches
    table = markdown(report)
    assert "| lookup |" in table and "c(b)/c(1)" in table


def test_profile_script_end_to_end_and_bad_input(tmp_path, capsys) -> None:
    """``scripts/profile_decode.py`` on a tiny local checkpoint: writes profile.json/.md; bad input is one line."""
    model = tiny_model("llama")
    save_checkpoint(model, tmp_path / "tiny")
    policy = SkipPolicy(skip_attention=(1,), draft=DraftSettings(lookup_max_ngram=2)).with_model(model, "tiny")
    policy.save(tmp_path / "hybrid.json")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        json.dumps({"question_id": 1, "category": "qa", "turns": ["hello world w1 w2 hello world"]}) + "\n"
    )
    out = tmp_path / "out"
    common = ["--model", str(tmp_path / "tiny"), "--prompts", str(prompts), "--max-new-tokens", "6", "--repeats", "1"]
    result = run_script("profile_decode.py", *common, "--policy", str(tmp_path / "hybrid.json"), "--ablate",
                        "--out", str(out), "--no-progress")  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((out / "profile.json").read_text())
    names = [c["name"] for c in report["configs"]]
    assert names == ["plain", "hybrid", "hybrid-no-lookup", "hybrid-lookup-only"]
    assert report["command"].startswith("python scripts/profile_decode.py")
    assert "| hybrid-lookup-only |" in (out / "profile.md").read_text()
    rows = (out / "profile.csv").read_text().splitlines()
    assert rows[0].startswith("config,tokens_per_second") and [r.split(",")[0] for r in rows[1:]] == names
    # Bad input through the script's own main in this process: the same one-line path, no interpreter start-up.
    assert_bad_input(_in_process(capsys, *common, "--max-new-tokens", "0", "--out", str(out)), "--max-new-tokens")
    other = SkipPolicy(skip_mlp=(1,)).with_model(tiny_model("llama", num_hidden_layers=2), "other")
    other.save(tmp_path / "other.json")
    assert_bad_input(
        _in_process(capsys, *common, "--policy", str(tmp_path / "other.json"), "--out", str(out)), "policy other"
    )


def _in_process(capsys, *args: str) -> subprocess.CompletedProcess[str]:
    spec = importlib.util.spec_from_file_location("profile_decode_script", REPO / "scripts" / "profile_decode.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return run_in_process(module.main, capsys, *args)
