"""Finalists measured together by real generation: one interleaved window, paired medians, noise, close calls.

The cheap score prices each trial's draft with a few timings taken minutes apart from its rivals';
it picks the finalists, never the winner. The finalists then run in ONE window beside plain
decoding (HF ``generate``): ``rounds`` rounds, each every finalist and the baseline on every
calibration prompt, the order rotated (``measure.timing.run_rounds``). A finalist's speedup in a
round is its aggregate throughput over the baseline's in that same round (a pair: same prompts,
same minutes); its figure is the median over the rounds, and the interquartile range of its
per-round speedups is its measured noise.

Close calls: when the fastest finalist's median beats another's by no more than the larger of the
two noises, timing cannot order them. The rival with the most tokens per verify (tau: tokens per
full-model forward) is chosen then, the faster median breaking a tie in tau. Tau is exact in
greedy decoding (no timing noise), and at equal speed the draft that needs fewer full-model
forwards loses least when the draft's price moves (a busier machine, other prompt lengths).
Measuring again was the other way: it costs a second window and may stay inside the noise.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from layerskip.drafts.policy.skip_policy import SkipPolicy
from layerskip.engine.decoding import Decoder, DecodeSettings
from layerskip.integration.baselines import hf_generate
from layerskip.measure.timing import Runner, aggregate_throughput, run_rounds, speedup
from layerskip.search.objective import Calibration
from layerskip.stats import GenerationStats

MIN_ROUNDS = 5  # a median and an interquartile range need a few rounds; 5 is the least that tells an outlier
BASELINE = "hf"
WARMUP_TOKENS = 8


@dataclass
class Confirmation:
    """A policy measured by real generation against HF generate on the calibration prompts."""

    speedup: float  # median over the rounds of the round's speedup over HF generate
    tokens_per_second: float  # over the whole window
    baseline_tokens_per_second: float
    mean_accepted: float  # tokens per full-model forward (tau)
    acceptance_rate: float
    identical_fraction: float  # generations token-for-token equal to HF generate's
    prompts: int
    max_new_tokens: int
    rounds: int = 1
    speedup_iqr: float = 0.0  # interquartile range of the per-round speedups: the measured noise
    round_speedups: list[float] | None = None


def interquartile_range(values: Sequence[float]) -> float:
    """Third quartile minus first (inclusive quartiles: over 5 values, the 4th minus the 2nd); 0 below 2 values."""
    if len(values) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q3 - q1


def confirm_window(
    model: nn.Module,
    calibration: Calibration,
    policies: Mapping[int, SkipPolicy],
    max_new_tokens: int,
    rounds: int = MIN_ROUNDS,
    progress: bool = False,
) -> dict[int, Confirmation]:
    """Every policy (keyed by trial number) and HF generate, greedy, interleaved over ``rounds``
    rounds of the calibration prompts in one window; one ``Confirmation`` per policy."""
    eos = calibration.eos_token_ids
    runners: dict[str, Runner] = {BASELINE: lambda ids, n: (hf_generate(model, ids, n, eos), None)}
    for number, policy in policies.items():
        decoder = Decoder.for_policy(model, policy)  # prepared once: its draft copy is built before the window

        def run(ids: list[int], n: int, decoder: Decoder = decoder) -> tuple[list[int], GenerationStats | None]:
            return decoder.decode(ids, DecodeSettings(max_new_tokens=n, eos_token_ids=eos))

        runners[f"trial {number}"] = run
    device = next(model.parameters()).device
    prompts = calibration.prompts
    window = run_rounds(runners, prompts, max_new_tokens, device, rounds, WARMUP_TOKENS, progress, "confirm")
    baseline_rounds = [[runs[BASELINE] for runs in passes] for passes in window]
    results = {}
    for number in policies:
        name = f"trial {number}"
        own_rounds = [[runs[name] for runs in passes] for passes in window]
        per_round = [speedup(own, base) or 0.0 for own, base in zip(own_rounds, baseline_rounds)]
        own = [run for passes in own_rounds for run in passes]
        base = [run for passes in baseline_rounds for run in passes]
        stats = GenerationStats.combined([run.stats for run in own if run.stats is not None])
        results[number] = Confirmation(
            speedup=statistics.median(per_round),
            tokens_per_second=aggregate_throughput(own),
            baseline_tokens_per_second=aggregate_throughput(base),
            mean_accepted=stats.mean_accepted,
            acceptance_rate=stats.acceptance_rate,
            identical_fraction=sum(a.tokens == b.tokens for a, b in zip(own, base)) / len(own),
            prompts=len(calibration.prompts),
            max_new_tokens=max_new_tokens,
            rounds=rounds,
            speedup_iqr=interquartile_range(per_round),
            round_speedups=per_round,
        )
    return results


@dataclass
class Decision:
    """Which finalist of a window is chosen, and why."""

    chosen: int  # trial number
    fastest: int  # the best median speedup
    close_call: bool  # another finalist is within the noise of the fastest
    rivals: list[int]  # the fastest and every finalist within its noise, fastest first
    decided_by: str  # "speedup" (clear win, or a single finalist) or "acceptance" (close call)

    def describe(self, confirmed: Mapping[int, Mapping[str, Any]]) -> str:
        """One or two plain sentences for the study summary and the policy's provenance."""

        def figure(number: int, tau: bool = False) -> str:
            c = confirmed[number]
            text = f"trial {number} {c['speedup']:.2f}x (IQR {c.get('speedup_iqr', 0.0):.2f}"
            return text + (f", tau {c['mean_accepted']:.2f})" if tau else ")")

        if len(confirmed) == 1:
            return f"one finalist: {figure(self.chosen)}; chosen on measured speedup"
        if not self.close_call:
            runner_up = sorted(confirmed, key=lambda n: confirmed[n]["speedup"], reverse=True)[1]
            return (
                f"{figure(self.fastest)} beats {figure(runner_up)} by more than their noise; chosen on measured speedup"
            )
        others = " and ".join(figure(number, tau=True) for number in self.rivals if number != self.fastest)
        tau = confirmed[self.chosen]["mean_accepted"]
        tied = any(confirmed[n]["mean_accepted"] == tau for n in self.rivals if n != self.chosen)
        return (
            f"close call: {figure(self.fastest, tau=True)} is the fastest, but {others} "
            f"{'is' if len(self.rivals) == 2 else 'are'} within the measured noise of it; broken on acceptance "
            f"(most tokens per verify{', tied here, then the faster median' if tied else ''}): trial {self.chosen}"
        )


def decide(confirmed: Mapping[int, Mapping[str, Any]]) -> Decision | None:
    """The finalist to export from one window's confirmations (``asdict(Confirmation)`` by trial).

    Clear win: the best median speedup. Close call (another finalist's median within the larger of
    the two interquartile ranges of the fastest's): the highest tau among those rivals, then the
    faster median."""
    if not confirmed:
        return None

    def noise(number: int) -> float:
        return float(confirmed[number].get("speedup_iqr", 0.0))

    ranked = sorted(confirmed, key=lambda n: (confirmed[n]["speedup"], -n), reverse=True)
    fastest = ranked[0]
    top = confirmed[fastest]["speedup"]
    rivals = [n for n in ranked if top - confirmed[n]["speedup"] <= max(noise(fastest), noise(n))]
    if len(rivals) == 1:
        return Decision(fastest, fastest, False, rivals, "speedup")
    chosen = max(rivals, key=lambda n: (confirmed[n]["mean_accepted"], confirmed[n]["speedup"]))
    return Decision(chosen, fastest, True, rivals, "acceptance")
