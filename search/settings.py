"""What a search can be asked for: ``SearchSettings``, one field per ``layerskip-search`` flag, and
its presets.

The command line and ``run_study`` share these fields, their defaults and the preset rule (a
preset's value where the caller gave none), so a flag and a keyword argument mean one thing:
``--n-trials 30`` is ``n_trials=30``, ``--no-cache`` is ``no_cache=True``.
"""

from __future__ import annotations

import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from layerskip.errors import LayerskipError
from layerskip.hf.models import resolve_device
from layerskip.search.confirmation import MIN_ROUNDS

PRESETS = ("quick",)


@dataclass(frozen=True)
class SearchSettings:
    """Every setting of a search but the model, its prompts and the preset (``--help`` says what each does)."""

    # the model, when it is loaded by name
    dtype: str = "float32"
    device: str = "cpu"
    # the calibration prompts
    text_field: str | None = None
    n_prompts: int = 6
    per_category: int | None = None
    categories: tuple[str, ...] = ()
    chat: bool | None = None  # None: the chat template where the model is an instruct model
    # the study
    n_trials: int = 60
    total_trials: int | None = None
    timeout: float | None = None
    storage: str = "sqlite:///layerskip-search.db"
    study_name: str | None = None  # None: MODEL-OBJECTIVE (with a preset: MODEL-PRESET)
    objective: str = "speedup"
    reference_tokens: int = 48
    max_new_tokens: int = 64
    confirm_top: int = 3
    confirm_rounds: int = MIN_ROUNDS
    # the draft settings a trial chooses among
    draft_tokens: tuple[int, ...] = (2, 3, 4, 6, 8)
    no_adaptive: bool = False
    draft_vocab: tuple[int, ...] = (0,)
    lookup: tuple[int, ...] = (0,)
    lookup_tokens: tuple[int, ...] = ()
    lookup_min: tuple[int, ...] = (2,)
    lookup_confidence: tuple[float, ...] = (0.0,)
    verify_pad: tuple[int, ...] = (0,)
    tree_matches: tuple[int, ...] = (1,)
    tree_siblings: tuple[int, ...] = (0,)
    draft_precision: tuple[str, ...] = ("model",)
    require_skip_draft: bool = False
    # which sublayers a trial may bypass, and where the search starts
    space: str = "ranked"
    warm_start: tuple[str, ...] = ()
    exit_adapters: tuple[str, ...] = ()
    exit_thresholds: tuple[float, ...] = (0.3, 0.5, 0.7)
    never_skip: tuple[int, ...] = ()
    min_skip_fraction: float = 0.0
    max_skip_fraction: float = 1.0
    # this process
    seed: int = 0
    worker: int = 0
    out: str | None = None  # the policy file written (the command line's default: STUDY_NAME.policy.json)
    export_trial: int | None = None
    force: bool = False
    plots: str | None = None
    no_progress: bool = False
    no_cache: bool = False

    def __post_init__(self) -> None:
        for name, hint in HINTS.items():
            object.__setattr__(self, name, _checked(name, getattr(self, name), hint))


def flag(name: str) -> str:
    """A setting's flag: ``n_trials`` -> ``--n-trials``."""
    return "--" + name.replace("_", "-")


def _checked(name: str, value: Any, hint: Any) -> Any:
    """``value`` as the field's type (a list where a tuple is wanted becomes one), else one line."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None and type(None) in options:
        return None
    kind = next(option for option in options if option is not type(None))
    if typing.get_origin(kind) is tuple:
        item = typing.get_args(kind)[0]
        if isinstance(value, (list, tuple)) and all(_is(v, item) for v in value):
            return tuple(_as(v, item) for v in value)
        example = {int: "[2, 4]", float: "[0.3, 0.5]", str: '["a", "b"]'}[item]
        raise LayerskipError(f"{name} takes a list of {item.__name__} values, e.g. {name}={example} (got {value!r})")
    if _is(value, kind):
        return _as(value, kind)
    raise LayerskipError(f"{name} takes {'a number' if kind is float else kind.__name__} (got {value!r})")


def _is(value: Any, kind: type) -> bool:
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is str:  # a path is a file name too
        return isinstance(value, (str, os.PathLike))
    return isinstance(value, kind) and (kind is bool or not isinstance(value, bool))


def _as(value: Any, kind: type) -> Any:
    return float(value) if kind is float else os.fspath(value) if kind is str else value


HINTS = typing.get_type_hints(SearchSettings)  # setting -> its type
SETTINGS = tuple(field.name for field in fields(SearchSettings))
DEFAULTS = SearchSettings()


def preset_values(name: str, device: Any) -> dict[str, Any]:
    """What ``--preset NAME`` sets (setting -> value), unless a flag sets it.

    ``quick``: the recipe of the searches that made the shipped skip-only and hybrid policies
    (docs/search.md: ranked space, an int4 draft with a 4096- or 16384-row head, k 3..6, at
    most a quarter of the sublayers bypassed, every trial a skip draft, prompt lookup in front or
    not), cut to 30 trials on 4 prompts and 2 confirmations so that it ends in about 5 minutes on
    2 CPU cores; trials stop starting after 150 s on a slower machine. int4 is a CPU kernel: on
    a GPU the draft keeps the model's own weights.
    """
    if name != "quick":
        raise LayerskipError(f"unknown --preset '{name}'; choose from {', '.join(PRESETS)}")
    return {
        "n_trials": 30,
        "n_prompts": 4,
        "reference_tokens": 40,
        "max_new_tokens": 48,
        "confirm_top": 2,
        "space": "ranked",
        # The lean int4 draft step costs 0.1-0.2 of a plain step: longer drafts can pay.
        "draft_tokens": (3, 4, 5, 6, 8),
        "draft_precision": ("int4",) if device.type == "cpu" else ("model",),
        "draft_vocab": (4096, 16384),
        "lookup": (0, 3),
        # On CPUs whose small-matrix kernels run 2-3 rows one at a time, a 2-3 token verify costs
        # more than a 4-token one (draft_cost.py's verify curve): padding is searched.
        "verify_pad": (0, 4),
        "require_skip_draft": True,
        "max_skip_fraction": 0.25,
        "timeout": 150.0,
    }


def resolve_settings(preset: str | None, given: Mapping[str, Any]) -> tuple[SearchSettings, dict[str, Any] | None]:
    """The settings a search runs with: those ``given``, then the preset's, then the defaults; and
    what the study records of the preset (its values, and which of them ``given`` overrode)."""
    unknown = sorted(set(given) - set(SETTINGS))
    if unknown:
        raise LayerskipError(
            f"unknown search setting(s) {', '.join(unknown)}; a setting is a layerskip-search flag "
            "with underscores (n_trials for --n-trials); see layerskip-search --help"
        )
    settings = SearchSettings(**given)
    if preset is None:
        return settings, None
    values = preset_values(preset, resolve_device(settings.device))
    settings = SearchSettings(**{**values, **given})
    record = {
        "name": preset,
        "values": {flag(name): list(v) if isinstance(v, tuple) else v for name, v in values.items()},
        "overridden": [flag(name) for name, value in values.items() if getattr(settings, name) != value],
    }
    return settings, record
