"""layerskip: lossless self-speculative decoding by bypassing decoder sublayers."""

from layerskip.engine.decoding import (
    Decoder,
    DecodeSettings,
    decode,
    decode_autoregressive,
    decode_speculative,
    generate,
)
from layerskip.engine.exit_adapter import ExitAdapter, ExitSpec
from layerskip.engine.policy import DraftSettings, ExitSettings, SkipPolicy
from layerskip.engine.sampling import Sampling
from layerskip.engine.stats import GenerationResult, GenerationStats
from layerskip.errors import LayerskipError
from layerskip.hf.models import load_model

__all__ = [
    "DecodeSettings",
    "Decoder",
    "DraftSettings",
    "ExitAdapter",
    "ExitSettings",
    "ExitSpec",
    "GenerationResult",
    "GenerationStats",
    "LayerskipError",
    "Sampling",
    "SkipPolicy",
    "decode",
    "decode_autoregressive",
    "decode_speculative",
    "generate",
    "load_model",
]
