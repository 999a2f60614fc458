"""``layerskip.search.run_study``: a study from Python on the tiny Llama, its policy generating,
resuming, presets, the command line as its caller, its refusals, and docs/python-api.md's script."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from search_fixtures import load_study

import layerskip.search
from layerskip import LayerskipError, SkipPolicy, generate, load_model
from layerskip.hf.adapters import weights_sample_digest
from layerskip.search import StudyResult, run_study
from layerskip.search import cli as search_cli

# The cheapest study that still calibrates, runs trials, confirms and exports (FAST_ARGS as keywords).
FAST = dict(reference_tokens=8, max_new_tokens=8, confirm_top=1, draft_tokens=[2, 3], no_progress=True)
PROMPTS = ["Write a short story about a robot.", "What is the capital of France?"]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return load_model(str(tiny_llama))


def test_a_study_on_a_loaded_model_exports_a_policy_that_generates_as_plain_decoding(tiny, tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 's.db'}"
    result = run_study(tiny, PROMPTS, storage=url, study_name="api", n_trials=4, **FAST)
    assert isinstance(result, StudyResult) and result.out is None and not list(tmp_path.glob("*.json"))
    assert result.trials == 4 and result.study.study_name == "api"
    assert result.policy.model.fingerprint == result.study.user_attrs["model_fingerprint"]
    # The study names the weights' values too, so a fine-tune of the same shape is another model.
    assert result.study.user_attrs["model_weights_sample"] == weights_sample_digest(tiny.model)
    assert result.policy.model.weights_sample == weights_sample_digest(tiny.model)  # and so does its policy
    assert result.study.user_attrs["command"].startswith("layerskip.search.run_study('tiny-llama', <2 prompts>")
    assert result.study.user_attrs["calibration"]["prompts"] == ["prompt-1", "prompt-2"]
    assert "| trial |" in result.summary() and "x" in result.verdict

    path = tmp_path / "policy.json"
    result.policy.save(path)
    policy = SkipPolicy.load(path)
    drafted = generate(tiny.model, tiny.tokenizer, PROMPTS[0], policy, max_new_tokens=12)
    plain = generate(tiny.model, tiny.tokenizer, PROMPTS[0], "plain", max_new_tokens=12)
    assert drafted.tokens == plain.tokens  # greedy: lossless

    # The same call again resumes the study; other prompts are refused before any work.
    assert run_study(tiny, PROMPTS, storage=url, study_name="api", n_trials=2, **FAST).trials == 6
    with pytest.raises(LayerskipError, match="was calibrated on 2 prompt"):
        run_study(tiny, PROMPTS[:1], storage=url, study_name="api", n_trials=2, **FAST)


def test_a_model_by_name_with_a_preset_writes_its_policy(tiny_llama, tmp_path) -> None:
    url, out = f"sqlite:///{tmp_path / 'q.db'}", tmp_path / "q.json"
    # The tiny model has 300 vocabulary rows: the preset's head sizes are overridden to fit it.
    result = run_study(
        tiny_llama,
        "builtin",
        preset="quick",
        storage=url,
        out=out,
        n_trials=2,
        n_prompts=2,
        draft_vocab=[0, 128],
        **FAST,
    )
    assert result.out == out and SkipPolicy.load(out).to_dict() == result.policy.to_dict()
    study = load_study(url, "tiny-llama-quick")  # the preset names the default study, as on the command line
    assert study.user_attrs["preset"]["name"] == "quick"
    assert study.user_attrs["preset"]["overridden"] == ["--n-trials", "--n-prompts", "--reference-tokens",
                                                        "--max-new-tokens", "--confirm-top", "--draft-tokens",
                                                        "--draft-vocab"]  # fmt: skip
    assert study.user_attrs["space"]["precision_choices"] == ["int4"]  # the preset's, on a CPU


def test_the_command_line_calls_run_study_with_the_flags_it_was_given(monkeypatch, tmp_path) -> None:
    """Only typed flags reach run_study: a preset gives way to them, even to a default's value."""
    calls = []

    def fake(model, prompts, **kwargs):
        calls.append((model, prompts, kwargs))
        raise LayerskipError("stop here")

    monkeypatch.setattr(search_cli, "run_study", fake)
    argv = ["--model", "m", "--preset", "quick", "--n-trials", "60", "--lookup", "0,3", "--warm-start", "a.json"]
    assert search_cli.main(argv) == 2
    ((model, prompts, kwargs),) = calls
    assert (model, prompts, kwargs.pop("preset")) == ("m", "builtin", "quick")
    assert kwargs.pop("command").startswith("layerskip-search --model m")
    assert kwargs == {"n_trials": 60, "lookup": (0, 3), "warm_start": ["a.json"], "out": "m-quick.policy.json"}


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda m: run_study(m, PROMPTS, n_trails=3), "unknown search setting(s) n_trails"),
        (lambda m: run_study(m, PROMPTS, n_trials="3"), "n_trials takes int (got '3')"),
        (lambda m: run_study(m, PROMPTS, draft_tokens=3), "draft_tokens takes a list of int values"),
        (lambda m: run_study(m, PROMPTS, objective="fast"), "--objective must be one of pareto, speedup"),
        (lambda m: run_study(m, PROMPTS, n_prompts=2), "n_prompts pick prompts from a prompts source"),
        (lambda m: run_study(m, ["ok", " "]), "prompts[1] is not a prompt's text"),
        (lambda m: run_study(m, []), "non-empty list of prompts"),
        (lambda m: run_study(m, PROMPTS, dtype="bfloat16"), "dtype load a model by name"),
        (lambda m: run_study(m.model, PROMPTS), "a loaded model needs its tokenizer"),
        (lambda m: run_study(m, PROMPTS, preset="slow"), "unknown --preset 'slow'; choose from quick"),
        (lambda m: run_study(3, PROMPTS), "model must be a name, a path, a hub id or a loaded model"),
    ],
)
def test_bad_input_is_one_line_before_any_work(tiny, tmp_path, monkeypatch, call, message) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(LayerskipError, match=re.escape(message)) as raised:
        call(tiny)
    assert "\n" not in str(raised.value)
    assert not list(tmp_path.iterdir())  # no storage, no policy


def test_the_python_api_page_script_runs(tiny_llama, tmp_path, monkeypatch) -> None:
    """docs/python-api.md's study script, as written, on the tiny Llama with a tiny budget."""
    page = (ROOT / "docs" / "python-api.md").read_text()
    section = page[page.index('<a id="search-from-python"></a>') :]
    script = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    assert "run_study(" in script and "SkipPolicy.load(" in script and "generate(" in script

    real_run, real_load = layerskip.search.run_study, layerskip.load_model
    budget = {**FAST, "n_trials": 2, "draft_vocab": [0, 128]}  # the tiny model has 300 vocabulary rows
    monkeypatch.setattr(layerskip.search, "run_study", lambda *a, **k: real_run(*a, **{**k, **budget}))
    monkeypatch.setattr(layerskip, "load_model", lambda name, *a, **k: real_load(str(tiny_llama), *a, **k))
    monkeypatch.chdir(tmp_path)
    exec(compile(script, "docs/python-api.md", "exec"), {})
    assert list(tmp_path.glob("*.json")) and list(tmp_path.glob("*.db"))


def test_the_search_installs_as_layerskip_search_only(tmp_path) -> None:
    """Outside the checkout there is no top-level ``search`` (a user's own search.py cannot shadow
    it, nor it theirs), and no script re-executes Python to keep its folder off the path."""
    probe = (
        "import importlib.util, sys; from layerskip.search import run_study; "
        "sys.exit(importlib.util.find_spec('search') is not None)"
    )
    found = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True)
    assert found.returncode == 0, found.stderr
    assert not [p.name for p in (ROOT / "scripts").glob("*.py") if "execv" in p.read_text(encoding="utf-8")]
