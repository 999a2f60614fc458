"""The prepared ``Decoder`` for a model and a ``skip_policy`` argument, reused across ``generate`` calls.

Preparing a decoder checks the policy against the model and builds the draft (a low-precision
copy of the projections it keeps, its truncated head): seconds on a real model. ``generate``
is called once per prompt, so the plug-in keeps each prepared decoder on the model object itself
(``_layerskip_decoders``) instead of in a module-level registry: the cache lives and dies with the
model, two models never share one, and nothing global outlives them. An on-the-fly decoder
also keeps what its selection learned from call to call, as a server would.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from torch import nn

from layerskip.drafts.policy.skip_policy import SkipPolicy
from layerskip.drafts.policy.spec import PLAIN, load_policy
from layerskip.engine.decoding import Decoder
from layerskip.errors import LayerskipError

CACHE_ATTRIBUTE = "_layerskip_decoders"
# Each decoder may hold a low-precision copy of the model's projections: a caller that passes a
# new SkipPolicy object every call (a sweep) must not grow memory without bound.
MAX_DECODERS = 4
PolicySpec = SkipPolicy | str | os.PathLike[str]


def _spec_key(spec: PolicySpec) -> tuple[Any, ...]:
    """What identifies a policy argument: a policy's content, or a file's path and version."""
    if isinstance(spec, SkipPolicy):
        return ("policy", json.dumps(spec.to_dict(), sort_keys=True, default=str), spec.root)
    text = os.fspath(spec)
    path = Path(text.split(":", 1)[1] if text.startswith("on-the-fly:") else text)
    # A file is keyed by its modification time and size too, so an edited policy is re-read.
    version = (path.stat().st_mtime_ns, path.stat().st_size) if path.is_file() else None
    return ("spec", text, str(path.resolve()) if version else "", version)


def decoder_for(model: nn.Module, spec: PolicySpec | None) -> Decoder:
    """The prepared decoder of ``model`` for ``spec``; built on first use, then reused."""
    if not isinstance(spec, (SkipPolicy, str, os.PathLike)):
        raise LayerskipError(
            "layerskip's custom_generate needs skip_policy=: 'auto', 'plain', a policy file, a SkipPolicy "
            f"or 'on-the-fly' (got {type(spec).__name__})"
        )
    first = next(model.parameters())
    # Moving or casting the model invalidates a draft copied from its weights.
    key = (_spec_key(spec), str(first.device), str(first.dtype))
    # In the instance's __dict__, bypassing nn.Module.__setattr__: a plain dict
    decoders: dict[tuple[Any, ...], Decoder] = model.__dict__.setdefault(CACHE_ATTRIBUTE, {})
    decoder = decoders.pop(key, None)
    if decoder is None:
        policy = spec if isinstance(spec, SkipPolicy) else None
        if policy is None and spec != PLAIN:  # plain: no draft, plain decoding on the engine
            # The policy-argument syntax is the command line's (--policy), so both accept the same values.
            policy = load_policy(os.fspath(spec), first.device, "skip_policy=")[1]
        decoder = Decoder.for_policy(model, policy)
        while len(decoders) >= MAX_DECODERS:
            decoders.pop(next(iter(decoders)))  # the least recently used
    decoders[key] = decoder  # re-inserted: dict order is recency
    return decoder
