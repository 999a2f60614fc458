"""layerskip: lossless self-speculative decoding for Hugging Face models, the model drafting for itself
(an int4 copy of its weights, prompt lookup, bypassed layers or sublayers), each choice priced on the machine.

The public names, re-exported from the packages that hold them (see docs/contributing.md). Every
other name imports from its own module (``from layerskip.drafts.builder import prepare_draft``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers and editors see; at run time __getattr__ imports on first use
    from layerskip.drafts.policy.skip_policy import DraftSettings, SkipPolicy
    from layerskip.engine.decoding import Decoder, DecodeSettings, generate
    from layerskip.errors import LayerskipError
    from layerskip.hf.models import load_model
    from layerskip.integration.plugin import SelfSpeculativeOutput, custom_generate_path, self_speculative_generate
    from layerskip.sampling import Sampling
    from layerskip.stats import GenerationResult, GenerationStats

# Each public name and the module that holds it. They import on first use (PEP 562): ``import
# layerskip`` alone, or a tool that needs only some of the package, does not pay for torch and
# transformers before it asks for them.
_HOMES = {
    "DecodeSettings": "layerskip.engine.decoding",
    "Decoder": "layerskip.engine.decoding",
    "DraftSettings": "layerskip.drafts.policy.skip_policy",
    "GenerationResult": "layerskip.stats",
    "GenerationStats": "layerskip.stats",
    "LayerskipError": "layerskip.errors",
    "Sampling": "layerskip.sampling",
    "SelfSpeculativeOutput": "layerskip.integration.plugin",
    "SkipPolicy": "layerskip.drafts.policy.skip_policy",
    "custom_generate_path": "layerskip.integration.plugin",
    "generate": "layerskip.engine.decoding",
    "load_model": "layerskip.hf.models",
    "self_speculative_generate": "layerskip.integration.plugin",
}

__all__ = [
    "DecodeSettings",
    "Decoder",
    "DraftSettings",
    "GenerationResult",
    "GenerationStats",
    "LayerskipError",
    "Sampling",
    "SelfSpeculativeOutput",
    "SkipPolicy",
    "custom_generate_path",
    "generate",
    "load_model",
    "self_speculative_generate",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:  # AttributeError lets `from layerskip import fileio` fall through to the submodule
        raise AttributeError(f"module 'layerskip' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later look-ups find it without this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
