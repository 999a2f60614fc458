"""Fast in-process tests of ``search.study``: storage URLs, the schema race retry, Ctrl-C handling."""

from __future__ import annotations

import os
import signal

import optuna
import pytest
from optuna.trial import TrialState

from layerskip.errors import LayerskipError
from search import study as study_module
from search.study import (
    check_storage_url,
    check_study_matches,
    local_storage_file,
    open_storage,
    run_trials,
)

optuna.logging.set_verbosity(optuna.logging.ERROR)


def new_study() -> optuna.Study:
    return optuna.create_study(storage=optuna.storages.InMemoryStorage())


def states(study: optuna.Study) -> list[TrialState]:
    return [t.state for t in study.get_trials(deepcopy=False)]


def ctrl_c() -> None:
    os.kill(os.getpid(), signal.SIGINT)


# -- storage URLs ------------------------------------------------------------------------------------------------------
def test_local_storage_file(tmp_path):
    assert local_storage_file(f"sqlite:///{tmp_path}/s.db") == tmp_path / "s.db"
    assert local_storage_file(f"{tmp_path}/j.log") == tmp_path / "j.log"
    assert local_storage_file(f"journal:{tmp_path}/j.txt") == tmp_path / "j.txt"
    assert local_storage_file(f"sqlite:///{tmp_path}/odd.log") == tmp_path / "odd.log"  # SQLite wins
    assert local_storage_file("postgresql://u:p@host/db") is None


@pytest.mark.parametrize(
    "url, message",
    [
        ("foo://bar", "unsupported storage URL"),
        ("sqlite:///{tmp}/missing/s.db", "does not exist"),
        ("{tmp}/missing/j.log", "does not exist"),
    ],
)
def test_check_storage_url_touches_nothing(tmp_path, url, message):
    with pytest.raises(LayerskipError, match=message):
        check_storage_url(url.replace("{tmp}", str(tmp_path)))
    assert list(tmp_path.iterdir()) == []


def test_postgresql_url_gets_the_installed_driver(monkeypatch):
    installed = {"psycopg2"}
    monkeypatch.setattr(study_module.importlib.util, "find_spec", lambda name: object() if name in installed else None)
    assert study_module._with_installed_driver("postgresql://u:p@h/db") == "postgresql+psycopg2://u:p@h/db"
    installed = {"psycopg"}
    assert study_module._with_installed_driver("postgresql://u:p@h/db") == "postgresql+psycopg://u:p@h/db"
    installed = {"psycopg", "psycopg2"}
    assert study_module._with_installed_driver("postgresql://u:p@h/db") == "postgresql://u:p@h/db"
    assert study_module._with_installed_driver("postgresql+psycopg2://h/db") == "postgresql+psycopg2://h/db"


def test_missing_driver_is_one_line(monkeypatch):
    monkeypatch.setattr(study_module.importlib.util, "find_spec", lambda name: None)

    def no_driver(*args, **kwargs):
        try:
            raise ModuleNotFoundError("No module named 'psycopg'", name="psycopg")
        except ModuleNotFoundError as cause:
            raise ImportError("Failed to import DB access module") from cause

    monkeypatch.setattr(optuna.storages, "RDBStorage", no_driver)
    with pytest.raises(LayerskipError, match=r"psycopg is not installed\); pip install psycopg2-binary") as info:
        open_storage("postgresql://user:secret@127.0.0.1:1/db")
    assert "secret" not in str(info.value)


def test_schema_creation_race_is_retried(monkeypatch, tmp_path):
    """Two workers creating a new database's tables at once: the loser opens it again."""
    from sqlalchemy.exc import IntegrityError, OperationalError

    real = optuna.storages.RDBStorage
    calls = []

    def racing(url, **kwargs):
        calls.append(url)
        if len(calls) == 1:
            raise IntegrityError("INSERT INTO alembic_version", {}, Exception("UNIQUE constraint failed"))
        if len(calls) == 2:
            raise OperationalError("CREATE TABLE studies", {}, Exception("table studies already exists"))
        return real(url, **kwargs)

    monkeypatch.setattr(optuna.storages, "RDBStorage", racing)
    monkeypatch.setattr(study_module.time, "sleep", lambda seconds: None)
    storage = open_storage(f"sqlite:///{tmp_path}/s.db")
    assert len(calls) == 3 and isinstance(storage, real)


def test_unreachable_server_is_not_retried(monkeypatch):
    from sqlalchemy.exc import OperationalError

    calls = []

    def refused(url, **kwargs):
        calls.append(url)
        raise OperationalError("connect", {}, Exception("connection refused"))

    monkeypatch.setattr(optuna.storages, "RDBStorage", refused)
    with pytest.raises(LayerskipError, match="cannot open storage"):
        open_storage("postgresql://u:p@127.0.0.1:1/db")
    assert len(calls) == 1


def test_study_of_another_model_names_both():
    attrs = {"model_fingerprint": "aaa", "model_name": "old-model", "objective": "speedup"}
    check_study_matches(None, "s", {"model_fingerprint": "bbb"})
    check_study_matches(attrs, "s", {"model_fingerprint": "aaa", "objective": "speedup"})
    with pytest.raises(LayerskipError, match="old-model.*'bbb'.*new-model.*another --study-name"):
        check_study_matches(attrs, "s", {"model_fingerprint": "bbb", "model_name": "new-model"})


# -- Ctrl-C ------------------------------------------------------------------------------------------------------------
def test_ctrl_c_in_objective_fails_that_trial():
    study = new_study()
    before = signal.getsignal(signal.SIGINT)

    def objective(trial):
        x = trial.suggest_float("x", 0, 1)
        if trial.number == 2:
            ctrl_c()  # noted; the next call on the trial raises it
            trial.set_user_attr("after", True)
            raise AssertionError("not reached")
        return x

    with pytest.raises(KeyboardInterrupt):
        run_trials(study, objective, 10, None, None, progress=False)
    assert states(study) == [TrialState.COMPLETE, TrialState.COMPLETE, TrialState.FAIL]
    assert "after" not in study.trials[2].user_attrs
    assert signal.getsignal(signal.SIGINT) is before  # handler restored


def test_ctrl_c_between_trials_fails_the_next_one():
    study = new_study()

    def interrupt_after_second(study, trial):  # runs in Optuna's loop, outside any objective
        if trial.number == 1:
            ctrl_c()

    with pytest.raises(KeyboardInterrupt):
        with study_module._InterruptGuard(lambda t: t.suggest_float("x", 0, 1)) as guarded:
            study.optimize(guarded, n_trials=10, callbacks=[interrupt_after_second])
    assert states(study) == [TrialState.COMPLETE, TrialState.COMPLETE, TrialState.FAIL]


def test_ctrl_c_in_the_last_trial_still_interrupts():
    study = new_study()

    def objective(trial):
        if trial.number == 1:
            ctrl_c()  # no call on the trial follows: the trial completes, then the run stops
        return 1.0

    with pytest.raises(KeyboardInterrupt):
        run_trials(study, objective, 2, None, None, progress=False)
    assert states(study) == [TrialState.COMPLETE, TrialState.COMPLETE]


def test_second_ctrl_c_interrupts_at_once():
    study = new_study()
    reached = []

    def objective(trial):
        ctrl_c()
        ctrl_c()  # raises here, without waiting for a call on the trial
        reached.append(True)
        return 1.0

    with pytest.raises(KeyboardInterrupt):
        run_trials(study, objective, 5, None, None, progress=False)
    assert reached == [] and states(study) == [TrialState.FAIL]


def test_total_trials_already_reached_runs_nothing():
    study = new_study()
    run_trials(study, lambda t: t.suggest_float("x", 0, 1), 3, None, None, progress=False)
    run_trials(study, lambda t: t.suggest_float("x", 0, 1), 10, 2, None, progress=False)
    run_trials(study, lambda t: t.suggest_float("x", 0, 1), 10, 5, None, progress=False)
    assert len(study.trials) == 5


# -- export: the evaluated policy, never the full model drafting for itself -----------------------------------------
def _trial_with(study: optuna.Study, policy, predicted: float) -> int:
    from search.space import POLICY_ATTR, policy_attr

    trial = study.ask()
    trial.set_user_attr(POLICY_ATTR, policy_attr(policy))
    trial.set_user_attr("predicted_speedup", predicted)
    study.tell(trial, predicted)
    return trial.number


def test_export_never_offers_a_draft_that_bypasses_nothing(tmp_path):
    from layerskip.drafts.policy import DraftSettings, SkipPolicy
    from search.export import choose_trial, export_policy, verdict
    from search.study import finalists

    study = optuna.create_study(direction="maximize")
    bare = _trial_with(study, SkipPolicy(draft=DraftSettings(max_draft_tokens=4)), 2.0)
    skip = _trial_with(study, SkipPolicy(skip_mlp=(1,)), 0.8)
    assert [t.number for t in finalists(study, "speedup", 5)] == [skip]
    study.set_user_attr(f"confirmed:{bare}", {"speedup": 1.5})  # even a better measurement does not count
    study.set_user_attr(f"confirmed:{skip}", {"speedup": 0.9})
    assert choose_trial(study).number == skip
    policy = export_policy(study, tmp_path / "p.json")
    assert policy.skip_mlp == (1,) and policy.measured["confirmed"]["speedup"] == 0.9
    assert "nothing found beats plain decoding" in verdict(policy)


def test_export_refuses_a_study_without_an_exportable_trial():
    from layerskip.drafts.policy import SkipPolicy
    from search.export import choose_trial

    study = optuna.create_study(direction="maximize")
    _trial_with(study, SkipPolicy(), 1.0)
    with pytest.raises(LayerskipError, match="bypasses a sublayer"):
        choose_trial(study)


def test_confirm_uses_the_benchmark_timing_and_speedup(monkeypatch):
    """confirm() times through measure.timing and reports aggregate throughput, as the benchmark does."""
    from tiny_models import random_prompt, tiny_model

    from layerskip.drafts.policy import SkipPolicy
    from layerskip.measure.timing import TimedRun
    from search import objective

    calls = []

    def fake_runs(runners, prompts, max_new, device, warmup, progress, desc):
        calls.append((list(runners), len(prompts)))
        real = [{name: runner(ids, 4) for name, runner in runners.items()} for ids in prompts]
        # Prompt 1: 4 tokens in 1 s vs 2 s; prompt 2: 4 tokens in 4 s vs 2 s. Mean of ratios 1.25, aggregate 0.8.
        seconds = [{"ours": 1.0, "hf": 2.0}, {"ours": 4.0, "hf": 2.0}]
        return [
            {name: TimedRun(run[0], seconds[i][name], run[1]) for name, run in by_name.items()}
            for i, by_name in enumerate(real)
        ]

    monkeypatch.setattr(objective, "run_interleaved", fake_runs)
    model = tiny_model("llama")
    prompts = [random_prompt(seed=0), random_prompt(seed=1)]
    calibration = objective.Calibration(prompts, [], 1.0, {}, prompts[0])
    confirmation = objective.confirm(model, calibration, SkipPolicy(skip_attention=(0,)), 4)
    assert calls == [(["ours", "hf"], 2)]
    assert confirmation.speedup == pytest.approx((8 / 5) / (8 / 4))
    assert confirmation.identical_fraction == 1.0
