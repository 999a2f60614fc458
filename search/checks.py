"""Checks of a search's command line made before any model loads or any storage is written.

Three kinds: values no study can use (a negative seed, timeout or head size), exit adapters that
are not there (``read_exit_choices``), and, for a study that already exists, flags that would
change its search space or its calibration. Optuna refuses a parameter whose choices changed
("dynamic value space") only when a trial samples it, after minutes of calibration, and records a
FAIL trial; here it is one line before any work. Other calibration prompts would not fail at all:
new trials would be scored on other text than the study's earlier ones, and the study and its
exported policy would still name the first prompts.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from layerskip.data import Prompt
from layerskip.drafts.model.precision import PRECISIONS
from layerskip.drafts.policy.skip_policy import MAX_DRAFT_TOKENS
from layerskip.errors import LayerskipError, few
from layerskip.fileio import Items, Obj, load_json
from layerskip.search.confirmation import MIN_ROUNDS
from layerskip.search.objective import OBJECTIVES
from layerskip.search.settings import SearchSettings, flag
from layerskip.search.space import ExitChoice

# numpy's RandomState (under Optuna's samplers) takes seeds in [0, 2**32); the sampler seed
# adds the worker and trial counts to --seed, so --seed leaves them room.
MAX_SEED = 2**31 - 1

SPACES = ("ranked", "switches")
DTYPES = ("float32", "bfloat16")  # the dtypes a search loads a model in (a loaded model keeps its own)

# The search-space fields a study records (SearchSpace.to_dict) -> the setting that sets each.
SPACE_SETTINGS: dict[str, str] = {
    "never_skip": "never_skip",
    "min_fraction": "min_skip_fraction",
    "max_fraction": "max_skip_fraction",
    "draft_token_choices": "draft_tokens",
    "tune_adaptive": "no_adaptive",  # inverted: see space_fields
    "draft_vocab_choices": "draft_vocab",
    "lookup_ngram_choices": "lookup",
    "lookup_token_choices": "lookup_tokens",
    "lookup_confidence_choices": "lookup_confidence",
    "lookup_min_ngram_choices": "lookup_min",
    "verify_pad_choices": "verify_pad",
    "tree_match_choices": "tree_matches",
    "tree_sibling_choices": "tree_siblings",
    "precision_choices": "draft_precision",
    "require_skip_draft": "require_skip_draft",
    "exit_threshold_choices": "exit_thresholds",
}


def space_fields(args: SearchSettings) -> dict[str, Any]:
    """The ``SearchSpace`` fields the settings set."""
    fields = {name: getattr(args, setting) for name, setting in SPACE_SETTINGS.items()}
    fields["tune_adaptive"] = not args.no_adaptive
    return fields


def check_arguments(args: SearchSettings) -> None:
    """One-line LayerskipError for a value the search cannot use; reads nothing, writes nothing."""
    for name in ("n_trials", "n_prompts", "reference_tokens", "max_new_tokens"):
        if getattr(args, name) <= 0:
            raise LayerskipError(f"{flag(name)} must be > 0 (got {getattr(args, name)})")
    if args.total_trials is not None and args.total_trials <= 0:
        raise LayerskipError("--total-trials must be > 0")
    if args.confirm_top < 0:
        raise LayerskipError("--confirm-top must be >= 0")
    if args.confirm_rounds < MIN_ROUNDS:
        raise LayerskipError(
            f"--confirm-rounds must be >= {MIN_ROUNDS} (got {args.confirm_rounds}): fewer rounds cannot tell "
            "the noise; --confirm-top 0 skips the confirmation"
        )
    # The command line's parser refuses these already; run_study's keywords reach here unchecked.
    for name, value, choices in (
        ("objective", args.objective, OBJECTIVES),
        ("space", args.space, SPACES),
        ("dtype", args.dtype, DTYPES),
    ):
        if value not in choices:
            raise LayerskipError(f"--{name} must be one of {', '.join(choices)} (got '{value}')")
    if not 0 <= args.seed <= MAX_SEED:
        raise LayerskipError(f"--seed must be between 0 and {MAX_SEED} (got {args.seed})")
    if not 0 <= args.worker <= 999_999:
        raise LayerskipError(f"--worker must be between 0 and 999999 (got {args.worker})")
    if args.timeout is not None and not (math.isfinite(args.timeout) and args.timeout > 0):
        raise LayerskipError(f"--timeout must be a number of seconds > 0 (got {args.timeout})")
    if args.export_trial is not None and args.export_trial < 0:
        raise LayerskipError(f"--export-trial must be a trial number >= 0 (got {args.export_trial})")
    if args.study_name is not None and not args.study_name.strip():
        raise LayerskipError("--study-name is empty; name the study, or leave the flag out for MODEL-OBJECTIVE")
    # Every list of a trial's choices needs one (--never-skip and --lookup-tokens may be empty: none, tied to k).
    for name in SPACE_SETTINGS.values():
        if getattr(args, name) == () and name not in ("never_skip", "lookup_tokens"):
            raise LayerskipError(f"{flag(name)} needs at least one choice")
    unknown = [p for p in args.draft_precision if p not in PRECISIONS]
    if unknown:
        raise LayerskipError(f"--draft-precision {unknown} unknown; choose from {', '.join(PRECISIONS)}")
    # A policy drafts at most MAX_DRAFT_TOKENS tokens (drafts/policy/skip_policy.py): a larger choice
    # would fail every trial.
    _within("--draft-tokens", args.draft_tokens, 1, MAX_DRAFT_TOKENS)
    _within("--draft-vocab", args.draft_vocab, 0, note="0 = the full head")
    _within("--lookup", args.lookup, 0, note="0 = off")
    _within("--lookup-tokens", args.lookup_tokens, 1, MAX_DRAFT_TOKENS)
    _within("--lookup-min", args.lookup_min, 1)
    _within("--verify-pad", args.verify_pad, 0, MAX_DRAFT_TOKENS + 1, "0 = no padding")
    _within("--tree-matches", args.tree_matches, 1, 16, "1 = a chain")
    _within("--tree-siblings", args.tree_siblings, 0, 8, "0 = none")
    _within("--never-skip", args.never_skip, 0)
    if not all(0 <= c < 1 for c in args.lookup_confidence):
        got = _flag_value(args.lookup_confidence)
        raise LayerskipError(f"--lookup-confidence choices must be in [0, 1) (got {got})")
    if not all(0.0 <= t <= 1.0 for t in args.exit_thresholds):
        raise LayerskipError("--exit-thresholds must list numbers in [0, 1]")
    low, high = args.min_skip_fraction, args.max_skip_fraction
    if not (math.isfinite(low) and math.isfinite(high) and 0.0 <= low <= high <= 1.0):
        raise LayerskipError(f"need 0 <= --min-skip-fraction ({low}) <= --max-skip-fraction ({high}) <= 1")


# What a layerskip-train-exit report.json holds of each exit it trained (what a search reads of it).
_REPORT = Obj(required={"exits": Items(Obj(required={"adapter": str, "layer": int, "kind": str, "sha256": str}))})


def read_exit_choices(directories: list[str]) -> tuple[ExitChoice, ...]:
    """The exit adapters listed in each layerskip-train-exit output directory's report.json."""
    choices: dict[str, ExitChoice] = {}
    for directory in directories:
        report_path = Path(directory) / "report.json"
        report = load_json(
            report_path, "--exit-adapters report", "pass a layerskip-train-exit --out directory", shape=_REPORT
        )
        for entry in report["exits"]:
            path = (Path(directory) / entry["adapter"]).resolve()
            if not path.is_file():
                raise LayerskipError(f"exit adapter {path} listed in {report_path} is missing; train it again")
            label = f"L{entry['layer']}-{entry['kind']}"
            choices.setdefault(label, ExitChoice(label, entry["layer"], entry["kind"], str(path), entry["sha256"]))
    return tuple(choices.values())


def _within(flag: str, values: Sequence[int], low: int, high: int | None = None, note: str = "") -> None:
    if any(v < low for v in values):
        hint = f" ({note})" if note else ""
        raise LayerskipError(f"{flag} choices must be >= {low}{hint}; got {_flag_value(values)}")
    if high is not None and any(v > high for v in values):
        raise LayerskipError(f"{flag} choices must be <= {high}; got {_flag_value(values)}")


def check_head_sizes(sizes: Sequence[int], rows: int) -> None:
    """--draft-vocab choices past the model's vocabulary would fail every trial that draws them."""
    larger = [size for size in sizes if size > rows]
    if larger:
        raise LayerskipError(
            f"--draft-vocab choices {_flag_value(larger)} are more than this model's {rows} vocabulary rows; "
            f"choose sizes below {rows} (0 = the full head)"
        )


def check_resumed_space(attrs: dict[str, Any] | None, study_name: str, args: SearchSettings) -> None:
    """A resumed study keeps the space it was made with: a changed flag is refused, naming the
    flag, the study's value and the way out. A new study (``attrs`` None) passes."""
    recorded = (attrs or {}).get("space")
    if not isinstance(recorded, dict):
        return
    for key, value in space_fields(args).items():
        if key not in recorded:  # a study made before the field existed
            continue
        was = recorded[key]
        if _normalise(key, was) != _normalise(key, value):
            name = flag(SPACE_SETTINGS[key])
            raise _changed(study_name, f"made with {_describe(name, was)}", _describe(name, value), "the study's value")
    was_ranked = bool(recorded.get("sublayer_order"))
    if "sublayer_order" in recorded and was_ranked != (args.space == "ranked"):
        made = "--space " + ("ranked" if was_ranked else "switches")
        raise _changed(study_name, f"made with {made}", f"--space {args.space}", made)


def _changed(study_name: str, was: str, now: str, rerun: str, verb: str = "has") -> LayerskipError:
    """The refusal of a flag that changes a resumed study."""
    return LayerskipError(
        f"study '{study_name}' was {was} but this run {verb} {now}; "
        f"re-run with {rerun}, or start a new study with another --study-name"
    )


def _normalise(key: str, value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        items = [float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v for v in value]
        return sorted(set(items)) if key == "never_skip" else items
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return value


def _flag_value(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value) if value else "(none)"
    return str(value)


def _describe(flag: str, value: Any) -> str:
    """How the flag reads on a command line that gives ``value``."""
    if flag == "--no-adaptive":
        return "adaptive draft endings" if value else "--no-adaptive"
    if flag == "--require-skip-draft":
        return flag if value else f"no {flag}"
    return f"{flag} {_flag_value(value)}"


# The flags that pick a study's calibration prompts, for the message that refuses other prompts.
PROMPT_FLAGS = "--prompts, --text-field, --categories, --per-category, --n-prompts and --seed"


def prompts_digest(prompts: Sequence[Prompt]) -> str:
    """A hash of the calibration prompts (ids, categories and text): the same whichever flags or path
    spelling picked them, different if a file's text changed."""
    payload = json.dumps([[p.id, p.category, p.text] for p in prompts], ensure_ascii=False)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def check_resumed_calibration(
    attrs: dict[str, Any] | None, study_name: str, reference_tokens: int, source: str, prompts: Sequence[Prompt]
) -> None:
    """A resumed study keeps the prompts and reference length it was calibrated on: every trial of
    a study must be scored on the same references. A new study (``attrs`` None) passes. ``source``:
    where the prompts come from, as the study records it."""
    recorded = (attrs or {}).get("calibration")
    if not isinstance(recorded, dict):
        return
    was_length = recorded.get("reference_tokens")
    if was_length is not None and was_length != reference_tokens:
        was, now = f"--reference-tokens {was_length}", f"--reference-tokens {reference_tokens}"
        raise _changed(study_name, f"calibrated with {was}", now, "the study's value")
    was_ids = list(recorded.get("prompts", []))
    ids = [p.id for p in prompts]
    digest = recorded.get("prompts_sha256")
    # Studies made before the digest was recorded are compared by prompt ids and source.
    recorded_source = str(recorded.get("source", "?"))
    same = digest == prompts_digest(prompts) if digest else (was_ids == ids and recorded_source == source)
    if same:
        return
    if recorded_source == source and was_ids == ids:
        change = f"the same prompt ids from {source} with other text (the file changed, or --text-field)"
    else:
        change = f"{len(ids)} prompt(s) {few(ids, 3)} from {source}"
    was = f"calibrated on {len(was_ids)} prompt(s) {few(was_ids, 3)} from {recorded_source}"
    raise _changed(study_name, was, change, f"the study's {PROMPT_FLAGS}", verb="picks")


def check_resumed_chat(attrs: dict[str, Any] | None, study_name: str, chat: bool) -> None:
    """The chat template changes every calibration prompt's tokens (checked once the model says
    whether it is an instruct model)."""
    was = ((attrs or {}).get("calibration") or {}).get("chat")
    if was is not None and bool(was) != chat:
        before, now = ("--chat", "--no-chat") if was else ("--no-chat", "--chat")
        raise _changed(study_name, f"calibrated with {before}", now, before)
