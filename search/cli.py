"""layerskip-search: find which sublayers a model's draft should bypass, on your data and device.

Runs (or resumes) an Optuna study scored by teacher-forced acceptance and measured draft
latency, confirms the best candidates by real generation against HF generate, and exports
the best policy as JSON.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from typing import Any

import torch

from layerskip.cli.common import add_model_arguments, float_list, int_list, run_cli, str_list
from layerskip.errors import LayerskipError
from layerskip.hf.models import resolve_device
from layerskip.search.calibration_cache import CACHE_ENV
from layerskip.search.confirmation import MIN_ROUNDS
from layerskip.search.objective import OBJECTIVES
from layerskip.search.phases import run


def preset_values(name: str, device: torch.device) -> dict[str, Any]:
    """What ``--preset NAME`` sets (argparse destinations -> values), unless a flag sets it.

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


PRESETS = ("quick",)


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _as_flags(values: dict[str, Any]) -> str:
    """``{"n_trials": 30, "lookup": (0, 3), "require_skip_draft": True}`` as flags:
    ``--n-trials 30 --lookup 0,3 --require-skip-draft``."""

    def shown(value: Any) -> str:
        if isinstance(value, tuple):
            return ",".join(map(str, value))
        return f"{value:g}" if isinstance(value, float) else str(value)

    return " ".join(_flag(dest) if value is True else f"{_flag(dest)} {shown(value)}" for dest, value in values.items())


def _preset_help() -> str:
    return (
        "quick: the recommended recipe; it ends in about 5 minutes on 2 CPU cores with a policy tuned for this "
        f"machine: {_as_flags(preset_values('quick', torch.device('cpu')))} (trials stop starting after 150 s; "
        "on a GPU --draft-precision model). A flag given explicitly overrides the preset's value"
    )


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    """The command line, with a ``--preset``'s values where no flag was given (``args.preset_record``
    says which values the preset set and which flags overrode it; the study records it)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.preset_record = None
    if args.preset is None:
        return args
    values = preset_values(args.preset, resolve_device(args.device))
    # Parsed again with the preset's values as the defaults: a flag on the command line wins.
    parser.set_defaults(**values)
    args = parser.parse_args(argv)
    overridden = [_flag(dest) for dest, value in values.items() if getattr(args, dest) != value]
    args.preset_record = {
        "name": args.preset,
        "values": {_flag(dest): list(v) if isinstance(v, tuple) else v for dest, v in values.items()},
        "overridden": overridden,
    }
    return args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="layerskip-search", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_arguments(parser)
    parser.add_argument("--preset", choices=PRESETS, help=_preset_help())
    _add_prompt_arguments(parser)
    _add_study_arguments(parser)
    _add_draft_arguments(parser)
    _add_bypass_arguments(parser)
    _add_run_arguments(parser)
    return parser


def _add_prompt_arguments(parser: argparse.ArgumentParser) -> None:
    """The calibration prompts: which, how many, chat template or not."""
    parser.add_argument(
        "--prompts",
        default="builtin",
        help="'builtin', 'code' (12 code prompts), a Spec-Bench-style JSONL, or a json/csv/parquet file",
    )
    parser.add_argument("--text-field", help="column holding the prompt text (json/csv/parquet)")
    parser.add_argument("--n-prompts", type=int, default=6, help="calibration prompts (spread over categories)")
    parser.add_argument("--per-category", type=int, help="sample this many prompts from each category first")
    parser.add_argument("--categories", type=str_list, default=(), help="only these prompt categories, e.g. qa,rag")
    parser.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None)


def _add_study_arguments(parser: argparse.ArgumentParser) -> None:
    """The study: its budget, storage, name and objective, the reference length, and the confirmation."""
    parser.add_argument("--n-trials", type=int, default=60, help="trials this process runs")
    parser.add_argument("--total-trials", type=int, help="stop when the study (all workers) has this many trials")
    parser.add_argument("--timeout", type=float, help="stop starting trials after this many seconds")
    parser.add_argument(
        "--storage",
        default="sqlite:///layerskip-search.db",
        help="sqlite:///path.db, a journal file path.log, or postgresql://user:pass@host/db",
    )
    parser.add_argument("--study-name", help="default: MODEL-OBJECTIVE (with --preset: MODEL-PRESET)")
    parser.add_argument("--objective", choices=OBJECTIVES, default="speedup")
    parser.add_argument("--reference-tokens", type=int, default=48, help="length of each teacher-forcing reference")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens per prompt in the real confirmation")
    parser.add_argument(
        "--confirm-top",
        type=int,
        default=3,
        help="finalists confirmed by real generation: the N best predicted, and the best predicted trial of each "
        "other kind of draft (exit, skip, hybrid, lookup) found (0: none)",
    )
    parser.add_argument(
        "--confirm-rounds",
        type=int,
        default=MIN_ROUNDS,
        help=f"rounds of the confirmation window (>= {MIN_ROUNDS}): each runs every finalist and HF generate on "
        "every calibration prompt, interleaved; a finalist's speedup is the median over rounds, its noise the "
        "interquartile range",
    )


def _add_draft_arguments(parser: argparse.ArgumentParser) -> None:
    """The draft settings a trial chooses among."""
    parser.add_argument("--draft-tokens", type=int_list, default=(2, 3, 4, 6, 8), help="max draft token choices")
    parser.add_argument(
        "--no-adaptive",
        action="store_true",
        help="do not search how drafts end (fixed k only: no adaptive threshold, no length by cost)",
    )
    parser.add_argument(
        "--draft-vocab",
        type=int_list,
        default=(0,),
        help="truncated draft head sizes to search (0 = full head), e.g. 0,4096,16384",
    )
    parser.add_argument(
        "--lookup", type=int_list, default=(0,), help="prompt-lookup max n-gram choices (0 = off), e.g. 0,3"
    )
    parser.add_argument(
        "--lookup-tokens",
        type=int_list,
        default=(),
        help="longest lookup run choices, e.g. 4,8,16 (default: the draft length k)",
    )
    parser.add_argument("--lookup-min", type=int_list, default=(2,), help="shortest lookup n-gram choices, e.g. 1,2")
    parser.add_argument(
        "--lookup-confidence",
        type=float_list,
        default=(0.0,),
        help="choices for cutting lookup runs below this estimated chance of full acceptance, e.g. 0,0.1,0.2",
    )
    parser.add_argument(
        "--verify-pad",
        type=int_list,
        default=(0,),
        help="choices for padding short verify blocks to N tokens (0 = never), e.g. 0,4",
    )
    parser.add_argument(
        "--tree-matches",
        type=int_list,
        default=(1,),
        help="token-tree choices: lookup continuations verified at once (1 = a chain), e.g. 1,4",
    )
    parser.add_argument(
        "--tree-siblings",
        type=int_list,
        default=(0,),
        help="token-tree choices: the draft's next choices added where it hesitates (0 = none), e.g. 0,1",
    )
    parser.add_argument(
        "--draft-precision",
        type=str_list,
        default=("model",),
        help="draft weight precisions to search: model, bfloat16, int8, int4 (int8/int4: CPU), e.g. model,int4",
    )
    parser.add_argument(
        "--require-skip-draft",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="every trial drafts with its skip policy (lookup, if on, leads where the context repeats)",
    )


def _add_bypass_arguments(parser: argparse.ArgumentParser) -> None:
    """Which sublayers a trial may bypass, and where the search starts."""
    parser.add_argument(
        "--space",
        choices=("ranked", "switches"),
        default="ranked",
        help="ranked: bypass the N sublayers whose single bypass changes the draft least (N searched); "
        "switches: one on/off switch per sublayer",
    )
    parser.add_argument(
        "--warm-start",
        metavar="POLICY",
        action="append",
        default=[],
        help="policy JSON to try first (repeatable), e.g. the set on-the-fly selection ended on "
        "(generate.py --policy on-the-fly --save-policy PATH), or 'auto': what --policy auto chooses here "
        "after generating from the calibration prompts; in the ranked space a new study's order starts with "
        "its bypassed sublayers",
    )
    parser.add_argument(
        "--exit-adapters",
        action="append",
        default=[],
        help="a layerskip-train-exit --out directory: its trained exit adapters become choices of an 'exit' knob "
        "(repeatable; adapters are loaded, never trained, by trials). An exit draft bypasses every layer after "
        "its exit and nothing before it: it uses no sublayer switches, so --max/--min-skip-fraction do not bound it",
    )
    parser.add_argument(
        "--exit-thresholds", type=float_list, default=(0.3, 0.5, 0.7), help="exit drafts' confidence threshold choices"
    )
    parser.add_argument("--never-skip", type=int_list, default=(), help="layers never to bypass, e.g. 0,1")
    parser.add_argument("--min-skip-fraction", type=float, default=0.0)
    parser.add_argument("--max-skip-fraction", type=float, default=1.0)


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """This process: its seed and worker number, its outputs and what it prints."""
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker", type=int, default=0, help="worker number: varies the sampler seed between workers")
    parser.add_argument("--out", help="policy JSON to write (default: STUDY_NAME.policy.json)")
    parser.add_argument("--export-trial", type=int, help="export this trial (e.g. a Pareto point) instead of the best")
    parser.add_argument("--force", action="store_true", help="let --out replace a file that is not a policy")
    parser.add_argument("--plots", help="directory for pareto.png, history.png, skip_frequency.png")
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress bars and no per-phase timing lines on stderr"
    )
    parser.add_argument(
        "--no-cache",
        action="store_true",
        help="build the references and measure latency again instead of reusing them. Both are cached "
        f"(under ${CACHE_ENV}, default <model cache>/search) per model, prompts, settings, device, dtype and "
        "torch version; cached latency is reused as measured, so pass this when the machine's state has "
        "changed (a calibration measured on a busy machine is never cached). Fresh results replace the cached ones",
    )


def _main(argv: list[str] | None) -> int:
    args = parse_arguments(argv)
    command = shlex.join(["layerskip-search", *(sys.argv[1:] if argv is None else argv)])
    return run(args, command)  # layerskip.search.phases: check, storage, calibrate, rank, trials, confirm, export


def main(argv: list[str] | None = None) -> int:
    # `datasets` (prompt files) draws "Generating train split" bars on stderr, which would break
    # the one-line error contract; it reads this variable when first imported.
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    return run_cli(_main, argv)


if __name__ == "__main__":
    raise SystemExit(main())
