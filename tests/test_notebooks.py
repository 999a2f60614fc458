"""The notebooks run headless with their small settings (as scripts/run_notebooks.py --small --no-save runs them).

Each notebook runs in a fresh kernel of this interpreter, one torch thread, into a temporary copy
(the committed notebooks are not rewritten); a cell that raises fails the test. In small mode the
notebooks read no local results: they run a tiny search and a tiny benchmark on the embedded SmolLM2.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ["01_quickstart.ipynb", "02_search_analysis.ipynb", "03_benchmarks.ipynb"]
CELL_TIMEOUT = 300
MAX_BYTES = 2 * 2**20

pytestmark = pytest.mark.slow  # loads the real embedded models


def _runner():
    spec = importlib.util.spec_from_file_location("run_notebooks", ROOT / "scripts" / "run_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def runner():
    module = _runner()
    module.ensure_kernel()
    return module


def test_every_notebook_is_listed(runner):
    assert [p.name for p in runner.default_notebooks()] == NOTEBOOKS


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(runner, name, tmp_path):
    source = ROOT / "notebooks" / name
    before = source.read_bytes()
    outcome = runner.execute(source, out=tmp_path / name, timeout=CELL_TIMEOUT, small=True, threads=1)
    assert outcome.error is None, f"{name} failed after {outcome.seconds:.0f} s:\n{outcome.error}"
    assert source.read_bytes() == before, "the committed notebook was rewritten"
    assert outcome.size_bytes < MAX_BYTES
    cells = json.loads(outcome.saved.read_text())["cells"]
    errors = [o for c in cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    images = [o for c in cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert not errors
    assert images, f"{name} drew no figure"
