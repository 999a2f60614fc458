"""Identical drafts share one draft-step timing within a study (``layerskip.search.draft_timing``): in a process,
across processes (a resumed run, another worker) through the study, and never across different drafts."""

from __future__ import annotations

import optuna
import pytest
from tiny_models import random_prompt, tiny_model

from layerskip.drafts.policy.skip_policy import DraftSettings, SkipPolicy
from layerskip.measure.agreement import build_references
from layerskip.search import objective as objective_module
from layerskip.search.draft_timing import TIMING_PREFIX
from layerskip.search.objective import Calibration, CheapObjective
from layerskip.search.space import SearchSpace

optuna.logging.set_verbosity(optuna.logging.ERROR)


@pytest.fixture
def timed(monkeypatch):
    """Every draft-step timing the objective takes: (skip attention, skip MLP, head rows); each a new value."""
    calls = []

    def fake(draft_model, context, attention, mlp, head_rows, repeats):
        calls.append((tuple(attention), tuple(mlp), None if head_rows is None else len(head_rows)))
        return 0.001 * len(calls)  # every timing differs, as noise would make it

    monkeypatch.setattr(objective_module, "draft_step_seconds", fake)
    return calls


def _objective(model) -> CheapObjective:
    prompts = [random_prompt(seed=0), random_prompt(seed=1)]
    calibration = Calibration(prompts, build_references(model, prompts, 6), 0.01, {2: 0.012, 3: 0.014}, prompts[0])
    return CheapObjective(model, calibration, SearchSpace(num_layers=2), "speedup", ranking=range(40))


def _score(objective: CheapObjective, study: optuna.Study, policy: SkipPolicy):
    trial = study.ask()
    score = objective.score(policy, trial)
    study.tell(trial, score.predicted_speedup)
    return trial.number, score


def test_identical_drafts_time_once_and_share_it_through_the_study(timed):
    model = tiny_model("llama", num_hidden_layers=2)
    study = optuna.create_study(direction="maximize")
    objective = _objective(model)
    draft = SkipPolicy(skip_attention=(1,), skip_mlp=(1,), draft=DraftSettings(max_draft_tokens=2))
    # The same draft: only how drafts end and their length differ, which a draft step's cost does not see.
    same = SkipPolicy(skip_attention=(1,), skip_mlp=(1,), draft=DraftSettings(max_draft_tokens=3, adaptive=True))
    first, a = _score(objective, study, draft)
    _, b = _score(objective, study, same)
    assert len(timed) == 1
    assert a.draft_seconds == b.draft_seconds and a.draft_cost == b.draft_cost
    assert a.draft_timed_by_trial == b.draft_timed_by_trial == first
    stored = [value for key, value in study.user_attrs.items() if key.startswith(TIMING_PREFIX)]
    assert [(entry["seconds"], entry["trial"]) for entry in stored] == [(a.draft_seconds, first)]

    # Another draft: other sublayers, another precision or another head size is timed on its own.
    for other in (
        SkipPolicy(skip_attention=(1,)),
        SkipPolicy(skip_attention=(1,), skip_mlp=(1,), draft=DraftSettings(precision="bfloat16")),
        SkipPolicy(skip_attention=(1,), skip_mlp=(1,), draft=DraftSettings(draft_vocab_size=16)),
    ):
        _, score = _score(objective, study, other)
        assert score.draft_seconds != a.draft_seconds
    assert len(timed) == 4 and timed[-1] == ((1,), (1,), 16)

    # A resumed run or another worker (a new objective, nothing known in its process) reads the study's.
    _, c = _score(_objective(model), study, same)
    assert len(timed) == 4 and c.draft_seconds == a.draft_seconds and c.draft_timed_by_trial == first
    # Outside a study (no trial), a new process times it again.
    assert _objective(model).score(same).draft_timed_by_trial is None and len(timed) == 5


def test_lookup_only_trials_time_no_draft(timed):
    model = tiny_model("llama", num_hidden_layers=2)
    study = optuna.create_study(direction="maximize")
    lookup = SkipPolicy(draft=DraftSettings(use_skip_draft=False, lookup_max_ngram=3))
    _, score = _score(_objective(model), study, lookup)
    assert timed == [] and score.draft_timed_by_trial is None and score.draft_seconds == 0.0
