"""The cheap score of a candidate policy: the predicted speedup every trial of a study gets.

A trial's draft (its bypassed sublayers, precision and head) predicts each token of the
calibration references teacher-forced; those predictions are replayed through the engine's own
drafting rules (``measure.agreement.simulate_greedy``) and priced with the draft step's latency
and every verify block length *measured* on the device. ``prepare_calibration`` builds the
references and measures the latency once per run (cached between runs). The score ranks the
trials: the best become the finalists.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import optuna
from torch import nn

from layerskip.drafts.builder import DraftModels, head_rows
from layerskip.drafts.policy.skip_policy import SkipPolicy
from layerskip.drafts.rules.costs import block_cost
from layerskip.engine.calibration import own_text
from layerskip.engine.latency import draft_step_seconds, measure_latency
from layerskip.hf import adapters
from layerskip.measure.agreement import Reference, TeacherForcedDraft, build_references, simulate_greedy
from layerskip.search.calibration_cache import CalibrationCache
from layerskip.search.draft_timing import DraftTimings, draft_key
from layerskip.search.log import phase
from layerskip.search.space import POLICY_ATTR, SearchSpace, policy_attr, with_vocabulary

OBJECTIVES = ("pareto", "speedup")
LATENCY_WARNING_ATTR = "latency_warning"


@dataclass
class Calibration:
    """Everything the cheap score needs, computed once per run from the calibration prompts."""

    prompts: list[list[int]]  # token ids, chat template applied where the model wants it
    references: list[Reference]
    plain_step_seconds: float  # one full forward of one token: the unit of cost
    verify_seconds: dict[int, float]  # block length -> seconds of one full forward over it
    latency_context: list[int]  # the tokens the latency was timed after: drafts are timed after them too
    eos_token_ids: tuple[int, ...] = ()
    description: dict[str, Any] = field(default_factory=dict)

    def verify_cost(self, block: int) -> float:
        """A verify over ``block`` tokens in plain steps (HF's step = 1; the engine's own one-token
        verify may cost less, its head being certified from bf16)."""
        if block <= 1 and 1 not in self.verify_seconds:
            return 1.0
        return block_cost({1: self.plain_step_seconds, **self.verify_seconds}, block) / self.plain_step_seconds


def prepare_calibration(
    model: nn.Module,
    prompts: list[list[int]],
    reference_tokens: int,
    draft_token_choices: Sequence[int],
    eos_token_ids: tuple[int, ...] = (),
    description: dict[str, Any] | None = None,
    progress: bool = True,
    max_block: int = 0,
    cache: CalibrationCache | None = None,
) -> Calibration:
    """References and measured latency for the cheap score; with ``cache``, reused from (and saved
    to) disk when every input they depend on is the same (the latency is ``auto``'s, keyed by model
    and machine). ``description["latency"]`` records how the costs were measured (and a
    busy-machine warning, printed here too)."""
    with phase("references", progress) as info:
        references = cache.references(prompts, reference_tokens) if cache is not None else None
        if references is None:
            references = build_references(model, prompts, reference_tokens, progress=progress)
            if cache is not None:
                cache.store_references(prompts, reference_tokens, references)
            info["detail"] = f"{len(prompts)} prompts x {reference_tokens} tokens built"
        else:
            info["detail"] = f"{len(prompts)} prompts, cached"
    # Every block length a step may verify (partial drafts, k + 1, lookup runs, padded blocks):
    # on CPU the cost is not monotone in length (a 2-3-row matmul can cost more than a 4-row
    # one), so no length is interpolated.
    largest = max(9, *(k + 1 for k in draft_token_choices), max_block)
    blocks = list(range(2, largest + 1))
    with phase("latency calibration", progress) as info:
        if cache is not None:
            latency = cache.latency(blocks, progress)
        else:
            latency = measure_latency(model, own_text(model), blocks, progress)
        if latency.warning is not None:  # only a fresh measurement has one: a busy one is never cached
            print(latency.warning, file=sys.stderr)
        measured = "cached" if latency.cached_from else f"{len(latency.verify_seconds)} block lengths measured"
        info["detail"] = f"plain step {1000 * latency.plain_step_seconds:.2f} ms, {measured}"
    description = {**(description or {}), "latency": latency.describe()}
    return Calibration(
        prompts,
        references,
        latency.plain_step_seconds,
        latency.verify_seconds,
        latency.context,
        eos_token_ids,
        description,
    )


@dataclass
class CheapScore:
    acceptance: float
    draft_seconds: float
    draft_cost: float  # draft step / plain step
    verify_cost: float  # verify of k+1 / plain step
    predicted_speedup: float
    draft_timed_by_trial: int | None = None  # the trial whose timing of this same draft priced it


@dataclass(eq=False, repr=False)
class CheapObjective:
    """Optuna objective: samples a policy from the space and scores it cheaply.

    ``pareto``: (maximise acceptance, minimise draft-step seconds).
    ``speedup``: maximise predicted speedup; the acceptance estimate is reported prompt by
    prompt so a pruner can stop hopeless trials early. ``ranking`` orders the vocabulary for
    truncated draft heads (the policy of a trial keeps its first ``draft_vocab_size`` ids).
    """

    model: nn.Module
    calibration: Calibration
    space: SearchSpace
    mode: str
    ranking: Sequence[int] = ()
    latency_repeats: int = 5
    # One draft forward per (precision, exit adapter), every sublayer kept: an adapter is loaded
    # and checked once per study process, never trained by a trial.
    draft_models: DraftModels = field(init=False)
    # One timing per distinct draft in the study (layerskip.search.draft_timing): noise cannot price it twice.
    draft_timings: DraftTimings = field(init=False, default_factory=DraftTimings)

    def __post_init__(self) -> None:
        self.ranking = tuple(self.ranking)
        self.draft_models = DraftModels(self.model)

    def score(self, policy: SkipPolicy, trial: optuna.Trial | None = None) -> CheapScore:
        cal = self.calibration
        k = policy.draft.max_draft_tokens
        draft_cost = draft = 0.0
        timed_by = None
        draft_model = self.draft_models.for_policy(policy, all_sublayers=True)
        rows = head_rows(policy, adapters.lm_head(self.model).weight.shape[0])
        attention, mlp = policy.skip_attention, policy.skip_mlp
        if policy.draft.use_skip_draft:
            context, repeats = cal.latency_context, self.latency_repeats
            timing = self.draft_timings.seconds(
                draft_key(self.model, policy, rows, context, repeats),
                lambda: draft_step_seconds(draft_model, context, attention, mlp, rows, repeats),
                trial,
            )
            draft, timed_by = timing.seconds, timing.trial
            draft_cost = draft / cal.plain_step_seconds
        matches = total = tokens = drafted = accepted = 0
        cost = 0.0
        for step, reference in enumerate(cal.references):
            predictor = None
            if policy.draft.use_skip_draft:
                view = TeacherForcedDraft(draft_model, reference, attention, mlp, rows)
                m, n = view.agreement()
                matches, total = matches + m, total + n
                predictor = view.predict
            replay = simulate_greedy(reference, policy.draft, predictor, (draft_cost, cal.verify_cost))
            tokens += replay.tokens
            drafted += replay.drafted
            accepted += replay.accepted
            cost += replay.predicted_cost(draft_cost, cal.verify_cost)
            if trial is not None and self.mode == "speedup":
                trial.report(tokens / cost, step)
                if trial.should_prune():
                    raise optuna.TrialPruned(f"predicted speedup hopeless after {step + 1} prompts")
        # Skip drafts: teacher-forced top-1 agreement; lookup-only: replayed lookup acceptance.
        if policy.draft.use_skip_draft:
            acceptance = matches / total if total else 0.0
        else:
            acceptance = accepted / drafted if drafted else 0.0
        predicted = tokens / cost if cost else 0.0
        return CheapScore(acceptance, draft, draft_cost, cal.verify_cost(k + 1), predicted, timed_by)

    def __call__(self, trial: optuna.Trial) -> float | tuple[float, float]:
        policy = with_vocabulary(self.space.suggest(trial), self.ranking)
        trial.set_user_attr(POLICY_ATTR, policy_attr(policy))  # what is scored is what gets exported
        warning = self.calibration.description.get("latency", {}).get("warning")
        if warning:  # priced with costs measured on a busy machine: said in the exported policy
            trial.set_user_attr(LATENCY_WARNING_ATTR, warning)
        score = self.score(policy, trial)
        for key, value in asdict(score).items():
            trial.set_user_attr(key, value)
        if self.mode == "pareto":
            return score.acceptance, score.draft_seconds
        return score.predicted_speedup
