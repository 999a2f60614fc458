"""End-to-end tests of ``scripts/search.py`` on a tiny random Llama saved as a local HF directory.

Resuming a study, journal and SQLite storages, two workers on one study, the Pareto objective and
its plots, the one-line errors for bad input (leaving no file behind), and Ctrl-C in the middle of
a study. Two workers and Ctrl-C run the real script as subprocesses (offline, one thread), as a
user would start it; the other runs call the same ``main`` in this process (``search``,
``generate``): the one-line error path is the same, without an interpreter start-up (most of a
tiny search's time) per run.
"""

from __future__ import annotations

import functools
import json
import signal
import sqlite3
import time
from dataclasses import replace
from pathlib import Path

import optuna
import pytest
from cli_helpers import assert_bad_input
from optuna.trial import TrialState
from search_fixtures import (
    counted,
    generate_in_process,
    kill_9_then_resume,
    load_study,
    ok,
    search_in_process,
    start_search,
    trial_numbers,
    wait_all,
)

from layerskip.drafts.policy.skip_policy import SkipPolicy
from layerskip.search.space import trial_policy

FINISHED = {TrialState.COMPLETE, TrialState.PRUNED}


@pytest.fixture
def run_search(capsys):
    """``layerskip-search`` in this process: ``run_search(model, *args, fast=True)``."""
    return functools.partial(search_in_process, capsys)


@pytest.fixture
def run_generate(capsys):
    """``layerskip-generate`` in this process: ``run_generate(*args)``."""
    return functools.partial(generate_in_process, capsys)


def states(study) -> list[TrialState]:
    return [t.state for t in study.get_trials(deepcopy=False)]


def assert_clean_numbering(study, expected_counted: int) -> None:
    """``expected_counted`` finished trials numbered 0..n-1: none lost, none duplicated, none left RUNNING."""
    assert len(counted(study)) == expected_counted, states(study)
    assert trial_numbers(study) == list(range(len(study.get_trials(deepcopy=False))))
    assert set(states(study)) <= FINISHED, states(study)


def snapshot(path: Path) -> tuple[bytes, int] | None:
    return (path.read_bytes(), path.stat().st_mtime_ns) if path.exists() else None


# -- the done-when flow ---------------------------------------------------------------------------------------------
def test_search_writes_policy_resumes_and_policy_is_lossless(run_search, run_generate, tiny_llama, tmp_path):
    db, out = tmp_path / "s.db", tmp_path / "p.json"
    args = ["--n-trials", "6", "--storage", f"sqlite:///{db}", "--study-name", "t", "--out", str(out)]

    first = ok(run_search(tiny_llama, *args))
    assert "6 trials (complete + pruned)" in first.stdout
    policy = SkipPolicy.load(out)
    study = load_study(f"sqlite:///{db}", "t")
    assert policy.model.fingerprint and policy.model.fingerprint == study.user_attrs["model_fingerprint"]
    assert policy.model.num_layers == 4 and policy.model.architecture == "llama"
    assert policy.provenance["study"] == "t" and policy.provenance["method"] == "optuna"
    assert_clean_numbering(study, 6)

    second = ok(run_search(tiny_llama, *args))  # the same command again resumes the study
    # 6 + 6: the second run also samples past TPE's 8 random start-up trials
    assert "6 trials so far" in second.stderr and "12 trials (complete + pruned)" in second.stdout
    study = optuna.load_study(study_name="t", storage=f"sqlite:///{db}")
    assert_clean_numbering(study, 12)
    assert len(study.user_attrs["runs"]) == 2
    SkipPolicy.load(out)

    result = ok(
        run_generate(
            "--model",
            str(tiny_llama),
            "--policy",
            str(out),
            "--compare",
            "--json",
            "--no-chat",
            "--prompt",
            "Write a short story about a robot who learns to paint.",
            "--max-new-tokens",
            "16",
        )
    )
    report = json.loads(result.stdout)
    assert report["identical"] is True, report
    assert report["new_tokens"] > 0


# -- what is scored is what is exported ------------------------------------------------------------------------------
def test_single_choice_knobs_and_head_rows_reach_the_exported_policy(run_search, tiny_llama, tmp_path):
    """Knobs given one value are no Optuna parameters, yet the trials score them and the export keeps them;
    the truncated head's rows in the file are the study's ranking, the rows every trial was scored with."""
    db, out = tmp_path / "k.db", tmp_path / "p.json"
    knobs = ["--verify-pad", "5", "--lookup", "3", "--lookup-min", "1", "--lookup-confidence", "0.2"]
    draft = ["--draft-vocab", "32", "--draft-precision", "bfloat16", "--require-skip-draft"]
    storage = ["--storage", f"sqlite:///{db}", "--study-name", "k", "--out", str(out)]
    ok(run_search(tiny_llama, "--n-trials", "3", *knobs, *draft, *storage))
    policy = SkipPolicy.load(out)
    d = policy.draft
    assert (d.min_verify_block, d.lookup_max_ngram, d.lookup_min_ngram, d.lookup_confidence) == (5, 3, 1, 0.2)
    assert d.precision == "bfloat16" and d.draft_vocab_size == 32 and d.use_skip_draft
    study = load_study(f"sqlite:///{db}", "k")
    assert list(policy.draft_vocabulary) == study.user_attrs["draft_vocab_ranking"][:32]
    assert policy.bypasses_anything  # trial 0 (nothing bypassed) is never exported
    assert policy.provenance["trial"] != 0


# -- finalists measured together; a close call is said, broken on acceptance, and recorded --------------------------
def test_close_call_is_broken_on_acceptance_and_reported(run_search, tiny_llama, tmp_path, monkeypatch):
    """Two finalists closer than their measured noise: the summary says so, the one with more tokens per
    verify is exported, and the policy's provenance carries each finalist's noise and how the call was made."""
    import layerskip.search.phases
    from layerskip.search.confirmation import Confirmation

    monkeypatch.setattr(layerskip.search.phases, "HOPELESS_PREDICTED", 0.0)  # a tiny random model predicts little
    windows = []

    def within_noise(model, calibration, policies, max_new_tokens, rounds, progress):
        windows.append((sorted(policies), rounds))
        fast, slow = sorted(policies)
        figures = {fast: (1.50, 2.0), slow: (1.45, 2.4)}  # 0.05 apart, noise 0.10 each; the slower accepts more
        return {
            n: Confirmation(speed, 9.0, 6.0, tau, 0.6, 1.0, 2, 8, rounds, 0.10, [speed] * rounds)
            for n, (speed, tau) in figures.items()
        }

    monkeypatch.setattr(layerskip.search.phases, "confirm_window", within_noise)
    out = tmp_path / "p.json"
    args = [
        "--n-trials",
        "3",
        "--confirm-top",
        "2",
        "--confirm-rounds",
        "6",
        "--storage",
        f"sqlite:///{tmp_path / 's.db'}",
    ]
    result = ok(run_search(tiny_llama, *args, "--out", str(out)))

    assert len(windows) == 1 and len(windows[0][0]) == 2 and windows[0][1] == 6  # one window, both finalists
    fast, slow = windows[0][0]
    assert "1.50x (0.10)" in result.stdout and "1.45x (0.10)" in result.stdout
    assert "and HF generate in one interleaved window, 6 rounds x 2 prompts x 8 tokens" in result.stdout
    assert f"decision: close call: trial {fast} 1.50x (IQR 0.10, tau 2.00) is the fastest" in result.stdout
    assert f"broken on acceptance (most tokens per verify): trial {slow}" in result.stdout
    assert "draft timings:" in result.stdout and "distinct drafts timed once each" in result.stdout
    policy = SkipPolicy.load(out)
    confirmation = policy.provenance["confirmation"]
    assert policy.provenance["trial"] == slow and confirmation["chosen"] == slow
    assert confirmation["close_call"] is True and confirmation["decided_by"] == "acceptance"
    assert sorted((f["trial"], f["speedup_iqr"]) for f in confirmation["finalists"]) == [(fast, 0.1), (slow, 0.1)]
    assert confirmation["rounds"] == 6 and "close call" in confirmation["note"]
    assert policy.measured["confirmed"]["speedup_iqr"] == 0.10 and policy.measured["draft_timed_by_trial"] >= 0


# -- journal storage, Pareto objective, plots, --total-trials ---------------------------------------------------------
def test_journal_storage_pareto_plots_and_total_trials(run_search, tiny_llama, tmp_path):
    journal, out, plots = tmp_path / "j.log", tmp_path / "p.json", tmp_path / "plots"
    # With the lookup knobs: every trial keeps a skip draft, lookup runs have their own lengths and cut.
    lookup = ["--lookup", "0,3", "--lookup-tokens", "4,12", "--lookup-confidence", "0,0.2", "--require-skip-draft"]
    args = ["--storage", str(journal), "--objective", "pareto", "--out", str(out), *lookup]

    ok(run_search(tiny_llama, *args, "--n-trials", "6", "--plots", str(plots)))
    for name in ("pareto.png", "history.png", "skip_frequency.png"):
        png = plots / name
        assert png.is_file() and png.stat().st_size > 1000, name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    policy = SkipPolicy.load(out)
    assert policy.provenance["objective"] == "pareto" and policy.model.fingerprint
    study = load_study(str(journal), "tiny-llama-pareto")  # default study name: MODEL-OBJECTIVE
    assert len(study.directions) == 2
    assert_clean_numbering(study, 6)
    assert all("use_skip_draft" not in t.params for t in study.trials)
    assert policy.draft.use_skip_draft

    # A worker killed mid-append left half a record: the resume removes it (kept in a backup), warns, goes on.
    whole = journal.read_bytes()
    with journal.open("ab") as handle:
        handle.write(b'{"op_code": 6, "worker_id": "w", "trial_id": 3, "user_at')
    # --total-trials caps the study, not this process: 3 more although 50 were asked for ...
    capped = ok(run_search(tiny_llama, *args, "--n-trials", "50", "--total-trials", "9"))
    assert "9 trials (complete + pruned)" in capped.stdout
    assert "warning: journal" in capped.stderr and "damaged record" in capped.stderr
    assert (tmp_path / "j.log.damaged-1").read_bytes().startswith(whole)
    assert_clean_numbering(load_study(str(journal), "tiny-llama-pareto"), 9)
    # ... and a study already at its cap runs none, but still exports.
    out.unlink()
    ok(run_search(tiny_llama, *args, "--n-trials", "50", "--total-trials", "5"))
    assert_clean_numbering(load_study(str(journal), "tiny-llama-pareto"), 9)
    SkipPolicy.load(out)


# -- several workers on one study ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["sqlite", "journal"])
def test_two_workers_share_one_study(tiny_llama, tmp_path, kind):
    url = f"sqlite:///{tmp_path / 'w.db'}" if kind == "sqlite" else str(tmp_path / "w.log")
    workers = [
        start_search(
            tiny_llama,
            "--storage",
            url,
            "--study-name",
            "shared",
            "--n-trials",
            "5",
            "--worker",
            str(w),
            "--out",
            str(tmp_path / f"p{w}.json"),
        )
        for w in (0, 1)
    ]
    for code, out, err in wait_all(workers):
        assert code == 0, f"exit {code}\nstdout:\n{out}\nstderr:\n{err}"
    study = load_study(url, "shared")
    assert_clean_numbering(study, 10)
    assert counted(study) == list(range(10))
    for w in (0, 1):
        SkipPolicy.load(tmp_path / f"p{w}.json")


# -- bad input: one line, exit code 2, nothing written --------------------------------------------------------------
def _prompt_files(directory: Path) -> dict[str, Path]:
    files = {
        "empty.jsonl": "",
        "broken.jsonl": '{"question_id": 1, "turns": ["What is 2 + 2?"]}\n{"question_id": 2, "turns"\n',
        "prompts.csv": "text,category\nWhat is 2 + 2?,math\nName a colour.,qa\n",
        "prompts.json": json.dumps([{"text": "What is 2 + 2?"}, {"text": "Name a colour."}]),
    }
    paths = {}
    for name, content in files.items():
        paths[name] = directory / name
        paths[name].write_text(content)
    return paths


BAD_INPUTS = {
    # id: (extra arguments, storage kind, fragments the error line must contain)
    "storage-url": (["--storage", "foo://bar"], None, ["unsupported storage URL"]),
    "storage-dir": (["--storage", "sqlite:///{tmp}/no/such/dir/s.db"], None, ["does not exist"]),
    "unreachable-db": (["--storage", "postgresql://u:secret@127.0.0.1:1/db"], None, ["cannot open storage", "u:***@"]),
    "n-trials-0": (["--n-trials", "0"], "sqlite", ["--n-trials must be > 0"]),
    "prompts-missing": (["--prompts", "{tmp}/missing.jsonl"], "sqlite", ["not found"]),
    "prompts-empty": (["--prompts", "{tmp}/empty.jsonl"], "journal", ["is empty"]),
    "prompts-malformed": (["--prompts", "{tmp}/broken.jsonl"], "sqlite", ["line 2"]),
    "text-field-csv": (["--prompts", "{tmp}/prompts.csv", "--text-field", "body"], "sqlite", ["no text field 'body'"]),
    "text-field-json": (["--prompts", "{tmp}/prompts.json", "--text-field", "body"], "journal", ["'body'"]),
    "model-missing": (["--model", "{tmp}/no-such-model"], "sqlite", ["unknown model"]),
    "never-skip-range": (["--never-skip", "7"], "journal", ["out of range"]),
    "confirm-rounds-3": (["--confirm-rounds", "3"], "sqlite", ["--confirm-rounds must be >= 5"]),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_line_and_writes_nothing(run_search, tiny_llama, tmp_path, case):
    extra, kind, fragments = BAD_INPUTS[case]
    _prompt_files(tmp_path)
    db, journal, out = tmp_path / "s.db", tmp_path / "j.log", tmp_path / "p.json"
    storage = {"sqlite": ["--storage", f"sqlite:///{db}"], "journal": ["--storage", str(journal)], None: []}[kind]
    # The case's own arguments come last: they win over the defaults here (and over --model).
    args = [arg.replace("{tmp}", str(tmp_path)) for arg in [*storage, "--n-trials", "2", "--out", str(out), *extra]]
    before = sorted(p.name for p in tmp_path.iterdir())

    result = run_search(tiny_llama, *args)

    line = assert_bad_input(result, *fragments)
    assert "secret" not in line
    assert sorted(p.name for p in tmp_path.iterdir()) == before, "a failed run left files behind"


@pytest.mark.parametrize("kind", ["sqlite", "journal"])
def test_study_of_another_model_is_refused_untouched(run_search, tiny_llama, other_llama, tmp_path, kind):
    path = tmp_path / ("s.db" if kind == "sqlite" else "j.log")
    url = f"sqlite:///{path}" if kind == "sqlite" else str(path)
    ok(
        run_search(
            tiny_llama,
            "--storage",
            url,
            "--study-name",
            "mine",
            "--n-trials",
            "2",
            "--confirm-top",
            "0",
            "--out",
            str(tmp_path / "first.json"),
        )
    )
    before, listing = snapshot(path), sorted(p.name for p in tmp_path.iterdir())
    time.sleep(0.05)  # an mtime change would show

    result = run_search(
        other_llama, "--storage", url, "--study-name", "mine", "--n-trials", "2", "--out", str(tmp_path / "second.json")
    )

    assert_bad_input(result, "study 'mine'", "tiny-llama", "other-llama", "another --study-name")
    assert snapshot(path) == before, "the existing study was modified"
    assert sorted(p.name for p in tmp_path.iterdir()) == listing


# -- Ctrl-C in the middle of a study ----------------------------------------------------------------------------------
def _finished_trials(db: Path) -> int:
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as connection:
            return connection.execute("SELECT count(*) FROM trials WHERE state IN ('COMPLETE', 'PRUNED')").fetchone()[0]
    except sqlite3.OperationalError:  # not created yet
        return 0


def test_ctrl_c_leaves_a_resumable_study(run_search, tiny_llama, tmp_path):
    db = tmp_path / "s.db"
    url = f"sqlite:///{db}"
    args = ["--storage", url, "--study-name", "int", "--out", str(tmp_path / "p.json")]
    worker = start_search(tiny_llama, *args, "--n-trials", "10000")
    deadline = time.monotonic() + 120
    while _finished_trials(db) < 2:
        assert worker.poll() is None, worker.communicate()
        assert time.monotonic() < deadline, "no trials finished in 120 s"
        time.sleep(0.1)
    worker.send_signal(signal.SIGINT)
    [(code, out, err)] = wait_all([worker], timeout=60)
    assert code == 130, f"exit {code}\nstdout:\n{out}\nstderr:\n{err}"
    assert "Traceback" not in err and "interrupted" in err

    study = load_study(url, "int")
    before = len(counted(study))
    assert before >= 2
    assert TrialState.RUNNING not in states(study), "an interrupted trial was left RUNNING"
    assert TrialState.FAIL in states(study), "the interrupted trial should be recorded as FAIL"
    assert set(states(study)) <= FINISHED | {TrialState.FAIL, TrialState.WAITING}  # WAITING: unused warm starts
    assert trial_numbers(study) == list(range(len(study.get_trials(deepcopy=False))))

    ok(run_search(tiny_llama, *args, "--n-trials", "3"))
    study = load_study(url, "int")
    assert len(counted(study)) == before + 3
    assert TrialState.RUNNING not in states(study)
    assert trial_numbers(study) == list(range(len(study.get_trials(deepcopy=False))))
    SkipPolicy.load(tmp_path / "p.json")


# -- warm start from what on-the-fly selection ended on ---------------------------------------------------------------
def test_on_the_fly_set_seeds_a_study(run_search, run_generate, tiny_llama, tmp_path):
    """generate.py --policy on-the-fly --save-policy writes the set it ended on; search --warm-start runs it first."""
    saved, db, out = tmp_path / "otf.json", tmp_path / "w.db", tmp_path / "p.json"
    common = ["--model", str(tiny_llama), "--no-chat", "--prompt", "Write a short story about a robot.", "--json"]
    refused = run_generate(*common, "--policy", "plain", "--save-policy", str(saved))
    assert_bad_input(refused, "--save-policy needs a policy that chooses while generating")
    assert not saved.exists()
    report = json.loads(
        ok(
            run_generate(*common, "--policy", "on-the-fly", "--max-new-tokens", "24", "--save-policy", str(saved))
        ).stdout
    )
    fixed = SkipPolicy.load(saved)
    assert fixed.on_the_fly is None and fixed.model.num_layers == 4
    assert [list(fixed.skip_attention), list(fixed.skip_mlp)] == [
        report["selection"]["skip_attention"],
        report["selection"]["skip_mlp"],
    ]
    # A set that bypasses something, so the ranked order must be led by it.
    seed = replace(fixed, skip_attention=(3,), skip_mlp=(1, 2))
    seed.save(saved)
    args = ["--n-trials", "2", "--storage", f"sqlite:///{db}", "--study-name", "w", "--out", str(out)]
    result = ok(run_search(tiny_llama, *args, "--warm-start", str(saved)))  # FAST_ARGS: --draft-tokens 2,3
    study = load_study(f"sqlite:///{db}", "w")
    first = trial_policy(study, study.trials[0])
    assert (first.skip_attention, first.skip_mlp) == ((3,), (1, 2))
    assert (
        "max_draft_tokens" in result.stderr
    )  # the on-the-fly draft length (6) is a choice; its 0.1 threshold is noted


# -- kill -9 in the middle of a study ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["sqlite", "journal"])
def test_kill_9_then_the_same_command_resumes(run_search, tiny_llama, tmp_path, kind):
    """Killed in the middle of a trial: nothing completed is lost, the trial is marked FAIL (no trial
    stays RUNNING), and --out is whole after the resume. (PostgreSQL: tests/test_search_postgres.py.)"""
    url = f"sqlite:///{tmp_path / 'k.db'}" if kind == "sqlite" else str(tmp_path / "k.log")
    kill_9_then_resume(run_search, tiny_llama, url, "k", tmp_path / "p.json")
