"""Where a generation's time goes: draft, verify forward, loop overhead, and the framework floor.

Three measurements, all on the model's own device:

* the cost of one full forward over a block of ``b`` tokens, ``c(b)``, against one plain step
  ``c(1)`` (a verify of ``k`` drafted tokens is a block of ``k + 1``);
* the step time of the model's *overhead twin* (same family, depth and module calls, 8-wide
  heads: ``adapters.overhead_twin``), the per-step framework cost no drafting can remove;
* real generations per configuration, interleaved, whose stats split each token's time into
  prefill, draft, verify and the rest of the loop. The verify time is split again into the
  forward time predicted by ``c(b)`` for the blocks actually run, and the remainder
  (acceptance, cache rollback, Python).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from layerskip.drafts.policy.skip_policy import SkipPolicy
from layerskip.drafts.rules.costs import block_cost
from layerskip.engine.decoding import Decoder, DecodeSettings
from layerskip.engine.latency import verify_seconds
from layerskip.hf import adapters
from layerskip.measure.report import csv_table, fmt, percent, table
from layerskip.measure.timing import Runner, TimedRun, run_interleaved, throughput
from layerskip.stats import GenerationStats


@dataclass
class ForwardCosts:
    """Median seconds of one full forward over ``b`` tokens after a real context."""

    seconds: dict[int, float]  # block size -> seconds
    twin_step_seconds: float  # one step of the overhead twin: the framework floor

    @property
    def plain(self) -> float:
        return self.seconds[1]

    def cost(self, block: int) -> float:
        """Seconds of a block of ``block`` tokens, interpolated between measured sizes."""
        return block_cost(self.seconds, block)

    def to_dict(self) -> dict[str, Any]:
        return {
            "block_seconds": {str(b): s for b, s in sorted(self.seconds.items())},
            "block_relative": {str(b): s / self.plain for b, s in sorted(self.seconds.items())},
            "twin_step_seconds": self.twin_step_seconds,
            "twin_step_relative": self.twin_step_seconds / self.plain,
        }


def forward_costs(
    model: nn.Module, context: Sequence[int], blocks: Sequence[int] = (*range(1, 14), 17), repeats: int = 9
) -> ForwardCosts:
    seconds = {b: verify_seconds(model, context, b, repeats) for b in blocks}
    twin = adapters.overhead_twin(model)
    twin_context = [t % adapters.TWIN_VOCAB for t in context]
    return ForwardCosts(seconds, verify_seconds(twin, twin_context, 1, repeats))


@dataclass
class ConfigProfile:
    """One configuration's generations, summed; times in ms per generated token."""

    name: str
    runs: list[TimedRun] = field(default_factory=list)

    def summary(self, costs: ForwardCosts) -> dict[str, Any]:
        stats = GenerationStats.combined([r.stats for r in self.runs if r.stats is not None])
        seconds = sum(r.seconds for r in self.runs)
        steps = sum(stats.block_histogram.values())  # verify forwards (the prefill excluded)
        per_token = 1000.0 / max(1, stats.new_tokens)
        forward = sum(costs.cost(b) * n for b, n in stats.block_histogram.items())
        other = seconds - stats.prefill_seconds - stats.draft_seconds - stats.verify_seconds
        drafted_steps = sum(n for b, n in stats.block_histogram.items() if b > 1)
        return {
            "name": self.name,
            "new_tokens": stats.new_tokens,
            "tokens_per_second": throughput(stats.new_tokens, seconds),
            # The prompt's forward gives each run's first token; the verifies give the rest.
            "tokens_per_verify": (stats.new_tokens - len(self.runs)) / steps if steps else None,
            "steps_with_draft": drafted_steps / steps if steps else None,
            "lookup_share": stats.lookup_steps / steps if steps else None,
            "mean_block": sum(b * n for b, n in stats.block_histogram.items()) / steps if steps else None,
            "ms_per_token": {
                "total": seconds * per_token,
                "prefill": stats.prefill_seconds * per_token,
                "draft": stats.draft_seconds * per_token,
                "verify_forward": forward * per_token,
                "verify_rest": (stats.verify_seconds - forward) * per_token,
                "loop_other": max(0.0, other) * per_token,
                "framework_floor": costs.twin_step_seconds * steps * per_token,
            },
            "blocks": {str(b): n for b, n in sorted(stats.block_histogram.items())},
        }


def profile_configs(
    model: nn.Module,
    prompt_ids: Sequence[list[int]],
    configs: dict[str, SkipPolicy | None],
    eos_token_ids: tuple[int, ...],
    max_new_tokens: int,
    progress: bool = True,
) -> list[ConfigProfile]:
    """Generate with every configuration on every prompt (interleaved, ``measure.timing``); None = plain."""
    decoders = {name: Decoder.for_policy(model, policy) for name, policy in configs.items()}

    def runner(decoder: Decoder) -> Runner:
        return lambda ids, max_new: decoder.decode(
            ids, DecodeSettings(max_new_tokens=max_new, eos_token_ids=eos_token_ids)
        )

    device = next(model.parameters()).device
    runs = run_interleaved(
        {name: runner(d) for name, d in decoders.items()}, prompt_ids, max_new_tokens, device, 16, progress, "profile"
    )
    return [ConfigProfile(name, [by_name[name] for by_name in runs]) for name in configs]


def profile_report(costs: ForwardCosts, profiles: Sequence[ConfigProfile]) -> dict[str, Any]:
    summaries = [p.summary(costs) for p in profiles]
    plain = next((s for s in summaries if s["steps_with_draft"] == 0.0), None)
    if plain is not None:
        for s in summaries:
            s["speedup_vs_plain"] = plain["ms_per_token"]["total"] / s["ms_per_token"]["total"]
    return {"forward_costs": costs.to_dict(), "configs": summaries, "plain_ms": 1000.0 * costs.plain}


CSV_COLUMNS = ("tokens_per_second", "speedup_vs_plain", "tokens_per_verify", "steps_with_draft", "lookup_share")
MS_PARTS = ("total", "prefill", "draft", "verify_forward", "verify_rest", "loop_other", "framework_floor")


def csv_text(report: dict[str, Any]) -> str:
    """One row per configuration: its figures, then its ms-per-token split."""
    parts = list(report["configs"][0]["ms_per_token"]) if report["configs"] else []
    rows = [{**c, "config": c["name"], **{f"ms_{p}": c["ms_per_token"][p] for p in parts}} for c in report["configs"]]
    return csv_table(rows, ("config", *CSV_COLUMNS, *(f"ms_{part}" for part in parts)))


def markdown(report: dict[str, Any]) -> str:
    costs, rows = report["forward_costs"], []
    header = ["config", "tok/s", "vs plain", "tokens/verify", "steps drafted", "lookup steps", "ms/token", "prefill"]
    header += ["draft", "verify fwd", "verify rest", "loop other", "framework floor"]
    for s in report["configs"]:
        speed, per_verify, drafted, lookup = (s.get(k) for k in CSV_COLUMNS[1:])
        cells = [s["name"], fmt(s["tokens_per_second"], 1), "-" if speed is None else f"{speed:.2f}x", fmt(per_verify)]
        rows.append([*cells, percent(drafted), percent(lookup), *(fmt(s["ms_per_token"][p], 1) for p in MS_PARTS)])
    blocks = costs["block_relative"]
    return (
        "Forward cost of a block of b tokens, relative to one plain step "
        f"({report['plain_ms']:.1f} ms); overhead twin step: {costs['twin_step_relative']:.2f} of a plain step.\n\n"
        + table(["b", *blocks], [["c(b)/c(1)", *(f"{v:.2f}" for v in blocks.values())]])
        + "\n\n"
        + table(header, rows)
    )
