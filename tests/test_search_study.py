"""Fast in-process tests of ``layerskip.search.study``: storage URLs, the schema race retry, Ctrl-C handling."""

from __future__ import annotations

import os
import signal

import optuna
import pytest
import torch
from optuna.trial import TrialState

from layerskip.errors import LayerskipError
from layerskip.search import study as study_module
from layerskip.search.study import (
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
    from layerskip.search.space import POLICY_ATTR, policy_attr

    trial = study.ask()
    trial.set_user_attr(POLICY_ATTR, policy_attr(policy))
    trial.set_user_attr("predicted_speedup", predicted)
    study.tell(trial, predicted)
    return trial.number


def test_export_never_offers_a_draft_that_bypasses_nothing(tmp_path):
    from layerskip.drafts.policy.skip_policy import DraftSettings, SkipPolicy
    from layerskip.search.export import choose_trial, export_policy, verdict
    from layerskip.search.study import finalists

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


def test_finalists_add_the_best_of_every_other_kind_of_draft():
    """The cheap score may rank a whole kind of draft just below another on noise: the best of each kind
    is confirmed beside the top predictions."""
    from layerskip.drafts.policy.skip_policy import DraftSettings, ExitSettings, SkipPolicy
    from layerskip.search.space import trial_policy
    from layerskip.search.study import draft_kind, finalists

    study = optuna.create_study(direction="maximize")
    exit_draft = ExitSettings(adapter="/a.safetensors", sha256="0" * 64, layer=1, kind="linear")
    exits = [_trial_with(study, SkipPolicy.early_exit(4, 2, exit=exit_draft), p) for p in (2.0, 1.9)]
    skip = _trial_with(study, SkipPolicy(skip_mlp=(1,)), 1.8)
    _trial_with(study, SkipPolicy(skip_mlp=(2,)), 1.7)  # a second skip draft: not its kind's best
    hybrid = _trial_with(study, SkipPolicy(skip_mlp=(1,), draft=DraftSettings(lookup_max_ngram=3)), 1.5)
    lookup = _trial_with(study, SkipPolicy(draft=DraftSettings(use_skip_draft=False, lookup_max_ngram=3)), 1.0)
    assert [t.number for t in finalists(study, "speedup", 2)] == [*exits, skip, hybrid, lookup]
    kinds = [draft_kind(trial_policy(study, t)) for t in finalists(study, "speedup", 1)]
    assert kinds == ["exit", "skip", "hybrid", "lookup"]


def test_export_refuses_a_study_without_an_exportable_trial():
    from layerskip.drafts.policy.skip_policy import SkipPolicy
    from layerskip.search.export import choose_trial

    study = optuna.create_study(direction="maximize")
    _trial_with(study, SkipPolicy(), 1.0)
    with pytest.raises(LayerskipError, match="bypasses a sublayer"):
        choose_trial(study)


def test_export_refusal_states_the_rule_it_applies_to_lookup_trials():
    """A trial that drafts by lookup beside a skip draft bypassing nothing (what ``--warm-start auto``
    gives where nothing pays to bypass) is not exportable; the refusal says so, not that no trial
    drafts by lookup."""
    from layerskip.drafts.policy.skip_policy import DraftSettings, SkipPolicy
    from layerskip.search.export import choose_trial

    study = optuna.create_study(direction="maximize")
    _trial_with(study, SkipPolicy(draft=DraftSettings(lookup_max_ngram=3, precision="int4")), 1.2)
    with pytest.raises(LayerskipError, match="drafts by lookup alone") as error:
        choose_trial(study)
    assert "none of its 1 completed trial(s)" in str(error.value) and "whole model" in str(error.value)


# -- confirmation: finalists in one interleaved window, paired medians, noise, close calls ----------------------------
def test_run_rounds_warms_up_once_and_rotates_every_round():
    """Each round runs every method on every prompt; the order turns by one per prompt and per round."""
    from layerskip.measure.timing import run_rounds

    calls = []

    def runner(name):
        return lambda ids, n: (calls.append((name, ids[0], n)), ([1] * n, None))[1]

    runners = {name: runner(name) for name in ("a", "b", "hf")}
    window = run_rounds(runners, [[0], [1]], 3, torch.device("cpu"), rounds=2, warmup_tokens=1)
    assert calls[:3] == [("a", 0, 1), ("b", 0, 1), ("hf", 0, 1)]  # one warm-up each, then never again
    orders = [[name for name, _, _ in calls[3 + 3 * i : 6 + 3 * i]] for i in range(4)]
    assert orders == [["a", "b", "hf"], ["b", "hf", "a"], ["b", "hf", "a"], ["hf", "a", "b"]]
    assert len(window) == 2 and all(list(passes[0]) == ["a", "b", "hf"] and len(passes) == 2 for passes in window)


def test_confirm_window_pairs_each_finalist_with_the_baseline_round_by_round(monkeypatch):
    """Every finalist and HF generate run in ONE window; a finalist's speedup is the median of its
    per-round speedups (same round, same prompts as the baseline), its noise their interquartile range."""
    from tiny_models import random_prompt, tiny_model

    from layerskip.drafts.policy.skip_policy import SkipPolicy
    from layerskip.measure.timing import TimedRun
    from layerskip.search import confirmation
    from layerskip.search.objective import Calibration

    # Seconds per round for the whole round (one prompt): the baseline drifts, the finalists follow it.
    seconds = {
        "hf": [2.0, 4.0, 2.0, 2.0, 3.0],
        "trial 3": [1.0, 2.0, 1.0, 0.5, 1.5],  # speedups 2, 2, 2, 4, 2
        "trial 7": [1.0, 1.0, 2.0, 1.0, 1.0],  # speedups 2, 4, 1, 2, 3
    }
    calls = []

    def timed(name, runner, ids, max_new, round_index):
        tokens, stats = runner(ids, max_new)  # a real generation: its tokens and the engine's record
        return TimedRun(tokens, seconds[name][round_index], stats)

    def fake_rounds(runners, prompts, max_new, device, rounds, warmup, progress, desc):
        calls.append((sorted(runners), len(prompts), rounds))
        return [
            [{name: timed(name, runner, ids, max_new, r) for name, runner in runners.items()} for ids in prompts]
            for r in range(rounds)
        ]

    monkeypatch.setattr(confirmation, "run_rounds", fake_rounds)
    model = tiny_model("llama")
    prompts = [random_prompt(seed=0)]
    calibration = Calibration(prompts, [], 1.0, {}, prompts[0])
    policies = {3: SkipPolicy(skip_attention=(0,)), 7: SkipPolicy(skip_mlp=(1,))}
    confirmed = confirmation.confirm_window(model, calibration, policies, 4, rounds=5)
    assert calls == [(["hf", "trial 3", "trial 7"], 1, 5)]  # one window for both finalists
    assert confirmed[3].round_speedups == [2.0, 2.0, 2.0, 4.0, 2.0] and confirmed[3].speedup == 2.0
    assert confirmed[3].speedup_iqr == 0.0  # one disturbed round moves neither the median nor the noise
    assert confirmed[7].speedup == 2.0 and confirmed[7].speedup_iqr == pytest.approx(3.0 - 2.0)
    assert confirmed[3].identical_fraction == 1.0 and confirmed[3].rounds == 5 and confirmed[3].prompts == 1
    assert confirmed[3].mean_accepted >= 1.0


def _figures(speedup: float, iqr: float, tau: float) -> dict:
    return {"speedup": speedup, "speedup_iqr": iqr, "mean_accepted": tau}


def test_decide_takes_a_clear_win_on_speed():
    from layerskip.search.confirmation import decide

    confirmed = {1: _figures(1.80, 0.05, 2.0), 2: _figures(1.60, 0.05, 3.0)}
    decision = decide(confirmed)
    assert (decision.chosen, decision.close_call, decision.decided_by) == (1, False, "speedup")
    assert "chosen on measured speedup" in decision.describe(confirmed)
    assert decide({4: _figures(1.1, 0.2, 1.5)}).chosen == 4


def test_decide_breaks_a_close_call_on_acceptance():
    """Within the larger noise of the two, the rival with more tokens per verify wins; a finalist
    outside the noise is no rival, whatever its acceptance."""
    from layerskip.search.confirmation import decide

    confirmed = {
        1: _figures(1.80, 0.03, 2.0),
        2: _figures(1.75, 0.08, 2.6),  # 0.05 slower, its own noise 0.08: a rival
        3: _figures(1.50, 0.08, 4.0),  # far slower: not a rival
    }
    decision = decide(confirmed)
    assert (decision.chosen, decision.fastest, decision.close_call) == (2, 1, True)
    assert decision.rivals == [1, 2] and decision.decided_by == "acceptance"
    note = decision.describe(confirmed)
    assert note.startswith("close call: trial 1 1.80x") and "trial 2 1.75x (IQR 0.08, tau 2.60)" in note
    assert note.endswith("broken on acceptance (most tokens per verify): trial 2")
    tied = {1: _figures(1.80, 0.1, 2.0), 2: _figures(1.75, 0.1, 2.0)}
    assert decide(tied).chosen == 1 and "tied here, then the faster median" in decide(tied).describe(tied)


def _confirmation(speedup: float, iqr: float, tau: float):
    from layerskip.search.confirmation import Confirmation

    return Confirmation(speedup, 10.0, 5.0, tau, 0.5, 1.0, 2, 8, 5, iqr, [speedup] * 5)


def test_confirm_finalists_measures_once_keeps_its_winner_and_exports_the_decision(tmp_path):
    """One window per set of finalists; the same set again is not measured again; a new set is measured
    together with the last winner; the export follows the window's decision and carries its noise."""
    from layerskip.drafts.policy.skip_policy import SkipPolicy
    from layerskip.search.export import export_policy, verdict
    from layerskip.search.study import WINDOW_ATTR, confirm_finalists

    study = optuna.create_study(direction="maximize")
    numbers = [_trial_with(study, SkipPolicy(skip_mlp=(i,)), 2.0 - i / 10) for i in range(3)]
    trials = {t.number: t for t in study.get_trials()}
    windows = []
    figures = {numbers[0]: (1.80, 0.05, 2.0), numbers[1]: (1.76, 0.05, 2.5), numbers[2]: (1.90, 0.01, 1.5)}

    def measure(policies):
        windows.append(sorted(policies))
        return {n: _confirmation(*figures[n]) for n in policies}

    settings = {"rounds": 5, "prompts": 2, "max_new_tokens": 8}
    window, measured = confirm_finalists(study, [trials[numbers[0]], trials[numbers[1]]], measure, settings)
    assert measured and windows == [numbers[:2]]
    assert window["decision"]["chosen"] == numbers[1] and window["decision"]["close_call"]
    assert study.user_attrs[WINDOW_ATTR] == window
    _, again = confirm_finalists(study, [trials[numbers[1]], trials[numbers[0]]], measure, settings)
    assert not again and len(windows) == 1
    # A new finalist displaces the winner from the top: the winner is measured again beside it.
    window, measured = confirm_finalists(study, [trials[numbers[2]], trials[numbers[0]]], measure, settings)
    assert measured and windows[-1] == sorted(numbers)
    assert window["decision"]["chosen"] == numbers[2] and not window["decision"]["close_call"]

    policy = export_policy(study, tmp_path / "p.json")
    confirmation = policy.provenance["confirmation"]
    assert policy.provenance["trial"] == numbers[2] and confirmation["chosen"] == numbers[2]
    assert confirmation["close_call"] is False and confirmation["decided_by"] == "speedup"
    assert confirmation["rounds"] == 5 and confirmation["exported_is_chosen"] is True
    by_trial = {f["trial"]: f for f in confirmation["finalists"]}
    assert by_trial[numbers[1]]["speedup_iqr"] == 0.05 and by_trial[numbers[1]]["mean_accepted"] == 2.5
    assert "IQR" in confirmation["note"] and policy.measured["confirmed"]["speedup_iqr"] == 0.01
    assert "median of 5 rounds, IQR 0.01" in verdict(policy)
