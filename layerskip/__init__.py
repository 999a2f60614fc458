"""layerskip: lossless self-speculative decoding by bypassing decoder sublayers."""

from layerskip.decoding import DecodeSettings, decode_autoregressive, decode_speculative, generate
from layerskip.errors import LayerskipError
from layerskip.models import load_model
from layerskip.policy import DraftSettings, SkipPolicy
from layerskip.sampling import Sampling
from layerskip.stats import GenerationResult, GenerationStats

__all__ = [
    "DecodeSettings",
    "DraftSettings",
    "GenerationResult",
    "GenerationStats",
    "LayerskipError",
    "Sampling",
    "SkipPolicy",
    "decode_autoregressive",
    "decode_speculative",
    "generate",
    "load_model",
]
