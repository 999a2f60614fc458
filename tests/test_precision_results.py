"""The precision page quotes its committed runs: each row of its table is rebuilt here from the
calibration's prices (the model's ``auto`` run) and the decoding of the same model with the draft
copy fixed to int4 and to int8 (one sitting), so a rerun without a new table (or the reverse) fails."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
PAGE = RESULTS / "precision" / "README.md"
# The check run in docs/results/precision (decoding with the copy fixed to int4 and to int8), and
# the run of the same sitting whose calibration priced both copies with its method: the model's own
# auto run kept beside it, or the check run itself where it ran auto too.
CHECKS = {
    "smollm2-135m": ("smollm2-135m.json", "smollm2-135m-auto.json", "self-spec"),
    "gemma3-270m-offgrid": ("gemma3-270m-offgrid.json", "gemma3-270m-offgrid-auto.json", "self-spec"),
    # after the int4 fit weighs each input by what the model feeds it
    "smollm2-135m-offgrid (weighed int4)": ("smollm2-135m-offgrid-weighed.json",) * 2 + ("self-spec:auto",),
    "gemma3-270m-offgrid (weighed int4)": ("gemma3-270m-offgrid-weighed.json",) * 2 + ("self-spec:auto",),
}


def _overall(data: dict, method: str) -> dict:
    return data["methods"][method]["overall"]


def table_row(check: str) -> str:
    """The calibration's price of each copy and which it chose; each copy's decoding (tokens per
    second and speedup over HF ``generate``) and which was faster; outputs identical to HF's."""
    decoded_file, priced_file, priced_method = CHECKS[check]
    priced = json.loads((RESULTS / "precision" / priced_file).read_text())
    prices = _overall(priced, priced_method)["auto"]["calibration"]["precisions"]
    decoded = json.loads((RESULTS / "precision" / decoded_file).read_text())
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
