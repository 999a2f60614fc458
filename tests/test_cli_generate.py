"""scripts/generate.py as a user runs it: bad input -> exit 2 and one ``error:`` line; good input works.

A few checks run ``python scripts/generate.py`` in a subprocess, as a user does: an error before
the model loads, the whole ``--compare --json`` path, a planted pickle, the module's batched path.
The other checks call the same ``main(argv)`` the script calls, in-process (the exit code and the
one stderr line are its return value and what it printed; an interpreter start costs ~4 s on a
busy 2-core machine, many times the check). Models: a tiny Llama checkpoint, or SmolLM2 from its
local cache where the real model matters.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_helpers import assert_bad_input, run_script, script_env
from search_fixtures import generate_in_process
from tiny_models import LAYERS, save_checkpoint, tiny_model

from layerskip.drafts.policy.skip_policy import DraftSettings, ModelIdentity, SkipPolicy
from layerskip.hf.models import DEFAULT_MODEL as SMOLLM2

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "generate.py"
SMOLLM2_LAYERS = 30
REPORT_KEYS = {
    "text",
    "new_tokens",
    "seconds",
    "tokens_per_second",
    "steps",
    "mean_accepted",
    "acceptance_rate",
    "baseline_tokens_per_second",
    "speedup",
    "identical",
}


def generate(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return run_script("generate.py", *args, timeout=timeout)


# -- bad input caught before the model loads --------------------------------------------------------


def test_unknown_model_name() -> None:
    assert_bad_input(generate("--model", "no-such-model-1b", "--prompt", "hi"), "unknown model 'no-such-model-1b'")


def test_nonexistent_model_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nowhere" / "model"
    assert_bad_input(generate_in_process(capsys, "--model", str(missing), "--prompt", "hi"), "unknown model")


def test_corrupt_policy_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policy = tmp_path / "corrupt.json"
    policy.write_text('{"format": "layerskip-policy", "version": 1, "skip_attention": [1, 2')
    assert_bad_input(
        generate_in_process(capsys, "--prompt", "hi", "--policy", str(policy)), "not valid JSON", "corrupt.json"
    )


def test_wrong_schema_policy_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policy = tmp_path / "schema.json"
    data = SkipPolicy(skip_attention=(1,)).to_dict()
    data["skip_attention"] = ["one"]
    data["draft"]["max_draft_tokens"] = "4"
    policy.write_text(json.dumps(data))
    assert_bad_input(generate_in_process(capsys, "--prompt", "hi", "--policy", str(policy)), "wrong schema")


def test_max_new_tokens_zero(capsys: pytest.CaptureFixture[str]) -> None:
    assert_bad_input(generate_in_process(capsys, "--prompt", "hi", "--max-new-tokens", "0"), "--max-new-tokens")


def test_cuda_without_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert_bad_input(generate_in_process(capsys, "--prompt", "hi", "--device", "cuda"), "CUDA")


def test_unsupported_architecture(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import OPTConfig, OPTForCausalLM

    config = OPTConfig(
        vocab_size=66,
        hidden_size=32,
        word_embed_proj_dim=32,
        num_hidden_layers=2,
        ffn_dim=64,
        num_attention_heads=4,
        max_position_embeddings=64,
    )
    save_checkpoint(OPTForCausalLM(config), tmp_path / "tiny-opt")
    assert_bad_input(
        generate_in_process(capsys, "--model", str(tmp_path / "tiny-opt"), "--prompt", "hello world"),
        "unsupported architecture 'opt'",
    )


# -- bad input found once the model is loaded ---------------------------------------------------------
# A tiny Llama checkpoint loads in a fraction of a second; SmolLM2 (from its local cache) where it matters.


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    directory = tmp_path_factory.mktemp("models") / "tiny-llama"
    save_checkpoint(tiny_model("llama"), directory)
    return str(directory)


def _policy_file(tmp_path: Path, policy: SkipPolicy, name: str = "policy.json") -> str:
    return str(policy.save(tmp_path / name))


def test_policy_for_another_model(tmp_path: Path, tiny_llama_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    other = SkipPolicy(skip_mlp=(1,), model=ModelIdentity(name="tiny", architecture="gpt2", num_layers=7))
    result = generate_in_process(
        capsys, "--model", tiny_llama_dir, "--prompt", "hello", "--policy", _policy_file(tmp_path, other)
    )
    assert_bad_input(result, "'gpt2' model", "'llama'")


def test_policy_index_out_of_range(tmp_path: Path, tiny_llama_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    out_of_range = SkipPolicy(skip_attention=(3, 99))
    result = generate_in_process(
        capsys, "--model", tiny_llama_dir, "--prompt", "hello", "--policy", _policy_file(tmp_path, out_of_range)
    )
    assert_bad_input(result, "[99]", f"valid 0..{LAYERS - 1}")


def test_empty_prompt(tiny_llama_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert_bad_input(
        generate_in_process(capsys, "--model", tiny_llama_dir, "--prompt", "", "--max-new-tokens", "4"),
        "prompt is empty",
    )


@pytest.mark.slow
def test_policy_skipping_every_sublayer_of_smollm2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    everything = SkipPolicy.early_exit(SMOLLM2_LAYERS, 0)
    assert_bad_input(
        generate_in_process(capsys, "--prompt", "hi", "--policy", _policy_file(tmp_path, everything)), "every sublayer"
    )


def test_tiny_checkpoint_compare_json(tmp_path: Path, tiny_llama_dir: str) -> None:
    """The whole --compare --json path on a local HF directory, cheap enough for every run."""
    policy = _policy_file(tmp_path, SkipPolicy(skip_attention=(0,), skip_mlp=(2,)))
    result = generate(
        "--model",
        tiny_llama_dir,
        "--prompt",
        "hello world w1 w2",
        "--policy",
        policy,
        "--compare",
        "--json",
        "--max-new-tokens",
        "12",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert REPORT_KEYS <= set(report)
    assert report["identical"] is True and report["model"] == "tiny-llama"
    assert report["divergence"] is None


def test_compare_names_the_divergence_and_its_class(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--compare on a bf16 run whose verify keeps one draft past the first mismatch (an injected
    defect): the line and the JSON give the position, both tokens and the class, checked in fp32."""
    from oracles import one_past_the_mismatch

    from layerskip.engine import verifiers

    save_checkpoint(tiny_model("mistral"), tmp_path / "tiny-mistral")
    policy = _policy_file(tmp_path, SkipPolicy(skip_attention=(0, 2), draft=DraftSettings(max_draft_tokens=4)))
    args = ["--model", str(tmp_path / "tiny-mistral"), "--dtype", "bfloat16", "--policy", policy, "--compare"]
    args += ["--prompt", "w5 w9 hello w3 w3 world", "--max-new-tokens", "16"]
    assert json.loads(generate_in_process(capsys, *args, "--json").stdout)["divergence"] is None  # correct: identical
    monkeypatch.setattr(verifiers, "accept_tree_greedy", one_past_the_mismatch)
    result = generate_in_process(capsys, *args)
    assert result.returncode == 0, result.stderr
    assert "identical: False (first divergence at new token 1: ours 'w45' (id 47), HF " in result.stderr
    assert "fp32 gap" in result.stderr and "error bound" in result.stderr
    assert result.stderr.rstrip().endswith(": defect)]")
    report = json.loads(generate_in_process(capsys, *args, "--json").stdout)
    found = report["divergence"]
    assert report["identical"] is False and found["position"] == 1 and found["class"] == "defect"
    assert found["method_token"] == 47 and found["method_text"] == "w45" and found["fp32_gap"] > found["error_bound"]


# -- more bad input, run in-process ----------------------------------------------------------------


def test_directory_without_a_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text("{}")  # no model_type: transformers raises ValueError
    line = assert_bad_input(generate_in_process(capsys, "--model", str(tmp_path), "--prompt", "hi"))
    assert str(tmp_path) in line
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')  # no weights: OSError
    assert_bad_input(generate_in_process(capsys, "--model", str(tmp_path), "--prompt", "hi"), str(tmp_path))


@pytest.mark.parametrize("damage", ["truncated", "garbage", "truncated-bin"])
def test_damaged_weights_are_named(
    tiny_llama_dir: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str
) -> None:
    """A copy or download cut short: one line naming the file and the way out, not safetensors'
    (or torch's) traceback, which names no file."""
    model = tmp_path / "tiny-llama"
    shutil.copytree(tiny_llama_dir, model)
    weights = model / "model.safetensors"
    if damage == "truncated-bin":  # the older format: torch.save's zip archive
        from safetensors.torch import load_file

        torch.save(load_file(weights), model / "pytorch_model.bin")
        weights.unlink()
        weights = model / "pytorch_model.bin"
    whole = weights.read_bytes()
    weights.write_bytes(b"\xff" * 512 if damage == "garbage" else whole[: len(whole) // 2])
    line = assert_bad_input(
        generate_in_process(capsys, "--model", str(model), "--prompt", "hi"),
        f"{weights} is truncated or damaged",
        "save_pretrained",
    )
    assert "Traceback" not in line


class _Planted:
    """Unpickled, it would create ``marker``: proof, when the file stays absent, that nothing ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (open, (str(self.marker), "w"))


def test_a_planted_pickle_is_refused_in_one_line_and_never_run(tiny_llama_dir: str, tmp_path: Path) -> None:
    import pickle

    model = tmp_path / "planted"
    shutil.copytree(tiny_llama_dir, model)
    (model / "model.safetensors").unlink()
    marker = tmp_path / "ran"
    (model / "pytorch_model.bin").write_bytes(pickle.dumps({"weight": _Planted(marker)}))
    line = assert_bad_input(
        generate("--model", str(model), "--prompt", "hi"),
        f"{model / 'pytorch_model.bin'} holds pickled objects other than tensors",
        "nothing in it was run",
        "safetensors",
    )
    assert "UnpicklingError" not in line and not marker.exists()


@pytest.mark.parametrize("kept", [(), ("tokenizer_config.json",)])
def test_a_directory_without_its_tokenizer(
    tiny_llama_dir: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], kept: tuple[str, ...]
) -> None:
    """Weights copied without the tokenizer: the missing files are named, with the fix (transformers'
    own message is cut off at "Couldn't instantiate the backend tokenizer from one of: ")."""
    model = tmp_path / "tiny-llama"
    shutil.copytree(tiny_llama_dir, model)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if name not in kept:
            (model / name).unlink()
    line = assert_bad_input(
        generate_in_process(capsys, "--model", str(model), "--prompt", "hi"),
        f"model directory {model} has no tokenizer (tokenizer.json",
        "tokenizer.save_pretrained",
    )
    assert ("tokenizer_config.json" in line) == (not kept)


def test_policy_json_problems(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    not_policy = tmp_path / "config.json"
    not_policy.write_text(json.dumps({"model_type": "llama"}))
    assert_bad_input(generate_in_process(capsys, "--prompt", "hi", "--policy", str(not_policy)), "not a layerskip")
    missing = str(tmp_path / "none.json")
    assert_bad_input(generate_in_process(capsys, "--prompt", "hi", "--policy", missing), "not found")
    assert_bad_input(generate_in_process(capsys, "--prompt", "hi", "--policy", str(tmp_path)), "is a directory")


@pytest.mark.parametrize(
    "args",
    [
        ["--max-new-tokens", "-3"],
        ["--sample", "--temperature", "0"],
        ["--sample", "--top-p", "-0.1"],
        ["--sample", "--top-k", "-1"],
        ["--sample", "--temperature", "nan"],
        ["--sample", "--temperature", "inf"],
        ["--seed", "99999999999999999999999"],
        ["--seed", "-1"],
    ],
    ids=["negative-budget", "temperature", "top-p", "top-k", "temperature-nan", "temperature-inf", "huge-seed", "seed"],
)
def test_bad_numeric_options(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert_bad_input(generate_in_process(capsys, "--prompt", "hi", *args))


def test_prompt_sources(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert_bad_input(generate_in_process(capsys, "--max-new-tokens", "4"), "no prompt")
    missing = str(tmp_path / "none.txt")
    assert_bad_input(generate_in_process(capsys, "--prompt-file", missing), "cannot read prompt file")
    assert_bad_input(generate_in_process(capsys, "--prompt-file", str(tmp_path)), "cannot read prompt file")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9 au lait".encode("latin-1"))
    assert_bad_input(generate_in_process(capsys, "--prompt-file", str(latin1)), "cannot read prompt file", "UTF-8")


def test_chat_without_a_chat_template(tiny_llama_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    result = generate_in_process(capsys, "--model", tiny_llama_dir, "--prompt", "hello", "--chat")
    assert_bad_input(result, "no chat template")


# -- success ------------------------------------------------------------------------------------------------

PROMPT = "Explain in a few sentences why the sky is blue."


@pytest.fixture(scope="module")
def smollm2_policy(tmp_path_factory: pytest.TempPathFactory, smollm2) -> str:
    policy = SkipPolicy(skip_attention=(5, 20), draft=DraftSettings(max_draft_tokens=4)).with_model(
        smollm2.model, SMOLLM2
    )
    return str(policy.save(tmp_path_factory.mktemp("cli") / "smollm2.json"))


@pytest.fixture(scope="module")
def compare_report(smollm2_policy: str) -> dict:
    """One --compare --json run in this process (the model loads from its cache, no interpreter start-up)."""
    from layerskip.cli.generate import main

    args = ["--compare", "--json", "--prompt", PROMPT, "--policy", smollm2_policy, "--max-new-tokens", "24"]
    out, err = io.StringIO(), io.StringIO()
    # A module fixture runs before conftest's one-thread fixture: on a busy 2-core machine torch's
    # default pool would spin-wait for descheduled threads (as a script, OMP_NUM_THREADS=1 did this).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(args)
    finally:
        torch.set_num_threads(threads)
    result = subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1, result.stdout  # one JSON object, nothing streamed
    return json.loads(lines[0])


@pytest.mark.slow
def test_compare_json_reports_identical_output(compare_report: dict, smollm2_policy: str) -> None:
    report = compare_report
    assert REPORT_KEYS <= set(report), REPORT_KEYS - set(report)
    assert report["identical"] is True
    assert report["model"] == SMOLLM2 and report["policy"] == smollm2_policy
    assert isinstance(report["text"], str) and report["text"].strip()
    assert 0 < report["new_tokens"] <= 24
    assert 1 <= report["steps"] <= report["new_tokens"]
    assert report["mean_accepted"] == pytest.approx(report["new_tokens"] / report["steps"])
    assert 0.0 <= report["acceptance_rate"] <= 1.0
    for key in ("seconds", "tokens_per_second", "baseline_tokens_per_second", "speedup"):
        assert isinstance(report[key], float) and report[key] > 0, key


@pytest.mark.slow
def test_streaming_text_mode(compare_report: dict, smollm2_policy: str, capsys: pytest.CaptureFixture[str]) -> None:
    result = generate_in_process(capsys, "--prompt", PROMPT, "--policy", smollm2_policy, "--max-new-tokens", "24")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    # Greedy decoding is deterministic: the streamed text is the JSON report's text.
    assert result.stdout.strip() == compare_report["text"].strip()
    assert "tokens in" in result.stderr and "acceptance" in result.stderr


# -- faults: output paths, positions, extreme sampling values ----------------------------------------------------
def test_save_policy_path_checked_before_loading(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    taken = tmp_path / "file"
    taken.write_text("mine")
    common = ["--model", str(tmp_path / "no-model"), "--prompt", "hi", "--policy", "on-the-fly"]
    for path, fragment in ((tmp_path, "is a directory"), (taken / "p.json", "is a file, not a directory")):
        assert_bad_input(generate_in_process(capsys, *common, "--save-policy", str(path)), "--save-policy", fragment)
    assert taken.read_text() == "mine"


def test_save_policy_replaces_only_a_policy_unless_forced(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mine = tmp_path / "notes.json"
    mine.write_text('{"my": "notes"}')
    common = ["--model", str(tmp_path / "no-model"), "--prompt", "hi", "--policy", "on-the-fly", "--save-policy"]
    result = generate_in_process(capsys, *common, str(mine))
    assert_bad_input(result, "--save-policy", "is not a layerskip policy", "--force")
    assert mine.read_text() == '{"my": "notes"}'
    # With --force, or over an earlier policy, the run goes on (to the model that does not exist).
    assert_bad_input(generate_in_process(capsys, *common, str(mine), "--force"), "unknown model")
    earlier = SkipPolicy(skip_mlp=(1,)).save(tmp_path / "earlier.json")
    assert_bad_input(generate_in_process(capsys, *common, str(earlier)), "unknown model")


def test_save_policy_never_replaces_a_fifo_or_a_device(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Only a regular file or a new path is replaced; a FIFO or a device node (/dev/null, /dev/stdout)
    is refused before any work and left as it is. An empty path is refused too, not skipped."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    common = ["--model", str(tmp_path / "no-model"), "--prompt", "hi", "--save-policy"]
    for target in (str(fifo), "/dev/null"):
        result = generate_in_process(capsys, *common, target, "--force")
        assert_bad_input(result, f"--save-policy {target} is not a regular file", "left as it is")
    assert stat.S_ISFIFO(fifo.stat().st_mode) and stat.S_ISCHR(os.stat("/dev/null").st_mode)
    assert_bad_input(generate_in_process(capsys, *common, ""), "--save-policy is empty")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo"]


@pytest.mark.parametrize(
    "args", [["--temperature", "-1"], ["--temperature", "0.7"], ["--top-p", "0.9", "--top-k", "5"]]
)
def test_sampling_options_without_sample_are_refused(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """Greedy decoding would ignore them: refused in one line that says to add --sample."""
    line = assert_bad_input(generate_in_process(capsys, "--prompt", "hi", *args), "add --sample")
    assert all(flag in line for flag in args if flag.startswith("--"))


def test_prompt_and_policy_files_that_no_reader_should_take(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A FIFO would block the reader for good, /dev/zero would never end, deep nesting was a
    RecursionError: one line each, before the model loads."""
    fifo, deep = tmp_path / "fifo", tmp_path / "deep.json"
    os.mkfifo(fifo)
    deep.write_text("[" * 100_000 + "]" * 100_000)
    zero = tmp_path / "zero.txt"
    zero.symlink_to("/dev/zero")
    model = ["--model", str(tmp_path / "no-model")]
    for source in (fifo, zero):
        result = generate_in_process(capsys, *model, "--prompt-file", str(source))
        assert_bad_input(result, "cannot read prompt file", "not a regular file")
        result = generate_in_process(capsys, *model, "--prompt", "hi", "--policy", str(source))
        assert_bad_input(result, "cannot read policy file", "not a regular file")
    result = generate_in_process(capsys, *model, "--prompt", "hi", "--policy", str(deep))
    assert_bad_input(result, "cannot read policy file", "nests deeper than")


def test_a_whitespace_prompt_is_decoded_as_the_plugin_decodes_it(
    tiny_llama: Path, tiny_llama_dir: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Whitespace is text (a byte-level tokenizer gives it tokens, and the plug-in decodes them);
    only a prompt with no token at all (a word-level tokenizer's whitespace) is refused."""
    spaces = tmp_path / "spaces.txt"
    spaces.write_text("   \n")
    args = ["--prompt-file", str(spaces), "--no-chat", "--json", "--max-new-tokens", "4", "--policy", "plain"]
    result = generate_in_process(capsys, "--model", str(tiny_llama), *args)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["new_tokens"] == 4
    assert_bad_input(generate_in_process(capsys, "--model", tiny_llama_dir, *args), "encodes to no token")


def test_top_p_zero_keeps_the_most_likely_token(tiny_llama_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    """As transformers' top-p warper does with 0: sampling then gives the greedy text."""
    common = ["--model", tiny_llama_dir, "--prompt", "hello world", "--no-chat", "--json", "--max-new-tokens", "8"]
    greedy = generate_in_process(capsys, *common, "--policy", "plain")
    sampled = generate_in_process(capsys, *common, "--policy", "plain", "--sample", "--top-p", "0", "--seed", "1")
    assert sampled.returncode == 0, sampled.stderr
    assert json.loads(sampled.stdout)["text"] == json.loads(greedy.stdout)["text"]


def test_more_threads_than_cpus_are_refused_before_loading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from layerskip.cli import common

    monkeypatch.setattr(common, "available_cpus", lambda: 2)
    args = ["--model", str(tmp_path / "no-model"), "--prompt", "hi", "--max-new-tokens", "4"]
    for count in ("3", "999"):
        result = generate_in_process(capsys, *args, "--threads", count)
        assert_bad_input(result, f"--threads {count} is more than the 2 CPU(s)", "'auto'")
    assert_bad_input(generate_in_process(capsys, *args, "--threads", "2"), "unknown model")


@pytest.mark.parametrize("arch", ["llama", "gpt2"])  # rotary positions, and learned ones (an IndexError before)
def test_prompt_past_the_model_positions(arch: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    directory = tmp_path / arch
    save_checkpoint(tiny_model(arch), directory)
    prompt = " ".join(["hello world"] * 200)  # 400 tokens of the word-level tokenizer; the models hold 256
    line = assert_bad_input(
        generate_in_process(capsys, "--model", str(directory), "--prompt", prompt, "--no-chat", "--max-new-tokens", "8")
    )
    assert "400 tokens" in line and "8 new tokens" in line and "256 positions" in line
    fits = ["--model", str(directory), "--prompt", "hello world", "--no-chat", "--json"]
    assert_bad_input(generate_in_process(capsys, *fits, "--max-new-tokens", "300"), "256 positions")


def test_tiny_temperature_samples_the_greedy_token(tiny_llama_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    """--temperature 1e-30 is the limit of sampling: the greedy choice (no NaN from overflowing logits)."""
    common = ["--model", tiny_llama_dir, "--prompt", "hello world", "--no-chat", "--json", "--max-new-tokens", "8"]
    greedy = generate_in_process(capsys, *common)
    assert greedy.returncode == 0, greedy.stderr
    for policy in ([], ["--policy", "on-the-fly"]):
        sampled = generate_in_process(capsys, *common, *policy, "--sample", "--temperature", "1e-30", "--seed", "3")
        assert sampled.returncode == 0, sampled.stderr
        assert json.loads(sampled.stdout)["text"] == json.loads(greedy.stdout)["text"]


# -- batches (--batch-size) ---------------------------------------------------------------------------


def test_the_module_reaches_its_batched_path(tmp_path: Path) -> None:
    """``python -m layerskip.cli.generate --batch-size`` ran main before the batched functions were
    defined (a NameError); now its bad input is one line, as the script's is."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello\nworld\n")
    command = [sys.executable, "-m", "layerskip.cli.generate", "--prompt-file", str(prompts), "--batch-size", "0"]
    result = subprocess.run(command, cwd=tmp_path, env=script_env(), capture_output=True, text=True, timeout=180)
    assert_bad_input(result, "--batch-size must be >= 1")


def _generate_calls(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """Every HF ``generate`` call's keywords, as the call goes on."""
    from transformers import GenerationMixin

    calls: list[dict] = []
    original = GenerationMixin.generate

    def spy(self, *args, **kwargs):
        calls.append(kwargs)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(GenerationMixin, "generate", spy)
    return calls


def test_a_sampled_batch_compare_samples_hf_too_and_claims_no_identity(
    tiny_llama_dir: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The baseline was greedy while ours sampled (a speedup of sampling over greedy decoding), and the
    report said "identical rows None/3"."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello world\nworld hello\nhello hello world\n")
    calls = _generate_calls(monkeypatch)
    common = ["--model", tiny_llama_dir, "--prompt-file", str(prompts), "--batch-size", "3", "--no-chat"]
    common += ["--policy", "plain", "--max-new-tokens", "4", "--compare", "--sample", "--temperature", "0.7"]
    result = generate_in_process(capsys, *common, "--seed", "1")
    assert result.returncode == 0, result.stderr
    assert calls and all(call["do_sample"] and call["temperature"] == 0.7 for call in calls)
    assert "sampled: not compared token for token" in result.stderr and "None" not in result.stderr
    report = json.loads(generate_in_process(capsys, *common, "--json").stdout.splitlines()[-1])
    assert report["identical_rows"] is None and report["speedup"] is not None
    greedy = generate_in_process(capsys, *common[:-3])
    assert "identical rows 3/3" in greedy.stderr, greedy.stderr


def test_a_sampled_compare_claims_no_identity(tiny_llama_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    common = ["--model", tiny_llama_dir, "--prompt", "hello world", "--no-chat", "--policy", "plain"]
    result = generate_in_process(capsys, *common, "--max-new-tokens", "4", "--compare", "--sample", "--seed", "1")
    assert result.returncode == 0, result.stderr
    assert "sampled: not compared token for token" in result.stderr and "identical: None" not in result.stderr
