"""Turn a trial of a study into a policy file ready for ``layerskip-generate --policy``.

The exported policy is the one the trial evaluated (stored on the trial), with the study's
model identity, provenance and the figures measured for it. Only *exportable* trials are
offered (``layerskip.search.space.exportable``): a skip draft that bypasses nothing is the full model
drafting for itself and is never exported. The trial exported by default is the one the last
confirmation window chose (``layerskip.search.confirmation``); the provenance then records every
finalist's measured speedup and noise and whether a close call decided it. Whether the choice
beats plain decoding is reported by ``verdict``, plainly, and the study's finalists by ``summary``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from layerskip.drafts.policy.skip_policy import ModelIdentity, SkipPolicy
from layerskip.errors import LayerskipError
from layerskip.search.draft_timing import shared_timing_counts
from layerskip.search.space import exportable, trial_policy
from layerskip.search.study import CODE_ATTR, confirmation_window, confirmations

CHEAP_FIGURES = (
    "acceptance",
    "draft_seconds",
    "draft_cost",
    "verify_cost",
    "predicted_speedup",
    "skip_fraction",
    "draft_timed_by_trial",
)


def choose_trial(study: optuna.Study, trial_number: int | None = None) -> FrozenTrial:
    """The chosen trial, else the last confirmation window's choice (``layerskip.search.confirmation.decide``), else
    the exportable trial with the best *measured* speedup, else the best predicted one."""
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if not complete:
        raise LayerskipError(f"study '{study.study_name}' has no completed trial yet; run more trials first")
    if trial_number is not None:
        for trial in complete:
            if trial.number == trial_number:
                return trial
        raise LayerskipError(f"trial {trial_number} is not a completed trial of study '{study.study_name}'")
    candidates = [t for t in complete if exportable(trial_policy(study, t))]
    if not candidates:
        # The rule as ``exportable`` applies it: lookup counts only without a skip draft, since a skip
        # draft that bypasses nothing is the whole model drafting for itself, beside lookup or not.
        raise LayerskipError(
            f"study '{study.study_name}' has no exportable trial: none of its {len(complete)} completed trial(s) "
            "bypasses a sublayer or drafts by lookup alone (a skip draft that bypasses nothing is the whole model "
            "drafting for itself); run more trials (or allow more skips: --max-skip-fraction)"
        )
    window = confirmation_window(study)
    chosen = None if window is None else window["decision"]["chosen"]
    for trial in candidates:  # the finalists measured together, and its close call settled
        if trial.number == chosen:
            return trial
    confirmed = confirmations(study)  # a study from before confirmation windows
    measured = [t for t in candidates if t.number in confirmed]
    if measured:
        return max(measured, key=lambda t: confirmed[t.number]["speedup"])
    return max(candidates, key=lambda t: t.user_attrs.get("predicted_speedup", 0.0))


def export_policy(study: optuna.Study, out: str | Path | None, trial_number: int | None = None) -> SkipPolicy:
    """The chosen trial's policy (``choose_trial``) with the study's model identity, provenance and
    the figures measured for it, saved to ``out`` unless it is None."""
    trial = choose_trial(study, trial_number)
    attrs = study.user_attrs
    # The study records the model's identity field by field, as model_name, model_architecture ...
    identity = ModelIdentity(
        **{key: attrs.get(f"model_{key}", value) for key, value in asdict(ModelIdentity()).items()}
    )
    measured = {key: trial.user_attrs[key] for key in CHEAP_FIGURES if key in trial.user_attrs}
    confirmed = confirmations(study)
    if trial.number in confirmed:
        measured["confirmed"] = confirmed[trial.number]
    provenance = {
        "method": "optuna",
        "study": study.study_name,
        "trial": trial.number,
        **{key: attrs.get(key) for key in ("objective", "calibration", "device", "dtype", "command")},
    }
    # The machine its costs were measured on (the trial's own; studies made before trials recorded
    # it: the study's), and the preset that set the search.
    machine = trial.user_attrs.get("machine") or attrs.get("machine")
    if machine:
        provenance["machine"] = machine
    code = trial.user_attrs.get(CODE_ATTR)  # the commit that measured the trial (None outside a git checkout)
    if isinstance(code, dict):
        provenance.update(commit=code.get("commit"), dirty=code.get("dirty"))
    if attrs.get("preset"):
        provenance["preset"] = attrs["preset"]
    window = confirmation_window(study)
    if window is not None:
        provenance["confirmation"] = window_provenance(window, confirmed, trial.number)
    if trial.user_attrs.get("latency_warning"):  # its costs were measured on a busy machine
        provenance["latency_warning"] = trial.user_attrs["latency_warning"]
    policy = replace(trial_policy(study, trial), model=identity, provenance=provenance, measured=measured)
    if out is not None:
        policy.save(out)
    return policy


def window_provenance(window: dict[str, Any], confirmed: dict[int, dict[str, Any]], exported: int) -> dict[str, Any]:
    """How the finalists were measured, each one's noise, and how the choice among them was made."""
    settings = window.get("settings", {})
    finalists = [
        {
            "trial": number,
            "speedup": confirmed[number]["speedup"],
            "speedup_iqr": confirmed[number].get("speedup_iqr", 0.0),
            "mean_accepted": confirmed[number]["mean_accepted"],
        }
        for number in window["trials"]
        if number in confirmed
    ]
    decision = window["decision"]
    return {
        "window": "finalists and HF generate interleaved, paired by round",
        **settings,
        "noise": "interquartile range of each finalist's per-round speedups (speedup_iqr)",
        "finalists": finalists,
        "close_call": decision["close_call"],
        "decided_by": decision["decided_by"],
        "chosen": decision["chosen"],
        "exported_is_chosen": exported == decision["chosen"],
        "note": window.get("note", ""),
    }


def verdict(policy: SkipPolicy) -> str:
    """One plain sentence on whether the exported policy beats plain decoding."""
    confirmed = policy.measured.get("confirmed")
    if confirmed is not None:
        speed = confirmed["speedup"]
        noise = ""
        if "rounds" in confirmed:
            noise = f" (median of {confirmed['rounds']} rounds, IQR {confirmed['speedup_iqr']:.2f})"
        worse = ": nothing found beats plain decoding on this model and device" if speed < 1.0 else ""
        return f"measured {speed:.2f}x vs HF generate{noise}{worse}"
    predicted = policy.measured.get("predicted_speedup")
    if predicted is None:
        return "not measured"
    note = ": predicted not to beat plain decoding" if predicted < 1.0 else ""
    return f"predicted {predicted:.2f}x (not confirmed by real generation){note}"


def summary(study: optuna.Study, top: Sequence[FrozenTrial]) -> str:
    """The table a search prints at its end: the finalists ``top`` (and the last confirmation window's
    trials) with their cheap and measured figures, how the window was measured and what it decided."""
    confirmed = confirmations(study)
    window = confirmation_window(study)
    rows = list(top)
    if window is not None:  # the last window's trials, a previous winner among them, are shown too
        extra = set(window["trials"]) - {t.number for t in rows}
        rows += [t for t in study.get_trials(deepcopy=False) if t.number in extra]
    lines = [
        "| trial | attention skipped | MLP skipped | draft | acceptance (tf) | predicted "
        "| measured speedup (IQR) | tau | identical |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for trial in rows:
        policy = trial_policy(study, trial)
        c = confirmed.get(trial.number)
        noise = f" ({c['speedup_iqr']:.2f})" if c and "speedup_iqr" in c else ""
        measured = (
            f"{c['speedup']:.2f}x{noise} | {c['mean_accepted']:.2f} | {c['identical_fraction']:.2f}"
            if c
            else "- | - | -"
        )
        k = f"{policy.draft.max_draft_tokens} {policy.draft.ending}".rstrip()
        if policy.draft.precision != "model" and policy.draft.use_skip_draft:
            k += f", {policy.draft.precision}"
        if policy.draft.draft_vocab_size and policy.draft.use_skip_draft:
            k += f", head {policy.draft.draft_vocab_size}"
        if policy.exit is not None:
            k += f", exit after layer {policy.exit.layer} ({policy.exit.kind})"
        if not policy.draft.use_skip_draft:
            k = f"lookup only ({policy.draft.lookup_min_ngram}-{policy.draft.lookup_max_ngram}-gram)"
        lines.append(
            f"| {trial.number} | {list(policy.skip_attention)} | {list(policy.skip_mlp)} | {k} "
            f"| {trial.user_attrs.get('acceptance', 0):.3f} | {trial.user_attrs.get('predicted_speedup', 0):.2f}x "
            f"| {measured} |"
        )
    if window is not None:
        settings = window.get("settings", {})
        lines.append(
            f"\nconfirmation: trials {', '.join(map(str, window['trials']))} and HF generate in one interleaved "
            f"window, {settings.get('rounds')} rounds x {settings.get('prompts')} prompts x "
            f"{settings.get('max_new_tokens')} tokens; speedup = median of the per-round speedups, "
            "noise = their interquartile range (IQR)"
        )
        lines.append(f"decision: {window['note']}")
    timed, reused = shared_timing_counts(study.get_trials(deepcopy=False))
    if timed or reused:
        lines.append(f"draft timings: {timed} distinct drafts timed once each; {reused} trials reused a timing")
    return "\n".join(lines)
