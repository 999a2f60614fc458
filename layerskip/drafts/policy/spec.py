"""The policy argument shared by ``--policy`` and the plug-in's ``skip_policy=``.

A value is a policy file; ``auto`` (every drafting choice made while generating, priced by a
calibration of this machine: no study, no file); ``auto-trees`` (the same, drafting token
trees); ``on-the-fly`` (skip sets chosen while generating, from nothing bypassed, with the
default draft for the device); or ``on-the-fly:PATH`` (chosen while generating, starting from
that file's skip sets and drafting with its settings).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from layerskip.drafts.policy.skip_policy import OnTheFlySettings, SkipPolicy
from layerskip.errors import LayerskipError

ON_THE_FLY = "on-the-fly"
AUTO = "auto"
AUTO_TREES = "auto-trees"  # auto drafting token trees
PLAIN = "plain"  # the command line's name for no draft at all (plain decoding)


def load_policy(spec: str, device: str | torch.device = "cpu", flag: str = "--policy") -> tuple[str, SkipPolicy]:
    """``(label, policy)`` for a ``--policy`` value (one of those the module's docstring lists; on-the-fly's
    default draft is ``device``'s); ``flag`` names the argument in a refusal's fix (the plug-in's ``skip_policy=``)."""
    if spec == AUTO:
        return AUTO, SkipPolicy.auto_choice(device)
    if spec == AUTO_TREES:
        return AUTO_TREES, SkipPolicy.auto_trees(device)
    if spec == ON_THE_FLY:
        return ON_THE_FLY, SkipPolicy.adaptive_selection(device=device)
    if spec.startswith(ON_THE_FLY + ":"):
        path = spec[len(ON_THE_FLY) + 1 :]
        start = SkipPolicy.load(path, flag)
        if not start.draft.use_skip_draft:
            raise LayerskipError(f"{path} drafts by lookup only; on-the-fly selection needs a policy with a skip draft")
        selection = start.on_the_fly or OnTheFlySettings()
        return f"{ON_THE_FLY}-{Path(path).stem}", replace(start, on_the_fly=selection)
    return Path(spec).stem, SkipPolicy.load(spec, flag)


def load_policies(specs: list[str], device: str | torch.device = "cpu") -> dict[str, SkipPolicy]:
    """Policies by label (a file's stem; a repeated label gets ``-2``, ``-3``: nothing is dropped)."""
    policies: dict[str, SkipPolicy] = {}
    for spec in specs:
        stem, policy = load_policy(spec, device)
        label = stem
        number = 2
        while label in policies:
            label = f"{stem}-{number}"
            number += 1
        policies[label] = policy
    return policies
