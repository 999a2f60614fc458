"""Shared fixtures: offline mode, tiny random models, and the real embedded SmolLM2 (loaded once)."""

from __future__ import annotations

import os
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # before anything imports huggingface_hub: nothing is ever downloaded
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

SMOLLM2 = "smollm2-135m"
SEARCH_CACHE_ENV = "LAYERSKIP_SEARCH_CACHE"  # layerskip.search.calibration_cache.CACHE_ENV, torch not imported
AUTO_CACHE_ENV = "LAYERSKIP_CALIBRATION_CACHE"  # layerskip.engine.calibration.CACHE_ENV


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """A tiny Llama checkpoint for the search CLI: 4 layers, hidden 32, 2 heads, 300-token byte-level BPE."""
    from search_fixtures import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def other_llama(tmp_path_factory) -> Path:
    """Another tiny Llama with different shapes (3 layers, hidden 48): another weights fingerprint."""
    from search_fixtures import save_tiny_llama

    return save_tiny_llama(
        tmp_path_factory.mktemp("models") / "other-llama", num_hidden_layers=3, hidden_size=48, intermediate_size=96
    )


@pytest.fixture(scope="session")
def smollm2():
    """The embedded SmolLM2-135M-Instruct (30 Llama layers) as a ``LoadedModel``; tests using it are slow."""
    from layerskip.hf.models import load_model

    return load_model(SMOLLM2)


@pytest.fixture(scope="session", autouse=True)
def _search_cache(tmp_path_factory):
    """Searches and ``auto`` run by tests cache their references and latency in directories of this
    session, never in the user's cache (subprocesses inherit the variables)."""
    previous = {name: os.environ.get(name) for name in (SEARCH_CACHE_ENV, AUTO_CACHE_ENV)}
    os.environ[SEARCH_CACHE_ENV] = str(tmp_path_factory.mktemp("search-cache"))
    os.environ[AUTO_CACHE_ENV] = str(tmp_path_factory.mktemp("calibration-cache"))
    yield
    for name, value in previous.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


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


# Files that take longest run first: under pytest-xdist (make test) they then overlap the rest of
# the suite on the other worker, instead of starting late and running alone at the end.
LONGEST_FIRST = ("tests/test_notebooks.py", "tests/test_search_cli.py", "tests/test_real_model.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        path = item.nodeid.split("::")[0]
        return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: every file keeps its own order
