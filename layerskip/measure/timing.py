"""The one way this project times decoding methods against each other.

Every call is timed from the outside with the device's clock (CUDA synchronised), from the
moment the method is called until its tokens are back: our engine's per-call set-up (drafter,
head rows, cache) is inside the clock exactly as HF ``generate``'s own set-up is inside its.
Methods run back to back on each prompt, in an order that rotates from prompt to prompt, after
every method has been warmed up once.

Speedup is aggregate throughput: a method's total new tokens over its total seconds, divided by
the baseline's on the same prompts in the same run. Greedy lossless methods produce the same
tokens, so this is the baseline's total time over the method's; long prompts weigh what they cost.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from layerskip.stats import DeviceClock, GenerationStats

# (prompt ids, max new tokens) -> (new tokens, our engine's record or None for HF methods)
Runner = Callable[[list[int], int], tuple[list[int], GenerationStats | None]]


@dataclass
class TimedRun:
    tokens: list[int]
    seconds: float  # the device clock around the whole call
    stats: GenerationStats | None = None
    peak_memory_mb: float | None = None


def timed_call(runner: Runner, ids: list[int], max_new_tokens: int, device: torch.device) -> TimedRun:
    clock = DeviceClock(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = clock.now()
    tokens, stats = runner(ids, max_new_tokens)
    seconds = clock.now() - start
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    return TimedRun(tokens, seconds, stats, peak)


def run_interleaved(
    runners: dict[str, Runner],
    prompt_ids: Sequence[list[int]],
    max_new_tokens: int,
    device: torch.device,
    warmup_tokens: int = 16,
    progress: bool = False,
    desc: str = "runs",
) -> list[dict[str, TimedRun]]:
    """Every runner on every prompt, interleaved after a warm-up; one ``{name: run}`` per prompt."""
    return run_rounds(runners, prompt_ids, max_new_tokens, device, 1, warmup_tokens, progress, desc)[0]


def run_rounds(
    runners: dict[str, Runner],
    prompt_ids: Sequence[list[int]],
    max_new_tokens: int,
    device: torch.device,
    rounds: int,
    warmup_tokens: int = 16,
    progress: bool = False,
    desc: str = "runs",
) -> list[list[dict[str, TimedRun]]]:
    """``rounds`` passes of every runner over every prompt in one window, after one warm-up each.

    The order rotates by one from prompt to prompt and again from round to round, so no method
    always runs first, on any prompt, and a drift of the machine's speed falls on every method
    alike; a round's runs of two methods are a pair (same prompts, same minutes). Per round, one
    ``{name: run}`` per prompt.
    """
    names = list(runners)
    for name in tqdm(names, desc="warm-up", disable=not progress, leave=False):
        runners[name](prompt_ids[0], warmup_tokens)
    results: list[list[dict[str, TimedRun]]] = []
    bar = tqdm(total=rounds * len(prompt_ids) * len(names), desc=desc, disable=not progress, leave=False)
    for round_index in range(rounds):
        passes: list[dict[str, TimedRun]] = []
        for index, ids in enumerate(prompt_ids):
            runs: dict[str, TimedRun] = {}
            shift = (round_index + index) % len(names)
            for name in names[shift:] + names[:shift]:
                runs[name] = timed_call(runners[name], ids, max_new_tokens, device)
                bar.update()
            passes.append({name: runs[name] for name in names})
        results.append(passes)
    bar.close()
    return results


def throughput(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0


def aggregate_throughput(runs: Sequence[TimedRun]) -> float:
    """Total new tokens over total seconds."""
    return throughput(sum(len(r.tokens) for r in runs), sum(r.seconds for r in runs))


def speedup(runs: Sequence[TimedRun], baseline: Sequence[TimedRun]) -> float | None:
    """Aggregate throughput of ``runs`` over the baseline's (same prompts, same run)."""
    base = aggregate_throughput(baseline)
    return aggregate_throughput(runs) / base if base else None
