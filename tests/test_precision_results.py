"""The precision page quotes its committed runs: each row of its table is rebuilt here from the
calibration's prices (the model's ``auto`` run) and the decoding of the same model with the draft
copy fixed to int4 and to int8 (one sitting), so a rerun without a new table (or the reverse) fails."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
PAGE = RESULTS / "precision" / "README.md"
# (the check run in docs/results/precision, the auto run of the same sitting whose calibration
# priced both copies, kept beside it)
CHECKS = {
    "smollm2-135m": "precision/smollm2-135m-auto.json",
    "gemma3-270m-offgrid": "precision/gemma3-270m-offgrid-auto.json",
}


def _overall(data: dict, method: str) -> dict:
    return data["methods"][method]["overall"]


def table_row(check: str) -> str:
    """The calibration's price of each copy and which it chose; each copy's decoding (tokens per
    second and speedup over HF ``generate``) and which was faster; outputs identical to HF's."""
    priced = json.loads((RESULTS / CHECKS[check]).read_text())
    prices = _overall(priced, "self-spec")["auto"]["calibration"]["precisions"]
    decoded = json.loads((RESULTS / "precision" / f"{check}.json").read_text())
    runs = {copy: _overall(decoded, f"self-spec:auto-{copy}") for copy in ("int4", "int8")}
    faster = max(runs, key=lambda copy: runs[copy]["tokens_per_second"])
    ratio = runs["int8"]["tokens_per_second"] / runs["int4"]["tokens_per_second"]
    cells = [check, f"{prices['int4']['agreement']:.2f} / {prices['int8']['agreement']:.2f}"]
    cells.append(f"{prices['int4']['tokens_per_second']:.1f} / {prices['int8']['tokens_per_second']:.1f}")
    cells.append(prices["chosen"])
    cells += [f"{runs[c]['tokens_per_second']:.1f} ({runs[c]['speedup']:.2f}x)" for c in ("int4", "int8")]
    cells += [f"{ratio:.2f}", faster]
    identical = sum(runs[c]["n_identical"] for c in runs)
    cells.append(f"{identical}/{len(runs) * decoded['prompts']['n']}")
    return "| " + " | ".join(cells) + " |"


@pytest.mark.parametrize("check", CHECKS)
def test_the_page_quotes_each_committed_check(check: str) -> None:
    assert table_row(check) in PAGE.read_text()
