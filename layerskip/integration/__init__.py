"""The transformers integration, above the engine: the ``model.generate(custom_generate=...)``
plug-in, the mapping of ``generate`` arguments onto the engine, scores, and the HF ``generate``
baselines the benchmarks compare against."""

from layerskip.integration.plugin import SelfSpeculativeOutput, custom_generate_path, self_speculative_generate

__all__ = ["SelfSpeculativeOutput", "custom_generate_path", "self_speculative_generate"]
