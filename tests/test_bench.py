"""The benchmark harness: build_methods -> run_benchmark -> summarise -> report files, and the CLI.

Library level: a tiny random Llama (4 layers, hidden 64, vocab 128), two token-id prompts in
categories "a" and "b", 12 new tokens. CLI level: ``scripts/bench.py`` as a user runs it, on the
same tiny model saved as a local HF directory with a word-level tokenizer (see tiny_models.py);
each subprocess costs an interpreter start (~4 s).
"""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from cli_helpers import assert_bad_input, run_in_process, run_script
from tiny_models import LAYERS, VOCAB, random_prompt, save_checkpoint, tiny_model

from layerskip.data import Prompt
from layerskip.drafts.policy.skip_policy import DraftSettings, ModelIdentity, SkipPolicy
from layerskip.errors import LayerskipError
from layerskip.measure import bench
from layerskip.measure import report as report_module
from layerskip.measure.bench import (
    BenchConfig,
    Method,
    build_methods,
    measure_memory,
    prompt_seed,
    run_benchmark,
    summarise,
)
from layerskip.measure.memory import call_growth_mb
from layerskip.measure.report import COLUMNS, held_out_table, write_outputs
from layerskip.measure.results import read_result_file
from layerskip.sampling import Sampling

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "bench.py"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
OUTPUT_FILES = ("results.json", "results.csv", "results.md", "speedup.png")
FIGURE_KEYS = set(COLUMNS)  # tokens_per_second, speedup, mean_accepted, acceptance_rate, identical_fraction, n_prompts
RESULT_KEYS = {"command", "device", "dtype", "versions", "model", "methods"}

NEW_TOKENS = 12
WARMUP_TOKENS = 4
METHOD_NAMES = ["hf-ar", "ar", "self-spec", "self-spec-lookup", "hf-pld"]
LOSSLESS = ("ar", "self-spec", "self-spec-lookup")
PROMPTS = [Prompt("p0", "a", "unused"), Prompt("p1", "b", "unused")]
PROMPT_IDS = [random_prompt(seed=0), random_prompt(seed=1)]


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_model("llama")


def _policy() -> SkipPolicy:
    # Bypasses the attention of layers 0 and 2: on these prompts its drafts are accepted and rejected.
    return SkipPolicy(skip_attention=(0, 2), draft=DraftSettings(max_draft_tokens=4))


@pytest.fixture(scope="module")
def benchmark(model: torch.nn.Module) -> dict:
    """One benchmark run of every method; every call a method receives is recorded in order."""
    methods = build_methods(model, METHOD_NAMES, (), {"skip-attn-0-2": _policy()})
    calls: list[tuple[str, int]] = []

    def recorded(method: Method) -> Method:
        inner = method.run

        def run(ids: list[int], max_new: int):
            calls.append((method.name, max_new))
            return inner(ids, max_new)

        return Method(method.name, run, method.policy)

    methods = [recorded(m) for m in methods]
    config = BenchConfig(max_new_tokens=NEW_TOKENS, warmup_tokens=WARMUP_TOKENS, progress=False)
    # Module fixtures run before conftest's function-scoped one-thread fixture: set it here too,
    # or torch's thread pool spin-waits on this shared 2-core machine (~40x slower tiny decodes).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = run_benchmark(model, methods, PROMPTS, PROMPT_IDS, config)
    finally:
        torch.set_num_threads(threads)
    return {"methods": methods, "rows": rows, "summary": summarise(rows), "calls": calls}


# -- build_methods ---------------------------------------------------------------------------------


def test_build_methods_names_and_policies(model: torch.nn.Module) -> None:
    methods = build_methods(model, METHOD_NAMES, (), {"skip-attn-0-2": _policy()})
    assert [m.name for m in methods] == METHOD_NAMES
    by_name = {m.name: m for m in methods}
    assert by_name["self-spec"].policy == _policy()
    lookup = by_name["self-spec-lookup"].policy
    assert lookup is not None and not lookup.draft.use_skip_draft and lookup.draft.lookup_max_ngram == 3
    assert by_name["ar"].policy is None and by_name["hf-ar"].policy is None


def test_build_methods_adds_the_baseline_and_expands_policies(model: torch.nn.Module) -> None:
    policies = {"one": _policy(), "two": SkipPolicy(skip_mlp=(2,))}
    names = [m.name for m in build_methods(model, ["ar", "self-spec"], (), policies)]
    assert names == ["hf-ar", "ar", "self-spec:one", "self-spec:two"]  # hf-ar: every figure is a ratio to it


@pytest.mark.parametrize(
    "names, policies, match",
    [
        (["ar", "no-such-method"], {}, "unknown method"),
        (["hf-ar", "self-spec"], {}, "needs a policy"),
        (["hf-assistant"], {}, "assistant"),
    ],
    ids=["unknown-method", "self-spec-without-policy", "hf-assistant-without-model"],
)
def test_build_methods_rejects_bad_requests(model: torch.nn.Module, names: list[str], policies: dict, match: str):
    with pytest.raises(LayerskipError, match=match):
        build_methods(model, names, (), policies)


def test_ablate_adds_each_ingredient_off(model: torch.nn.Module) -> None:
    hybrid = SkipPolicy(
        skip_attention=(1,), draft=DraftSettings(max_draft_tokens=3, draft_vocab_size=64, lookup_max_ngram=3)
    )
    methods = {m.name: m.policy for m in build_methods(model, ["self-spec"], (), {"h": hybrid}, ablate=True)}
    assert list(methods) == [
        "hf-ar",
        "self-spec:h",
        "self-spec:h-no-lookup",
        "self-spec:h-lookup-only",
        "self-spec:h-full-head",
        "self-spec:h-no-bypass",
    ]
    assert methods["self-spec:h-no-lookup"].draft.lookup_max_ngram == 0
    assert methods["self-spec:h-no-lookup"].skip_attention == (1,)
    only = methods["self-spec:h-lookup-only"]
    assert not only.draft.use_skip_draft and not only.bypasses_anything and only.draft.lookup_max_ngram == 3
    assert methods["self-spec:h-full-head"].draft.draft_vocab_size == 0
    assert methods["self-spec:h-full-head"].draft.lookup_max_ngram == 3
    bare = methods["self-spec:h-no-bypass"]
    assert not bare.bypasses_anything and bare.draft == hybrid.draft  # same head and precision, nothing bypassed
    # A plain skip policy has no ingredient to remove.
    plain = [m.name for m in build_methods(model, ["self-spec"], (), {"p": _policy()}, ablate=True)]
    assert plain == ["hf-ar", "self-spec"]


def test_early_exit_depth(model: torch.nn.Module) -> None:
    assert bench._early_exit_depth(model, SkipPolicy.early_exit(LAYERS, 3)) == 3
    assert bench._early_exit_depth(model, _policy()) == LAYERS // 2  # not a prefix draft
    assert bench._early_exit_depth(model, None) == LAYERS // 2


# -- run_benchmark -----------------------------------------------------------------------------------


def test_warmup_then_interleaved_rotating_order(benchmark: dict) -> None:
    names = [m.name for m in benchmark["methods"]]
    calls = benchmark["calls"]
    assert calls[: len(names)] == [(n, WARMUP_TOKENS) for n in names]  # every method warmed up first
    first, second = calls[len(names) : 2 * len(names)], calls[2 * len(names) :]
    assert [n for n, _ in first] == names
    assert [n for n, _ in second] == names[1:] + names[:1]  # the order rotates from prompt to prompt
    assert all(max_new == NEW_TOKENS for _, max_new in first + second)


def test_rows(benchmark: dict) -> None:
    rows = benchmark["rows"]
    assert len(rows) == len(PROMPTS) * len(METHOD_NAMES)
    assert {(r.prompt_id, r.category) for r in rows} == {("p0", "a"), ("p1", "b")}
    for row in rows:
        assert row.new_tokens == NEW_TOKENS  # the tiny model has no EOS
        assert row.seconds > 0 and row.tokens_per_second == pytest.approx(NEW_TOKENS / row.seconds)
        if row.method in LOSSLESS or row.method == "hf-ar":
            assert row.identical is True and row.divergence is None, row
        if row.method == "ar":
            assert row.steps == NEW_TOKENS and row.drafted == 0 and row.accepted == 0
        if row.method in ("self-spec", "self-spec-lookup"):
            assert 1 <= row.steps <= NEW_TOKENS and 0 <= row.accepted <= row.drafted
        if row.method.startswith("hf-"):
            assert row.steps is None and row.drafted is None
    accepted = sum(r.accepted for r in rows if r.method == "self-spec")
    drafted = sum(r.drafted for r in rows if r.method == "self-spec")
    assert 0 < accepted < drafted  # the draft was both accepted and rejected: a real test


def test_summary_structure(benchmark: dict) -> None:
    summary = benchmark["summary"]
    assert list(summary) == METHOD_NAMES
    for name, figures in summary.items():
        assert set(figures) == {"overall", "by_category"}, name
        assert set(figures["by_category"]) == {"a", "b"}, name
        assert FIGURE_KEYS <= set(figures["overall"]), name
        assert figures["overall"]["n_prompts"] == 2
        for category in ("a", "b"):
            assert FIGURE_KEYS <= set(figures["by_category"][category]), (name, category)
            assert figures["by_category"][category]["n_prompts"] == 1
        assert figures["overall"]["new_tokens"] == 2 * NEW_TOKENS
        assert figures["overall"]["tokens_per_second"] > 0 and figures["overall"]["speedup"] > 0


def test_summary_figures(benchmark: dict) -> None:
    summary = benchmark["summary"]
    base = summary["hf-ar"]
    assert base["overall"]["speedup"] == 1.0
    assert all(c["speedup"] == 1.0 for c in base["by_category"].values())
    for name in ("hf-ar", *LOSSLESS):
        assert summary[name]["overall"]["identical_fraction"] == 1.0, name
        assert all(c["identical_fraction"] == 1.0 for c in summary[name]["by_category"].values()), name
        assert summary[name]["overall"]["divergences"] == []
    for name in ("hf-ar", "ar"):
        assert summary[name]["overall"]["mean_accepted"] == 1.0
        assert summary[name]["overall"]["acceptance_rate"] is None
        assert all(c["mean_accepted"] == 1.0 for c in summary[name]["by_category"].values())
    rows = [r for r in benchmark["rows"] if r.method == "self-spec"]
    spec = summary["self-spec"]["overall"]
    assert spec["mean_accepted"] == pytest.approx(2 * NEW_TOKENS / sum(r.steps for r in rows))
    assert spec["acceptance_rate"] == pytest.approx(sum(r.accepted for r in rows) / sum(r.drafted for r in rows))
    assert spec["mean_accepted"] > 1.0 and 0 < spec["acceptance_rate"] < 1
    assert summary["hf-pld"]["overall"]["mean_accepted"] is None  # HF does not expose its forward count

    # Speedup is aggregate throughput (total tokens / total seconds) over the baseline's, same prompts.
    def aggregate(name: str, category: str | None = None) -> float:
        rows = [r for r in benchmark["rows"] if r.method == name and category in (None, r.category)]
        return sum(r.new_tokens for r in rows) / sum(r.seconds for r in rows)

    for name in METHOD_NAMES:
        assert summary[name]["overall"]["speedup"] == pytest.approx(aggregate(name) / aggregate("hf-ar"))
        for category in ("a", "b"):
            expected = aggregate(name, category) / aggregate("hf-ar", category)
            assert summary[name]["by_category"][category]["speedup"] == pytest.approx(expected)


def test_time_profile(benchmark: dict) -> None:
    """Our methods carry a per-token time split that adds up to their measured time; HF methods none."""
    summary = benchmark["summary"]
    for name in ("hf-ar", "hf-pld"):
        assert summary[name]["overall"]["profile"] is None
    for name in LOSSLESS:
        profile = summary[name]["overall"]["profile"]
        rows = [r for r in benchmark["rows"] if r.method == name]
        total_ms = 1000 * sum(r.seconds for r in rows) / sum(r.new_tokens for r in rows)
        assert profile["total_ms"] == pytest.approx(total_ms)
        parts = profile["prefill_ms"] + profile["draft_ms"] + profile["verify_ms"] + profile["other_ms"]
        assert parts == pytest.approx(total_ms, rel=1e-6)
        assert profile["verify_ms"] > 0
    assert summary["ar"]["overall"]["profile"]["draft_ms"] == 0.0
    assert summary["self-spec"]["overall"]["profile"]["draft_ms"] > 0
    assert summary["self-spec"]["overall"]["profile"]["lookup_share"] == 0.0
    assert 0.0 <= summary["self-spec-lookup"]["overall"]["profile"]["lookup_share"] <= 1.0


def test_a_divergence_is_recorded_and_classed(model: torch.nn.Module) -> None:
    """A method that leaves the reference is flagged: where, the two tokens, the fp32 gap against the
    error bound, and its class (in fp32 a wrong token is a defect); the summary counts it."""
    baseline = build_methods(model, ["hf-ar"], (), {})

    def wrong(ids: list[int], max_new: int):
        tokens, _ = baseline[0].run(ids, max_new)
        if len(tokens) > 3:  # not in the 2-token warm-up
            tokens[3] = (tokens[3] + 1) % VOCAB
        return tokens, None

    config = BenchConfig(max_new_tokens=6, warmup_tokens=2, progress=False)
    rows = run_benchmark(model, [*baseline, Method("broken", wrong)], PROMPTS[:1], PROMPT_IDS[:1], config)
    broken = next(r for r in rows if r.method == "broken")
    reference = next(r for r in rows if r.method == "hf-ar")
    assert broken.identical is False and reference.divergence is None
    found = broken.divergence
    assert found["position"] == 3 and found["class"] == "defect"
    assert found["method_token"] == (found["reference_token"] + 1) % VOCAB
    assert found["fp32_gap"] > found["error_bound"] > 0 and found["dtype"] == "float32"
    figures = summarise(rows)["broken"]["overall"]
    assert figures["identical_fraction"] == 0.0 and figures["divergences"] == [found]
    assert (figures["n_identical"], figures["n_rounding"], figures["n_defect"]) == (0, 0, 1)
    assert summarise(rows)["hf-ar"]["overall"]["n_identical"] == 1
    results = {"methods": summarise(rows), "per_prompt": bench.rows_as_dicts(rows)}
    table = report_module.markdown_report(results)
    assert "| broken | p0 | 3 |" in table and "| defect |" in table
    assert "| 0 / 0 / 1 |" in report_module.markdown_table(results)


def test_bf16_bench_classes_every_method_hf_pld_included(monkeypatch: pytest.MonkeyPatch) -> None:
    """In bf16 each method's figures count identical / rounding / defect, HF's prompt lookup
    included; a method with a real defect (a draft accepted past the first mismatch) is counted
    a defect, the same policy run correctly is not."""
    from oracles import one_past_the_mismatch

    from layerskip.engine import verifiers

    model = tiny_model("mistral").to(torch.bfloat16)  # sliding window 4; the prompts of test_divergence
    prompt_ids = [random_prompt(seed=0), random_prompt(seed=2)]
    policy = _policy()
    methods = build_methods(model, ["hf-ar", "self-spec", "hf-pld"], (), {"p": policy})

    sloppy = build_methods(model, ["self-spec"], (), {"p": policy})[1].run

    def defective(ids: list[int], max_new: int):
        with monkeypatch.context() as patch:
            patch.setattr(verifiers, "accept_tree_greedy", one_past_the_mismatch)
            return sloppy(ids, max_new)

    methods.append(Method("sloppy", defective, policy))
    config = BenchConfig(max_new_tokens=16, warmup_tokens=2, progress=False)
    rows = run_benchmark(model, methods, PROMPTS, prompt_ids, config)
    summary = summarise(rows)
    for name in ("hf-ar", "self-spec", "hf-pld", "sloppy"):
        o = summary[name]["overall"]
        assert o["n_identical"] + o["n_rounding"] + o["n_defect"] + o["n_unclassified"] == 2, name
        assert o["n_defect"] == sum(d["class"] == "defect" for d in o["divergences"]), name
    assert summary["self-spec"]["overall"]["n_defect"] == 0
    assert summary["sloppy"]["overall"]["n_defect"] == 2
    for row in rows:
        if row.divergence is not None:
            assert {"position", "reference_token", "method_token", "fp32_gap", "error_bound", "class"} <= set(
                row.divergence
            )
            assert row.divergence["dtype"] == "bfloat16"
    table = list(csv.reader(io.StringIO(report_module.csv_text({"methods": summary}))))
    assert table[0][-3:] == ["n_identical", "n_rounding", "n_defect"]
    assert [r[-1] for r in table[1:] if r[:2] == ["sloppy", "overall"]] == ["2"]


def test_truncated_head_policy_in_the_benchmark(model: torch.nn.Module) -> None:
    """A policy with draft_vocab_size runs its own rows in the benchmark and stays lossless."""
    truncated = SkipPolicy(
        skip_attention=(1,), draft=DraftSettings(draft_vocab_size=32), draft_vocabulary=tuple(range(VOCAB - 1, 0, -1))
    )
    methods = build_methods(model, ["self-spec"], (), {"full": _policy(), "truncated": truncated})
    assert [m.name for m in methods] == ["hf-ar", "self-spec:full", "self-spec:truncated"]
    reference, _ = methods[0].run(PROMPT_IDS[0], NEW_TOKENS)
    for method in methods[1:]:
        tokens, stats = method.run(PROMPT_IDS[0], NEW_TOKENS)
        assert tokens == reference, method.name
        assert stats.drafted > 0


def test_one_outside_clock_for_every_method(model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every method is timed by the same clock around the whole call: for our engine the row's
    seconds enclose everything its own stats clock saw (set-up included), never less."""
    from layerskip.stats import DeviceClock

    ticks = iter(range(100_000))
    monkeypatch.setattr(DeviceClock, "now", lambda self: float(next(ticks)))  # every reading one tick later
    methods = build_methods(model, ["ar", "self-spec"], (), {"p": _policy()})
    config = BenchConfig(max_new_tokens=4, warmup_tokens=2, progress=False)
    rows = run_benchmark(model, methods, PROMPTS[:1], PROMPT_IDS[:1], config)
    for row in rows:
        assert row.seconds >= 1
        if row.stats is not None:
            assert row.seconds > row.stats.total_seconds > 0


# -- sampled runs and memory --------------------------------------------------------------------------

SAMPLED = Sampling(temperature=1.0)


def test_a_sampled_benchmark_samples_every_method_seeded_per_prompt(model: torch.nn.Module) -> None:
    """With sampling, every method draws (HF's through generate(do_sample=True)), each prompt's draws
    seeded alike for every method and every run; nothing is compared token for token."""
    policies = {"skip-attn-0-2": _policy()}
    methods = build_methods(model, METHOD_NAMES, (), policies, sampling=SAMPLED, seed=3)
    config = BenchConfig(NEW_TOKENS, WARMUP_TOKENS, progress=False, sampling=SAMPLED)
    rows = run_benchmark(model, methods, PROMPTS, PROMPT_IDS, config)
    assert len(rows) == len(PROMPTS) * len(METHOD_NAMES)
    assert all(row.identical is None and row.divergence is None for row in rows)
    for name, figures in summarise(rows).items():
        overall = figures["overall"]
        assert overall["identical_fraction"] is None and "n_identical" not in overall, name
        assert overall["speedup"] is not None and overall["n_prompts"] == len(PROMPTS)
    greedy = {m.name: m for m in build_methods(model, METHOD_NAMES, (), policies)}
    for method in methods:
        draws = [method.run(ids, NEW_TOKENS)[0] for ids in PROMPT_IDS]
        if method.name in ("hf-ar", "ar", "hf-pld"):  # no draft choice changes the draws: they repeat
            assert draws == [method.run(ids, NEW_TOKENS)[0] for ids in PROMPT_IDS], method.name
        assert draws != [greedy[method.name].run(ids, NEW_TOKENS)[0] for ids in PROMPT_IDS], method.name
    assert prompt_seed(PROMPT_IDS[0], 3) != prompt_seed(PROMPT_IDS[1], 3)
    assert prompt_seed(PROMPT_IDS[0], 3) == prompt_seed(list(PROMPT_IDS[0]), 3) != prompt_seed(PROMPT_IDS[0], 4)


def test_a_call_peak_is_measured_after_a_larger_one() -> None:
    """The high-water mark is reset before each call: a call that needs nothing shows nothing, even
    after one that needed 64 MiB."""
    cpu = torch.device("cpu")

    def large() -> None:
        torch.ones(16 * 2**20).sum()  # 64 MiB, freed on return

    first = call_growth_mb(large, cpu)
    if first is None:
        pytest.skip("this system cannot reset the resident high-water mark")
    assert first >= 60
    assert call_growth_mb(lambda: None, cpu) < 30


def test_memory_per_method(model: torch.nn.Module) -> None:
    int4 = SkipPolicy(skip_attention=(1,), draft=DraftSettings(precision="int4"))
    methods = build_methods(model, ["hf-ar", "self-spec"], (), {"int4": int4})
    memory = measure_memory(methods, PROMPT_IDS, 4, torch.device("cpu"), 500.0)
    if memory is None:
        pytest.skip("this system cannot reset the resident high-water mark")
    assert memory["prompt_tokens"] == max(len(ids) for ids in PROMPT_IDS) and memory["new_tokens"] == 4
    figures = memory["methods"]
    assert list(figures) == ["hf-ar", "self-spec"]
    for name, one in figures.items():
        assert one["loaded_mb"] == 500.0 and one["call_mb"] >= 0, name
        assert one["peak_mb"] == pytest.approx(one["loaded_mb"] + one["draft_mb"] + one["call_mb"])
    assert figures["hf-ar"]["draft_mb"] == 0 and figures["self-spec"]["draft_mb"] > 0  # its int4 copy
    assert measure_memory(methods, PROMPT_IDS, 4, torch.device("cpu"), None) is None


# -- report files ------------------------------------------------------------------------------------


def test_held_out_split(benchmark: dict) -> None:
    """A method whose policy names its tuning categories also gets figures over the others."""
    summary = summarise(benchmark["rows"], {"self-spec": frozenset({"a"})})
    split = summary["self-spec"]["split"]
    assert split["tuned_categories"] == ["a"]
    by_category = summary["self-spec"]["by_category"]
    assert split["tuned"]["speedup"] == pytest.approx(by_category["a"]["speedup"])
    assert split["held_out"]["speedup"] == pytest.approx(by_category["b"]["speedup"])
    assert split["held_out"]["n_prompts"] == 1
    assert all("split" not in summary[name] for name in METHOD_NAMES if name != "self-spec")
    everything = summarise(benchmark["rows"], {"self-spec": frozenset({"a", "b"})})["self-spec"]["split"]
    assert everything["held_out"] is None  # tuned on every category: nothing held out, and it says so
    table = held_out_table({"methods": summary})
    assert "| self-spec | a |" in table
    assert "no other category" in held_out_table({"methods": {"self-spec": {"split": everything}}})


def test_tuning_categories() -> None:
    tuned = SkipPolicy(skip_attention=(1,), provenance={"calibration": {"categories": ["qa", "rag"]}})
    assert bench.tuning_categories(tuned) == frozenset({"qa", "rag"})
    assert bench.tuning_categories(SkipPolicy(skip_attention=(1,))) is None
    assert bench.tuning_categories(None) is None


def _results(benchmark: dict) -> dict:
    env = bench.environment(torch.device("cpu"))
    return {
        "command": "layerskip-bench --model tiny-llama",
        "device": env["device"],
        "device_name": env.get("cpu_model", env["device_name"]),
        "dtype": "float32",
        "versions": env["versions"],
        "model": "tiny-llama",
        "max_new_tokens": NEW_TOKENS,
        "prompts": {"source": "test", "n": len(PROMPTS), "categories": ["a", "b"]},
        "policies": {"skip-attn-0-2": _policy().to_dict()},
        "methods": benchmark["summary"],
        "per_prompt": bench.rows_as_dicts(benchmark["rows"]),
        "environment": env,
    }


def test_write_outputs(benchmark: dict, tmp_path: Path) -> None:
    results = _results(benchmark)
    paths = write_outputs(results, tmp_path / "out")
    assert [p.name for p in paths] == list(OUTPUT_FILES)
    assert_output_files(tmp_path / "out", METHOD_NAMES, ["a", "b"])
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["versions"]["torch"] == torch.__version__
    assert len(saved["per_prompt"]) == len(benchmark["rows"])


def test_write_outputs_replaces_an_earlier_run_whole_or_not_at_all(
    benchmark: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--out naming an earlier run: a figure that fails to draw leaves that run's files untouched."""
    out = tmp_path / "run"
    results = _results(benchmark)
    write_outputs(results, out)
    before = {name: (out / name).read_bytes() for name in OUTPUT_FILES}

    def broken_figure(results: dict) -> bytes:
        raise RuntimeError("cannot draw")

    monkeypatch.setattr(report_module, "speedup_png", broken_figure)
    with pytest.raises(RuntimeError, match="cannot draw"):
        write_outputs({**results, "model": "another"}, out)
    assert {name: (out / name).read_bytes() for name in OUTPUT_FILES} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"], "a staging directory was left behind"
    monkeypatch.undo()
    write_outputs({**results, "model": "another"}, out)
    assert json.loads((out / "results.json").read_text())["model"] == "another"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def assert_output_files(directory: Path, methods: list[str], categories: list[str]) -> dict:
    """The four report files exist and agree with each other; returns results.json."""
    for name in OUTPUT_FILES:
        assert (directory / name).is_file() and (directory / name).stat().st_size > 0, name
    results = json.loads((directory / "results.json").read_text())
    assert RESULT_KEYS <= set(results), RESULT_KEYS - set(results)
    assert list(results["methods"]) == methods
    table = list(csv.reader(io.StringIO((directory / "results.csv").read_text())))
    assert table[0] == ["method", "category", *COLUMNS]
    assert [(r[0], r[1]) for r in table[1:]] == [(m, c) for m in methods for c in ["overall", *categories]]
    figures, _, profile = (directory / "results.md").read_text().partition("Time per generated token (ms):")
    markdown = figures.strip().split("\n\n")[0].splitlines()  # the figures table (a held-out table may follow)
    assert markdown[0].startswith("| method |") and all(c in markdown[0] for c in categories)
    assert [line.split("|")[1].strip() for line in markdown[2:]] == methods
    ours = [m for m in methods if not m.startswith("hf-")]
    profile_rows = profile.strip().splitlines()[2:]
    assert [line.split("|")[1].strip() for line in profile_rows] == ours  # the time split of our methods
    assert (directory / "speedup.png").read_bytes().startswith(PNG_SIGNATURE)
    return results


# -- the command line ----------------------------------------------------------------------------------


def run_bench(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return run_script("bench.py", *args, timeout=timeout)


@pytest.fixture(scope="module")
def cli_inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A tiny Llama checkpoint with a word-level tokenizer, a policy made for it, and a 2-prompt JSONL."""
    root = tmp_path_factory.mktemp("bench-cli")
    model = tiny_model("llama")
    save_checkpoint(model, root / "tiny-llama")
    policy = SkipPolicy(
        skip_attention=(1,), skip_mlp=(2,), provenance={"calibration": {"categories": ["qa"]}}
    ).with_model(model, "tiny-llama")
    prompts = root / "prompts.jsonl"
    rows = [
        {"question_id": "q1", "category": "writing", "turns": ["hello world w1 w2 w3 w4 w5 w6", "second turn"]},
        {"question_id": "q2", "category": "qa", "turns": ["w7 w8 hello w9 w10 world w11 w12"]},
    ]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return {
        "model": str(root / "tiny-llama"),
        "policy": str(policy.save(root / "tiny.json")),
        "prompts": str(prompts),
        "root": str(root),
    }


def test_cli_end_to_end(cli_inputs: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "results"
    result = run_bench(
        "--model", cli_inputs["model"], "--prompts", cli_inputs["prompts"], "--methods", "hf-ar,ar,self-spec",
        "--policy", cli_inputs["policy"], "--max-new-tokens", "8", "--out", str(out), "--no-progress", "--no-chat",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    results = assert_output_files(out, ["hf-ar", "ar", "self-spec"], ["mt_bench", "qa"])  # writing -> mt_bench
    for name in ("ar", "self-spec"):
        assert results["methods"][name]["overall"]["identical_fraction"] == 1.0, name
        assert results["methods"][name]["overall"]["n_prompts"] == 2
    assert results["methods"]["hf-ar"]["overall"]["speedup"] == 1.0
    assert results["command"].startswith("layerskip-bench --model ")
    assert results["model"] == "tiny-llama" and results["dtype"] == "float32" and results["device"] == "cpu"
    assert results["prompts"]["n"] == 2 and results["prompts"]["categories"] == ["mt_bench", "qa"]
    assert results["policies"]["tiny"]["skip_attention"] == [1]
    assert len(results["per_prompt"]) == 6
    assert all(0 < row["new_tokens"] <= 8 for row in results["per_prompt"])
    spec = [row for row in results["per_prompt"] if row["method"] == "self-spec"]
    assert sum(row["drafted"] for row in spec) > 0  # the draft really ran
    assert result.stderr.count("wrote ") == len(OUTPUT_FILES)
    assert "| self-spec |" in result.stdout  # the Markdown table goes to stdout
    assert (
        "Time per generated token" in result.stdout and "Time per generated token" in (out / "results.md").read_text()
    )
    # The policy says it was tuned on qa: its figures are also split into qa vs the rest (held out).
    split = results["methods"]["self-spec"]["split"]
    assert split["tuned_categories"] == ["qa"]
    assert split["tuned"]["n_prompts"] == 1 and split["held_out"]["n_prompts"] == 1
    assert "split" not in results["methods"]["ar"]
    assert "Held-out check" in (out / "results.md").read_text()

    # --from-results re-summarises the saved rows without a model: the same figures come back.
    again = tmp_path / "again"
    redo = run_bench("--from-results", str(out / "results.json"), "--out", str(again))
    assert redo.returncode == 0, redo.stdout + redo.stderr
    resummarised = assert_output_files(again, ["hf-ar", "ar", "self-spec"], ["mt_bench", "qa"])
    for name, figures in results["methods"].items():
        for key in ("speedup", "mean_accepted", "acceptance_rate", "identical_fraction"):
            assert resummarised["methods"][name]["overall"][key] == pytest.approx(figures["overall"][key]), (name, key)
    assert resummarised["methods"]["self-spec"]["split"]["held_out"]["speedup"] == pytest.approx(
        split["held_out"]["speedup"]
    )


def test_cli_sampled(cli_inputs: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "sampled"
    result = run_bench(
        "--model", cli_inputs["model"], "--prompts", cli_inputs["prompts"], "--methods", "hf-ar,hf-pld,self-spec",
        "--policy", cli_inputs["policy"], "--max-new-tokens", "8", "--temperature", "0.7", "--top-p", "0.9",
        "--out", str(out), "--no-progress", "--no-chat",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    results = json.loads((out / "results.json").read_text())
    assert results["sampled"] == {"temperature": 0.7, "top_k": 0, "top_p": 0.9, "seed": 0}
    assert all(row["identical"] is None for row in results["per_prompt"])
    assert "Sampled (T 0.7, top-p 0.9)" in result.stdout and "n/a (sampled)" in result.stdout
    if results["memory"] is not None:  # where /proc lets the peak be reset
        assert list(results["memory"]["methods"]) == ["hf-ar", "hf-pld", "self-spec"]
        assert "peak memory, MiB" in (out / "results.md").read_text()
    assert read_result_file(out / "results.json").sampled  # the results tables take it, as a sampled run


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["--top-p", "0.9"], ["--top-p", "--temperature"]),
        (["--temperature", "0"], ["temperature must be"]),
        (["--temperature", "0.7", "--top-p", "2"], ["top_p must be"]),
        (["--temperature", "0.7", "--batch-size", "2"], ["--batch-size", "greedy"]),
    ],
    ids=["top-p-alone", "zero-temperature", "top-p-above-1", "batches"],
)
def test_cli_sampling_options_refused_before_any_model_loads(
    bench_cli, tmp_path: Path, args: list[str], fragments: list[str]
) -> None:
    result = bench_cli("--model", str(tmp_path / "no-model"), "--out", str(tmp_path / "o"), *args)
    assert_bad_input(result, *fragments)


@pytest.fixture
def bench_cli(capsys: pytest.CaptureFixture[str]):
    """``layerskip-bench ARGS`` in this process: the script's own ``main`` and one-line-error path,
    without an interpreter start-up per bad-input case."""
    from layerskip.cli.bench import main

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return run_in_process(main, capsys, *args)

    return run


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["--batch-size", "1,2", "--batch-layouts", ","], ["--batch-layouts names no layout"]),
        (["--batch-size", ","], ["--batch-size names no batch size"]),
    ],
    ids=["no-layout", "no-size"],
)
def test_cli_an_empty_batch_list_is_refused(bench_cli, tmp_path: Path, args: list[str], fragments: list[str]) -> None:
    """No layout ran nothing and wrote an empty table; no size ran the per-prompt benchmark instead."""
    result = bench_cli("--model", str(tmp_path / "no-model"), "--out", str(tmp_path / "o"), *args)
    assert_bad_input(result, *fragments)
    assert not (tmp_path / "o").exists()


def test_cli_from_results_bad_file(bench_cli, tmp_path: Path) -> None:
    bad = tmp_path / "results.json"
    bad.write_text("[1, 2]")
    assert_bad_input(bench_cli("--from-results", str(bad), "--out", str(tmp_path / "o")), "not a layerskip-bench")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("kind", ["nested-deep", "fifo"])
def test_cli_from_results_that_no_reader_should_take(bench_cli, tmp_path: Path, kind: str) -> None:
    """Deep nesting used to end in RecursionError; a FIFO would block the reader for good."""
    bad = tmp_path / "results.json"
    if kind == "fifo":
        os.mkfifo(bad)
    else:
        bad.write_text("[" * 100_000 + "]" * 100_000)
    reason = "nests deeper" if kind == "nested-deep" else "not a regular file"
    assert_bad_input(bench_cli("--from-results", str(bad), "--out", str(tmp_path / "o")), "--from-results", reason)
    assert not (tmp_path / "o").exists()


def test_cli_out_holding_a_fifo_where_a_report_goes(bench_cli, tmp_path: Path) -> None:
    """The report files are replaced as a set; a FIFO among them is refused before any work, and stays."""
    source = tmp_path / "source.json"
    source.write_text("[1]")
    (tmp_path / "o").mkdir()
    os.mkfifo(tmp_path / "o" / "results.md")
    assert_bad_input(bench_cli("--from-results", str(source), "--out", str(tmp_path / "o")), "not a regular file")
    assert [p.name for p in (tmp_path / "o").iterdir()] == ["results.md"]


def test_cli_unknown_method(bench_cli, cli_inputs: dict[str, str], tmp_path: Path) -> None:
    result = bench_cli("--model", cli_inputs["model"], "--methods", "ar,turbo", "--out", str(tmp_path))
    assert_bad_input(result, "unknown method", "turbo")


def test_cli_self_spec_without_policy(bench_cli, cli_inputs: dict[str, str], tmp_path: Path) -> None:
    result = bench_cli("--model", cli_inputs["model"], "--methods", "ar,self-spec", "--out", str(tmp_path))
    assert_bad_input(result, "needs a policy", "--policy")


@pytest.mark.parametrize(
    "identity, fragments",
    [
        (ModelIdentity(name="other", architecture="gpt2", num_layers=LAYERS), ("'gpt2' model", "'llama'")),
        (ModelIdentity(name="other", architecture="llama", num_layers=7), ("7-layer model", f"{LAYERS} layers")),
    ],
    ids=["architecture", "num-layers"],
)
def test_cli_policy_for_another_model(
    bench_cli, cli_inputs: dict[str, str], tmp_path: Path, identity: ModelIdentity, fragments: tuple[str, ...]
) -> None:
    policy = str(SkipPolicy(skip_mlp=(1,), model=identity).save(tmp_path / "other.json"))
    result = bench_cli(
        "--model", cli_inputs["model"], "--prompts", cli_inputs["prompts"], "--policy", policy,
        "--max-new-tokens", "4", "--out", str(tmp_path / "out"), "--no-progress", "--no-chat",
    )  # fmt: skip
    line = assert_bad_input(result, "policy other:", *fragments)
    assert not (tmp_path / "out").exists(), line  # nothing was benchmarked or written


def test_cli_missing_prompts_file(bench_cli, cli_inputs: dict[str, str], tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.jsonl"
    result = bench_cli(
        "--model", cli_inputs["model"], "--prompts", str(missing), "--methods", "ar", "--out", str(tmp_path / "out")
    )
    assert_bad_input(result, "not found", "nowhere.jsonl")


def test_cli_per_category_zero(bench_cli, cli_inputs: dict[str, str], tmp_path: Path) -> None:
    result = bench_cli(
        "--model", cli_inputs["model"], "--per-category", "0", "--methods", "ar", "--out", str(tmp_path / "out")
    )
    assert_bad_input(result, "--per-category must be > 0")


# -- faults: each ends in one line before any work, and leaves no file behind ------------------------------------
@pytest.mark.parametrize(
    "rows",
    [[{"method": "ar"}], [[1, 2]], ["x"], [{"method": 3, "category": "a", "stats": "broken"}]],
    ids=["missing-fields", "list-row", "string-row", "bad-stats"],
)
def test_cli_from_results_malformed_rows(bench_cli, tmp_path: Path, rows: list) -> None:
    bad = tmp_path / "results.json"
    bad.write_text(json.dumps({"per_prompt": rows, "policies": {}}))
    assert_bad_input(bench_cli("--from-results", str(bad), "--out", str(tmp_path / "o")), "not a layerskip-bench")
    assert not (tmp_path / "o").exists()


def test_cli_out_that_is_a_file_or_under_a_file(bench_cli, cli_inputs: dict[str, str], tmp_path: Path) -> None:
    taken = tmp_path / "taken"
    taken.write_text("mine")
    # --model names nothing loadable: these checks must come before the model is loaded.
    for out, fragment in ((taken, "is a file"), (taken / "sub", "is a file, not a directory")):
        result = bench_cli("--model", str(tmp_path / "no-model"), "--methods", "ar", "--out", str(out))
        assert_bad_input(result, "--out", fragment)
    assert taken.read_text() == "mine"


def test_cli_out_holding_files_no_bench_wrote(bench_cli, benchmark: dict, tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "results.json").write_text('{"my": "data"}')
    args = ["--model", str(tmp_path / "no-model"), "--methods", "ar", "--out", str(out)]
    assert_bad_input(bench_cli(*args), "--out", "holds results.json, which no layerskip-bench run wrote", "--force")
    assert (out / "results.json").read_text() == '{"my": "data"}'
    assert_bad_input(bench_cli(*args, "--force"), "unknown model")  # forced: the run goes on
    (out / "results.json").unlink()
    (out / "results.csv").write_text("a,b\n")  # a report file with no bench results.json beside it
    assert_bad_input(bench_cli(*args), "holds results.csv")
    write_outputs(_results(benchmark), out)  # an earlier bench run's set is replaced without --force
    assert_bad_input(bench_cli(*args), "unknown model")


def test_cli_more_threads_than_cpus(bench_cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from layerskip.cli import common

    monkeypatch.setattr(common, "available_cpus", lambda: 2)
    args = ["--model", str(tmp_path / "no-model"), "--methods", "ar", "--out", str(tmp_path / "o")]
    assert_bad_input(bench_cli(*args, "--threads", "auto,1,999"), "--threads 999 is more than the 2 CPU(s)")
    assert not (tmp_path / "o").exists()


def test_cli_unwritable_out_is_refused_before_the_work(
    bench_cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != locked and real_access(path, mode))
    result = bench_cli("--model", str(tmp_path / "no-model"), "--methods", "ar", "--out", str(locked / "run"))
    assert_bad_input(result, "not writable", str(locked))


def test_cli_non_utf8_prompts(bench_cli, tmp_path: Path) -> None:
    prompts = tmp_path / "latin1.jsonl"
    prompts.write_bytes(json.dumps({"turns": ["caf\u00e9"]}).encode().replace(b"\\u00e9", "\xe9".encode("latin-1")))
    args = ["--prompts", str(prompts), "--methods", "ar", "--out", str(tmp_path / "o")]
    result = bench_cli("--model", str(tmp_path / "no-model"), *args)
    assert_bad_input(result, "not UTF-8", "line 1")
    assert not (tmp_path / "o").exists()


def test_cli_prompt_past_the_model_positions(bench_cli, cli_inputs: dict[str, str], tmp_path: Path) -> None:
    prompts = tmp_path / "long.jsonl"
    prompts.write_text(json.dumps({"question_id": "long", "turns": [" ".join(["hello world"] * 200)]}) + "\n")
    result = bench_cli(
        "--model", cli_inputs["model"], "--prompts", str(prompts), "--methods", "ar", "--max-new-tokens", "8",
        "--out", str(tmp_path / "o"), "--no-progress", "--no-chat",
    )  # fmt: skip
    assert_bad_input(result, "prompt long", "8 new tokens", "256 positions")
    assert not (tmp_path / "o").exists()


def test_cli_processors_go_to_every_method(bench_cli, cli_inputs: dict[str, str], tmp_path: Path) -> None:
    """Generation arguments that add logits processors reach HF's methods and ours alike: every
    output still equals HF generate's under the same processors, and the run records them."""
    config = tmp_path / "generation_config.json"
    config.write_text(json.dumps({"repetition_penalty": 1.3, "max_new_tokens": 99, "do_sample": False}))
    out = tmp_path / "processed"
    result = bench_cli(
        "--model", cli_inputs["model"], "--prompts", cli_inputs["prompts"], "--methods", "hf-ar,ar,self-spec",
        "--policy", cli_inputs["policy"], "--max-new-tokens", "8", "--out", str(out), "--no-progress", "--no-chat",
        "--generation-config", str(config), "--no-repeat-ngram-size", "2", "--suppress-tokens", "5,6",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    results = json.loads((out / "results.json").read_text())
    expected = {"repetition_penalty": 1.3, "no_repeat_ngram_size": 2, "suppress_tokens": [5, 6]}
    assert results["generation"] == expected  # the file's own max_new_tokens and do_sample are the bench's
    for name in ("ar", "self-spec"):
        assert results["methods"][name]["overall"]["identical_fraction"] == 1.0, name
    assert "--generation-config" in results["command"]


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["--min-new-tokens", "-1"], ["--min-new-tokens must be"]),
        (["--repetition-penalty", "0"], ["--repetition-penalty must be"]),
        (["--no-repeat-ngram-size", "0"], ["--no-repeat-ngram-size must be"]),
        (["--suppress-tokens", "a,b"], ["--suppress-tokens must be token ids"]),
        (["--generation-config", "missing.json"], ["--generation-config"]),
    ],
    ids=["min-new-tokens", "penalty", "ngram", "suppress", "config"],
)
def test_cli_processor_arguments_refused_before_any_model_loads(
    bench_cli, tmp_path: Path, args: list[str], fragments: list[str]
) -> None:
    result = bench_cli("--model", str(tmp_path / "no-model"), "--out", str(tmp_path / "o"), *args)
    assert_bad_input(result, *fragments)
