"""Every result file names the code that ran it, and the figures the docs quote are the files' own.

A bench result (per-prompt or batches: both take ``environment()``), the measurement scripts'
JSON and a search's exported policy record ``commit`` and ``dirty`` (``layerskip.machine.code_version``);
the results page shows them beside the CPU. The docs' figures below are checked against the
committed result file each one cites.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from layerskip.machine import SOURCE_ROOT, code_version
from layerskip.measure.bench import environment
from layerskip.measure.labels import commit_label
from layerskip.measure.results import ResultFile, ScriptRun, file_section, load_result_files, run_section

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"


def _git(cwd: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    return done.stdout.strip()


def _is_checkout(root: Path) -> bool:
    try:
        return Path(_git(root, "rev-parse", "--show-toplevel")).resolve() == root.resolve()
    except (OSError, subprocess.SubprocessError):
        return False


# -- the code a result names ------------------------------------------------------------------------------------------
def test_a_bench_environment_names_the_commit_of_the_checkout_it_ran_from() -> None:
    env = environment(torch.device("cpu"))
    assert "commit" in env and "dirty" in env
    if not _is_checkout(SOURCE_ROOT):
        pytest.skip("the package does not run from a git checkout here")
    assert env["commit"] == _git(SOURCE_ROOT, "rev-parse", "--short", "HEAD")
    assert isinstance(env["dirty"], bool)


def test_the_commit_and_whether_tracked_files_changed(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "layerskip").mkdir(parents=True)
    (repo / "layerskip" / "x.py").write_text("a = 1\n")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "one")
    head = _git(repo, "rev-parse", "--short", "HEAD")
    assert code_version(repo) == {"commit": head, "dirty": False}
    (repo / "notes.txt").write_text("untracked\n")  # an untracked file is no change to the code
    assert code_version(repo) == {"commit": head, "dirty": False}
    (repo / "docs" / "results").mkdir(parents=True)
    (repo / "docs" / "results" / "r.json").write_text("{}\n")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "a result")
    head = _git(repo, "rev-parse", "--short", "HEAD")
    (repo / "docs" / "results" / "r.json").write_text('{"rerun": 1}\n')  # a sitting rewriting its results
    assert code_version(repo) == {"commit": head, "dirty": False}
    (repo / "layerskip" / "x.py").write_text("a = 2\n")
    assert code_version(repo) == {"commit": head, "dirty": True}


def test_no_commit_outside_a_checkout_of_its_own(tmp_path: Path) -> None:
    unknown = {"commit": None, "dirty": None}
    assert code_version(tmp_path) == unknown  # no repository at all
    assert code_version(tmp_path / "missing") == unknown
    repo = tmp_path / "project"
    (repo / "venv" / "site-packages").mkdir(parents=True)
    _git(repo, "init", "-q")
    # a package installed inside another project's repository is no checkout of layerskip
    assert code_version(repo / "venv" / "site-packages") == unknown


def test_no_commit_without_git(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "")
    assert code_version(SOURCE_ROOT) == {"commit": None, "dirty": None}


def test_every_script_result_records_the_code() -> None:
    """Each front end that writes a JSON result records ``code_version()`` in it (bench through
    ``environment()``, the measuring scripts through ``cli.common.measured_run``)."""
    writers = [ROOT / "layerskip" / "cli" / "bench.py", *(ROOT / "scripts").glob("*.py")]
    writers += [ROOT / "layerskip" / "cli" / name for name in ("train_exit.py", "twin.py")]
    missing = []
    for path in writers:
        text = path.read_text()
        if "write_json_atomic(" in text or "write_outputs(" in text:
            if not any(call in text for call in ("code_version()", "environment(", "measured_run(")):
                missing.append(str(path.relative_to(ROOT)))
    assert not missing, f"these write results without the commit: {missing}"
    assert "code_version()" in (ROOT / "layerskip" / "measure" / "bench.py").read_text()
    assert "**code_version()" in (ROOT / "layerskip" / "cli" / "common.py").read_text()


def test_a_search_trial_records_the_code_and_its_exported_policy_names_it(tmp_path: Path) -> None:
    import optuna

    from layerskip.drafts.policy.skip_policy import SkipPolicy
    from layerskip.machine import this_machine
    from layerskip.search.export import export_policy
    from layerskip.search.space import POLICY_ATTR, policy_attr
    from layerskip.search.study import CODE_ATTR, run_trials

    def objective(trial: optuna.Trial) -> float:
        trial.set_user_attr(POLICY_ATTR, policy_attr(SkipPolicy(skip_mlp=(1,))))
        trial.set_user_attr("predicted_speedup", 1.5)
        return 1.5

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize")
    run_trials(study, objective, 1, None, None, progress=False, here=this_machine("cpu"))
    code = code_version()
    assert study.trials[0].user_attrs[CODE_ATTR] == code
    policy = export_policy(study, tmp_path / "p.json")
    assert {key: policy.provenance[key] for key in code} == code
    assert json.loads((tmp_path / "p.json").read_text())["provenance"]["commit"] == code["commit"]


def test_the_results_page_shows_the_commit_beside_the_cpu() -> None:
    committed = load_result_files(RESULTS)[0]
    data = json.loads(json.dumps(committed.data))
    assert "commit not recorded" in file_section(committed)
    data["environment"].update(commit="abc1234", dirty=False)
    cpu_line = next(line for line in file_section(ResultFile("x", data)).splitlines() if line.startswith("- CPU:"))
    assert cpu_line.endswith("commit abc1234")
    data["environment"]["dirty"] = True
    assert "commit abc1234 + uncommitted changes" in file_section(ResultFile("x", data))
    batches = json.loads((RESULTS / "batches" / "smollm2-135m-float32-amx" / "batches.json").read_text())
    assert "greedy; commit not recorded." in run_section(ScriptRun("batches", "b", batches))
    batches["environment"]["commit"] = "abc1234"
    assert "greedy; commit abc1234." in run_section(ScriptRun("batches", "b", batches))
    assert commit_label({"commit": None}) == commit_label({}) == "not recorded"


# -- the docs' figures are the cited files' ---------------------------------------------------------------------------
def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def _speedup(name: str, method: str = "self-spec") -> Callable[[], float]:
    return lambda: _json(RESULTS / f"{name}.json")["methods"][method]["overall"]["speedup"]


def _hf_batch(name: str, size: int, key: str) -> Callable[[], float]:
    def value() -> float:
        runs = _json(RESULTS / "batches" / name / "batches.json")["runs"]
        run = next(r for r in runs if r["method"] == "hf-batched" and r["size"] == size and r["layout"] == "similar")
        return run[key]

    return value


EPYC_GEMMA, EPYC_SMOLLM2 = "gemma3-270m-float32-avx512bf16", "smollm2-135m-float32-avx512bf16"


def _peer(model: str, method: str, key: str) -> Callable[[], float]:
    """A method's overall ``key`` in the committed peers run of ``model`` (docs/results/peers)."""

    def value() -> float:
        return _json(RESULTS / "peers" / model / "results.json")["methods"][method]["overall"][key]

    return value


def _batch_row(name: str, size: int, key: str, layout: str = "similar") -> Callable[[], float]:
    """A batch row's ``key`` (its summary row in batches.json)."""

    def value() -> float:
        rows = _json(RESULTS / "batches" / name / "batches.json")["batches"]
        return next(r[key] for r in rows if r["batch_size"] == size and r["layout"] == layout)

    return value


def _calibrations(pattern: str, cached: bool, form: str) -> Callable[[], str]:
    """The range of the calibrations (cached or measured in the run) of the ``auto`` runs ``pattern`` names."""

    def value() -> str:
        seconds = []
        for path in RESULTS.glob(pattern):
            for figures in _json(path)["methods"].values():
                calibration = (figures["overall"].get("auto") or {}).get("calibration") or {}
                if "seconds" in calibration and bool(calibration.get("cached")) == cached:
                    seconds.append(calibration["seconds"])
        return f"{form.format(min(seconds))}–{form.format(max(seconds))} s"

    return value


# (doc, the figure as the doc writes it, what the doc cites for it, the figure from that file, its format)
CLAIMS: list[tuple[str, str, str, Callable[[], Any], str]] = [
    ("docs/choosing-a-policy.md", "[0.97×](results.md#gemma3-270m-float32-amx-auto-t1.0)",
     "results.md#gemma3-270m-float32-amx-auto-t1.0", _speedup("gemma3-270m-float32-amx-auto-t1.0"), "{:.2f}×"),
    ("docs/choosing-a-policy.md", "[1.23×](results.md#gemma3-270m-float32-amx-auto-t0.7)",
     "results.md#gemma3-270m-float32-amx-auto-t0.7", _speedup("gemma3-270m-float32-amx-auto-t0.7"), "{:.2f}×"),
    ("docs/choosing-a-policy.md", "[1.47×](results.md#smollm2-135m-float32-amx-auto-t0.7)",
     "results.md#smollm2-135m-float32-amx-auto-t0.7", _speedup("smollm2-135m-float32-amx-auto-t0.7"), "{:.2f}×"),
    ("docs/choosing-a-policy.md", "[1.26×](results.md#smollm2-135m-float32-amx-auto-t1.0)",
     "results.md#smollm2-135m-float32-amx-auto-t1.0", _speedup("smollm2-135m-float32-amx-auto-t1.0"), "{:.2f}×"),
    ("docs/choosing-a-policy.md", "12.7–14.3 s", "results.md#smollm2-135m-float32-avx512bf16-auto-ar",
     _calibrations("*-float32-avx512bf16-auto-ar*.json", False, "{:.1f}"), "{}"),
    ("docs/choosing-a-policy.md", "0.005–0.013 s", "results.md#gemma3-270m-bfloat16-avx512bf16-auto",
     _calibrations("*-avx512bf16*auto.json", True, "{:.3f}"), "{}"),
    ("README.md", "[0.97×](docs/results.md#gemma3-270m-float32-amx-auto-t1.0)",
     "docs/results.md#gemma3-270m-float32-amx-auto-t1.0", _speedup("gemma3-270m-float32-amx-auto-t1.0"), "{:.2f}×"),
    ("README.md", "[1.23×](docs/results.md#gemma3-270m-float32-amx-auto-t0.7)",
     "docs/results.md#gemma3-270m-float32-amx-auto-t0.7", _speedup("gemma3-270m-float32-amx-auto-t0.7"), "{:.2f}×"),
    ("docs/plugin.md", "took 8.04 s", "results.md#batches-gemma3-270m-float32-amx",
     _hf_batch("gemma3-270m-float32-amx", 2, "seconds"), "{:.2f} s"),
    ("docs/plugin.md", "against 7.74 s", "results.md#batches-gemma3-270m-float32-amx",
     _hf_batch("gemma3-270m-float32-amx", 1, "seconds"), "{:.2f} s"),
    ("docs/plugin.md", "31.9 against", "results.md#batches-gemma3-270m-float32-amx",
     _hf_batch("gemma3-270m-float32-amx", 2, "tokens_per_second"), "{:.1f}"),
    ("docs/plugin.md", "16.5 tokens/s", "results.md#batches-gemma3-270m-float32-amx",
     _hf_batch("gemma3-270m-float32-amx", 1, "tokens_per_second"), "{:.1f}"),
    ("docs/plugin.md", "[1.33×](results.md#batches-smollm2-135m-float32-amx)",
     "results.md#batches-smollm2-135m-float32-amx",
     _batch_row("smollm2-135m-float32-amx", 2, "speedup", "mixed"), "{:.2f}×"),
    ("docs/plugin.md", "gave 31.5 tokens/s", "results.md#batches-smollm2-135m-float32-avx512bf16",
     _batch_row(EPYC_SMOLLM2, 2, "hf_tokens_per_second"), "{:.1f}"),
    ("docs/plugin.md", "against 25.4 for one prompt", "results.md#batches-smollm2-135m-float32-avx512bf16",
     _batch_row(EPYC_SMOLLM2, 1, "hf_tokens_per_second"), "{:.1f}"),
    ("docs/plugin.md", "ours 2.30× HF's batch", "results.md#batches-smollm2-135m-float32-avx512bf16",
     _batch_row(EPYC_SMOLLM2, 2, "speedup"), "{:.2f}"),
    ("README.md", "one at a time gave [57.3 tok/s]", "docs/results.md#batches-gemma3-270m-float32-avx512bf16",
     _batch_row(EPYC_GEMMA, 16, "alone_tokens_per_second"), "{:.1f}"),
    ("README.md", "each row done in 1.99 s", "docs/results.md#batches-gemma3-270m-float32-avx512bf16",
     _batch_row(EPYC_GEMMA, 16, "row_latency_alone_s"), "{:.2f}"),
    ("README.md", "together 116.0 tok/s", "docs/results.md#batches-gemma3-270m-float32-avx512bf16",
     _batch_row(EPYC_GEMMA, 16, "ours_tokens_per_second"), "{:.1f}"),
    ("README.md", "every row done at 17.66 s", "docs/results.md#batches-gemma3-270m-float32-avx512bf16",
     _batch_row(EPYC_GEMMA, 16, "row_latency_ours_s"), "{:.2f}"),
    ("README.md", "SmolLM2: 58.7 tok/s one at a time", "docs/results.md#batches-smollm2-135m-float32-avx512bf16",
     _batch_row(EPYC_SMOLLM2, 16, "alone_tokens_per_second"), "{:.1f}"),
    ("README.md", "105.8 tok/s together", "docs/results.md#batches-smollm2-135m-float32-avx512bf16",
     _batch_row(EPYC_SMOLLM2, 16, "ours_tokens_per_second"), "{:.1f}"),
]  # fmt: skip

# The Which tool page's peers table: per method, its SmolLM2 and Gemma-3 cells as the page writes them.
PEER_CELLS = {
    "hf-ar": ("12.6 (1.00x)", "8.1 (1.00x)"),
    "ar": ("13.8 (1.10x)", "11.0 (1.36x)"),
    "self-spec": ("27.2 (2.17x)", "28.8 (3.57x)"),
    "llama.cpp": ("41.4 (3.29x)", "42.9 (5.32x)"),
    "llama.cpp-lookup": ("23.1 (1.84x)", "23.2 (2.88x)"),
}
CLAIMS += [
    ("docs/which-tool.md", f"| {cell} |", f"results/peers/{model}/results.md",
     _peer(model, method, "tokens_per_second"), "{:.1f}")
    for method, cells in PEER_CELLS.items()
    for model, cell in zip(("smollm2-135m", "gemma3-270m"), cells, strict=True)
]  # fmt: skip


@pytest.mark.parametrize(
    ("doc", "written", "cited", "value", "form"), CLAIMS, ids=[f"{c[0]}: {c[1].split(']')[0]}" for c in CLAIMS]
)
def test_a_doc_figure_is_in_the_file_it_cites(
    doc: str, written: str, cited: str, value: Callable[[], Any], form: str
) -> None:
    text = (ROOT / doc).read_text()
    assert written in text, f"{doc} no longer says {written!r}: update CLAIMS with the sentence"
    assert f"]({cited})" in text, f"{doc} does not cite {cited}"
    number = re.compile(r"\d+\.\d+(?:–\d+\.\d+)?")
    figure, recorded = number.search(written).group(0), number.search(form.format(value())).group(0)
    assert figure == recorded, f"{doc}: {written!r}, but the file gives {recorded}"


def test_figures_without_a_committed_file_are_gone() -> None:
    """Figures that only the development log held, or that no file held, are not quoted."""
    gone = {
        "docs/choosing-a-policy.md": ["7.8 s", "9.0 s", "11.7 s"],
        "docs/plugin.md": ["35.7 ms", "35.9 ms", "862 tokens"],
        "docs/concepts.md": ["1.11-1.13", "1.30 where", "0.97-1.00"],
    }
    for doc, figures in gone.items():
        text = (ROOT / doc).read_text()
        assert not [f for f in figures if f in text], doc


def test_the_batch_figures_name_their_cpu() -> None:
    """The README's batch table has a row per committed batch run's CPU, and the prose says what
    the runs' machines had in common: two cores."""
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "128 new tokens, on 2-core machines, each row naming its CPU" in readme
    for path in RESULTS.glob("batches/*/batches.json"):
        env = _json(path)["environment"]
        assert env["cores"] == 2, path
        flags = set(env["cpu_flags"])
        cpu = "Intel Xeon" if "Xeon" in env["cpu_model"] else "AMD EPYC"
        assert cpu.split()[-1] in env["cpu_model"] and ("amx_bf16" in flags) == (cpu == "Intel Xeon"), path
        assert f"batches-{path.parent.name})" in readme and f"| {cpu} (" in readme, path


def test_the_postgres_extra_is_installed_from_the_checkout() -> None:
    pages = [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    assert not [p.name for p in pages if re.search(r"pip install \"?layerskip\[", p.read_text())]
    assert 'pip install -e ".[postgres]"' in (ROOT / "docs" / "search.md").read_text()
    assert "postgres = [" in (ROOT / "pyproject.toml").read_text()
