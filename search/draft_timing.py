"""One draft-step timing per distinct draft within a study.

What one draft step costs is decided by the sublayers it runs (its skip sets, or its exit and
adapter), the precision of its weights and the rows of its head. The draft length, how drafts
end, lookup and thresholds do not change it. So two trials with the same draft share one timing:
the first trial that needs it times it and stores it on the study (a user attribute), and every
later trial reuses it, in this process, in a resumed run, or in another worker. Noise cannot then
price the same draft twice. The key also holds the timing context, the repeats and the machine
(host, device, dtype, threads), so a worker on another machine times its own.

Two workers may time one new draft at the same moment. The one that stores second adopts the
stored timing if it sees it in time; if it does not, the later write wins for the trials after it.
"""

from __future__ import annotations

import hashlib
import json
import platform
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from layerskip.drafts.policy.skip_policy import SkipPolicy

TIMING_PREFIX = "draft_timing:"  # study user attribute: TIMING_PREFIX + digest of the key


@dataclass(frozen=True)
class SharedTiming:
    seconds: float
    trial: int | None  # the trial that measured it (None: measured outside a study)


def draft_key(
    model: nn.Module, policy: SkipPolicy, head_rows: Sequence[int] | None, context: Sequence[int], repeats: int
) -> dict[str, Any]:
    """Everything that decides what one draft step of ``policy`` costs when timed after ``context``."""
    parameter = next(model.parameters())
    exit = policy.exit
    return {
        "attention": sorted(policy.skip_attention),
        "mlp": sorted(policy.skip_mlp),
        "precision": policy.draft.precision,
        "head_rows": "full" if head_rows is None else len(head_rows),
        "exit": None if exit is None else {"sha256": exit.sha256, "layer": exit.layer, "kind": exit.kind},
        "context": hashlib.sha256(json.dumps(list(map(int, context))).encode()).hexdigest()[:16],
        "repeats": repeats,
        "machine": {
            "host": platform.node(),
            "device": str(parameter.device),
            "dtype": str(parameter.dtype),
            "threads": torch.get_num_threads(),
        },
    }


class DraftTimings:
    """Draft-step timings by ``draft_key``: this process's, backed by the study of the trial asked with."""

    def __init__(self) -> None:
        self.known: dict[str, SharedTiming] = {}

    def seconds(self, key: dict[str, Any], measure: Callable[[], float], trial: Any = None) -> SharedTiming:
        """The timing of the draft ``key`` names: known here, stored on ``trial``'s study, or measured
        now (by ``measure``) and stored for the trials after this one."""
        name = TIMING_PREFIX + hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
        if name not in self.known:
            study = getattr(trial, "study", None)
            timing = _stored(study, name)
            if timing is None:
                measured = SharedTiming(measure(), getattr(trial, "number", None))
                timing = _stored(study, name) or measured  # another worker stored one meanwhile: keep theirs
                if timing is measured and study is not None:
                    study.set_user_attr(name, {"seconds": measured.seconds, "trial": measured.trial, "key": key})
            self.known[name] = timing
        return self.known[name]


def _stored(study: Any, name: str) -> SharedTiming | None:
    if study is None:
        return None
    value = study.user_attrs.get(name)
    if not isinstance(value, dict) or not isinstance(value.get("seconds"), (int, float)) or value["seconds"] <= 0:
        return None  # absent, or not a timing this module wrote: measured again
    trial = value.get("trial")
    return SharedTiming(float(value["seconds"]), trial if isinstance(trial, int) else None)


def shared_timing_counts(trials: Sequence[Any]) -> tuple[int, int]:
    """(drafts timed, trials that reused a timing) among trials that record ``draft_timed_by_trial``."""
    timed_by = [(trial.user_attrs.get("draft_timed_by_trial"), trial.number) for trial in trials]
    timed = sum(by == number for by, number in timed_by)
    return timed, sum(by is not None for by, _ in timed_by) - timed
