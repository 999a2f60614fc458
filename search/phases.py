"""The search, phase by phase, in the order ``run_study`` and ``layerskip-search`` run them (``run``).

check      the settings, prompts, warm starts, exit adapters and outputs, before the model
           loads (``check_inputs``); then the model against them (``check_model``)
storage    the study's storage reached, a damaged journal repaired and a resumed study's space and
           prompts checked, before the model loads (``check_storage``); a new SQLite or journal
           file is created only once every input has been checked (``open_study_storage``)
calibrate  the references and measured latency the cheap score needs (layerskip.search.objective), cached
rank       the ranked space's sublayer order; a new study's starts with the warm starts' sublayers
trials     the study opened (warm starts enqueued) and its trials run, each scored cheaply
confirm    the best finalists measured by real generation in one window (layerskip.search.confirmation)
export     the chosen trial as a policy (written where the settings say), and the plots

Every phase refuses what it can before the work that follows: a search must not fail, after
minutes of calibration or trials, on something it could have refused at the start.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import optuna
import torch
from optuna.trial import FrozenTrial
from torch import nn

from layerskip.cli.common import check_fits, check_policies
from layerskip.data import Prompt, prompts_selected_by
from layerskip.drafts.model.exit_adapter import ExitAdapter
from layerskip.drafts.model.vocab import DraftVocabulary
from layerskip.drafts.policy.skip_policy import ModelIdentity, SkipPolicy, is_policy_file
from layerskip.drafts.policy.spec import AUTO
from layerskip.engine.decoding import Decoder, DecodeSettings
from layerskip.fileio import check_output_dir, check_output_file, check_replaceable
from layerskip.hf import adapters
from layerskip.hf.models import LoadedModel, load_model
from layerskip.hf.prompting import encode_prompt, eos_token_ids
from layerskip.machine import Machine, this_machine
from layerskip.measure.agreement import sublayer_order
from layerskip.search.calibration_cache import CalibrationCache
from layerskip.search.checks import (
    check_arguments,
    check_head_sizes,
    check_resumed_calibration,
    check_resumed_chat,
    check_resumed_space,
    prompts_digest,
    read_exit_choices,
    space_fields,
)
from layerskip.search.confirmation import Confirmation, confirm_window
from layerskip.search.export import export_policy
from layerskip.search.journal import repair_journal
from layerskip.search.log import phase
from layerskip.search.objective import Calibration, CheapObjective, prepare_calibration
from layerskip.search.plots import PLOT_FILES, write_plots
from layerskip.search.settings import SearchSettings
from layerskip.search.space import RANKING_ATTR, ExitChoice, SearchSpace
from layerskip.search.study import (
    check_local_storage,
    check_study_matches,
    confirm_finalists,
    counted_trials,
    existing_study_attrs,
    finalists,
    local_storage_file,
    open_storage,
    open_study,
    run_trials,
    warn_if_made_elsewhere,
)

HOPELESS_PREDICTED = 0.5  # finalists predicted below this are not confirmed by real generation


@dataclass
class Inputs:
    """What a search is asked for (``run_study``'s arguments, a preset's values applied), read and
    checked before the model loads."""

    model: str | LoadedModel  # an embedded name, a path or a hub id, or a model already loaded
    prompts_source: str  # where the prompts come from, as the study records it ("a list": given as such)
    args: SearchSettings
    preset: dict[str, Any] | None  # what the study records of the preset: its values and what overrode them
    command: str  # as the study and the policy's provenance record it
    prompts: list[Prompt]
    seeds: dict[str, SkipPolicy]  # --warm-start path -> its policy
    exit_choices: tuple[ExitChoice, ...]
    study_name: str

    @property
    def progress(self) -> bool:
        return not self.args.no_progress


@dataclass
class Storage:
    """The study's storage: open where it already exists (a resume), else created by ``open``."""

    url: str
    study_name: str
    opened: optuna.storages.BaseStorage | None
    attrs: dict[str, Any] | None  # the study's attributes when it exists already

    def open(self) -> optuna.storages.BaseStorage:
        if self.opened is None:
            self.opened = open_storage(self.url)
        return self.opened


@dataclass
class Target:
    """The model searched, checked against the inputs, and what the search derives from it."""

    model: nn.Module
    tokenizer: Any
    identity: dict[str, Any]  # the model and the objective: a study serves one of each
    space: SearchSpace  # as the flags set it (``rank`` orders a ranked one)
    prompt_ids: list[list[int]]  # the calibration prompts, chat template applied where wanted
    calibration_info: dict[str, Any]  # what the study records of its calibration prompts
    here: Machine


def run(inputs: Inputs) -> tuple[optuna.Study, SkipPolicy, list[FrozenTrial]]:
    """The whole search on checked inputs (``check_inputs``), every phase in order: the study, the
    policy exported (written where the settings' ``out`` says) and the finalists."""
    storage = check_storage(inputs)
    target = check_model(inputs, storage)
    existing = open_study_storage(storage, target)
    calibration, cache = calibrate(inputs, target)
    space = rank(inputs, target, existing, cache, calibration)
    study = trials(inputs, target, storage, space, calibration)
    top = confirm(inputs, study, target.model, calibration)
    return study, export(inputs, study), top


# -- check ------------------------------------------------------------------------------------------------------------
def check_inputs(
    model: str | LoadedModel,
    prompts: str | tuple[Prompt, ...],
    args: SearchSettings,
    preset: dict[str, Any] | None,
    command: str,
) -> Inputs:
    """Every value and file the request names, read and checked; the outputs checked too (a
    search must not end, after all its work, unable to save)."""
    check_arguments(args)
    # A source: those the settings select; given as such: all of them.
    selected = prompts_selected_by(prompts, args) if isinstance(prompts, str) else list(prompts)
    # Bad files fail before the model loads; "auto" becomes auto's choices once it has run (check_model).
    seeds = {
        path: SkipPolicy.auto_choice() if path == AUTO else SkipPolicy.load(path, "--warm-start")
        for path in args.warm_start
    }
    exit_choices = read_exit_choices(args.exit_adapters)
    model_name = model.name if isinstance(model, LoadedModel) else model
    study_name = args.study_name or default_study_name(model_name, preset["name"] if preset else args.objective)
    if args.out is not None:
        check_output_file(args.out, "--out")
        check_replaceable(args.out, "--out", is_policy_file, "a layerskip policy", args.force)  # a resume re-exports
    if args.plots:
        check_output_dir(args.plots, "--plots", PLOT_FILES)
    source = prompts if isinstance(prompts, str) else "a list"
    return Inputs(model, source, args, preset, command, selected, seeds, exit_choices, study_name)


def auto_policy(model: nn.Module, prompt_ids: list[list[int]], max_new_tokens: int, name: str) -> SkipPolicy:
    """``--warm-start auto``: what auto chooses on this machine (its skip set, head size, padding,
    lookup and tree settings) after generating from the calibration prompts, as a fixed policy."""
    decoder = Decoder.for_policy(model, SkipPolicy.auto_choice(next(model.parameters()).device))
    for ids in prompt_ids:  # every one of max_new_tokens, EOS or not: as many steps to learn from as asked
        decoder.decode(ids, DecodeSettings(max_new_tokens=max_new_tokens, eos_token_ids=()))
    assert decoder.draft is not None
    return decoder.draft.fixed_policy().with_model(model, name)


def default_study_name(model: str, suffix: str) -> str:
    """``MODEL-SUFFIX`` from a model argument: its last path part (``org/Llama-3.2-1B`` ->
    ``Llama-3.2-1B``), without a ``.gguf`` suffix."""
    return f"{Path(model).name.removesuffix('.gguf')}-{suffix}"


def check_model(inputs: Inputs, storage: Storage) -> Target:
    """The model loaded and checked against the warm starts, head sizes, exit adapters, prompts and
    the resumed study's chat setting; the search space the flags ask for, on its layers."""
    args = inputs.args
    given = inputs.model
    loaded = given if isinstance(given, LoadedModel) else load_model(given, args.dtype, args.device)
    model, tokenizer = loaded.model, loaded.tokenizer
    check_policies({f"--warm-start {path}": policy for path, policy in inputs.seeds.items()}, model)
    check_head_sizes(args.draft_vocab, adapters.lm_head(model).weight.shape[0])
    # model_name, model_architecture ...: the study records ModelIdentity's fields, which the export reads back
    identity = {f"model_{key}": value for key, value in asdict(ModelIdentity.of(model, loaded.name)).items()}
    identity["objective"] = args.objective
    space = SearchSpace(adapters.num_layers(model), exit_choices=inputs.exit_choices, **space_fields(args))
    for choice in inputs.exit_choices:  # another model's adapter, or a changed file, fails before any work
        ExitAdapter.load(choice.adapter, model, choice.sha256)
    chat = loaded.instruct if args.chat is None else args.chat
    check_resumed_chat(storage.attrs, inputs.study_name, chat)  # known once the model says whether it is instruct
    prompt_ids = [encode_prompt(tokenizer, p.text, chat) for p in inputs.prompts]
    for prompt, ids in zip(inputs.prompts, prompt_ids):
        check_fits(model, len(ids), max(args.reference_tokens, args.max_new_tokens), f"calibration prompt {prompt.id}")
    if AUTO in inputs.seeds:
        inputs.seeds[AUTO] = auto_policy(model, prompt_ids, args.max_new_tokens, loaded.name)
    calibration_info = {
        "source": inputs.prompts_source,
        "prompts": [p.id for p in inputs.prompts],
        "prompts_sha256": prompts_digest(inputs.prompts),
        "categories": sorted({p.category for p in inputs.prompts}),
        "chat": chat,
        "reference_tokens": args.reference_tokens,
    }
    here = this_machine(next(model.parameters()).device)
    return Target(model, tokenizer, identity, space, prompt_ids, calibration_info, here)


# -- storage ----------------------------------------------------------------------------------------------------------
def check_storage(inputs: Inputs) -> Storage:
    """The storage checked before the model loads: a database server is contacted now, so an
    unreachable one fails first; a damaged journal's last record is repaired before anything
    appends; an existing study refuses a flag that changes its space or prompts. A new SQLite or
    journal file is not created yet, so a run that fails on bad input leaves nothing behind."""
    url, name, args = inputs.args.storage, inputs.study_name, inputs.args
    check_local_storage(url)
    storage_file = local_storage_file(url)
    if storage_file is not None and not url.startswith("sqlite:///"):
        repair = repair_journal(storage_file)  # a damaged last record must go before anything appends
        if repair is not None:
            print(repair.warning(storage_file), file=sys.stderr)
    opened = open_storage(url) if storage_file is None or storage_file.exists() else None
    attrs = None
    if opened is not None:  # resuming: a flag that changes the study's space or prompts is refused before any work
        attrs = existing_study_attrs(opened, name)
        check_resumed_space(attrs, name, args)
        check_resumed_calibration(attrs, name, args.reference_tokens, inputs.prompts_source, inputs.prompts)
    return Storage(url, name, opened, attrs)


def open_study_storage(storage: Storage, target: Target) -> dict[str, Any] | None:
    """The storage, created now if new (every input is checked); the existing study's attributes
    (None: a new study), refused if it was made for another model or objective, and a warning
    if it was made on another machine."""
    existing = existing_study_attrs(storage.open(), storage.study_name)
    check_study_matches(existing, storage.study_name, target.identity)
    warn_if_made_elsewhere(existing, storage.study_name, target.here)
    return existing


# -- calibrate --------------------------------------------------------------------------------------------------------
def calibrate(inputs: Inputs, target: Target) -> tuple[Calibration, CalibrationCache]:
    """References and measured latency for the cheap score, reused from the cache when every input
    they depend on is the same (``--no-cache``: measured again)."""
    args, model = inputs.args, target.model
    cache = CalibrationCache(model, read=not args.no_cache)
    calibration = prepare_calibration(
        model,
        target.prompt_ids,
        args.reference_tokens,
        args.draft_tokens,
        eos_token_ids(model, target.tokenizer),
        target.calibration_info,
        inputs.progress,
        max_block=max((*args.lookup_tokens, *args.verify_pad, 0)) + 1,
        cache=cache,
    )
    return calibration, cache


# -- rank -------------------------------------------------------------------------------------------------------------
def rank(
    inputs: Inputs, target: Target, existing: dict[str, Any] | None, cache: CalibrationCache, calibration: Calibration
) -> SearchSpace:
    """The ranked space with its sublayers ordered by how little bypassing each alone changes the
    draft's top-1 token (a resumed study keeps the order it was made with; a new study's starts
    with the warm starts' sublayers, smallest set first); the switches space as it is."""
    space = target.space
    if inputs.args.space != "ranked":
        return space
    known = (existing or {}).get("space", {}).get("sublayer_order")
    if known:
        return replace(space, sublayer_order=tuple(tuple(item) for item in known))
    with phase("sublayer order", inputs.progress) as info:
        order = cache.sublayer_order()
        info["detail"] = "cached"
        if order is None:
            order = sublayer_order(target.model, calibration.references, inputs.progress)
            cache.store_sublayer_order(order)
            info["detail"] = f"{len(order)} sublayers ranked"
    space = replace(space, sublayer_order=tuple(order))
    switched = [policy for policy in inputs.seeds.values() if policy.exit is None]  # exits sample no switches
    smallest_first = sorted(switched, key=lambda policy: len(policy.bypassed_sublayers))
    return space.with_leading([sub for policy in smallest_first for sub in policy.bypassed_sublayers])


# -- trials -----------------------------------------------------------------------------------------------------------
def trials(
    inputs: Inputs, target: Target, storage: Storage, space: SearchSpace, calibration: Calibration
) -> optuna.Study:
    """The study created or resumed (a new one records what it is for; the warm starts are enqueued;
    the truncated heads' vocabulary ranking is stored once) and this process's trials run, each
    scored by the cheap objective and recording the machine it was priced on."""
    args, model = inputs.args, target.model
    seed_params = []
    for path, policy in inputs.seeds.items():  # each checked against the model by check_model
        params, notes = space.params_for_policy(policy, f"--warm-start {path}")
        for note in notes:
            print(note, file=sys.stderr)
        seed_params.append(params)
    metadata = {
        **target.identity,
        "command": inputs.command,
        "calibration": calibration.description,
        "space": asdict(space),
        "device": str(next(model.parameters()).device),
        "machine": target.here.to_dict(),
        "dtype": args.dtype,
        "torch": torch.__version__,
        **({"preset": inputs.preset} if inputs.preset else {}),
    }
    # The --warm-start policies on every run, first; the space's own warm starts by worker 0 only:
    # checking for a twin and enqueueing is not atomic, and workers started together (a cached
    # calibration makes their start-up equally fast) would both enqueue them, leaving duplicates.
    warm_starts = [*seed_params, *(space.warm_starts() if args.worker == 0 else [])]
    seed = args.seed + 1000 * args.worker
    study = open_study(storage.open(), inputs.study_name, args.objective, seed, metadata, warm_starts)
    if RANKING_ATTR not in study.user_attrs:
        # Truncated draft heads start from the calibration text's tokens (then the lowest ids);
        # stored once, so every trial of the study (and every worker) scores the same rows.
        texts = [p.text for p in inputs.prompts]
        ranking = DraftVocabulary.from_texts(target.tokenizer, texts, model).top(max(args.draft_vocab))
        study.set_user_attr(RANKING_ATTR, list(ranking))
    print(f"study '{inputs.study_name}' on {args.storage}: {counted_trials(study)} trials so far", file=sys.stderr)
    objective = CheapObjective(model, calibration, space, args.objective, study.user_attrs[RANKING_ATTR])
    with phase("trials", inputs.progress) as info:
        before = counted_trials(study)
        run_trials(study, objective, args.n_trials, args.total_trials, args.timeout, inputs.progress, target.here)
        after = counted_trials(study)
        info["detail"] = f"{after - before} finished while this ran, {after} in the study"
    return study


# -- confirm ----------------------------------------------------------------------------------------------------------
def confirm(inputs: Inputs, study: optuna.Study, model: nn.Module, calibration: Calibration) -> list[FrozenTrial]:
    """The finalists (the best predictions, and the best of every other kind of draft: exit, skip,
    hybrid, lookup) measured by real generation in one window beside HF generate; returns them."""
    args, rounds = inputs.args, inputs.args.confirm_rounds
    top = finalists(study, args.objective, max(args.confirm_top, 1))
    with phase("confirm", inputs.progress) as info:
        # Real generation with a hopeless draft is slow and tells nothing new: skip those.
        hopeful = [t for t in top if t.user_attrs.get("predicted_speedup", 0.0) >= HOPELESS_PREDICTED]
        chosen = hopeful if args.confirm_top else []
        settings = {  # a window measured with other settings is not reused
            "rounds": rounds,
            "prompts": len(calibration.prompts),
            "max_new_tokens": args.max_new_tokens,
            "prompt_ids": calibration.description.get("prompts", []),
        }

        def measure(policies: dict[int, SkipPolicy]) -> dict[int, Confirmation]:
            return confirm_window(model, calibration, policies, args.max_new_tokens, rounds, inputs.progress)

        window, measured = confirm_finalists(study, chosen, measure, settings) if chosen else (None, False)
        info["detail"] = "nothing new to measure"
        if measured:
            info["detail"] = f"{len(window['trials'])} finalist(s) and HF generate interleaved, {rounds} rounds"
    return top


# -- export -----------------------------------------------------------------------------------------------------------
def export(inputs: Inputs, study: optuna.Study) -> SkipPolicy:
    """The chosen trial (the last window's choice, or ``--export-trial``) as a policy, written to
    ``out`` where the settings name one; the plots."""
    policy = export_policy(study, inputs.args.out, inputs.args.export_trial)
    if inputs.args.plots:
        for path in write_plots(study, inputs.args.plots):
            print(f"wrote {path}", file=sys.stderr)
    return policy
