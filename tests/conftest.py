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
    from layerskip.models import load_model

    return load_model(SMOLLM2)


@pytest.fixture(autouse=True)
def _one_thread_for_tiny_models(request: pytest.FixtureRequest):
    """Tiny-model tests run single-threaded: for 64-wide matmuls, threads only add sync overhead,
    and on a busy 2-core machine an oversubscribed pool makes them ~40x slower. Slow tests
    (the real model) keep torch's default."""
    import torch

    if request.node.get_closest_marker("slow") is not None:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
