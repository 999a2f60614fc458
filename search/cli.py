"""layerskip-search: find which sublayers a model's draft should bypass, on your data and device.

Runs (or resumes) an Optuna study scored by teacher-forced acceptance and measured draft
latency, confirms the best candidates by real generation against HF generate, and exports
the best policy as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from layerskip.cli.common import (
    add_model_arguments,
    check_fits,
    check_policies,
    float_list,
    int_list,
    run_cli,
    str_list,
)
from layerskip.data import load_prompts
from layerskip.drafts.exit_adapter import ExitAdapter
from layerskip.drafts.policy import SkipPolicy, is_policy_file
from layerskip.drafts.vocab import DraftVocabulary
from layerskip.errors import LayerskipError
from layerskip.fileio import check_output_dir, check_output_file, check_replaceable
from layerskip.hf import adapters
from layerskip.hf.models import load_model, resolve_device
from layerskip.hf.prompting import encode_prompt, eos_token_ids
from layerskip.machine import Machine, this_machine
from layerskip.measure.agreement import sublayer_order
from search.calibration_cache import CACHE_ENV, CalibrationCache
from search.checks import (
    check_arguments,
    check_head_sizes,
    check_resumed_calibration,
    check_resumed_chat,
    check_resumed_space,
    prompts_digest,
)
from search.confirmation import MIN_ROUNDS, confirm_window
from search.draft_timing import shared_timing_counts
from search.export import export_policy, verdict
from search.journal import repair_journal
from search.log import phase
from search.objective import OBJECTIVES, CheapObjective, prepare_calibration
from search.plots import write_plots
from search.space import RANKING_ATTR, ExitChoice, SearchSpace, trial_policy
from search.study import (
    check_local_storage,
    check_storage_url,
    check_study_matches,
    confirm_finalists,
    confirmation_window,
    confirmations,
    counted_trials,
    existing_study_attrs,
    finalists,
    local_storage_file,
    open_storage,
    open_study,
    run_trials,
)

HOPELESS_PREDICTED = 0.5  # finalists predicted below this are not confirmed by real generation
MACHINE_ATTR = "machine"  # study and trial attribute: the machine costs were measured on (layerskip.machine)


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


def default_study_name(model: str, suffix: str) -> str:
    """``MODEL-SUFFIX`` from a model argument: its last path part (``org/Llama-3.2-1B`` ->
    ``Llama-3.2-1B``), without a ``.gguf`` suffix."""
    name = Path(model).name
    return f"{name.removesuffix('.gguf')}-{suffix}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="layerskip-search", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_arguments(parser)
    parser.add_argument("--preset", choices=PRESETS, help=_preset_help())
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
        "(generate.py --policy on-the-fly --save-policy PATH); in the ranked space a new study's order "
        "starts with its bypassed sublayers",
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
    return parser


def _check_numbers(args: argparse.Namespace) -> None:
    for name in ("n_trials", "n_prompts", "reference_tokens", "max_new_tokens"):
        if getattr(args, name) <= 0:
            raise LayerskipError(f"--{name.replace('_', '-')} must be > 0 (got {getattr(args, name)})")
    if args.total_trials is not None and args.total_trials <= 0:
        raise LayerskipError("--total-trials must be > 0")
    if args.confirm_top < 0:
        raise LayerskipError("--confirm-top must be >= 0")
    if args.confirm_rounds < MIN_ROUNDS:
        raise LayerskipError(
            f"--confirm-rounds must be >= {MIN_ROUNDS} (got {args.confirm_rounds}): fewer rounds cannot tell "
            "the noise; --confirm-top 0 skips the confirmation"
        )
    if any(k < 1 for k in args.draft_tokens) or not args.draft_tokens:
        raise LayerskipError("--draft-tokens must list integers >= 1")


def read_exit_choices(directories: list[str]) -> tuple[ExitChoice, ...]:
    """The exit adapters listed in each layerskip-train-exit output directory's report.json."""
    choices: dict[str, ExitChoice] = {}
    for directory in directories:
        report_path = Path(directory) / "report.json"
        try:
            report = json.loads(report_path.read_text(encoding="utf-8"))
            exits = report["exits"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
            raise LayerskipError(
                f"--exit-adapters {directory} holds no readable report.json; "
                "pass a layerskip-train-exit --out directory"
            ) from None
        for entry in exits:
            path = (Path(directory) / entry["adapter"]).resolve()
            if not path.is_file():
                raise LayerskipError(f"exit adapter {path} listed in {report_path} is missing; train it again")
            label = f"L{entry['layer']}-{entry['kind']}"
            choices.setdefault(label, ExitChoice(label, entry["layer"], entry["kind"], str(path), entry["sha256"]))
    return tuple(choices.values())


def _summary(study, objective: str, top: list) -> str:
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


def _main(argv: list[str] | None) -> int:
    args = parse_arguments(argv)
    _check_numbers(args)
    check_arguments(args)
    command = shlex.join(["layerskip-search", *(sys.argv[1:] if argv is None else argv)])
    prompts = load_prompts(
        args.prompts,
        n=args.n_prompts,
        per_category=args.per_category,
        text_field=args.text_field,
        seed=args.seed,
        categories=args.categories,
    )
    seeds = {path: SkipPolicy.load(path) for path in args.warm_start}  # bad files fail before the model loads
    exit_choices = read_exit_choices(args.exit_adapters)
    if not args.exit_thresholds or not all(0.0 <= t <= 1.0 for t in args.exit_thresholds):
        raise LayerskipError("--exit-thresholds must list numbers in [0, 1]")
    study_name = args.study_name or default_study_name(args.model, args.preset or args.objective)
    # Outputs are checked now: a search must not end, after all its work, unable to save.
    out = args.out or f"{study_name}.policy.json"
    check_output_file(out, "--out")
    check_replaceable(out, "--out", is_policy_file, "a layerskip policy", args.force)  # a resume re-exports
    if args.plots:
        check_output_dir(args.plots, "--plots")
    # A database server is contacted now, so an unreachable one fails before the model loads; a
    # new SQLite or journal file is only created once every input has been checked, so a run that
    # fails on bad input leaves nothing behind.
    check_storage_url(args.storage)
    storage_file = local_storage_file(args.storage)
    check_local_storage(args.storage)
    if storage_file is not None and not args.storage.startswith("sqlite:///"):
        repair = repair_journal(storage_file)  # a damaged last record must go before anything appends
        if repair is not None:
            print(repair.warning(storage_file), file=sys.stderr)
    storage = open_storage(args.storage) if storage_file is None or storage_file.exists() else None
    attrs = None
    if storage is not None:  # resuming: a flag that changes the study's space or prompts is refused before any work
        attrs = existing_study_attrs(storage, study_name)
        check_resumed_space(attrs, study_name, args)
        check_resumed_calibration(attrs, study_name, args, prompts)

    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    model, tokenizer = loaded.model, loaded.tokenizer
    check_policies({f"--warm-start {path}": policy for path, policy in seeds.items()}, model)
    check_head_sizes(args.draft_vocab, adapters.lm_head(model).weight.shape[0])
    identity = {
        "model_name": loaded.name,
        "model_architecture": adapters.architecture_of(model),
        "model_num_layers": adapters.num_layers(model),
        "model_fingerprint": adapters.weights_fingerprint(model),
        "objective": args.objective,
    }
    space = SearchSpace(
        num_layers=adapters.num_layers(model),
        never_skip=args.never_skip,
        min_fraction=args.min_skip_fraction,
        max_fraction=args.max_skip_fraction,
        draft_token_choices=args.draft_tokens,
        tune_adaptive=not args.no_adaptive,
        draft_vocab_choices=args.draft_vocab,
        lookup_ngram_choices=args.lookup,
        lookup_token_choices=args.lookup_tokens,
        lookup_confidence_choices=args.lookup_confidence,
        lookup_min_ngram_choices=args.lookup_min,
        verify_pad_choices=args.verify_pad,
        precision_choices=args.draft_precision,
        require_skip_draft=args.require_skip_draft,
        exit_choices=exit_choices,
        exit_threshold_choices=args.exit_thresholds,
    )
    for choice in exit_choices:  # another model's adapter, or a changed file, fails before any work
        ExitAdapter.load(choice.adapter, model, choice.sha256)
    chat = loaded.instruct if args.chat is None else args.chat
    check_resumed_chat(attrs, study_name, chat)  # known once the model says whether it is an instruct model
    prompt_ids = [encode_prompt(tokenizer, p.text, chat) for p in prompts]
    for prompt, ids in zip(prompts, prompt_ids):
        check_fits(model, len(ids), max(args.reference_tokens, args.max_new_tokens), f"calibration prompt {prompt.id}")
    calibration_info = {
        "source": args.prompts,
        "prompts": [p.id for p in prompts],
        "prompts_sha256": prompts_digest(prompts),
        "categories": sorted({p.category for p in prompts}),
        "chat": chat,
        "reference_tokens": args.reference_tokens,
    }
    if storage is None:
        storage = open_storage(args.storage)
    existing = existing_study_attrs(storage, study_name)
    check_study_matches(existing, study_name, identity)
    here = this_machine(next(model.parameters()).device)
    _warn_if_made_elsewhere(existing, study_name, here)
    progress = not args.no_progress
    cache = CalibrationCache(model, read=not args.no_cache)
    calibration = prepare_calibration(
        model,
        prompt_ids,
        args.reference_tokens,
        args.draft_tokens,
        eos_token_ids(model, tokenizer),
        calibration_info,
        progress,
        max_block=max((*args.lookup_tokens, *args.verify_pad, 0)) + 1,
        cache=cache,
    )
    if args.space == "ranked":
        # Sublayers ordered by how little bypassing each alone changes the draft's top-1 token;
        # a resumed study keeps the order it was made with.
        known = (existing or {}).get("space", {}).get("sublayer_order")
        if known:
            order = [tuple(item) for item in known]
        else:
            with phase("sublayer order", progress) as info:
                order = cache.sublayer_order()
                info["detail"] = "cached"
                if order is None:
                    order = sublayer_order(model, calibration.references, progress)
                    cache.store_sublayer_order(order)
                    info["detail"] = f"{len(order)} sublayers ranked"
        space = replace(space, sublayer_order=tuple(order))
        if not known:  # a new study's order starts with the warm starts' sublayers, smallest set first
            switched = [policy for policy in seeds.values() if policy.exit is None]  # exits sample no switches
            smallest_first = sorted(switched, key=lambda policy: len(policy.bypassed_sublayers))
            space = space.with_leading([sub for policy in smallest_first for sub in policy.bypassed_sublayers])
    seed_params = []
    for path, policy in seeds.items():
        policy.validate_for(model)
        params, notes = space.params_for_policy(policy, f"--warm-start {path}")
        for note in notes:
            print(note, file=sys.stderr)
        seed_params.append(params)
    metadata = {
        **identity,
        "command": command,
        "calibration": calibration.description,
        "space": space.to_dict(),
        "device": str(next(model.parameters()).device),
        "machine": here.to_dict(),
        "dtype": args.dtype,
        "torch": torch.__version__,
        **({"preset": args.preset_record} if args.preset_record else {}),
    }
    seed = args.seed + 1000 * args.worker + counted_trials_safe(storage, study_name)
    study = open_study(
        storage,
        study_name,
        args.objective,
        seed,
        metadata,
        space.warm_starts(),
        seed_params,
        enqueue_warm_starts=args.worker == 0,
    )
    if RANKING_ATTR not in study.user_attrs:
        # Truncated draft heads start from the calibration text's tokens (then the lowest ids);
        # stored once, so every trial of the study (and every worker) scores the same rows.
        ranking = DraftVocabulary.from_texts(tokenizer, [p.text for p in prompts], model).top(max(args.draft_vocab))
        study.set_user_attr(RANKING_ATTR, list(ranking))
    ranking = study.user_attrs[RANKING_ATTR]
    print(f"study '{study_name}' on {args.storage}: {counted_trials(study)} trials so far", file=sys.stderr)
    objective = _recording_machine(CheapObjective(model, calibration, space, args.objective, ranking), here)
    with phase("trials", progress) as info:
        before = counted_trials(study)
        run_trials(study, objective, args.n_trials, args.total_trials, args.timeout, progress)
        after = counted_trials(study)
        info["detail"] = f"{after - before} finished while this ran, {after} in the study"

    # The best predictions, and the best of every other kind of draft (exit, skip, hybrid, lookup).
    top = finalists(study, args.objective, max(args.confirm_top, 1), per_kind=True)
    with phase("confirm", progress) as info:
        # Real generation with a hopeless draft is slow and tells nothing new: skip those.
        hopeful = [t for t in top if t.user_attrs.get("predicted_speedup", 0.0) >= HOPELESS_PREDICTED]
        chosen = hopeful if args.confirm_top else []
        settings = {  # a window measured with other settings is not reused
            "rounds": args.confirm_rounds,
            "prompts": len(calibration.prompts),
            "max_new_tokens": args.max_new_tokens,
            "prompt_ids": calibration.description.get("prompts", []),
        }

        def measure(policies):
            return confirm_window(model, calibration, policies, args.max_new_tokens, args.confirm_rounds, progress)

        window, measured = confirm_finalists(study, chosen, measure, settings) if chosen else (None, False)
        if measured:
            info["detail"] = (
                f"{len(window['trials'])} finalist(s) and HF generate interleaved, {args.confirm_rounds} rounds"
            )
        else:
            info["detail"] = "nothing new to measure"
    out = Path(out)
    policy = export_policy(study, out, args.export_trial)
    if args.plots:
        for path in write_plots(study, args.plots):
            print(f"wrote {path}", file=sys.stderr)
    print(f"\nstudy '{study_name}': {counted_trials(study)} trials (complete + pruned)")
    print(_summary(study, args.objective, top))
    print(f"\nexported trial {policy.provenance['trial']} to {out}: {policy.describe()}; {verdict(policy)}")
    return 0


def _recording_machine(objective: Callable[[Any], Any], here: Machine) -> Callable[[Any], Any]:
    """The objective, with each trial recording the machine its costs are measured on: an exported
    policy says it was tuned there (workers of one study may run on different machines)."""

    def measured_here(trial: Any) -> Any:  # an optuna.Trial
        trial.set_user_attr(MACHINE_ATTR, here.to_dict())
        return objective(trial)

    return measured_here


def _warn_if_made_elsewhere(attrs: dict[str, Any] | None, study_name: str, here: Machine) -> None:
    """A study resumed on another machine mixes costs measured on both: one warning line."""
    made_on = Machine.from_dict((attrs or {}).get(MACHINE_ATTR))
    if made_on is not None and (differences := made_on.differences(here)):
        print(
            f"warning: study '{study_name}' was made on another machine ({'; '.join(differences)}); its trials' "
            "costs were measured there and do not compare with this machine's; for a policy tuned here, start a "
            "new study (another --study-name)",
            file=sys.stderr,
        )


def counted_trials_safe(storage, study_name: str) -> int:
    """Trials already in the study (0 if new): offsets the sampler seed so a resumed run explores anew."""
    import optuna

    try:
        return counted_trials(optuna.load_study(study_name=study_name, storage=storage))
    except KeyError:
        return 0


def main(argv: list[str] | None = None) -> int:
    # `datasets` (prompt files) draws "Generating train split" bars on stderr, which would break
    # the one-line error contract; it reads this variable when first imported.
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    return run_cli(_main, argv)


if __name__ == "__main__":
    raise SystemExit(main())
