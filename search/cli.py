"""layerskip-search: tune a fixed drafting policy for a model, on your data and device.

Runs (or resumes) an Optuna study over how the model drafts for itself: the draft's weight
precision (an int4 copy on CPU) and head size, how long a draft runs, whether prompt lookup
drafts first, verify padding, and which layers or sublayers the draft bypasses. Trials are
scored by teacher-forced acceptance and measured latency; the best are confirmed by real
generation against HF generate, and the winner is exported as a policy JSON. No search is
needed to start: --policy auto (the default of generate and bench) makes these choices while
generating, priced by a calibration of the machine.
"""

# The command line is a thin caller of layerskip.search.run_study: the flags are its keywords
# (layerskip.search.settings holds their defaults and the presets), given only where typed, so
# that a preset's value gives way to a flag typed with the default's value too.

from __future__ import annotations

import argparse
import os
import shlex
import sys
import types
import typing
from typing import Any

import torch

from layerskip.cli.common import add_prompt_arguments, float_list, int_list, model_parser, run_cli, str_list
from layerskip.engine.calibration import CACHE_ENV as CALIBRATION_CACHE_ENV
from layerskip.search.api import run_study
from layerskip.search.calibration_cache import CACHE_ENV
from layerskip.search.checks import SPACES
from layerskip.search.confirmation import MIN_ROUNDS
from layerskip.search.objective import OBJECTIVES
from layerskip.search.phases import default_study_name
from layerskip.search.settings import DEFAULTS, HINTS, PRESETS, SETTINGS, flag, preset_values


def _as_flags(values: dict[str, Any]) -> str:
    """``{"n_trials": 30, "lookup": (0, 3), "require_skip_draft": True}`` as flags:
    ``--n-trials 30 --lookup 0,3 --require-skip-draft``."""

    def shown(value: Any) -> str:
        if isinstance(value, tuple):
            return ",".join(map(str, value))
        return f"{value:g}" if isinstance(value, float) else str(value)

    return " ".join(flag(dest) if value is True else f"{flag(dest)} {shown(value)}" for dest, value in values.items())


def given_arguments(argv: list[str] | None) -> tuple[argparse.Namespace, dict[str, Any]]:
    """The command line (every setting, defaults included), and the settings its flags give."""
    args = build_parser().parse_args(argv)
    typed = build_parser(argparse.SUPPRESS)
    typed.set_defaults(dtype=argparse.SUPPRESS, device=argparse.SUPPRESS)  # the model options name their defaults
    given = {name: value for name, value in vars(typed.parse_args(argv)).items() if name in SETTINGS}
    return args, {name: value for name, value in given.items() if value != argparse.SUPPRESS}


def build_parser(argument_default: Any = None) -> argparse.ArgumentParser:
    """The parser; ``argument_default=argparse.SUPPRESS`` leaves out every setting not typed."""
    parser = model_parser(__doc__.split("\n\n# ")[0], prog="layerskip-search", raw=True)
    parser.argument_default = argument_default
    parser.add_argument(
        "--preset",
        choices=PRESETS,
        help="quick: the recommended recipe; it ends in about 5 minutes on 2 CPU cores with a policy tuned for this "
        f"machine: {_as_flags(preset_values('quick', torch.device('cpu')))} (trials stop starting after 150 s; "
        "on a GPU --draft-precision model). A flag given explicitly overrides the preset's value",
    )
    add_prompt_arguments(parser)
    for name, text in HELP.items():
        _add_setting(parser, name, text)
    if argument_default is None:  # append flags add to a list of their own
        parser.set_defaults(**{name: list(v) if name in APPENDED else v for name, v in vars(DEFAULTS).items()})
    return parser


APPENDED = ("warm_start", "exit_adapters")  # repeatable flags: each adds to a list
BOTH_WAYS = ("chat", "require_skip_draft")  # switches with a --no- form
CHOICES = {"objective": OBJECTIVES, "space": SPACES}
LISTS = {int: int_list, float: float_list, str: str_list}  # a list setting's comma-separated items

# Every setting's flag in --help's order (the model's and --prompts' own come first): its help. Its
# type comes from its SearchSettings field: a number, a comma-separated list, or a switch.
HELP: dict[str, str | None] = {
    # the calibration prompts: which, how many, chat template or not
    "n_prompts": "calibration prompts (spread over categories)",
    "per_category": "sample this many prompts from each category first",
    "categories": "only these prompt categories, e.g. qa,rag",
    "chat": None,
    # the study: its budget, storage, name and objective, the reference length, and the confirmation
    "n_trials": "trials this process runs",
    "total_trials": "stop when the study (all workers) has this many trials",
    "timeout": "stop starting trials after this many seconds",
    "storage": "sqlite:///path.db, a journal file path.log, or postgresql://user:pass@host/db",
    "study_name": "default: MODEL-OBJECTIVE (with --preset: MODEL-PRESET)",
    "objective": None,
    "reference_tokens": "length of each teacher-forcing reference",
    "max_new_tokens": "tokens per prompt in the real confirmation",
    "confirm_top": "finalists confirmed by real generation: the N best predicted, and the best predicted trial of "
    "each other kind of draft (exit, skip, hybrid, lookup) found (0: none)",
    "confirm_rounds": f"rounds of the confirmation window (>= {MIN_ROUNDS}): each runs every finalist and HF generate "
    "on every calibration prompt, interleaved; a finalist's speedup is the median over rounds, its noise the "
    "interquartile range",
    # the draft settings a trial chooses among
    "draft_tokens": "max draft token choices",
    "no_adaptive": "do not search how drafts end (fixed k only: no adaptive threshold, no length by cost)",
    "draft_vocab": "truncated draft head sizes to search (0 = full head), e.g. 0,4096,16384",
    "lookup": "prompt-lookup max n-gram choices (0 = off), e.g. 0,3",
    "lookup_tokens": "longest lookup run choices, e.g. 4,8,16 (default: the draft length k)",
    "lookup_min": "shortest lookup n-gram choices, e.g. 1,2",
    "lookup_confidence": "choices for cutting lookup runs below this estimated chance of full acceptance, "
    "e.g. 0,0.1,0.2",
    "verify_pad": "choices for padding short verify blocks to N tokens (0 = never), e.g. 0,4",
    "tree_matches": "token-tree choices: lookup continuations verified at once (1 = a chain), e.g. 1,4",
    "tree_siblings": "token-tree choices: the draft's next choices added where it hesitates (0 = none), e.g. 0,1",
    "draft_precision": "draft weight precisions to search: model, bfloat16, int8, int4 (int8/int4: CPU), "
    "e.g. model,int4",
    "require_skip_draft": "every trial drafts with its skip policy (lookup, if on, leads where the context repeats)",
    # which sublayers a trial may bypass, and where the search starts
    "space": "ranked: bypass the N sublayers whose single bypass changes the draft least (N searched); "
    "switches: one on/off switch per sublayer",
    "warm_start": "policy JSON to try first (repeatable), e.g. the set on-the-fly selection ended on "
    "(generate.py --policy on-the-fly --save-policy PATH), or 'auto': what --policy auto chooses here "
    "after generating from the calibration prompts; in the ranked space a new study's order starts with "
    "its bypassed sublayers",
    "exit_adapters": "a layerskip-train-exit --out directory: its trained exit adapters become choices of an 'exit' "
    "knob (repeatable; adapters are loaded, never trained, by trials). An exit draft bypasses every layer after "
    "its exit and nothing before it: it uses no sublayer switches, so --max/--min-skip-fraction do not bound it",
    "exit_thresholds": "exit drafts' confidence threshold choices",
    "never_skip": "layers never to bypass, e.g. 0,1",
    "min_skip_fraction": None,
    "max_skip_fraction": None,
    # this process: its seed and worker number, its outputs and what it prints
    "seed": None,
    "worker": "worker number: varies the sampler seed between workers",
    "out": "policy JSON to write (default: STUDY_NAME.policy.json)",
    "export_trial": "export this trial (e.g. a Pareto point) instead of the best",
    "force": "let --out replace a file that is not a policy",
    "plots": "directory for pareto.png, history.png, skip_frequency.png",
    "no_progress": "no progress bars and no per-phase timing lines on stderr",
    "no_cache": "build the references and measure latency again instead of reusing them. The references are "
    f"cached (under ${CACHE_ENV}, default <model cache>/search) per model, prompts, settings, device, dtype "
    f"and torch version; the latency with auto's calibration (under ${CALIBRATION_CACHE_ENV}) per model, "
    "dtype, device and machine; cached latency is reused as measured, so pass this when the machine's state "
    "has changed (a calibration measured on a busy machine is never cached). Fresh results replace the cached ones",
}


def _add_setting(parser: argparse.ArgumentParser, name: str, text: str | None) -> None:
    """The flag of setting ``name``, its type read from its ``SearchSettings`` field."""
    hint = HINTS[name]
    kind = typing.get_args(hint)[0] if isinstance(hint, types.UnionType) else hint  # X | None: X
    options: dict[str, Any] = {"help": text}
    if name in APPENDED:
        options.update(action="append", metavar="POLICY" if name == "warm_start" else None)
    elif kind is bool:
        options["action"] = argparse.BooleanOptionalAction if name in BOTH_WAYS else "store_true"
    elif typing.get_origin(kind) is tuple:
        options["type"] = LISTS[typing.get_args(kind)[0]]
    elif name in CHOICES:
        options["choices"] = CHOICES[name]
    elif kind is not str:
        options["type"] = kind
    parser.add_argument(flag(name), **options)


def _main(argv: list[str] | None) -> int:
    args, given = given_arguments(argv)
    command = shlex.join(["layerskip-search", *(sys.argv[1:] if argv is None else argv)])
    study_name = given.get("study_name") or default_study_name(args.model, args.preset or args.objective)
    out = given.get("out") or f"{study_name}.policy.json"  # the command line always writes a policy
    result = run_study(args.model, args.prompts, preset=args.preset, command=command, **{**given, "out": out})
    print(f"\nstudy '{study_name}': {result.trials} trials (complete + pruned)")
    print(result.summary())
    policy = result.policy
    print(f"\nexported trial {policy.provenance['trial']} to {out}: {policy.describe()}; {result.verdict}")
    return 0


def main(argv: list[str] | None = None) -> int:
    # `datasets` (prompt files) draws "Generating train split" bars on stderr, which would break
    # the one-line error contract; it reads this variable when first imported.
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    return run_cli(_main, argv)


if __name__ == "__main__":
    raise SystemExit(main())
