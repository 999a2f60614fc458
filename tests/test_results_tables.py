"""Published figures come from the committed result files only: the README's table, docs/results.md
and notebook 03's data are what scripts/results_tables.py renders from docs/results/*.json.

The fixture tests/data/bench-smollm2-tiny.json is a real `scripts/bench.py` run (2 prompts, 16
tokens, SmolLM2) with its policies' draft vocabularies dropped, as `--add` stores a run.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import stat
from pathlib import Path

import pytest
from cli_helpers import REPO, assert_bad_input, run_in_process, run_script

from layerskip.cli.results_tables import main
from layerskip.drafts.drafters.auto import AUTO_REVISION
from layerskip.drafts.policy.skip_policy import SkipPolicy
from layerskip.errors import LayerskipError
from layerskip.measure import results as published
from layerskip.measure.report import batch_markdown, batch_table
from layerskip.measure.results import (
    BATCHES_END,
    BATCHES_START,
    FIRST_SCREEN_END,
    FIRST_SCREEN_START,
    README_END,
    README_START,
    RESULTS_DIR,
    ResultFile,
    ScriptRun,
    auto_lines,
    cpu_name,
    divergences_by_method,
    draft_cost_section,
    load_result_files,
    load_script_runs,
    policy_kind,
    publish,
    read_result_file,
    rendered,
    results_page,
    summary_table,
    tree_ceiling_section,
    tree_table,
    whole_int4_draft,
)

FIXTURE = Path(__file__).parent / "data" / "bench-smollm2-tiny.json"


def between_markers(text: str) -> str:
    """The README's generated results table: what stands between its markers."""
    return text[text.index(README_START) + len(README_START) : text.index(README_END)].strip("\n")


def test_the_committed_readme_table_and_results_page_match_the_result_files() -> None:
    """The one check that keeps the README's figures true: regenerate, compare, name what differs."""
    stale = [str(path.relative_to(REPO)) for path, text in rendered(REPO).items() if path.read_text() != text]
    assert not stale, f"{', '.join(stale)} differ from docs/results/*.json; run: python scripts/results_tables.py"


def _bf16_copy() -> dict:
    """The fixture as if run in bf16: one prompt of the hybrid diverged at a near-tie."""
    data = json.loads(FIXTURE.read_text())
    data["dtype"] = "bfloat16"
    hybrid = data["methods"]["self-spec:smollm2-135m-fp32-hybrid"]["overall"]
    hybrid["identical_fraction"] = 0.5
    hybrid["divergences"] = [{"position": 3, "top2_logit_gap": 0.125}]
    return data


def test_summary_table_takes_each_kind_of_method_from_its_policy() -> None:
    data = json.loads(FIXTURE.read_text())
    f = ResultFile("tiny", data)
    methods = data["methods"]
    table = summary_table([f], "docs/results.md")
    header, _, row = table.splitlines()[:3]
    assert header.split(" | ")[4:9] == ["decoding", "skip-only", "hybrid", "on-the-fly", "HF prompt lookup"]
    for method in ("self-spec:smollm2-135m-fp32-skip", "self-spec:smollm2-135m-fp32-hybrid", "self-spec-on-the-fly"):
        assert f"[{methods[method]['overall']['speedup']:.2f}×](docs/results.md#tiny)" in row
    assert "AMD EPYC (AVX2, AVX-512, avx512_bf16)" in row and "2/2" in row
    assert "lookup-only" not in header  # no column for a kind the run did not measure


def test_kinds_ablations_and_thread_variants() -> None:
    skip = {"draft": {"use_skip_draft": True, "lookup_max_ngram": 0}}
    assert policy_kind(skip) == "skip"
    assert policy_kind({"draft": {"use_skip_draft": True, "lookup_max_ngram": 3}}) == "hybrid"
    assert policy_kind({"draft": {"use_skip_draft": False, "lookup_max_ngram": 3}}) == "lookup"
    assert policy_kind({**skip, "on_the_fly": {}}) == "on-the-fly"
    assert policy_kind({**skip, "exit": {"layer": 3}}) == "exit"
    quick = {**skip, "provenance": {"command": "layerskip-search --preset quick --out policies/mine.json"}}
    assert policy_kind(quick) == "quick"
    f = ResultFile("x", {"policies": {"p": skip, "q": skip}})
    assert f.kind("self-spec:p") == "skip"
    assert f.kind("self-spec:p-no-lookup") is None  # an ablation: not a policy the file holds
    assert f.kind("self-spec:p@t1") is None and f.kind("hf-ar") is None and f.kind("ar") is None
    assert ResultFile("y", {"policies": {"p": skip}}).kind("self-spec") == "skip"  # a lone policy's name


def test_results_page_orders_runs_and_states_the_machine_command_and_divergences() -> None:
    fp32 = ResultFile("b-fp32", json.loads(FIXTURE.read_text()))
    bf16 = ResultFile("a-bf16", _bf16_copy())
    page = results_page(sorted([bf16, fp32], key=lambda f: (published.DTYPE_ORDER[f.data["dtype"]], f.name)))
    assert page.index('<a id="b-fp32">') < page.index('<a id="a-bf16">')
    assert '<a id="speedup">' in page and "aggregate throughput" in page
    assert fp32.data["command"] in page
    assert "avx512_bf16" in page and "transformers" in page
    assert "| self-spec:smollm2-135m-fp32-hybrid | 1 / 2 | not checked | 0.125 / 0.125 | not recorded |" in page
    assert "1/2" in summary_table([bf16], "")  # the worst identical count of the methods shown


def _sampled_copy() -> dict:
    """The fixture as if run with ``bench --temperature 0.7``: nothing compared, so no identity counts."""
    data = json.loads(FIXTURE.read_text())
    data["sampled"] = {"temperature": 0.7, "top_k": 0, "top_p": 1.0, "seed": 0}
    for figures in data["methods"].values():
        for part in [figures["overall"], *figures["by_category"].values()]:
            part["identical_fraction"] = None
            for key in ("n_identical", "n_rounding", "n_defect", "n_unclassified", "divergences"):
                part.pop(key, None)
    for row in data["per_prompt"]:
        row["identical"], row["divergence"] = None, None
    return data


def test_a_sampled_run_is_shown_as_sampled_never_as_identical(tmp_path: Path) -> None:
    path = tmp_path / "sampled.json"
    path.write_text(json.dumps(_sampled_copy()))
    sampled = read_result_file(path)  # the shape takes a run with nothing compared
    greedy = ResultFile("greedy", json.loads(FIXTURE.read_text()))
    table = summary_table([greedy, sampled], "docs/results.md").splitlines()
    columns = table[0].strip("| ").split(" | ")
    greedy_row, sampled_row = (line.strip("| ").split(" | ") for line in table[2:4])  # in the order given
    assert greedy_row[columns.index("decoding")] == "greedy"
    assert sampled_row[columns.index("decoding")] == "T 0.7, top-p 1.0"
    assert sampled_row[columns.index("identical (worst)")] == "n/a (sampled)"
    assert greedy_row[columns.index("identical (worst)")] == "2/2"
    assert "(docs/results.md#sampled)" in table[-1]
    page = results_page([sampled])
    assert '<a id="sampled"></a>' in page and "tests/test_sampling.py" in page
    assert "new tokens, greedy" not in page and "sampled (T 0.7, top-p 1.0" in page
    assert "n/a (sampled)" in page  # the run's own table
    twin = ResultFile(f"{sampled.name}-offgrid", sampled.data)
    assert published.first_screen_table([sampled], "docs/results.md").count("\n") == 1  # header only
    assert published.twin_section([sampled, twin]) == ""  # a twin's claim is greedy


def test_peak_memory_column_hf_against_the_fastest_of_ours() -> None:
    data = json.loads(FIXTURE.read_text())
    old = ResultFile("old", data)
    assert "| — |" in summary_table([old], "")  # a run from before memory was recorded
    fastest = max(
        (m for m in data["methods"] if old.kind(m) not in (None, "hf-pld")),
        key=lambda m: data["methods"][m]["overall"]["speedup"],
    )
    memory = {m: {"loaded_mb": 880.0, "draft_mb": 0.0, "call_mb": 14.0, "peak_mb": 894.4} for m in data["methods"]}
    memory[fastest] = {"loaded_mb": 880.0, "draft_mb": 63.0, "call_mb": 68.0, "peak_mb": 1011.0}
    new = ResultFile("new", {**data, "memory": {"measure": "resident memory", "methods": memory}})
    table = summary_table([new], "").splitlines()
    column = table[0].strip("| ").split(" | ").index("peak memory, MiB: HF → fastest")
    assert table[2].strip("| ").split(" | ")[column] == "894 → 1011"
    assert "Peak memory" in table[-1] and "high-water mark" in table[-1]


def test_no_result_files_says_so_and_links_how_to_make_them() -> None:
    assert "No result files" in summary_table([], "docs/results.md")
    assert "(docs/reproducing.md)" in summary_table([], "docs/results.md")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A repository root with a README holding the markers and no result file yet."""
    (tmp_path / "README.md").write_text(f"# x\n\n{README_START}\nold\n{README_END}\n\nafter\n")
    return tmp_path


def test_add_regenerate_check(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--root", str(root), "--check"]) == 1  # nothing generated yet
    assert main(["--root", str(root), "--add", str(FIXTURE), "--name", "smol-tiny"]) == 0
    stored = json.loads((root / "docs" / "results" / "smol-tiny.json").read_text())
    assert all(not p["draft_vocabulary"] for p in stored["policies"].values())
    readme = (root / "README.md").read_text()
    assert readme.endswith(f"{README_END}\n\nafter\n") and "\nold\n" not in readme
    assert "(docs/results.md#smol-tiny)" in between_markers(readme)
    assert (root / "docs" / "results.md").is_file()
    figures = (root / "docs" / "results" / "figures.csv").read_text().splitlines()
    assert figures[0].startswith("results,model,dtype,cpu,method,kind,decoding,category,")
    assert any(",self-spec-on-the-fly,on-the-fly,greedy,overall," in line for line in figures)
    prompts = (root / "docs" / "results" / "prompts.csv").read_text().splitlines()
    assert len(prompts) == 1 + len(stored["per_prompt"])
    assert [f.name for f in load_result_files(root / "docs" / "results")] == ["smol-tiny"]  # CSVs are not results
    assert main(["--root", str(root), "--check"]) == 0
    (root / "README.md").write_text(readme.replace("×](docs", "x](docs", 1))  # a hand-edited figure
    assert main(["--root", str(root), "--check"]) == 1
    assert "out of date: " in capsys.readouterr().err
    assert main(["--root", str(root)]) == 0 and main(["--root", str(root), "--check"]) == 0


def test_add_refuses_to_overwrite_and_bad_files_in_one_line(root: Path, tmp_path: Path) -> None:
    publish(FIXTURE, root / "docs" / "results", "one")
    before = (root / "docs" / "results" / "one.json").read_bytes()
    with pytest.raises(LayerskipError, match="exists; pass --replace"):
        publish(FIXTURE, root / "docs" / "results", "one")
    with pytest.raises(LayerskipError, match="may hold only"):
        publish(FIXTURE, root / "docs" / "results", "../escape")
    data = json.loads(FIXTURE.read_text())
    for broken, message in (
        ({k: v for k, v in data.items() if k != "command"}, "has no 'command'"),
        ({**data, "environment": {"device": "cpu"}}, "records no CPU model"),
        ({**data, "methods": {"ar": data["methods"]["hf-pld"]}}, "no hf-ar method"),
    ):
        path = tmp_path / "broken.json"
        path.write_text(json.dumps(broken))
        with pytest.raises(LayerskipError, match=message):
            read_result_file(path)
    (tmp_path / "garbage.json").write_text("{not json")
    with pytest.raises(LayerskipError, match="not valid JSON"):
        read_result_file(tmp_path / "garbage.json")
    assert (root / "docs" / "results" / "one.json").read_bytes() == before


def test_default_name_and_one_line_errors(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = copy.deepcopy(json.loads(FIXTURE.read_text()))
    assert published.default_name(ResultFile("x", data)) == "smollm2-135m-float32-avx512bf16"
    data["environment"]["cpu_flags"] = ["fma", "avx2"]
    assert ResultFile("x", data).cpu() == "AMD EPYC (AVX2 only)"
    shutil.copy(FIXTURE, root / "run.json")
    # The script as users run it (one subprocess), then the same contract in-process.
    assert_bad_input(run_script("results_tables.py", "--root", str(root), "--check", "--add", "x"), "pass one of them")
    for argv, fragment in (
        (["--root", str(root / "nowhere")], "no README.md"),
        (["--root", str(root), "--name", "x"], "go with --add"),
        (["--root", str(root), "--add", str(root / "missing.json")], "cannot read result file"),
    ):
        assert main(argv) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], lines
    (root / "README.md").write_text("# no markers\n")
    assert main(["--root", str(root)]) == 2
    assert "markers" in capsys.readouterr().err
    assert not (root / "docs").exists()  # nothing written by a refused run


def test_identical_column_says_whether_every_divergence_was_rounding() -> None:
    """bf16 runs diverge; the table says whether the divergence check explained each one."""
    data = _bf16_copy()
    assert summary_table([ResultFile("b", data)], "docs/results.md").splitlines()[2].endswith("| 1/2 |")  # not checked
    for figures in data["methods"].values():
        figures["overall"].update(n_rounding=0, n_defect=0, n_unclassified=0)
    hybrid = data["methods"]["self-spec:smollm2-135m-fp32-hybrid"]["overall"]
    hybrid.update(n_identical=1, n_rounding=1)
    row = summary_table([ResultFile("b", data)], "docs/results.md").splitlines()[2]
    assert row.endswith("| 1/2 (rest: rounding) |")
    hybrid.update(n_rounding=0, n_defect=1)
    row = summary_table([ResultFile("b", data)], "docs/results.md").splitlines()[2]
    assert row.endswith("| 1/2 (1 not rounding) |")


def _committed() -> list[ResultFile]:
    return load_result_files(REPO / RESULTS_DIR)


def _summary_rows() -> list[str]:
    """The rows of the results page's summary table (the one table of every run; README links it)."""
    page = (REPO / "docs" / "results.md").read_text()
    section = page[page.index("## Summary") :]
    table = section[: section.index("\n\n", section.index("| model"))]
    return [line for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]


def test_the_committed_results_come_from_more_than_one_cpu_and_the_summary_shows_each() -> None:
    """The summary table has a row per committed run, each with its CPU cell: a user on either CPU
    finds a row for it (the Intel Xeon runs with AMX beside the AMD EPYC ones); the README links it."""
    files = _committed()
    cpus = {f.cpu() for f in files}
    assert "AMD EPYC (AVX2, AVX-512, avx512_bf16)" in cpus
    assert "Intel Xeon (AVX2, AVX-512, avx512_bf16, AMX)" in cpus
    rows = _summary_rows()
    assert len(rows) == len(files)
    for f in files:
        assert any(f"(#{f.name})" in row and f"| {f.cpu()} |" in row for row in rows), f.name
    assert "(docs/results.md#summary)" in (REPO / "README.md").read_text()


def _row(name: str) -> str:
    return next(line for line in _summary_rows() if f"(#{name})" in line)


def test_the_xeon_rows_hold_the_figures_of_their_files() -> None:
    link = "(#{})"
    smol = _row("smollm2-135m-float32-amx")
    for figure in ("1.47×", "1.58×", "1.48×", "1.00×"):  # skip-only, hybrid, on-the-fly, HF prompt lookup
        assert f"[{figure}]{link.format('smollm2-135m-float32-amx')}" in smol
    assert "[1.39×]" in smol and "(tuned on AMD EPYC)" in smol  # the shipped quick policy, tuned on the EPYC
    gemma = _row("gemma3-270m-float32-amx")
    for figure in ("1.91×", "2.51×", "2.02×", "1.34×"):
        assert f"[{figure}]" in gemma
    assert "[2.56×]" in gemma and "(tuned on AMD EPYC)" in gemma
    tuned_here = _row("smollm2-135m-float32-amx-quick-tuned-here")
    assert "[1.52×]" in tuned_here and "[1.57×]" in tuned_here and "tuned on" not in tuned_here
    bf16 = _row("gemma3-270m-bfloat16-amx")
    assert "[3.88×]" in bf16 and "[2.68×]" in bf16 and "(rest: rounding)" in bf16


def test_a_quick_policy_names_the_cpu_it_was_tuned_on_when_that_is_not_the_runs() -> None:
    data = json.loads(FIXTURE.read_text())
    label = "smollm2-135m-fp32-hybrid"
    policy = data["policies"][label]
    policy["provenance"] = {"command": "layerskip-search --preset quick", "machine": dict(data["environment"])}
    f = ResultFile("x", data)
    assert f.kind(f"self-spec:{label}") == "quick" and f.tuned_elsewhere(f"self-spec:{label}") is None
    assert "tuned on" not in summary_table([f], "docs/results.md").splitlines()[2]
    policy["provenance"]["machine"] = {
        "device": "cpu",
        "cpu_model": "Intel(R) Xeon(R) Processor",
        "cpu_flags": ["avx2"],
    }
    assert f.tuned_elsewhere(f"self-spec:{label}") == "Intel Xeon"
    assert "(tuned on Intel Xeon)" in summary_table([f], "docs/results.md").splitlines()[2]
    policy["provenance"]["machine"] = {"device": "cpu", "cpu_model": "AMD EPYC", "cpu_flags": ["fma", "avx2"]}
    assert f.tuned_elsewhere(f"self-spec:{label}") == "AMD EPYC (AVX2 only)"  # same name: the features differ


def test_cpu_names_drop_trademarks_and_filler_words() -> None:
    assert cpu_name("Intel(R) Xeon(R) Processor") == "Intel Xeon"
    assert cpu_name("Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz") == "Intel Xeon Platinum 8481C @ 2.70GHz"
    assert cpu_name("AMD EPYC 7B13") == "AMD EPYC 7B13"


def test_divergences_are_summarised_from_the_recorded_gaps_and_bounds() -> None:
    data = _bf16_copy()
    overall = data["methods"]["self-spec:smollm2-135m-fp32-hybrid"]["overall"]
    overall.update(n_rounding=1, n_defect=0)
    overall["divergences"] = [{"fp32_gap": -0.02, "error_bound": 0.2}, {"fp32_gap": 0.1, "error_bound": 0.3}]
    table = divergences_by_method(data)
    assert "| self-spec:smollm2-135m-fp32-hybrid | 2 / 2 | 1 / 0 | 0.060 / 0.100 | 0.250 / 0.300 |" in table
    page = (REPO / "docs" / "results.md").read_text().replace("commit not recorded", "")  # runs older than it
    assert "- / -" not in page and "not recorded" not in page  # every committed divergence has its figures


def test_draft_cost_files_are_on_the_results_page(tmp_path: Path) -> None:
    costs = load_script_runs(REPO / RESULTS_DIR, "draft_cost")
    xeon = next(c for c in costs if c.name == "smollm2-135m-fp32-amx")
    assert xeon.cpu() == "Intel Xeon (AVX2, AVX-512, avx512_bf16, AMX)"
    assert round(whole_int4_draft(xeon)["relative_to_plain_step"], 2) == 0.37
    section = draft_cost_section(costs)
    assert '<a id="draft-cost"></a>' in section
    assert "| **0.37** |" in section and "| 1.14 | 1.15 | 1.23 | 1.57 | 1.55 |" in section
    assert section in (REPO / "docs" / "results.md").read_text()
    assert draft_cost_section([]) == ""
    no_int4 = ScriptRun(
        "draft_cost", "x", {**xeon.data, "rows": [r for r in xeon.data["rows"] if r["precision"] != "int4"]}
    )
    assert "no int4 draft measured" in draft_cost_section([no_int4])
    broken = tmp_path / "draft-cost" / "broken" / "draft_cost.json"
    broken.parent.mkdir(parents=True)
    broken.write_text(json.dumps({**xeon.data, "plain_step_ms": "fast"}))
    with pytest.raises(LayerskipError, match="plain_step_ms is a string, not a number above 0"):
        load_script_runs(tmp_path, "draft_cost")
    broken.write_text("{")
    with pytest.raises(LayerskipError, match="cannot read draft-cost file"):
        load_script_runs(tmp_path, "draft_cost")


def _committed_figures() -> tuple[set[str], set[str]]:
    """Every speedup of every committed run (overall and per category) and every draft-cost ratio,
    as the docs write them (two decimals)."""
    speedups: set[str] = set()
    for f in _committed():
        for figures in f.data["methods"].values():
            for values in [figures["overall"], *figures.get("by_category", {}).values()]:
                if values.get("speedup") is not None:
                    speedups.add(f"{values['speedup']:.2f}")
    for run in load_script_runs(REPO / RESULTS_DIR, "batches"):  # batches against HF's batched generate
        speedups.update(f"{row['speedup']:.2f}" for row in run.data["batches"])
    costs: set[str] = set()
    for c in load_script_runs(REPO / RESULTS_DIR, "draft_cost"):
        costs.update(f"{r['relative_to_plain_step']:.2f}" for r in c.data["rows"])
        for curve in c.data["verify_curves"].values():
            costs.update(f"{v:.2f}" for v in curve["to_plain_step"].values())
    return speedups, costs


def test_every_figure_in_the_readme_is_a_committed_figure() -> None:
    """Outside the generated table too, a speedup or a cost in plain steps that the README states
    is one that a committed result file holds."""
    speedups, costs = _committed_figures()
    text = (REPO / "README.md").read_text()
    prose = text.replace(between_markers(text), "") if README_START in text else text
    for start, end in ((FIRST_SCREEN_START, FIRST_SCREEN_END), (BATCHES_START, BATCHES_END)):  # generated too
        prose = prose[: prose.index(start)] + prose[prose.index(end) :]
    stated = re.findall(r"(\d+\.\d{2})×", prose)
    assert stated, "the README states no speedup outside its table"
    assert not [s for s in stated if s not in speedups], "README speedups that no result file holds"
    in_steps = re.findall(r"(\d+\.\d{2})(?:[–-](\d+\.\d{2}))? (?:of a plain step|plain steps)", prose)
    assert in_steps, "the README states no cost in plain steps"
    assert not [v for pair in in_steps for v in pair if v and v not in costs], "README costs no draft-cost file holds"


def _with_auto(tree_ablation: bool = True) -> dict:
    """The fixture as if run with ``--policy auto`` beside the shipped policies (``--tree-ablation``:
    also ``auto (chain)``, the same policy with trees off). The chain twin is made the faster, so a
    table that took it as the best auto would show."""
    data = json.loads(FIXTURE.read_text())
    data["policies"]["auto"] = SkipPolicy.auto_choice().to_dict()
    base = copy.deepcopy(data["methods"]["self-spec-on-the-fly"])
    tree = copy.deepcopy(base)
    tree["overall"].update(
        speedup=1.31,
        mean_accepted=2.6,
        draft_lengths={"0": 2, "4": 10, "9": 6},
        tree_steps=9,
        off_branch_steps=3,
        auto={
            "lookup_share": 0.25,
            "skip_share": 0.65,
            "draft_lengths": {"0": 2, "4": 10, "9": 6},
            "head_rows": {"0": 1, "4096": 11},
            "skip_sets": {"a|m": 12},
            "skip_changes": 0,
            "calibration": {"seconds": 7.5, "cached": False, "draft_build_seconds": 1.25, "machine": {}},
        },
    )
    data["methods"]["self-spec:auto"] = tree
    if tree_ablation:
        chain = copy.deepcopy(base)
        chain["overall"].update(
            speedup=1.44, mean_accepted=2.1, draft_lengths={"4": 18}, tree_steps=0, off_branch_steps=0
        )
        chain["overall"]["auto"] = {**tree["overall"]["auto"], "calibration": {"seconds": 0.02, "cached": True}}
        data["methods"]["self-spec:auto (chain)"] = chain
    return data


def test_the_auto_column_holds_the_best_auto_method_never_its_chain_twin() -> None:
    data = _with_auto()
    f = ResultFile("auto-run", data)
    assert policy_kind(data["policies"]["auto"]) == "auto"  # not on-the-fly, though it selects on the fly
    assert f.kind("self-spec:auto") == "auto"
    assert f.kind("self-spec:auto (chain)") is None  # a chain ablation fills no column
    table = summary_table([f], "docs/results.md")
    header, _, row = table.splitlines()[:3]
    columns = header.strip("| ").split(" | ")
    assert "auto (no search)" in columns
    cells = row.strip("| ").split(" | ")
    assert cells[columns.index("auto (no search)")] == "[1.31×](docs/results.md#auto-run)"  # not the chain's 1.44×
    assert "1.44" not in row
    assert "`auto (no search)` is `--policy auto`" in table and "`(chain)` run" in table
    # Recognised by what the policy is, not by its label.
    data["policies"]["mine"] = data["policies"].pop("auto")
    data["methods"]["self-spec:mine"] = data["methods"].pop("self-spec:auto")
    assert ResultFile("x", data).kind("self-spec:mine") == "auto"
    del data["policies"]["mine"]["auto"]  # an older record: its provenance says auto
    assert ResultFile("x", data).kind("self-spec:mine") == "auto"


def test_the_first_screen_quotes_only_runs_of_todays_auto() -> None:
    """A run of an older ``auto`` (or one from before the revision was recorded) leaves the first
    table; the committed README's first table is not empty, and every row of it is a run of today's."""
    data = _with_auto()
    data["max_new_tokens"], data["prompts"]["n"], data["prompts"]["source"] = 128, 30, "spec_bench/question.jsonl"
    data["environment"]["auto_revision"] = AUTO_REVISION
    current = ResultFile("current", data)
    assert "(docs/results.md#current)" in published.first_screen_table([current], "docs/results.md")
    for revision in (AUTO_REVISION - 1, None):
        older = copy.deepcopy(data)
        older["environment"]["auto_revision"] = revision
        table = published.first_screen_table([ResultFile("older", older)], "docs/results.md")
        assert table.count("\n") == 1  # the header only
    # A twin's run shows beside its model's, named as the model's twin; without its model's run, not at all.
    twin = ResultFile("current-offgrid", copy.deepcopy(data))
    rows = published.first_screen_table([twin, current], "docs/results.md").splitlines()[2:]
    assert len(rows) == 2 and "#current)" in rows[0] and "full-precision twin" in rows[1]
    assert published.first_screen_table([twin], "docs/results.md").count("\n") == 1
    readme = (REPO / "README.md").read_text()
    shown = readme[readme.index(FIRST_SCREEN_START) : readme.index(FIRST_SCREEN_END)]
    names = re.findall(r"\(docs/results\.md#([^)]+)\)", shown)
    assert names, "the first screen quotes no run"
    runs = {f.name: f for f in _committed()}
    assert all(runs[name].auto_revision == AUTO_REVISION for name in names), names


def test_a_policy_saved_from_autos_choices_is_classed_by_what_it_drafts_with() -> None:
    """generate --save-policy writes auto's choices as a fixed file: it no longer chooses while
    generating, so it is a hybrid like any other, not the auto column."""
    fixed = SkipPolicy.auto_choice().to_dict()
    fixed.pop("auto")
    fixed["on_the_fly"] = None
    assert fixed["provenance"]["source"] == "auto"
    assert policy_kind(fixed) == "hybrid"


def test_runs_without_auto_omit_the_column_and_a_mixed_table_leaves_their_cells_blank() -> None:
    old = ResultFile("old", json.loads(FIXTURE.read_text()))
    assert "auto (no search)" not in summary_table([old], "docs/results.md")
    both = summary_table([old, ResultFile("new", _with_auto())], "docs/results.md").splitlines()
    columns = both[0].strip("| ").split(" | ")
    where = columns.index("auto (no search)")
    assert both[2].strip("| ").split(" | ")[where] == ""  # the old run: a blank cell
    assert "#new" in both[3].strip("| ").split(" | ")[where]


def test_trees_get_their_own_table_beside_their_chain_twin_and_auto_its_choices() -> None:
    data = _with_auto()
    trees = tree_table(data)
    lines = trees.splitlines()
    assert lines[0].startswith("| method | τ | τ, chain | speedup | speedup, chain | tree steps |")
    # One row: the chain twin is beside its tree method, not a row of its own.
    assert lines[2:] == ["| self-spec:auto | 2.60 | 2.10 | 1.31× | 1.44× | 9 (50%) | 3 |"]
    choices = auto_lines(data)
    assert choices.splitlines()[0] == (
        "- `self-spec:auto`: prompt lookup drafted 25% of the steps, the skip draft 65%; draft lengths "
        "(tokens: steps) 0: 2, 4: 10, 9: 6; draft head (skip-drafted steps) 4096 rows: 11, full: 1; "
        "calibration 7.50 s, measured in this run, plus 1.25 s building the draft's weights"
    )
    assert "calibration 0.02 s, read from the cache" in choices.splitlines()[1]  # the chain twin's
    page = results_page([ResultFile("auto-run", data)])
    assert trees in page and choices in page
    # Without --tree-ablation the tree method still gets its row, its chain cells empty.
    alone = tree_table(_with_auto(tree_ablation=False))
    assert alone.splitlines()[2] == "| self-spec:auto | 2.60 | - | 1.31× | - | 9 (50%) | 3 |"
    busy = _with_auto()["methods"]["self-spec:auto"]["overall"]["auto"]
    busy["calibration"] = {"seconds": 9.0, "cached": False, "warning": "warning: the machine looks busy"}
    assert "(not cached: the machine looked busy)" in auto_lines({"methods": {"m": {"overall": {"auto": busy}}}})


def test_result_files_from_before_auto_and_trees_still_render() -> None:
    """Files without draft_lengths, tree_steps, off_branch_steps or auto: no tree table, no auto line."""
    data = json.loads(FIXTURE.read_text())
    assert all("tree_steps" not in m["overall"] and "auto" not in m["overall"] for m in data["methods"].values())
    assert tree_table(data) == "" and auto_lines(data) == ""
    page = results_page([ResultFile("old", data)])
    assert "Token trees" not in page and "What `auto` chose" not in page
    for f in _committed():  # every committed run renders as before
        assert tree_table(f.data) == "" or any(name.endswith(" (chain)") for name in f.data["methods"])


def test_tree_ceiling_files_are_on_the_results_page(tmp_path: Path) -> None:
    ceilings = load_script_runs(REPO / RESULTS_DIR, "tree_ceiling")
    assert {c.name for c in ceilings} >= {"smollm2-135m-fp32", "gemma3-270m-bf16"}
    section = tree_ceiling_section(ceilings)
    assert '<a id="tree-ceiling"></a>' in section
    assert section in (REPO / "docs" / "results.md").read_text()
    one = ceilings[0]
    extra = one.data["extra_tokens_per_step"]["every tree candidate"]
    assert f"+{extra:.2f} ({extra / one.data['tau_chain']:.1%})" in section
    assert tree_ceiling_section([]) == ""
    folder = tmp_path / "tree-ceiling" / "broken"
    folder.mkdir(parents=True)
    (folder / "tree_ceiling.json").write_text(json.dumps({**one.data, "tau_chain": "high"}))
    with pytest.raises(LayerskipError, match="tau_chain is a string, not a number above 0"):
        load_script_runs(tmp_path, "tree_ceiling")
    (folder / "tree_ceiling.json").write_text("{")
    with pytest.raises(LayerskipError, match="cannot read tree-ceiling file"):
        load_script_runs(tmp_path, "tree_ceiling")


def _with(data: dict, path: tuple, value: object) -> dict:
    """A deep copy of ``data`` with the value at ``path`` (keys and list indices) replaced;
    ``DROP`` removes it."""
    data = copy.deepcopy(data)
    where = data
    for key in path[:-1]:
        where = where[key]
    if value is DROP:
        del where[path[-1]]
    else:
        where[path[-1]] = value
    return data


DROP = object()
_COST = ("draft-cost", "smollm2-135m-fp32", "draft_cost.json")
_CEILING = ("tree-ceiling", "smollm2-135m-fp32", "tree_ceiling.json")
_RESULT = ("smollm2-135m-float32-avx512bf16.json",)
# A committed file with one nested value damaged (as the fault probe found them), and what the
# one-line error names. Each used to end --check in a traceback.
NESTED_DAMAGE = {
    "tau-chain-0": (_CEILING, ("tau_chain",), 0, "tau_chain is 0, not a number above 0"),
    "extra-tokens-strings": (
        _CEILING,
        ("extra_tokens_per_step", "every tree candidate"),
        "many",
        "extra_tokens_per_step['every tree candidate'] is a string",
    ),
    "verify-rows-key-abc": (_CEILING, ("verify_rows_cost",), {"abc": 1}, "verify_rows_cost has key 'abc'"),
    "verify-curves-a-number": (_COST, ("verify_curves",), {"float32": 5}, "verify_curves.float32 is a number"),
    "rows-of-numbers": (_COST, ("rows",), [1, 2], "rows[0] is a number, not an object"),
    "row-without-ratio": (_COST, ("rows", 0, "relative_to_plain_step"), DROP, "has no 'relative_to_plain_step'"),
    "per-prompt-numbers": (_RESULT, ("per_prompt",), [1, 2, 3], "per_prompt[0] is a number, not an object"),
    "policy-a-string": (_RESULT, ("policies",), {"x": "x"}, "policies.x is a string, not an object"),
    "cpu-flags-a-number": (_RESULT, ("environment", "cpu_flags"), 5, "environment.cpu_flags is a number"),
    "speedup-a-string": (_RESULT, ("methods", "hf-ar", "overall", "speedup"), "2x", "speedup is a string"),
    "category-without-speedup": (
        _RESULT,
        ("methods", "hf-ar", "by_category"),
        {"qa": {}},
        "by_category.qa has no 'speedup'",
    ),
    "histogram-keys": (
        _RESULT,
        ("methods", "hf-ar", "overall", "draft_lengths"),
        {"four": 1},
        "draft_lengths has key 'four', not an integer",
    ),
}


@pytest.mark.parametrize("name", list(NESTED_DAMAGE))
def test_nested_values_are_checked_when_a_file_is_read(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A damaged value deep in a committed file is refused in one line naming the file."""
    where, path, value, fragment = NESTED_DAMAGE[name]
    shutil.copytree(REPO / RESULTS_DIR, tmp_path / RESULTS_DIR)
    shutil.copy(REPO / "README.md", tmp_path / "README.md")
    target = tmp_path / RESULTS_DIR / Path(*where)
    target.write_text(json.dumps(_with(json.loads(target.read_text()), path, value)))
    capsys.readouterr()  # in-process: the script's own process contract is held by the test above
    assert main(["--root", str(tmp_path), "--check"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: ") and fragment in line, line
    assert str(target) in line and "; pass a " in line


@pytest.mark.parametrize("where", [_RESULT, _COST, _CEILING], ids=["result", "draft-cost", "tree-ceiling"])
@pytest.mark.parametrize("kind", ["nested-deep", "fifo", "a-list"])
def test_a_result_file_that_is_no_json_object_is_one_line(
    where: tuple, kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Deep nesting used to end in RecursionError; a FIFO would block the reader for good."""
    shutil.copytree(REPO / RESULTS_DIR, tmp_path / RESULTS_DIR)
    shutil.copy(REPO / "README.md", tmp_path / "README.md")
    target = tmp_path / RESULTS_DIR / Path(*where)
    target.unlink()
    if kind == "fifo":
        os.mkfifo(target)
    else:
        target.write_text("[" * 100_000 + "]" * 100_000 if kind == "nested-deep" else "[1, 2]")
    assert main(["--root", str(tmp_path), "--check"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and str(target) in lines[0], lines
    reason = {"nested-deep": "nests deeper than", "fifo": "not a regular file", "a-list": "holds a list"}[kind]
    assert reason in lines[0]


def test_a_fifo_in_place_of_an_output_is_left_and_nothing_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shutil.copytree(REPO / RESULTS_DIR, tmp_path / RESULTS_DIR)
    shutil.copy(REPO / "README.md", tmp_path / "README.md")
    (tmp_path / RESULTS_DIR / "figures.csv").unlink()
    (tmp_path / "docs" / "results.md").unlink(missing_ok=True)
    os.mkfifo(tmp_path / RESULTS_DIR / "figures.csv")
    refused = run_in_process(main, capsys, "--root", str(tmp_path))
    assert_bad_input(refused, "figures.csv", "not a regular file")
    assert stat.S_ISFIFO((tmp_path / RESULTS_DIR / "figures.csv").stat().st_mode)
    assert not (tmp_path / "docs" / "results.md").exists()  # refused before anything was written


def test_the_draft_cost_script_runs_end_to_end_and_its_file_renders(tiny_llama: Path, tmp_path: Path) -> None:
    """scripts/draft_cost.py on a tiny Llama (one repeat): it used to die after its measurement,
    writing nothing; its draft_cost.json now passes the results page's reader."""
    out = tmp_path / "draft-cost" / "tiny"
    result = run_script("draft_cost.py", "--model", str(tiny_llama), "--repeats", "1", "--out", str(out))
    assert result.returncode == 0, result.stderr
    [cost] = load_script_runs(tmp_path, "draft_cost")
    assert set(cost.data["draft_memory_mb"]) == {"model", "bfloat16", "int4"}
    assert all(megabytes > 0 for name, megabytes in cost.data["draft_memory_mb"].items() if name != "model")
    assert (out / "draft_cost.md").read_text().startswith("| policy |")
    assert "[tiny](results/draft-cost/tiny/draft_cost.json)" in draft_cost_section([cost])
    taken = tmp_path / "taken"
    taken.write_text("mine")
    refused = run_script("draft_cost.py", "--model", str(tmp_path / "no-model"), "--out", str(taken))
    assert_bad_input(refused, "--out", "is a file")  # before the model loads, not after the work


def test_a_batch_runs_report_holds_the_results_pages_table() -> None:
    """bench's batches.md and the results page render a batch run's figures as one table."""
    for run in load_script_runs(REPO / RESULTS_DIR, "batches"):
        table = batch_table(run.data)
        assert table.startswith("| batch | layout |") and table in batch_markdown(run.data)
        assert table in (REPO / "docs" / "results.md").read_text()


def test_each_twin_row_shows_what_changed_in_its_text() -> None:
    """A twin's ratio moves with its text: each row gives `auto`'s lookup share and the tokens
    written, for the model as shipped and its twin (the committed SmolLM2 Xeon pair: 23% -> 53%,
    2748 -> 2134 tokens, read from the files)."""
    files = {f.name: f for f in load_result_files(REPO / "docs" / "results")}
    pair = [files["smollm2-135m-float32-amx-auto-twin"], files["smollm2-135m-float32-amx-auto-twin-offgrid"]]
    table = published.twin_section(pair).splitlines()
    header = next(line for line in table if line.startswith("| model"))
    columns = header.strip("| ").split(" | ")
    row = table[table.index(header) + 2].strip("| ").split(" | ")
    shipped, twin = (f.data["methods"]["self-spec"]["overall"] for f in pair)
    assert row[columns.index("tokens written")] == f"{shipped['new_tokens']} → {twin['new_tokens']}"
    share = row[columns.index("`auto`'s lookup steps")]
    assert share == f"{shipped['auto']['lookup_share']:.0%} → {twin['auto']['lookup_share']:.0%}"
