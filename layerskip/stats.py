"""Counters, device-synchronised timing and the result dataclasses of one generation."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch


class DeviceClock:
    """Wall-clock seconds that include all queued device work (synchronises CUDA first)."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


@dataclass
class GenerationStats:
    new_tokens: int = 0
    steps: int = 0  # full-model forward passes that produced tokens (prefill + verifies)
    drafted: int = 0
    accepted: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    prefill_seconds: float = 0.0
    total_seconds: float = 0.0
    accept_histogram: dict[int, int] = field(default_factory=dict)  # accepted drafts -> steps
    block_histogram: dict[int, int] = field(default_factory=dict)  # verify forward length -> steps (no prefill)
    lookup_steps: int = 0  # steps whose draft came from prompt lookup
    # On-the-fly selection: how often the bypassed set changed, and steps drafted with each set
    # (label "a<layers>|m<layers>", e.g. "a3,7|m" bypasses the attention of layers 3 and 7).
    skip_changes: int = 0
    skip_sets: dict[str, int] = field(default_factory=dict)
    # CPU thread counts used ("draft:1", "verify:2" -> runs of that phase): see engine.threads.
    thread_runs: dict[str, int] = field(default_factory=dict)
    # How the phases ran, counted per generation: "draft step: lean" (or "hf (why)"), "draft
    # compiled: no", "verify head: certified bf16" (or "fp32"); and the verify rows whose argmax the
    # fp32 head had to give (a row too flat for the certified bf16 head).
    paths: dict[str, int] = field(default_factory=dict)
    head_fallback_rows: int = 0
    # Token trees: steps verified as a tree, and those whose accepted path left the tree's first
    # branch (what a chain of that branch would have lost).
    tree_steps: int = 0
    off_branch_steps: int = 0
    # Tokens drafted per step (0: a step that drafted nothing; the prefill is not a step).
    draft_histogram: dict[int, int] = field(default_factory=dict)
    # Skip-drafted steps by the draft head's size (its ranked rows; 0 = the full head).
    head_rows: dict[int, int] = field(default_factory=dict)
    # auto: how its costs were measured (seconds, whether from the cache, the machine). One
    # decoder's calibration: combining generations keeps the first one's.
    calibration: dict[str, Any] = field(default_factory=dict)
    # A batch decoded together: its steps of each kind (plain, lookup, draft), one record for the
    # whole batch (every row carries it; combining keeps the first).
    batch_steps: dict[str, int] = field(default_factory=dict)

    @property
    def mean_accepted(self) -> float:
        """Mean tokens produced per full-model forward (tau); 1.0 for plain decoding."""
        return self.new_tokens / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.total_seconds if self.total_seconds > 0 else 0.0

    def record_step(self, drafted: int, accepted: int, block: int | None = None) -> None:
        """A step: the prefill (``block`` None), or a verify forward over ``block`` positions."""
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        self.accept_histogram[accepted] = self.accept_histogram.get(accepted, 0) + 1
        if block is not None:
            self.draft_histogram[drafted] = self.draft_histogram.get(drafted, 0) + 1
            self.block_histogram[block] = self.block_histogram.get(block, 0) + 1

    @classmethod
    def combined(cls, items: Sequence[GenerationStats]) -> GenerationStats:
        """The sum of several generations' records (counts, seconds and histograms added up)."""
        total = cls()
        for item in items:
            for f in fields(cls):
                mine, theirs = getattr(total, f.name), getattr(item, f.name)
                if f.name in ("calibration", "batch_steps"):
                    setattr(total, f.name, mine or dict(theirs))
                elif isinstance(mine, dict):
                    for key, value in theirs.items():
                        mine[key] = mine.get(key, 0) + value
                else:
                    setattr(total, f.name, mine + theirs)
        return total

    def to_dict(self) -> dict[str, Any]:
        rates = ("mean_accepted", "acceptance_rate", "tokens_per_second")
        return asdict(self) | {name: getattr(self, name) for name in rates}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GenerationStats:
        """Back from ``to_dict`` (or its JSON, whose histogram keys are strings)."""
        known = {f.name: f for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        for name in ("accept_histogram", "block_histogram", "draft_histogram", "head_rows"):
            values[name] = {int(k): v for k, v in values.get(name, {}).items()}
        return cls(**values)


@dataclass
class GenerationResult:
    tokens: list[int]  # the new tokens only
    text: str
    prompt_tokens: int
    stats: GenerationStats
