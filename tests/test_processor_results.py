"""The processors page quotes its committed runs: each table row is rebuilt here from the
``batches.json`` files of one sitting, so a rerun without a new table (or the reverse) fails."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results" / "processors"
MODELS = ("smollm2-135m", "gemma3-270m")
SETTINGS = ("none", "min_new_tokens", "repetition_penalty", "no_repeat_ngram", "suppress_tokens")
# The control sitting: a penalty that leaves the text nearly as it is, beside its own "none".
CONTROL = RESULTS / "control"
CONTROL_SETTINGS = ("none", "repetition_penalty_1.001")


def _runs(model: str, setting: str, root: Path = RESULTS) -> dict[tuple[int, str], dict]:
    data = json.loads((root / f"{model}-{setting}" / "batches.json").read_text())
    return {(run["size"], run["method"]): run for run in data["runs"]}


def _rate(runs: dict, size: int, method: str) -> float:
    return runs[(size, method)]["tokens_per_second"]


def _of_none(value: float, bare: float, setting: str) -> str:
    return "" if setting == "none" else f"{value / bare:.2f} of none"


def _cell(rate: float, share: str) -> str:
    return f"{rate:.1f} ({share})" if share else f"{rate:.1f}"


OURS = ("self-spec-batched", "plain-batched", "self-spec-one-at-a-time")


def table_row(model: str, setting: str, root: Path = RESULTS) -> str:
    """One row of the page's table, at batch 1 and 8: HF batched → ours (speedup; its share of the
    same model's "none" speedup), our plain step's rate (its share of "none"); then ours on the 8
    prompts one at a time (share of "none"); rows identical to HF's, over all of ours."""
    runs, bare = _runs(model, setting, root), _runs(model, "none", root)
    cells = [model, setting]
    for size in (1, 8):
        hf, ours = _rate(runs, size, "hf-batched"), _rate(runs, size, "self-spec-batched")
        speedup = ours / hf
        share = _of_none(speedup, _rate(bare, size, "self-spec-batched") / _rate(bare, size, "hf-batched"), setting)
        cells.append(f"{hf:.1f} → {ours:.1f} ({speedup:.2f}x{', ' + share if share else ''})")
        plain = _rate(runs, size, "plain-batched")
        cells.append(_cell(plain, _of_none(plain, _rate(bare, size, "plain-batched"), setting)))
    alone = _rate(runs, 8, OURS[2])
    cells.append(_cell(alone, _of_none(alone, _rate(bare, 8, OURS[2]), setting)))
    ours_runs = [run for (_, method), run in runs.items() if method in OURS]
    identical = sum(run["identical_rows"] for run in ours_runs)
    cells.append(f"{identical}/{sum(len(run['prompt_ids']) for run in ours_runs)}")
    return "| " + " | ".join(cells) + " |"


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("model", MODELS)
def test_the_page_quotes_each_committed_run(model: str, setting: str) -> None:
    page = (RESULTS / "README.md").read_text()
    assert table_row(model, setting) in page, f"README.md lacks {table_row(model, setting)!r}"


@pytest.mark.parametrize("setting", CONTROL_SETTINGS)
@pytest.mark.parametrize("model", MODELS)
def test_the_page_quotes_each_control_run(model: str, setting: str) -> None:
    page = (RESULTS / "README.md").read_text()
    row = table_row(model, setting, CONTROL)
    assert row in page, f"README.md lacks {row!r}"


@pytest.mark.parametrize(("root", "settings"), [(RESULTS, SETTINGS), (CONTROL, CONTROL_SETTINGS)])
def test_one_sitting_one_commit(root: Path, settings: tuple[str, ...]) -> None:
    commits = {
        json.loads((root / f"{m}-{s}" / "batches.json").read_text())["environment"]["commit"]
        for m in MODELS
        for s in settings
    }
    assert len(commits) == 1, commits
    assert next(iter(commits)) in (RESULTS / "README.md").read_text()
