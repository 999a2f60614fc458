"""The notebooks run headless with their small settings (as scripts/run_notebooks.py --small --no-save runs them).

Each notebook runs in a fresh kernel of this interpreter (two at a time, one torch thread each), into a temporary copy
(the committed notebooks are not rewritten); a cell that raises fails its test. In small mode the
notebooks read no local results: 01 decodes with the embedded SmolLM2 and its shipped policies, 02 runs its
demonstration search and agreement on a tiny random model this test passes (LAYERSKIP_NOTEBOOK_MODEL).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ["01_quickstart.ipynb", "02_search_analysis.ipynb", "03_benchmarks.ipynb"]
CELL_TIMEOUT = 300
MAX_BYTES = 2 * 2**20
MODEL_ENV = "LAYERSKIP_NOTEBOOK_MODEL"  # read by notebook 02 in small mode

pytestmark = pytest.mark.slow  # loads the real embedded models


def _runner():
    spec = importlib.util.spec_from_file_location("run_notebooks", ROOT / "scripts" / "run_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.fixture(scope="module")
def runner():
    module = _runner()
    module.ensure_kernel()
    return module


@pytest.fixture(scope="module")
def executed(runner, tmp_path_factory, monkeypatch_module) -> dict:
    """Every notebook run once, two kernels at a time (one torch thread each): name -> Outcome.
    Notebook 02's demonstration search and agreement run on a tiny random 30-layer Llama (its
    figures say nothing about a model in small mode anyway); 01 loads the embedded SmolLM2, whose
    shipped policies it runs."""
    from search_fixtures import save_tiny_llama

    tiny = save_tiny_llama(tmp_path_factory.mktemp("notebook-model") / "tiny-llama", num_hidden_layers=30)
    monkeypatch_module.setenv(MODEL_ENV, str(tiny))
    sources = [ROOT / "notebooks" / name for name in NOTEBOOKS]
    before = {path: path.read_bytes() for path in sources}
    outcomes = runner.execute_all(
        sources, out_dir=tmp_path_factory.mktemp("notebooks"), jobs=2, timeout=CELL_TIMEOUT, small=True, threads=1
    )
    assert all(path.read_bytes() == content for path, content in before.items()), "a committed notebook was rewritten"
    return {outcome.notebook.name: outcome for outcome in outcomes}


def test_every_notebook_is_listed(runner):
    assert [p.name for p in runner.default_notebooks()] == NOTEBOOKS


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(executed, name):
    outcome = executed[name]
    assert outcome.error is None, f"{name} failed after {outcome.seconds:.0f} s:\n{outcome.error}"
    assert outcome.size_bytes < MAX_BYTES
    cells = json.loads(outcome.saved.read_text())["cells"]
    outputs = [o for cell in cells for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert [o for o in outputs if "image/png" in o.get("data", {})], f"{name} drew no figure"
