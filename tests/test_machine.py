"""The machine a policy was tuned on: the probe, the comparison, and the one line generate/bench print."""

from __future__ import annotations

import functools
import json
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from cli_helpers import assert_bad_input, run_in_process
from search_fixtures import generate_in_process
from tiny_models import save_checkpoint, tiny_model

from layerskip.cli.common import quick_search_command, tuning_advice
from layerskip.drafts.policy.skip_policy import SkipPolicy
from layerskip.machine import Machine, cpu_model_and_flags, this_machine
from layerskip.measure.bench import environment

EPYC = Machine("cpu", "AMD EPYC", "AMD EPYC", ("fma", "avx2"), 2)
XEON = Machine("cpu", "Intel Xeon Platinum 8480+", "Intel Xeon Platinum 8480+", ("fma", "avx2", "amx_bf16"), 2)
COMMAND = "layerskip-search --model m --preset quick"

X86_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse4_2 fma avx avx2 avx512f avx512_bf16 sha_ni

processor\t: 1
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse4_2 fma avx avx2 avx512f avx512_bf16 sha_ni
"""
ARM_CPUINFO = """processor\t: 0
BogoMIPS\t: 50.00
Features\t: fp asimd evtstrm aes sve i8mm bf16
CPU implementer\t: 0x41
"""


def test_cpu_model_and_kernel_flags_from_cpuinfo(tmp_path: Path) -> None:
    x86, arm = tmp_path / "x86", tmp_path / "arm"
    x86.write_text(X86_CPUINFO)
    arm.write_text(ARM_CPUINFO)
    assert cpu_model_and_flags(x86) == ("AMD EPYC 7B13", ("fma", "avx2", "avx512f", "avx512_bf16"))
    model, flags = cpu_model_and_flags(arm)  # no "model name" on ARM: platform.processor() names it
    assert model and flags == ("asimd", "sve", "bf16", "i8mm")
    model, flags = cpu_model_and_flags(tmp_path / "missing")  # not Linux
    assert model and flags == ()


def test_this_machine_round_trips() -> None:
    here = this_machine("cpu")
    assert here.device == "cpu" and here.device_name == here.cpu_model and here.cores >= 1
    assert Machine.from_dict(json.loads(json.dumps(here.to_dict()))) == here
    assert Machine.from_dict(None) is None and Machine.from_dict({"device": "cpu"}) is None  # older or edited files


def test_differences() -> None:
    assert EPYC.differences(replace(EPYC, cores=16)) == []  # cores are recorded, not compared
    assert EPYC.differences(replace(EPYC, cpu_model="AMD  EPYC")) == []  # whitespace only
    assert EPYC.differences(XEON) == [
        "AMD EPYC -> Intel Xeon Platinum 8480+",
        "this CPU adds amx_bf16",
    ]
    # The same model name with other flags (a VM that hides AVX-512): another machine for our kernels.
    assert EPYC.differences(replace(EPYC, cpu_flags=("fma",))) == ["this CPU lacks avx2"]
    gpu = Machine("cuda", "NVIDIA H100", "AMD EPYC", ("fma", "avx2"))
    assert gpu.differences(EPYC) == ["tuned on cuda NVIDIA H100, running on AMD EPYC (fma, avx2)"]


def _tuned(machine: Machine | None, **provenance) -> SkipPolicy:
    policy = SkipPolicy(skip_mlp=(1,), provenance={"method": "optuna", **provenance})
    return policy.with_machine(machine) if machine is not None else policy


def test_tuning_advice_is_at_most_one_line() -> None:
    line = tuning_advice({"a": _tuned(EPYC)}, XEON, COMMAND)
    assert line is not None and line.startswith("warning: policy a was tuned on another machine")
    assert "AMD EPYC -> Intel Xeon" in line and line.endswith(COMMAND) and "\n" not in line
    both = tuning_advice({"a": _tuned(EPYC), "b": _tuned(EPYC), "c": _tuned(XEON)}, XEON, COMMAND)
    assert both is not None and both.startswith("warning: policies a, b were tuned") and both.count(COMMAND) == 1
    # A policy file older than the field: one gentle note; the warning wins when both kinds are loaded.
    old = tuning_advice({"old": _tuned(None)}, XEON, COMMAND)
    assert old is not None and old.startswith("note: policy old does not record the machine") and COMMAND in old
    assert tuning_advice({"old": _tuned(None), "a": _tuned(EPYC)}, XEON, COMMAND).startswith("warning:")
    # Tuned here; written by hand with no provenance; on-the-fly selection built in this process; plain decoding.
    quiet = {"here": _tuned(XEON), "hand": SkipPolicy(skip_mlp=(1,)), "otf": SkipPolicy.adaptive_selection(), "x": None}
    assert tuning_advice(quiet, XEON, COMMAND) is None


def test_the_command_names_dtype_and_device() -> None:
    assert quick_search_command("org/My Model") == "layerskip-search --model 'org/My Model' --preset quick"
    assert quick_search_command("m", "bfloat16", "cuda").endswith("--preset quick --dtype bfloat16 --device cuda")


def test_bench_environment_records_the_machine() -> None:
    env, here = environment(torch.device("cpu")), this_machine("cpu")
    assert (env["device_name"], env["cpu_model"], env["cpu_flags"], env["cores"]) == (
        here.device_name,
        here.cpu_model,
        list(here.cpu_flags),
        here.cores,
    )


# -- generate and bench print the line once ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("machine") / "tiny-llama"
    save_checkpoint(tiny_model("llama"), directory)
    return directory


@pytest.fixture
def run_generate(capsys):
    return functools.partial(generate_in_process, capsys)


@pytest.fixture
def run_bench(capsys):
    from layerskip.cli.bench import main

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return run_in_process(main, capsys, *args)

    return run


def _warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(("warning:", "note:"))]


def test_generate_warns_once_for_a_policy_tuned_elsewhere(run_generate, tiny_dir: Path, tmp_path: Path) -> None:
    elsewhere = _tuned(replace(this_machine("cpu"), cpu_model="Some Other CPU")).save(tmp_path / "elsewhere.json")
    here = _tuned(this_machine("cpu")).save(tmp_path / "here.json")
    common = ["--model", str(tiny_dir), "--prompt", "hello world", "--no-chat", "--max-new-tokens", "4", "--json"]
    result = run_generate(*common, "--policy", str(elsewhere))
    assert result.returncode == 0, result.stderr
    (line,) = _warnings(result.stderr)
    assert f"policy {elsewhere} was tuned on another machine" in line
    assert line.endswith(f"layerskip-search --model {tiny_dir} --preset quick")
    assert _warnings(run_generate(*common, "--policy", str(here)).stderr) == []
    # on-the-fly from nothing is chosen on this machine as it generates: nothing to say; the set it
    # ended on is saved as tuned here.
    saved = tmp_path / "saved.json"
    result = run_generate(*common, "--policy", "on-the-fly", "--save-policy", str(saved))
    assert result.returncode == 0 and _warnings(result.stderr) == []
    assert SkipPolicy.load(saved).provenance["machine"] == this_machine("cpu").to_dict()


def test_bench_warns_once_for_several_policies(run_bench, tiny_dir: Path, tmp_path: Path) -> None:
    other = replace(this_machine("cpu"), cpu_flags=())
    policies = [str(_tuned(other).save(tmp_path / f"p{i}.json")) for i in (1, 2)]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"question_id": "q", "category": "qa", "turns": ["hello world w1 w2"]}) + "\n")
    result = run_bench(
        "--model", str(tiny_dir), "--prompts", str(prompts), "--methods", "self-spec", "--policy", policies[0],
        "--policy", policies[1], "--max-new-tokens", "4", "--no-progress", "--no-chat", "--out", str(tmp_path / "o"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    (line,) = _warnings(result.stderr)
    assert line.startswith("warning: policies p1, p2 were tuned on another machine (this CPU adds ")


def test_a_bad_policy_is_still_refused_in_one_line(run_generate, tiny_dir: Path, tmp_path: Path) -> None:
    """The warning comes after the policy's checks: a policy for another model is one error line, no warning."""
    policy = _tuned(replace(this_machine("cpu"), cpu_model="Other"))
    bad = replace(policy, skip_mlp=(99,)).save(tmp_path / "bad.json")
    assert_bad_input(run_generate("--model", str(tiny_dir), "--prompt", "hi", "--policy", str(bad)))
