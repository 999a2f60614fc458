"""The search's start-up cache (references, sublayer order, latency) and its busy-machine warning.

Each test runs ``layerskip-search`` in this process on the tiny random Llama with its own cache
directory (the search's and ``auto``'s calibration cache in one); ``build_references`` and
``measure_latency`` are wrapped to count how often they run.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from search_fixtures import load_study, ok, search_in_process
from tiny_models import tiny_model

import layerskip.engine.calibration as engine_calibration
import layerskip.engine.latency as engine_latency
import layerskip.search.calibration_cache as calibration_cache
import layerskip.search.objective as objective
from layerskip.drafts.builder import DraftModels
from layerskip.drafts.policy.skip_policy import SkipPolicy


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, int]:
    """A private cache directory, a quiet machine, and counts of references built and latency measured."""
    monkeypatch.setenv(calibration_cache.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv(engine_calibration.CACHE_ENV, str(tmp_path / "cache"))  # where the latency lives
    monkeypatch.setattr(engine_latency, "BUSY_SPREAD", float("inf"))  # a busy test machine still caches
    counts = {"references": 0, "latency": 0}

    def counting(name: str, function):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return function(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(objective, "build_references", counting("references", objective.build_references))
    measure = counting("latency", engine_calibration.measure_latency)
    monkeypatch.setattr(engine_calibration, "measure_latency", measure)
    return counts


@pytest.fixture
def search(capsys, tiny_llama: Path, tmp_path: Path):
    """``search(*extra, name=...)``: a 2-trial search with a fresh study each call."""
    runs = iter(range(1000))

    def run(*extra: str) -> object:
        number = next(runs)
        args = ["--n-trials", "2", "--confirm-top", "0", "--storage", f"sqlite:///{tmp_path / f's{number}.db'}"]
        args += ["--study-name", "t", "--out", str(tmp_path / f"p{number}.json"), *extra]
        return ok(search_in_process(capsys, tiny_llama, *args))

    return run


def cache_files(tmp_path: Path, kind: str) -> list[Path]:
    return sorted((tmp_path / "cache").glob(f"{kind}-*.json"))


def test_a_repeated_search_reuses_references_order_and_latency(search, counted, tmp_path: Path) -> None:
    first = search()
    assert counted == {"references": 1, "latency": 1}
    assert "using cached" not in first.stderr
    references, latency = cache_files(tmp_path, "references"), cache_files(tmp_path, "latency")
    assert len(references) == 1 and len(latency) == 1
    assert json.loads(references[0].read_text())["sublayer_order"]  # the ranked space's order, cached too

    second = search()
    assert counted == {"references": 1, "latency": 1}  # nothing rebuilt or re-measured
    assert f"using cached references from {references[0]}" in second.stderr
    assert "using cached calibration" in second.stderr and str(latency[0]) in second.stderr
    assert first.stdout.splitlines()[1:3] == second.stdout.splitlines()[1:3]  # same results table header

    # A resumed study (same storage) starts at once as well.
    db = tmp_path / "resume.db"
    resume = ["--storage", f"sqlite:///{db}", "--study-name", "r"]
    search(*resume)
    search(*resume)
    assert counted == {"references": 1, "latency": 1}
    assert len(cache_files(tmp_path, "references")) == 1


def test_progress_lines_name_each_phase(capsys, counted, tiny_llama: Path, tmp_path: Path) -> None:
    from search_fixtures import FAST_ARGS

    args = [a for a in FAST_ARGS if a != "--no-progress"]
    args += ["--n-trials", "2", "--storage", f"sqlite:///{tmp_path / 's.db'}", "--out", str(tmp_path / "p.json")]
    result = ok(search_in_process(capsys, tiny_llama, *args, fast=False))
    lines = result.stderr.splitlines()
    for name in ("references", "latency calibration", "sublayer order", "trials", "confirm"):
        assert any(line.startswith(f"search: {name}: ") and line.endswith(" s)") for line in lines), name
    quiet = search_in_process(
        capsys,
        tiny_llama,
        "--n-trials",
        "2",
        "--storage",
        f"sqlite:///{tmp_path / 'q.db'}",
        "--out",
        str(tmp_path / "q.json"),
    )
    assert "search: " not in ok(quiet).stderr  # --no-progress (in the fast arguments): no phase lines


@pytest.mark.parametrize(
    ("change", "rebuilds_references", "longer_curve"),
    [
        (["--reference-tokens", "6"], True, False),
        (["--n-prompts", "3"], True, False),
        (["--draft-tokens", "2,3,8"], False, False),
        (["--draft-tokens", "2,3,12"], False, True),  # verifies of 10 to 13 tokens: not on the cached curve
    ],
)
def test_other_inputs_miss_the_cache(search, counted, change: list[str], rebuilds_references, longer_curve) -> None:
    """References follow the prompts; the latency only the model and machine, so it is measured
    again only for blocks longer than it holds."""
    search()
    changed = search(*change)
    assert counted == {"references": 1 + rebuilds_references, "latency": 1 + longer_curve}
    assert ("using cached references" in changed.stderr) == (not rebuilds_references)
    assert ("using cached calibration" in changed.stderr) == (not longer_curve)


def test_a_damaged_cache_entry_is_rebuilt_with_a_warning(search, counted, tmp_path: Path) -> None:
    search()
    [references] = cache_files(tmp_path, "references")
    [latency] = cache_files(tmp_path, "latency")
    references.write_text('{"key": {"truncated": ')
    data = json.loads(latency.read_text())
    data["verify"] = {"2": -1.0}
    latency.write_text(json.dumps(data))

    result = search()
    assert counted == {"references": 2, "latency": 2}
    assert f"warning: ignoring damaged search cache {references}" in result.stderr
    assert f"warning: ignoring damaged calibration cache {latency}" in result.stderr
    assert json.loads(references.read_text())["references"]  # replaced by a whole entry
    assert search() and counted == {"references": 2, "latency": 2}


@pytest.mark.parametrize("kind", ["nested-deep", "fifo", "link-to-dev-zero", "latency-infinite"])
def test_a_cache_entry_that_no_reader_should_take_is_passed_by(search, counted, tmp_path: Path, kind: str) -> None:
    """Deep nesting (RecursionError on every run), a FIFO (a reader that never returns), a link to
    /dev/zero (a read without end) and infinite seconds: each is a warning, and the search rebuilds.
    A FIFO is not ours to replace: it stays, and the fresh entry is not cached; a link is replaced
    by the fresh entry (what it led to is never written)."""
    search()
    [references] = cache_files(tmp_path, "references")
    [latency] = cache_files(tmp_path, "latency")
    if kind == "latency-infinite":
        data = json.loads(latency.read_text())
        data["plain_step"] = float("inf")
        latency.write_text(json.dumps(data))
        assert "using cached calibration" not in search().stderr and counted["latency"] == 2
        return
    references.unlink()
    if kind == "nested-deep":
        references.write_text("[" * 100_000 + "]" * 100_000)
    elif kind == "fifo":
        os.mkfifo(references)
    else:
        references.symlink_to("/dev/zero")
    result = search()
    assert counted["references"] == 2 and "Traceback" not in result.stderr
    assert f"warning: ignoring damaged search cache {references}" in result.stderr
    if kind == "nested-deep":
        assert "nests deeper than" in result.stderr
    else:
        assert "not a regular file" in result.stderr
    if kind == "fifo":
        assert stat.S_ISFIFO(references.stat().st_mode)
    else:
        assert not references.is_symlink() and json.loads(references.read_text())["references"]  # a whole entry


@pytest.mark.parametrize(
    ("tamper", "reason"),
    [
        (lambda order: [[999, "mlp"], *order[1:]], "names [999, 'mlp']"),
        (lambda order: [order[0], *order[:-1]], "does not list this model's 8 sublayers once each"),
    ],
    ids=["layer-999", "one-twice"],
)
def test_a_cached_sublayer_order_is_checked_against_the_model(
    search, counted, tmp_path: Path, tamper, reason: str
) -> None:
    search()
    [references] = cache_files(tmp_path, "references")
    data = json.loads(references.read_text())
    whole = data["sublayer_order"]
    data["sublayer_order"] = tamper(whole)
    references.write_text(json.dumps(data))

    result = search()  # ok(): no trial failed on the order
    assert f"warning: ignoring damaged search cache {references} (its sublayer order {reason}" in result.stderr
    assert counted["references"] == 2
    assert json.loads(references.read_text())["sublayer_order"] == whole  # rebuilt whole
    study = load_study(f"sqlite:///{tmp_path / 's1.db'}", "t")
    states = [t.state.name for t in study.trials]
    assert "FAIL" not in states and states.count("COMPLETE") + states.count("PRUNED") == 2, states


def test_auto_and_the_search_measure_one_latency_between_them(counted) -> None:
    """The plain and verify curve ``auto`` calibrates is the one the search's cache reads, and the
    other way round: each model is timed once, whichever comes first."""
    first, second = tiny_model("llama", seed=1), tiny_model("llama", seed=2)
    costs = engine_calibration.calibrate(first, SkipPolicy.auto_choice(), DraftModels(first))
    latency = calibration_cache.CalibrationCache(first).latency(range(2, 10), progress=False)
    assert counted["latency"] == 1 and latency.cached_from and latency.verify_seconds == costs.verify

    latency = calibration_cache.CalibrationCache(second).latency(range(2, 10), progress=False)
    costs = engine_calibration.calibrate(second, SkipPolicy.auto_choice(), DraftModels(second))
    assert counted["latency"] == 2 and costs.info["cached"] is False  # its draft steps were timed, not its curve
    assert costs.verify == latency.verify_seconds and costs.plain_step == latency.plain_step_seconds


def test_no_cache_rebuilds_and_refreshes(search, counted, tmp_path: Path) -> None:
    search()
    [latency] = cache_files(tmp_path, "latency")
    before = json.loads(latency.read_text())["plain_timings"]
    result = search("--no-cache")
    assert counted == {"references": 2, "latency": 2}
    assert "using cached" not in result.stderr
    assert json.loads(latency.read_text())["plain_timings"] != before  # the fresh measurement replaced it


def test_cached_latency_is_said_in_help() -> None:
    from layerskip.search.cli import build_parser

    text = " ".join(build_parser().format_help().split())
    assert "--no-cache" in text and "cached latency is reused" in text


def test_busy_machine_warning_from_timing_spread() -> None:
    steady = [1.00, 1.01, 0.99, 1.02, 1.00, 0.98, 1.01, 1.00]
    busy = [1.0, 2.1, 1.0, 1.9, 1.1, 2.4, 1.0, 2.0]
    assert engine_latency.busy_warning(steady) is None
    warning = engine_latency.busy_warning(busy)
    assert warning is not None and "\n" not in warning and "machine looks busy" in warning
    assert engine_latency.timing_spread([1.0, 1.0]) == 0.0  # too few timings: no verdict


def test_a_busy_calibration_warns_is_recorded_and_not_cached(
    search, counted, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine_latency, "BUSY_SPREAD", 0.25)
    fake = iter([0.001, 0.0021, 0.001, 0.0019, 0.0011, 0.0024, 0.001, 0.002] * 1000)
    monkeypatch.setattr(
        engine_latency,
        "verify_timings",
        lambda model, ctx, block, n, greedy=None, warmup=2: [next(fake) for _ in range(n)],
    )
    result = search()
    warnings = [line for line in result.stderr.splitlines() if "machine looks busy" in line]
    assert len(warnings) == 1 and "may be off" in warnings[0]
    assert cache_files(tmp_path, "latency") == []  # never cached
    assert len(cache_files(tmp_path, "references")) == 1  # references do not depend on the machine's load
    study = load_study(f"sqlite:///{tmp_path / 's0.db'}", "t")
    assert study.user_attrs["calibration"]["latency"]["busy"] is True
    policy = SkipPolicy.load(tmp_path / "p0.json")
    assert "machine looks busy" in policy.provenance["latency_warning"]

    monkeypatch.setattr(
        engine_latency, "verify_timings", lambda model, ctx, block, n, greedy=None, warmup=2: [0.001] * n
    )
    quiet = search()
    assert "machine looks busy" not in quiet.stderr and counted["latency"] == 2
    assert len(cache_files(tmp_path, "latency")) == 1
