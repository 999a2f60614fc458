"""``run_study``: the search from Python, as ``layerskip-search`` runs it (the command line calls it);
its flags are keywords (``layerskip.search.settings``), and a refusal names the flag."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial
from torch import nn

from layerskip.data import Prompt
from layerskip.drafts.policy.skip_policy import SkipPolicy
from layerskip.errors import LayerskipError
from layerskip.hf import adapters
from layerskip.hf.models import LoadedModel, looks_instruct
from layerskip.search.checks import DTYPES
from layerskip.search.export import summary, verdict
from layerskip.search.phases import check_inputs, run
from layerskip.search.settings import resolve_settings
from layerskip.search.study import counted_trials

# Settings that pick prompts out of a source: prompts given as a list are used as they are.
SELECTING = ("n_prompts", "per_category", "categories", "text_field")


@dataclass
class StudyResult:
    """What a search ends with: the study (all its trials, resumable), the policy it exported and
    the finalists it confirmed by real generation."""

    study: optuna.Study
    policy: SkipPolicy  # the chosen trial's policy, stamped with the model and how it was found
    finalists: list[FrozenTrial]
    out: Path | None  # where the policy was written (None: nowhere; ``policy.save(path)`` writes it)

    @property
    def trials(self) -> int:
        """The study's trials that ran to the end or were pruned, by every worker, counted now."""
        return counted_trials(self.study)

    def __repr__(self) -> str:
        return f"StudyResult(study={self.study.study_name!r}, policy={self.policy.describe()!r}, out={self.out})"

    @property
    def verdict(self) -> str:
        """One sentence: the policy's measured (or else predicted) speedup over HF generate."""
        return verdict(self.policy)

    def summary(self) -> str:
        """The table ``layerskip-search`` prints: the finalists' predicted and measured figures."""
        return summary(self.study, self.finalists)


def run_study(
    model: str | os.PathLike[str] | LoadedModel | nn.Module,
    prompts: str | os.PathLike[str] | Sequence[str | Prompt] = "builtin",
    *,
    tokenizer: Any = None,
    preset: str | None = None,
    command: str | None = None,
    **settings: Any,
) -> StudyResult:
    """Run (or resume) a study and export its best policy.

    ``model``: an embedded name (``smollm2-135m``), a local directory, a ``.gguf`` file or a hub
    id, loaded with ``dtype`` and ``device``; or a model already loaded (``load_model``'s result,
    or a transformers model with its ``tokenizer``), searched in its own dtype and device.
    ``prompts``: the calibration prompts: ``builtin``, ``code`` or a prompts file, from which
    ``n_prompts`` are picked (``categories``, ``per_category``, ``text_field``), or a list of
    prompts used as they are. ``preset``: ``quick``, whose values apply where no keyword sets them.
    ``command``: what the study and the policy record as its origin (default: this call).
    ``settings``: ``layerskip-search``'s flags as keywords; the policy is written only where
    ``out`` names a file. Bad input raises ``LayerskipError`` before any work.
    """
    given = dict(settings)
    target = _model(model, tokenizer, given)
    calibration = _prompts(prompts, given)
    resolved, record = resolve_settings(preset, given)
    inputs = check_inputs(target, calibration, resolved, record, command or _call(target, calibration, preset, given))
    study, policy, finalists = run(inputs)
    return StudyResult(study, policy, finalists, None if resolved.out is None else Path(resolved.out))


def _model(model: Any, tokenizer: Any, given: dict[str, Any]) -> str | LoadedModel:
    """A name to load, or the loaded model; a loaded model's dtype and device become the settings'."""
    if isinstance(model, (str, os.PathLike)):
        if tokenizer is not None:
            raise LayerskipError("tokenizer= goes with a loaded model; a model given by name loads its own")
        return os.fspath(model)
    if isinstance(model, nn.Module):
        if tokenizer is None:
            raise LayerskipError("a loaded model needs its tokenizer: run_study(model, prompts, tokenizer=...)")
        path = getattr(getattr(model, "config", None), "name_or_path", "")
        name = getattr(model, "layerskip_name", None) or Path(path or "model").name
        model = LoadedModel(model, tokenizer, name, looks_instruct(name, tokenizer))
    elif not isinstance(model, LoadedModel):
        raise LayerskipError(f"model must be a name, a path, a hub id or a loaded model (got {type(model).__name__})")
    elif tokenizer is not None:
        raise LayerskipError("tokenizer= goes with a bare model; load_model's result brings its own")
    chosen = [name for name in ("dtype", "device") if name in given]
    if chosen:
        raise LayerskipError(f"{', '.join(chosen)} load a model by name; a loaded model is searched as it is")
    if model.model.training:  # dropout would make the references and the agreement random
        raise LayerskipError("the model is in training mode; call model.eval() before searching it")
    adapters.spec_for(model.model)  # an unsupported architecture: one line, before any work
    weight = next(model.model.parameters())
    dtype = str(weight.dtype).removeprefix("torch.")
    if dtype not in DTYPES:
        raise LayerskipError(f"the model is in {dtype}; a search runs in {' or '.join(DTYPES)} (model.to(...))")
    given.update(dtype=dtype, device=str(weight.device))
    return model


def _prompts(prompts: Any, given: dict[str, Any]) -> str | tuple[Prompt, ...]:
    """A prompts source as named, or the prompts given, each checked."""
    if isinstance(prompts, (str, os.PathLike)):
        return os.fspath(prompts)
    if not isinstance(prompts, Sequence) or not prompts:
        raise LayerskipError("prompts must be 'builtin', 'code', a prompts file or a non-empty list of prompts")
    selecting = [name for name in SELECTING if name in given]
    if selecting:
        raise LayerskipError(
            f"{', '.join(selecting)} pick prompts from a prompts source; a list of prompts is used as it is"
        )
    calibration = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            prompt = Prompt(id=f"prompt-{i + 1}", category="given", text=prompt)
        if not isinstance(prompt, Prompt) or not prompt.text.strip():
            raise LayerskipError(f"prompts[{i}] is not a prompt's text ({prompt!r}); give non-empty strings")
        calibration.append(prompt)
    return tuple(calibration)


def _call(model: str | LoadedModel, prompts: str | tuple[Prompt, ...], preset: str | None, given: dict) -> str:
    """This call as the study records it: ``layerskip.search.run_study('smollm2-135m', 'builtin', n_trials=30)``."""
    name = model.name if isinstance(model, LoadedModel) else model
    words = [repr(name), repr(prompts) if isinstance(prompts, str) else f"<{len(prompts)} prompts>"]
    words += [f"preset={preset!r}"] if preset else []
    words += [f"{key}={value!r}" for key, value in given.items()]
    return f"layerskip.search.run_study({', '.join(words)})"
