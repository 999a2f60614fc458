"""Turn a trial of a study into a policy file ready for ``layerskip-generate --policy``."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import optuna
from optuna.trial import FrozenTrial, TrialState

from layerskip.engine.policy import ModelIdentity, SkipPolicy
from layerskip.errors import LayerskipError
from search.space import policy_from_params
from search.study import confirmations

CHEAP_FIGURES = ("acceptance", "draft_seconds", "draft_cost", "verify_cost", "predicted_speedup", "skip_fraction")


def choose_trial(study: optuna.Study, trial_number: int | None = None) -> FrozenTrial:
    """The chosen trial, else the best *measured* speedup, else the best predicted one."""
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if not complete:
        raise LayerskipError(f"study '{study.study_name}' has no completed trial yet; run more trials first")
    if trial_number is not None:
        for trial in complete:
            if trial.number == trial_number:
                return trial
        raise LayerskipError(f"trial {trial_number} is not a completed trial of study '{study.study_name}'")
    confirmed = confirmations(study)
    measured = [t for t in complete if t.number in confirmed]
    if measured:
        return max(measured, key=lambda t: confirmed[t.number]["speedup"])
    return max(complete, key=lambda t: t.user_attrs.get("predicted_speedup", 0.0))


def policy_for_trial(study: optuna.Study, trial: FrozenTrial) -> SkipPolicy:
    attrs = study.user_attrs
    identity = ModelIdentity(
        name=attrs.get("model_name", ""),
        architecture=attrs.get("model_architecture", ""),
        num_layers=int(attrs.get("model_num_layers", 0)),
        fingerprint=attrs.get("model_fingerprint", ""),
    )
    policy = policy_from_params(trial.params, identity.num_layers)
    measured = {key: trial.user_attrs[key] for key in CHEAP_FIGURES if key in trial.user_attrs}
    confirmed = confirmations(study).get(trial.number)
    if confirmed is not None:
        measured["confirmed"] = confirmed
    provenance = {
        "method": "optuna",
        "study": study.study_name,
        "trial": trial.number,
        "objective": attrs.get("objective"),
        "calibration": attrs.get("calibration"),
        "device": attrs.get("device"),
        "dtype": attrs.get("dtype"),
        "command": attrs.get("command"),
    }
    return replace(policy, model=identity, provenance=provenance, measured=measured)


def export_policy(study: optuna.Study, out: str | Path, trial_number: int | None = None) -> SkipPolicy:
    policy = policy_for_trial(study, choose_trial(study, trial_number))
    policy.save(out)
    return policy
