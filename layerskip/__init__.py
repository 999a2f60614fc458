"""layerskip: lossless self-speculative decoding for Hugging Face models, the model drafting for itself
(an int4 copy of its weights, prompt lookup, bypassed layers or sublayers), each choice priced on the machine.

The public names, re-exported from the packages that hold them (see docs/contributing.md).
"""

from layerskip.drafts.builder import (
    DraftModels,
    DraftRun,
    PreparedDraft,
    build_drafter,
    check_policy_fits,
    prepare_draft,
)
from layerskip.drafts.exit_adapter import ExitAdapter, ExitSpec
from layerskip.drafts.policy import AutoSettings, DraftSettings, ExitSettings, OnTheFlySettings, SkipPolicy
from layerskip.engine.decoding import (
    Decoder,
    DecodeSettings,
    decode,
    decode_autoregressive,
    decode_speculative,
    generate,
)
from layerskip.errors import LayerskipError
from layerskip.hf.models import load_model
from layerskip.integration.plugin import SelfSpeculativeOutput, custom_generate_path, self_speculative_generate
from layerskip.sampling import Sampling
from layerskip.stats import GenerationResult, GenerationStats

__all__ = [
    "AutoSettings",
    "DecodeSettings",
    "Decoder",
    "DraftModels",
    "DraftRun",
    "DraftSettings",
    "ExitAdapter",
    "ExitSettings",
    "ExitSpec",
    "GenerationResult",
    "GenerationStats",
    "LayerskipError",
    "OnTheFlySettings",
    "PreparedDraft",
    "Sampling",
    "SelfSpeculativeOutput",
    "SkipPolicy",
    "build_drafter",
    "check_policy_fits",
    "custom_generate_path",
    "decode",
    "decode_autoregressive",
    "decode_speculative",
    "generate",
    "load_model",
    "prepare_draft",
    "self_speculative_generate",
]
