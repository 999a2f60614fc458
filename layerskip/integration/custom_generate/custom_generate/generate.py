"""The file transformers loads for ``model.generate(custom_generate=layerskip.custom_generate_path(),
trust_remote_code=True, skip_policy=...)``: it only re-exports the installed package's entry point,
so nothing here can drift from the engine."""

from layerskip.integration.plugin import generate

__all__ = ["generate"]
