"""Faults a search meets: each ends in one ``error:`` line, exit 2, before any work and with no file
changed, or, where going on is right, in success with a one-line warning (a journal whose last
record an interrupted write damaged).

The CLI runs in this process (``search_in_process``: its own ``main`` and one-line error path).
Most cases pass ``--model`` a path that does not exist: a check made after loading the model would
answer "unknown model" instead, so these tests also prove the order.
"""

from __future__ import annotations

import json
import os
import random
import sqlite3
import stat
from pathlib import Path

import optuna
import pytest
from cli_helpers import assert_bad_input
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState
from search_fixtures import search_in_process

from layerskip.data import load_prompts
from layerskip.drafts.policy.skip_policy import ModelIdentity, SkipPolicy
from layerskip.errors import LayerskipError
from layerskip.search import journal as journal_module
from layerskip.search.study import open_storage, open_study

NO_MODEL = "/nonexistent/model-dir"


def listing(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


# -- argument values no study can use --------------------------------------------------------------------------------
ARGUMENT_ERRORS = {
    "seed-negative": (["--seed", "-1"], ["--seed", "-1"]),
    "seed-huge": (["--seed", "99999999999999999999999"], ["--seed"]),
    "timeout-negative": (["--timeout", "-1"], ["--timeout", "-1"]),
    "timeout-nan": (["--timeout", "nan"], ["--timeout"]),
    "draft-vocab-negative": (["--draft-vocab", "0,-5"], ["--draft-vocab", "-5"]),
    "lookup-negative": (["--lookup", "-1"], ["--lookup", "-1"]),
    "lookup-min-zero": (["--lookup-min", "0"], ["--lookup-min"]),
    "lookup-confidence": (["--lookup-confidence", "1.5"], ["--lookup-confidence"]),
    "verify-pad-negative": (["--verify-pad", "-4"], ["--verify-pad"]),
    "worker-negative": (["--worker", "-1"], ["--worker"]),
    "fractions-crossed": (["--min-skip-fraction", "0.8", "--max-skip-fraction", "0.2"], ["--min-skip-fraction"]),
    "export-trial-negative": (["--export-trial", "-2"], ["--export-trial"]),
    "study-name-empty": (["--study-name", ""], ["--study-name is empty"]),
    "study-name-blank": (["--study-name", "  "], ["--study-name is empty"]),
    "draft-tokens-huge": (["--draft-tokens", "2,100"], ["--draft-tokens choices must be <= 64"]),
    "lookup-tokens-huge": (["--lookup-tokens", "1000"], ["--lookup-tokens choices must be <= 64"]),
}


@pytest.mark.parametrize("case", list(ARGUMENT_ERRORS))
def test_bad_values_are_refused_before_loading(case: str, tmp_path: Path, capsys) -> None:
    extra, fragments = ARGUMENT_ERRORS[case]
    storage = ["--storage", f"sqlite:///{tmp_path / 's.db'}", "--out", str(tmp_path / "p.json")]
    assert_bad_input(search_in_process(capsys, NO_MODEL, *storage, *extra), *fragments)
    assert list(tmp_path.iterdir()) == []


# -- output paths are checked before the work ------------------------------------------------------------------------
def test_output_paths_that_cannot_be_written(tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("mine")
    storage = ["--storage", f"sqlite:///{tmp_path / 's.db'}"]
    cases = [
        (["--out", str(tmp_path / "dir")], ["--out", "is a directory"]),
        (["--out", str(tmp_path / "file" / "p.json")], ["--out", "is a file, not a directory"]),
        (["--out", str(tmp_path / "p.json"), "--plots", str(tmp_path / "file")], ["--plots", "is a file"]),
        (["--out", str(tmp_path / "file")], ["--out", "is not a layerskip policy", "--force"]),  # not replaced
    ]
    for extra, fragments in cases:
        assert_bad_input(search_in_process(capsys, NO_MODEL, *storage, *extra), *fragments)
    locked = tmp_path / "dir"
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != locked and real_access(path, mode))
    result = search_in_process(capsys, NO_MODEL, *storage, "--out", str(locked / "p.json"))
    assert_bad_input(result, "--out", "not writable")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "file"]


# -- storages that cannot be written or read -------------------------------------------------------------------------
def test_read_only_storages(tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    db, journal = tmp_path / "s.db", tmp_path / "j.log"
    db.write_bytes(b"")
    journal.write_bytes(b"")
    real_access = os.access
    out = ["--out", str(tmp_path / "p.json")]
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) not in (db, journal) and real_access(path, mode))
    assert_bad_input(search_in_process(capsys, NO_MODEL, "--storage", f"sqlite:///{db}", *out), "read-only")
    assert_bad_input(search_in_process(capsys, NO_MODEL, "--storage", str(journal), *out), "read-only")
    # A journal's directory must be writable too: Optuna locks the journal with a file beside it.
    (tmp_path / "outputs").mkdir()
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != tmp_path and real_access(path, mode))
    new_journal, out = str(tmp_path / "new.log"), str(tmp_path / "outputs" / "p.json")
    result = search_in_process(capsys, NO_MODEL, "--storage", new_journal, "--out", out)
    assert_bad_input(result, "storage", str(tmp_path), "not writable")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["j.log", "outputs", "s.db"]


def test_damaged_sqlite_file_is_one_line(tmp_path: Path, capsys) -> None:
    db = tmp_path / "s.db"
    # Page size 4096, legacy (rollback-journal) read/write versions, then noise: random header
    # bytes 18-19 of 2 would ask for WAL mode, and SQLite would create -wal/-shm files beside it.
    noise = random.Random(0).randbytes(4096 - 20)
    db.write_bytes(b"SQLite format 3\x00" + bytes([0x10, 0x00, 0x01, 0x01]) + noise)
    before = db.read_bytes()
    result = search_in_process(capsys, NO_MODEL, "--storage", f"sqlite:///{db}", "--out", str(tmp_path / "p.json"))
    assert_bad_input(result, "storage")
    assert db.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["s.db"]


def test_sqlite_study_with_a_damaged_page_is_one_line(tmp_path: Path, capsys) -> None:
    """A page damaged inside a study that otherwise opens: caught before any work, not at the first write."""
    db = tmp_path / "s.db"
    study = optuna.create_study(study_name="s", storage=f"sqlite:///{db}")
    study.optimize(lambda trial: trial.suggest_float("x", 0, 1), n_trials=3)
    data = bytearray(db.read_bytes())
    page = 4096
    pages = len(data) // page
    assert pages > 3
    data[page * (pages - 1) : page * pages] = b"\x0d" + bytes(range(256)) * 15 + b"\x00" * 255  # the last page
    db.write_bytes(bytes(data))
    before = db.read_bytes()
    args = ["--storage", f"sqlite:///{db}", "--study-name", "s", "--out", str(tmp_path / "p.json")]
    assert_bad_input(search_in_process(capsys, NO_MODEL, *args), "SQLite storage", "damaged", "restore it")
    assert db.read_bytes() == before


def test_mysql_url_names_the_driver_it_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_driver(*args: object, **kwargs: object) -> None:
        try:
            raise ModuleNotFoundError("No module named 'MySQLdb'", name="MySQLdb")
        except ModuleNotFoundError as cause:
            raise ImportError("Failed to import DB access module") from cause

    monkeypatch.setattr(optuna.storages, "RDBStorage", no_driver)
    with pytest.raises(LayerskipError, match=r"MySQLdb is not installed\); pip install mysqlclient"):
        open_storage("mysql://user:secret@127.0.0.1:1/db")
    with pytest.raises(LayerskipError, match=r"pip install pymysql"):
        open_storage("mysql+pymysql://user:secret@127.0.0.1:1/db")


# -- journal files damaged by an interrupted write -------------------------------------------------------------------
def _journal_study(path: Path, trials: int = 3) -> None:
    storage = optuna.storages.JournalStorage(JournalFileBackend(str(path)))
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name="j", storage=storage)
    study.optimize(lambda trial: trial.suggest_float("x", 0, 1), n_trials=trials)


def _complete(path: Path) -> int:
    storage = optuna.storages.JournalStorage(JournalFileBackend(str(path)))
    return len(optuna.load_study(study_name="j", storage=storage).get_trials(states=(TrialState.COMPLETE,)))


@pytest.mark.parametrize(
    "tail",
    [
        b'{"op_code": 5, "worker_id": "a", "trial_id"',
        b"\x00\x00\x00garbage\n",
        b'{"op_code": \xff\xfe}\n',
        b"[" * 100_000 + b"]" * 100_000 + b"\n",
    ],
    ids=["partial", "garbage-line", "non-utf8", "nested-deep"],
)
def test_a_damaged_last_record_is_removed_after_a_backup(tmp_path: Path, tail: bytes) -> None:
    path = tmp_path / "j.log"
    _journal_study(path)
    whole = path.read_bytes()
    path.write_bytes(whole + tail)

    repair = journal_module.repair_journal(path)

    assert repair is not None and repair.line == whole.count(b"\n") + 1
    assert path.read_bytes() == whole, "every complete record is kept, the damaged one removed"
    assert repair.backup.read_bytes() == whole + tail, "the original is kept"
    assert "damaged record" in repair.warning(path) and str(repair.backup) in repair.warning(path)
    assert not Path(f"{path}.lock").exists()
    _journal_study_resumes(path)


def _journal_study_resumes(path: Path) -> None:
    storage = optuna.storages.JournalStorage(JournalFileBackend(str(path)))
    study = optuna.load_study(study_name="j", storage=storage)
    study.optimize(lambda trial: trial.suggest_float("x", 0, 1), n_trials=2)
    assert _complete(path) == 5  # appended after the repair, and still readable


def test_a_whole_journal_is_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "j.log"
    _journal_study(path)
    before = path.read_bytes()
    assert journal_module.repair_journal(path) is None
    assert journal_module.repair_journal(tmp_path / "new.log") is None
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["j.log"]


def test_a_damaged_middle_record_is_refused_untouched(tmp_path: Path, capsys) -> None:
    path = tmp_path / "j.log"
    _journal_study(path)
    lines = path.read_bytes().splitlines(keepends=True)
    lines.insert(2, b"\xff\xfe random bytes\n")
    path.write_bytes(b"".join(lines))
    before = listing(tmp_path)

    result = search_in_process(capsys, NO_MODEL, "--storage", str(path), "--out", str(tmp_path / "p.json"))

    assert_bad_input(result, str(path), "line 3", "restore the file from a backup")
    assert listing(tmp_path) == before


# -- a resumed study keeps its search space --------------------------------------------------------------------------
def _study_made_with(url: str, **space: object) -> None:
    study = optuna.create_study(study_name="s", storage=url)
    study.set_user_attr("space", {"lookup_ngram_choices": [3], "draft_token_choices": [2, 3], **space})
    study.set_user_attr("model_fingerprint", "f")


@pytest.mark.parametrize(
    "extra, recorded, fragments",
    [
        (["--lookup", "0,3"], {}, ["was made with --lookup 3", "this run has --lookup 0,3"]),
        (["--lookup", "3", "--draft-tokens", "2,3,4"], {}, ["--draft-tokens 2,3", "--draft-tokens 2,3,4"]),
        (["--lookup", "3", "--no-adaptive"], {"tune_adaptive": True}, ["--no-adaptive"]),
        (["--lookup", "3", "--space", "switches"], {"sublayer_order": [[0, "mlp"]]}, ["--space ranked"]),
        (["--lookup", "3", "--exit-thresholds", "0.4"], {"exit_threshold_choices": [0.5]}, ["--exit-thresholds 0.5"]),
    ],
    ids=["lookup", "draft-tokens", "adaptive", "space", "exit-thresholds"],
)
def test_a_changed_space_flag_is_refused_before_any_work(
    tmp_path: Path, capsys, extra: list[str], recorded: dict, fragments: list[str]
) -> None:
    db = tmp_path / "s.db"
    url = f"sqlite:///{db}"
    _study_made_with(url, **recorded)
    before = db.read_bytes()
    args = ["--storage", url, "--study-name", "s", "--out", str(tmp_path / "p.json"), "--draft-tokens", "2,3"]
    result = search_in_process(capsys, NO_MODEL, *args, *extra, fast=False)
    assert_bad_input(result, "study 's'", "another --study-name", *fragments)
    assert db.read_bytes() == before
    with sqlite3.connect(db) as connection:
        assert connection.execute("SELECT count(*) FROM trials").fetchone()[0] == 0


# -- a resumed study keeps its calibration prompts -------------------------------------------------------------------
def _study_calibrated_on(url: str, digest: bool = True, **changes: object) -> None:
    from layerskip.data import load_prompts
    from layerskip.search.checks import prompts_digest

    prompts = load_prompts("builtin", n=2)  # what FAST_ARGS pick
    calibration = {"source": "builtin", "prompts": [p.id for p in prompts], "chat": False, "reference_tokens": 8}
    if digest:
        calibration["prompts_sha256"] = prompts_digest(prompts)
    study = optuna.create_study(study_name="s", storage=url)
    study.set_user_attr("calibration", {**calibration, **changes})
    study.set_user_attr("model_fingerprint", "f")


@pytest.mark.parametrize(
    "extra, fragments",
    [
        (["--n-prompts", "3"], ["calibrated on 2 prompt(s)", "this run picks 3 prompt(s)", "--n-prompts"]),
        (["--categories", "qa"], ["this run picks 2 prompt(s)", "--categories"]),
        (["--per-category", "1"], ["--per-category"]),
        (["--prompts", "MINE"], ["from builtin", "mine.jsonl", "--prompts"]),
        (["--reference-tokens", "6"], ["--reference-tokens 8", "this run has --reference-tokens 6"]),
    ],
    ids=["n-prompts", "categories", "per-category", "prompts-file", "reference-tokens"],
)
@pytest.mark.parametrize("digest", [True, False], ids=["digest", "older-study"])
def test_other_calibration_prompts_are_refused_before_any_work(
    tmp_path: Path, capsys, extra: list[str], fragments: list[str], digest: bool
) -> None:
    db = tmp_path / "s.db"
    url = f"sqlite:///{db}"
    _study_calibrated_on(url, digest)
    mine = tmp_path / "mine.jsonl"
    mine.write_text('{"turns": ["a prompt of mine"]}\n{"turns": ["another one"]}\n')
    extra = [str(mine) if value == "MINE" else value for value in extra]
    before = db.read_bytes()
    args = ["--storage", url, "--study-name", "s", "--out", str(tmp_path / "p.json")]
    result = search_in_process(capsys, NO_MODEL, *args, *extra)
    assert_bad_input(result, "study 's'", "another --study-name", *fragments)
    assert db.read_bytes() == before


def test_the_same_prompts_resume_and_other_text_is_refused(tmp_path: Path, capsys) -> None:
    url = f"sqlite:///{tmp_path / 's.db'}"
    _study_calibrated_on(url)
    args = ["--storage", url, "--study-name", "s", "--out", str(tmp_path / "p.json")]
    # The study's own prompts pass every check made before loading: the unknown model is what stops it.
    assert_bad_input(search_in_process(capsys, NO_MODEL, *args), "unknown model")
    url = f"sqlite:///{tmp_path / 'other.db'}"
    _study_calibrated_on(url, prompts_sha256="0123456789abcdef")  # same ids and source, other text
    args = ["--storage", url, "--study-name", "s", "--out", str(tmp_path / "p.json")]
    assert_bad_input(search_in_process(capsys, NO_MODEL, *args), "the same prompt ids from builtin with other text")


def test_a_resumed_search_refuses_other_prompts_and_another_chat_setting(
    tiny_llama: Path, tmp_path: Path, capsys
) -> None:
    """End to end: the digest a study records is the one a resume compares with."""
    from search_fixtures import ok

    url = f"sqlite:///{tmp_path / 's.db'}"
    args = ["--storage", url, "--study-name", "base", "--out", str(tmp_path / "p.json"), "--n-trials", "2"]
    ok(search_in_process(capsys, tiny_llama, *args, "--confirm-top", "0"))
    policy_before = (tmp_path / "p.json").read_bytes()
    assert_bad_input(search_in_process(capsys, tiny_llama, *args, "--n-prompts", "3"), "--n-prompts")
    assert_bad_input(search_in_process(capsys, tiny_llama, *args, "--chat"), "calibrated with --no-chat")
    assert (tmp_path / "p.json").read_bytes() == policy_before


# -- warm starts -----------------------------------------------------------------------------------------------------
def test_a_failed_warm_start_is_queued_again_until_it_completes(tmp_path: Path) -> None:
    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'w.db'}")
    metadata = {"model_fingerprint": "f"}
    warm = [{"skip_count": 2, "max_draft_tokens": 4}]

    def reopen() -> optuna.Study:
        return open_study(storage, "w", "speedup", 0, metadata, warm)

    study = reopen()
    trial = study.ask()  # the warm start, claimed by a worker that is then killed
    assert study.trials[0].system_attrs["fixed_params"] == warm[0]
    study.tell(trial, state=TrialState.FAIL)
    study = reopen()  # the documented resume: the same command again
    waiting = study.get_trials(states=(TrialState.WAITING,))
    assert [t.system_attrs["fixed_params"] for t in waiting] == warm
    study = reopen()  # queued already: not twice
    assert len(study.get_trials(states=(TrialState.WAITING,))) == 1
    trial = study.ask()
    study.tell(trial, 1.0)
    study = reopen()  # evaluated: not again
    assert study.get_trials(states=(TrialState.WAITING,)) == []
    assert [t.state for t in study.trials] == [TrialState.FAIL, TrialState.COMPLETE]


def test_a_warm_start_for_another_model_is_refused_before_calibration(
    tiny_llama: Path, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    import layerskip.search.phases

    def calibrating(*args: object, **kwargs: object) -> None:
        raise AssertionError("calibration started")

    monkeypatch.setattr(layerskip.search.phases, "prepare_calibration", calibrating)
    other = SkipPolicy(skip_mlp=(1,), model=ModelIdentity(name="big", architecture="llama", num_layers=7))
    seed = other.save(tmp_path / "other.json")
    args = ["--storage", f"sqlite:///{tmp_path / 's.db'}", "--out", str(tmp_path / "p.json"), "--warm-start", str(seed)]
    assert_bad_input(search_in_process(capsys, tiny_llama, *args), "--warm-start", "7-layer model")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.json"]


# -- prompt files ----------------------------------------------------------------------------------------------------
PROMPT_FILES = {
    "non-utf8": ('{"turns": ["caf\xe9"]}\n'.encode("latin-1"), ["not UTF-8", "line 1"]),
    "malformed-line-1": (b'{"turns": ["a"]\n{"turns": ["b"]}\n', ["line 1 is not valid JSON"]),
    "row-without-turns": (b'{"turns": ["a"]}\n{"text": "b"}\n', ["line 2 has no 'turns'"]),
    "no-text-column": (b'{"body": "a"}\n', ["no 'turns'", "--text-field", "body"]),
    "nested-deep-line": (b'{"turns": ["a"]}\n' + b"[" * 100_000 + b"]" * 100_000 + b"\n", ["line 2", "nests deeper"]),
    "nested-deep-document": (b"[" * 100_000 + b"]" * 100_000, ["line 1", "nests deeper"]),
}


@pytest.mark.parametrize("case", list(PROMPT_FILES))
def test_prompt_file_problems_are_one_clear_line(case: str, tmp_path: Path, capsys) -> None:
    content, fragments = PROMPT_FILES[case]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_bytes(content)
    args = ["--prompts", str(prompts), "--storage", f"sqlite:///{tmp_path / 's.db'}", "--out", str(tmp_path / "p.json")]
    line = assert_bad_input(search_in_process(capsys, NO_MODEL, *args), *fragments)
    assert "unknown model" not in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompts.jsonl"]


@pytest.mark.parametrize("kind", ["fifo", "link-to-dev-zero"])
def test_a_prompts_path_that_is_no_regular_file_is_refused_without_reading(kind: str, tmp_path: Path, capsys) -> None:
    """A FIFO would block the reader for good, /dev/zero would never end: refused before any read."""
    prompts = tmp_path / "prompts.jsonl"
    if kind == "fifo":
        os.mkfifo(prompts)
    else:
        prompts.symlink_to("/dev/zero")
    args = ["--prompts", str(prompts), "--storage", f"sqlite:///{tmp_path / 's.db'}", "--out", str(tmp_path / "p.json")]
    assert_bad_input(search_in_process(capsys, NO_MODEL, *args), "prompts file", "not a regular file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompts.jsonl"]


def test_a_missing_warm_start_names_its_own_option(tmp_path: Path, capsys) -> None:
    args = ["--storage", f"sqlite:///{tmp_path / 's.db'}", "--out", str(tmp_path / "p.json")]
    line = assert_bad_input(search_in_process(capsys, NO_MODEL, *args, "--warm-start", "nope.json"), "not found")
    assert "--warm-start" in line and "--policy" not in line
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    assert_bad_input(search_in_process(capsys, NO_MODEL, *args, "--warm-start", str(deep)), "nests deeper")


@pytest.mark.parametrize("flag", ["--out", "--plots"])
def test_an_output_that_is_a_fifo_is_refused_before_the_work_and_left(flag: str, tmp_path: Path, capsys) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "plots").mkdir()
    os.mkfifo(tmp_path / "plots" / "pareto.png")
    target = str(fifo) if flag == "--out" else str(tmp_path / "plots")
    out = [] if flag == "--out" else ["--out", str(tmp_path / "p.json")]
    args = ["--storage", f"sqlite:///{tmp_path / 's.db'}", *out, flag, target]
    assert_bad_input(search_in_process(capsys, NO_MODEL, *args), flag, "not a regular file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "plots"]  # no study, nothing replaced
    assert stat.S_ISFIFO(fifo.stat().st_mode) and stat.S_ISFIFO((tmp_path / "plots" / "pareto.png").stat().st_mode)


def test_a_json_document_named_jsonl_is_still_read(tmp_path: Path) -> None:
    from layerskip.data import load_prompts

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps([{"text": "first"}, {"text": "second"}], indent=2))
    assert [p.text for p in load_prompts(str(prompts))] == ["first", "second"]


def test_running_trials_of_dead_local_workers_are_failed(tmp_path: Path) -> None:
    import socket
    import subprocess
    import sys

    from layerskip.search.study import WORKER_ATTR, fail_trials_of_dead_workers

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a process id that no longer runs
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 's.db'}")
    host = socket.gethostname()
    owners = {"dead": f"{host}:{gone.pid}", "alive": f"{host}:{os.getpid()}", "elsewhere": "other-host:1", "none": ""}
    trials = {}
    for label, owner in owners.items():
        trial = study.ask()
        if owner:
            trial.set_user_attr(WORKER_ATTR, owner)
        trials[label] = trial.number

    assert fail_trials_of_dead_workers(study) == [trials["dead"]]

    state = {t.number: t.state for t in study.trials}
    assert state[trials["dead"]] == TrialState.FAIL
    assert all(state[trials[label]] == TrialState.RUNNING for label in ("alive", "elsewhere", "none"))


def test_packaged_prompt_sets_load_by_name() -> None:
    """``--prompts builtin`` and ``--prompts code``: the project's own sets, no path needed."""
    builtin, code = load_prompts("builtin"), load_prompts("code")
    assert len(builtin) == 18 and len({p.category for p in builtin}) == 6
    assert len(code) == 12 and {p.category for p in code} == {"code"}
    assert len({p.id for p in code}) == 12 and all(p.text.strip() for p in code)
