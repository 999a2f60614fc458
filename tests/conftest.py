"""Shared fixtures: offline mode, tiny random models, and the real embedded SmolLM2 (loaded once)."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before anything imports huggingface_hub: nothing is ever downloaded
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

SMOLLM2 = "smollm2-135m"


@pytest.fixture(scope="session")
def smollm2():
    """The embedded SmolLM2-135M-Instruct (30 Llama layers) as a ``LoadedModel``; tests using it are slow."""
    from layerskip.hf.models import load_model

    return load_model(SMOLLM2)


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Run every test single-threaded. On a 2-core machine shared with other work, torch's
    default pool (one thread per core) spin-waits for descheduled threads: tiny-model decodes
    get ~40x slower and SmolLM2's ~7x; one thread costs little even when the machine is idle."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
