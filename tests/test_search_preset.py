"""``layerskip-search --preset quick``: its values, explicit flags over them, and what the study and policy record."""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch
from optuna.trial import TrialState
from search_fixtures import generate_in_process, load_study, ok, search_in_process

from layerskip.drafts.policy.skip_policy import SkipPolicy
from layerskip.machine import this_machine
from layerskip.search.cli import given_arguments, preset_values
from layerskip.search.phases import default_study_name
from layerskip.search.settings import SearchSettings, resolve_settings


def _resolved(argv: list[str]) -> tuple[SearchSettings, dict | None]:
    """What a command line runs with, as the command does it: its flags, then ``run_study``'s resolving."""
    args, given = given_arguments(argv)
    return resolve_settings(args.preset, given)


def test_the_preset_sets_its_values_and_flags_override_them() -> None:
    plain, record = _resolved([])
    assert record is None and plain.n_trials == 60 and plain.draft_precision == ("model",)
    quick, record = _resolved(["--preset", "quick"])
    values = preset_values("quick", torch.device("cpu"))
    assert {dest: getattr(quick, dest) for dest in values} == values
    assert quick.draft_precision == ("int4",) and quick.require_skip_draft and quick.timeout == 150
    assert record["overridden"] == []
    mine, record = _resolved(["--preset", "quick", "--n-trials", "10", "--lookup", "0", "--no-require-skip-draft"])
    assert (mine.n_trials, mine.lookup, mine.require_skip_draft) == (10, (0,), False)
    assert mine.draft_vocab == (4096, 16384)  # not given: the preset's
    assert record["overridden"] == ["--n-trials", "--lookup", "--require-skip-draft"]
    assert record["values"]["--lookup"] == [0, 3]  # what the preset would have set, as JSON


def test_every_setting_has_its_flag_and_default() -> None:
    """The parser's flags are built from the settings table: each setting has one, typed as its field."""
    from layerskip.search.cli import build_parser
    from layerskip.search.settings import DEFAULTS, SETTINGS, flag

    parser = build_parser()
    flags = {option for action in parser._actions for option in action.option_strings}
    assert {flag(name) for name in SETTINGS} <= flags
    parsed = vars(parser.parse_args([]))
    assert SearchSettings(**{name: parsed[name] for name in SETTINGS}) == DEFAULTS
    typed = ["--draft-tokens", "3,5", "--lookup-confidence", "0,0.2", "--timeout", "9", "--warm-start", "a.json"]
    _, given = given_arguments([*typed, "--no-chat", "--force", "--draft-precision", "int8"])
    assert given == {
        "draft_tokens": (3, 5), "lookup_confidence": (0.0, 0.2), "timeout": 9.0, "warm_start": ["a.json"],
        "chat": False, "force": True, "draft_precision": ("int8",),
    }  # fmt: skip


def test_on_a_gpu_the_draft_keeps_the_models_weights() -> None:
    assert preset_values("quick", torch.device("cuda"))["draft_precision"] == ("model",)


def test_default_study_names() -> None:
    assert default_study_name("meta-llama/Llama-3.2-1B", "quick") == "Llama-3.2-1B-quick"
    assert default_study_name("/models/smollm2.Q4.gguf", "speedup") == "smollm2.Q4-speedup"
    assert default_study_name("smollm2-135m", "speedup") == "smollm2-135m-speedup"


@pytest.fixture
def run_search(capsys):
    return functools.partial(search_in_process, capsys)


def test_a_quick_search_records_its_preset_and_machine(run_search, capsys, tiny_llama, tmp_path) -> None:
    """The preset's space reaches the study (a tiny, short run: FAST_ARGS and --n-trials override the
    preset's sizes); the exported policy records the preset and this machine, so generate says nothing."""
    db, out = tmp_path / "q.db", tmp_path / "q.json"
    storage = ["--storage", f"sqlite:///{db}", "--out", str(out)]
    # The tiny model has 300 vocabulary rows: the preset's head sizes are overridden to fit it.
    ok(run_search(tiny_llama, "--preset", "quick", "--n-trials", "3", "--draft-vocab", "0,128", *storage))
    study = load_study(f"sqlite:///{db}", "tiny-llama-quick")  # the preset names the default study
    space = study.user_attrs["space"]
    assert space["precision_choices"] == ["int4"] and space["draft_vocab_choices"] == [0, 128]
    assert space["lookup_ngram_choices"] == [0, 3] and space["require_skip_draft"] is True
    assert space["max_fraction"] == 0.25 and space["sublayer_order"]  # ranked
    assert study.user_attrs["preset"]["name"] == "quick"
    policy = SkipPolicy.load(out)
    assert policy.provenance["preset"] == study.user_attrs["preset"]
    assert "--n-trials" in policy.provenance["preset"]["overridden"]
    assert policy.tuned_machine == this_machine("cpu")
    finished = study.get_trials(states=(TrialState.COMPLETE, TrialState.PRUNED))
    assert finished and all(t.user_attrs["machine"] == this_machine("cpu").to_dict() for t in finished)
    # Resumed on "another machine" (the study says it was made elsewhere): one warning; the policy
    # still records where its trial was measured, here.
    study.set_user_attr("machine", replace(this_machine("cpu"), cpu_model="Elsewhere CPU").to_dict())
    resumed = ok(run_search(tiny_llama, "--preset", "quick", "--n-trials", "2", "--draft-vocab", "0,128", *storage))
    assert resumed.stderr.count("was made on another machine (Elsewhere CPU -> ") == 1
    assert SkipPolicy.load(out).tuned_machine == this_machine("cpu")
    generated = generate_in_process(
        capsys, "--model", str(tiny_llama), "--policy", str(out), "--prompt", "hello", "--no-chat",
        "--max-new-tokens", "4", "--json",
    )  # fmt: skip
    assert generated.returncode == 0 and "warning:" not in generated.stderr and "note:" not in generated.stderr
