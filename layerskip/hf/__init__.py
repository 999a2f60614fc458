"""Hugging Face glue: model internals (adapters), loading, HF ``generate`` baselines, prompts to ids."""
