"""Scoring a candidate policy, at two fidelities.

cheap: acceptance estimated by teacher-forced agreement over the calibration references, and
       the draft step's latency *measured* on the device; predicted speedup from both
       (DESIGN.md: E[tokens/step] / (k * c + v), c and v relative to one plain step).
real:  actual self-speculative generation against HF ``generate`` on the same prompts,
       interleaved after a warm-up; measured speedup, tau and acceptance.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import optuna
import torch
from torch import nn
from tqdm.auto import tqdm

from layerskip.engine.decoding import DecodeSettings, decode_speculative
from layerskip.engine.policy import SkipPolicy
from layerskip.hf.baselines import hf_generate
from layerskip.measure.agreement import Reference, build_references, draft_predictions, simulate_greedy
from layerskip.measure.latency import block_cost, draft_step_seconds, verify_seconds
from search.space import SearchSpace

OBJECTIVES = ("pareto", "speedup")
VocabRows = Callable[[SkipPolicy, Sequence[int]], "torch.Tensor | None"]


@dataclass
class Calibration:
    """Everything the cheap score needs, computed once per run from the calibration prompts."""

    prompts: list[list[int]]  # token ids, chat template applied where the model wants it
    references: list[Reference]
    plain_step_seconds: float  # one full forward of one token: the unit of cost
    verify_seconds: dict[int, float]  # block length -> seconds of one full forward over it
    latency_context: list[int]
    eos_token_ids: tuple[int, ...] = ()
    description: dict[str, Any] = field(default_factory=dict)

    def verify_cost(self, block: int) -> float:
        """A forward over ``block`` tokens in plain steps (a step without a draft costs exactly 1)."""
        if block <= 1:
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
) -> Calibration:
    references = build_references(model, prompts, reference_tokens, progress=progress)
    # Time on a realistic context: the longest prompt with its continuation.
    longest = max(references, key=lambda r: len(r.prompt))
    context = [*longest.prompt, *longest.continuation]
    plain = verify_seconds(model, context, 1)
    # Every block length a step may verify (partial drafts, k + 1, lookup runs, padded blocks):
    # on CPU the cost is not monotone in length (a 2-3-row matmul can cost more than a 4-row
    # one), so no length is interpolated.
    largest = max(9, *(k + 1 for k in draft_token_choices), max_block)
    blocks = list(range(2, largest + 1))
    verify = {block: verify_seconds(model, context, block) for block in blocks}
    return Calibration(prompts, references, plain, verify, context, eos_token_ids, description or {})


@dataclass
class CheapScore:
    acceptance: float
    draft_seconds: float
    draft_cost: float  # draft step / plain step
    verify_cost: float  # verify of k+1 / plain step
    predicted_speedup: float


class CheapObjective:
    """Optuna objective: samples a policy from the space and scores it cheaply.

    ``pareto``: (maximise acceptance, minimise draft-step seconds).
    ``speedup``: maximise predicted speedup; the acceptance estimate is reported prompt by
    prompt so a pruner can stop hopeless trials early.
    """

    def __init__(
        self,
        model: nn.Module,
        calibration: Calibration,
        space: SearchSpace,
        mode: str,
        vocab_rows: VocabRows | None = None,
        latency_repeats: int = 5,
    ) -> None:
        self.model = model
        self.calibration = calibration
        self.space = space
        self.mode = mode
        self.vocab_rows = vocab_rows or (lambda policy, prompt: None)
        self.latency_repeats = latency_repeats

    def score(self, policy: SkipPolicy, trial: optuna.Trial | None = None) -> CheapScore:
        cal = self.calibration
        k = policy.draft.max_draft_tokens
        draft_cost = 0.0
        draft = 0.0
        if policy.draft.use_skip_draft:
            rows = self.vocab_rows(policy, cal.latency_context)
            draft = draft_step_seconds(
                self.model, cal.latency_context, policy.skip_attention, policy.skip_mlp, rows, self.latency_repeats
            )
            draft_cost = draft / cal.plain_step_seconds
        matches = total = tokens = drafted = accepted = 0
        cost = 0.0
        for step, reference in enumerate(cal.references):
            rows = self.vocab_rows(policy, reference.prompt)
            predicted, confidence = draft_predictions(
                self.model, reference, policy.skip_attention, policy.skip_mlp, rows, with_confidence=True
            )
            target = torch.tensor(reference.continuation, device=predicted.device)
            matches += int((predicted == target).sum())
            total += len(reference.continuation)
            replay = simulate_greedy(reference, predicted.tolist(), confidence.tolist(), policy.draft)
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
        return CheapScore(acceptance, draft, draft_cost, cal.verify_cost(k + 1), tokens / cost if cost else 0.0)

    def __call__(self, trial: optuna.Trial) -> float | tuple[float, float]:
        policy = self.space.suggest(trial)
        score = self.score(policy, trial)
        for key, value in asdict(score).items():
            trial.set_user_attr(key, value)
        if self.mode == "pareto":
            return score.acceptance, score.draft_seconds
        return score.predicted_speedup


@dataclass
class Confirmation:
    """A policy measured by real generation against HF generate on the calibration prompts."""

    speedup: float
    tokens_per_second: float
    baseline_tokens_per_second: float
    mean_accepted: float
    acceptance_rate: float
    identical_fraction: float
    prompts: int
    max_new_tokens: int


@torch.inference_mode()
def confirm(
    model: nn.Module,
    calibration: Calibration,
    policy: SkipPolicy,
    max_new_tokens: int,
    vocab_rows: VocabRows | None = None,
    progress: bool = False,
) -> Confirmation:
    """Greedy self-speculative generation vs HF generate, interleaved prompt by prompt, after a warm-up."""
    vocab_rows = vocab_rows or (lambda p, prompt: None)
    settings = DecodeSettings(max_new_tokens=max_new_tokens, eos_token_ids=calibration.eos_token_ids)
    first = calibration.prompts[0]
    decode_speculative(
        model,
        first,
        policy,
        DecodeSettings(8, eos_token_ids=calibration.eos_token_ids),
        vocab_rows=vocab_rows(policy, first),
    )
    hf_generate(model, first, 8, calibration.eos_token_ids)
    ours_tokens = ours_seconds = base_tokens = base_seconds = 0.0
    steps = drafted = accepted = identical = 0
    for prompt in tqdm(calibration.prompts, desc="confirm", disable=not progress, leave=False):
        tokens, stats = decode_speculative(model, prompt, policy, settings, vocab_rows=vocab_rows(policy, prompt))
        reference, seconds = hf_generate(model, prompt, max_new_tokens, calibration.eos_token_ids)
        ours_tokens += len(tokens)
        ours_seconds += stats.total_seconds
        base_tokens += len(reference)
        base_seconds += seconds
        steps += stats.steps
        drafted += stats.drafted
        accepted += stats.accepted
        identical += tokens == reference
    ours_tps = ours_tokens / ours_seconds
    base_tps = base_tokens / base_seconds
    return Confirmation(
        speedup=ours_tps / base_tps,
        tokens_per_second=ours_tps,
        baseline_tokens_per_second=base_tps,
        mean_accepted=ours_tokens / steps,
        acceptance_rate=accepted / drafted if drafted else 0.0,
        identical_fraction=identical / len(calibration.prompts),
        prompts=len(calibration.prompts),
        max_new_tokens=max_new_tokens,
    )


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Rank correlation (no ties correction needed for continuous timings); None if < 3 points."""
    if len(xs) < 3:
        return None

    def ranks(values: Sequence[float]) -> list[float]:
        order = sorted(range(len(values)), key=lambda i: values[i])
        result = [0.0] * len(values)
        for rank, index in enumerate(order):
            result[index] = float(rank)
        return result

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else None
