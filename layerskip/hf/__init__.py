"""Hugging Face glue: model internals (adapters), loading, HF ``generate`` baselines, prompts to ids,
and the ``custom_generate`` plug-in that runs our engine from ``model.generate()``."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def custom_generate_path() -> str:
    """The directory to pass as ``model.generate(custom_generate=..., trust_remote_code=True)``.

    It ships inside the package (``custom_generate/generate.py`` as transformers expects), so
    nothing has to be copied by hand.
    """
    return str(Path(__file__).parent / "custom_generate")


def __getattr__(name: str) -> Any:
    # Imported on first use: the plug-in pulls in the engine, which itself imports this package.
    if name in ("self_speculative_generate", "SelfSpeculativeOutput"):
        from layerskip.hf import plugin

        return getattr(plugin, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
