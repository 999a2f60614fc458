"""``auto``: calibrated at load (cached per model, dtype, device and machine), lossless while it
mixes prompt lookup and skip drafts, and open about what it chose."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from compare import assert_same_tokens, hf_greedy
from search_fixtures import generate_in_process
from tiny_models import ARCHS, random_prompt, save_checkpoint, tiny_model

from layerskip.drafts.builder import DraftModels, check_policy_fits, prepare_draft
from layerskip.drafts.drafters import auto as auto_module
from layerskip.drafts.drafters.auto import AutoDrafter, AutoState, HeadCoverage, best_skip_rate
from layerskip.drafts.policy.skip_policy import AutoSettings, SkipPolicy
from layerskip.drafts.policy.spec import load_policy
from layerskip.drafts.rules.costs import DraftCosts, expected_tokens
from layerskip.engine import calibration
from layerskip.engine import latency as engine_latency
from layerskip.engine.decoding import Decoder, DecodeSettings
from layerskip.errors import LayerskipError
from layerskip.machine import Machine
from layerskip.sampling import Sampling
from layerskip.stats import GenerationStats

NEW_TOKENS = 48


@functools.cache
def _model(arch: str) -> torch.nn.Module:
    return tiny_model(arch)


def _repetitive_prompt(length: int = 24) -> list[int]:
    """A prompt whose n-grams repeat, so that prompt lookup finds matches from the first step."""
    base = random_prompt(seed=5)
    return (base * (length // len(base) + 1))[:length]


def test_auto_is_a_policy_name() -> None:
    label, policy = load_policy("auto")
    assert label == "auto" and policy.auto is not None and policy.on_the_fly is not None
    assert not policy.draft.uses_trees and load_policy("auto-trees")[1].draft.uses_trees
    assert policy.draft.lookup_max_ngram and policy.draft.length_by_cost and policy.draft.precision == "int4"
    again = SkipPolicy.from_dict(policy.to_dict())
    assert again.auto == policy.auto  # a file can hold it too


def test_auto_needs_its_calibration() -> None:
    with pytest.raises(LayerskipError, match="calibration"):
        prepare_draft(_model("llama"), SkipPolicy.auto_choice())


def test_head_sizes_stop_below_the_vocabulary() -> None:
    assert AutoSettings(min_head_rows=1024, max_head_rows=8192).head_sizes(50_000) == (1024, 2048, 4096, 8192, 0)
    assert AutoSettings().head_sizes(128) == (0,)


def test_calibration_is_cached_and_keyed_by_machine_and_dtype(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_latency, "BUSY_SPREAD", float("inf"))  # a busy test machine still caches
    model = _model("llama")
    policy = SkipPolicy.auto_choice()
    models = DraftModels(model)
    first = calibration.calibrate(model, policy, models, root=tmp_path)
    assert first.info["cached"] is False and first.info["seconds"] > 0
    assert set(first.verify) >= {1, 2, 4, 8} and set(first.draft_step) == {0}
    # A batch's plain and draft steps, timed per row count (the tiny llama drafts rows together).
    assert set(first.batch_plain) == set(first.batch_draft) == set(calibration.BATCH_ROWS)
    again = calibration.calibrate(model, policy, models, root=tmp_path)
    assert again.info["cached"] is True and again.verify == first.verify and again.draft_step == first.draft_step
    assert again.batch_plain == first.batch_plain and again.batch_draft == first.batch_draft

    # Another CPU: the cached costs are not this machine's, so they are measured again.
    other = Machine("cpu", "Other CPU", "Other CPU", ("avx2",), 2)
    with monkeypatch.context() as patch:
        patch.setattr(calibration, "this_machine", lambda device: other)
        assert calibration.calibrate(model, policy, models, root=tmp_path).info["cached"] is False
    assert calibration.calibrate(model, policy, models, root=tmp_path).info["cached"] is True

    # Another dtype of the same weights: measured again.
    half = tiny_model("llama").to(torch.bfloat16)
    assert calibration.calibrate(half, policy, DraftModels(half), root=tmp_path).info["cached"] is False


def test_a_busy_calibration_is_not_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_latency, "BUSY_SPREAD", -1.0)  # every spread counts as busy
    model = _model("llama")
    costs = calibration.calibrate(model, SkipPolicy.auto_choice(), DraftModels(model), root=tmp_path)
    assert "machine looks busy" in costs.info["warning"] and not list(tmp_path.glob("costs-*.json"))


def test_a_damaged_cache_entry_is_measured_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_latency, "BUSY_SPREAD", float("inf"))
    model = _model("llama")
    policy = SkipPolicy.auto_choice()
    calibration.calibrate(model, policy, DraftModels(model), root=tmp_path)
    (entry,) = tmp_path.glob("costs-*.json")
    entry.write_text('{"key": ', encoding="utf-8")
    assert calibration.calibrate(model, policy, DraftModels(model), root=tmp_path).info["cached"] is False


def _damage_costs(change: str) -> Callable[[dict], None]:
    """A change to a cached entry's costs (``{"verify": ..., "draft_step": ...}``) by name: the
    plain step and verify curve in the latency entry, the rest in the costs entry."""
    changes: dict[str, Callable[[dict], None]] = {
        "verify-block-0": lambda costs: costs.update(verify={"0": 0.05}),
        "verify-blocks-negative": lambda costs: costs.update(verify={"-3": 0.05, "-1": 0.01}),
        "verify-block-missing": lambda costs: costs["verify"].pop("17"),
        "verify-key-not-a-number": lambda costs: costs["verify"].update({"abc": 0.01}),
        "infinite-draft-step": lambda costs: costs["draft_step"].update({"0": float("inf")}),
        "infinite-plain-step": lambda costs: costs.update(plain_step=float("inf")),
        "nan-verify": lambda costs: costs["verify"].update({"2": float("nan")}),
        "zero-plain-step": lambda costs: costs.update(plain_step=0),
        "cost-is-a-string": lambda costs: costs["verify"].update({"2": "fast"}),
        "cost-is-a-bool": lambda costs: costs["draft_step"].update({"0": True}),
        "head-sizes-not-in-key": lambda costs: costs.update(draft_step={"7": 1e-4, "-5": 1e-4, "9999999": 1e-4}),
        "extra-head-size": lambda costs: costs["draft_step"].update({"7": 1e-5}),
        "verify-a-list": lambda costs: costs.update(verify=[1, 2]),
        "batch-rows-not-in-key": lambda costs: costs["batch_plain"].update({"3": 0.01}),
        "zero-batch-draft": lambda costs: costs["batch_draft"].update({"2": 0}),
    }
    return changes[change]


DAMAGES = [
    "verify-block-0",
    "verify-blocks-negative",
    "verify-block-missing",
    "verify-key-not-a-number",
    "infinite-draft-step",
    "infinite-plain-step",
    "nan-verify",
    "zero-plain-step",
    "cost-is-a-string",
    "cost-is-a-bool",
    "head-sizes-not-in-key",
    "extra-head-size",
    "verify-a-list",
    "batch-rows-not-in-key",
    "zero-batch-draft",
]
CURVE_DAMAGES = {damage for damage in DAMAGES if "verify" in damage or "plain-step" in damage} | {"cost-is-a-string"}


@pytest.mark.parametrize("damage", DAMAGES)
def test_cached_costs_are_checked_against_their_key_and_measured_again(
    damage: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cache entry whose key matches but whose costs would divide by zero, leave the verify curve,
    price a head size never measured, or are not finite seconds: never used, measured again and
    replaced, so the next load reads a sound entry."""
    monkeypatch.setattr(engine_latency, "BUSY_SPREAD", float("inf"))
    model = _model("llama")
    policy = SkipPolicy.auto_choice()
    calibration.calibrate(model, policy, DraftModels(model), root=tmp_path)
    curve = damage in CURVE_DAMAGES
    (entry,) = tmp_path.glob("latency-*.json" if curve else "costs-*.json")
    data = json.loads(entry.read_text())
    _damage_costs(damage)(data if curve else data["costs"])
    entry.write_text(json.dumps(data))  # inf and nan as JSON's Infinity and NaN, which Python reads back
    again = calibration.calibrate(model, policy, DraftModels(model), root=tmp_path)
    assert again.info["cached"] is False
    assert set(again.draft_step) == {0} and min(again.verify) == 1
    assert calibration.calibrate(model, policy, DraftModels(model), root=tmp_path).info["cached"] is True


def test_auto_generates_after_a_cache_that_would_divide_by_zero(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole path a user takes: the damaged entry in the cache directory, then ``auto`` generates."""
    monkeypatch.setattr(engine_latency, "BUSY_SPREAD", float("inf"))
    monkeypatch.setenv(calibration.CACHE_ENV, str(tmp_path))
    model = _model("llama")
    Decoder.for_policy(model, SkipPolicy.auto_choice())
    (entry,) = tmp_path.glob("latency-*.json")
    data = json.loads(entry.read_text())
    data["verify"] = {"0": 0.05}
    entry.write_text(json.dumps(data))
    decoder = Decoder.for_policy(model, SkipPolicy.auto_choice())
    tokens, stats = decoder.decode(_repetitive_prompt(), DecodeSettings(max_new_tokens=12))
    assert len(tokens) == 12 and stats.calibration["cached"] is False


@pytest.mark.parametrize("kind", ["fifo", "link-to-dev-zero", "nested-deep", "a-list", "not-utf8"])
def test_a_cache_entry_that_is_no_json_file_is_measured_again_without_hanging(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A FIFO would block the reader forever and /dev/zero would read until memory ran out; deep
    nesting would end in RecursionError on every load. Each is passed by, and measured again; a
    FIFO is left where it is (the new calibration is then not cached), and a link is replaced by
    the new entry (what it led to is never written)."""
    monkeypatch.setattr(engine_latency, "BUSY_SPREAD", float("inf"))
    model = _model("llama")
    policy = SkipPolicy.auto_choice()
    calibration.calibrate(model, policy, DraftModels(model), root=tmp_path)
    (entry,) = tmp_path.glob("costs-*.json")
    entry.unlink()
    if kind == "fifo":
        os.mkfifo(entry)
    elif kind == "link-to-dev-zero":
        entry.symlink_to("/dev/zero")
    elif kind == "nested-deep":
        entry.write_text("[" * 100_000 + "]" * 100_000)
    elif kind == "a-list":
        entry.write_text("[1, 2]")
    else:
        entry.write_bytes(b'{"key": "\xff"}')
    costs = calibration.calibrate(model, policy, DraftModels(model), root=tmp_path)
    assert costs.info["cached"] is False and set(costs.draft_step) == {0}
    if kind == "fifo":
        assert "not a regular file" in costs.info["not_cached"]
        assert stat.S_ISFIFO(entry.stat().st_mode)  # left as it was
    else:
        assert calibration.calibrate(model, policy, DraftModels(model), root=tmp_path).info["cached"] is True


@pytest.mark.parametrize("arch", ARCHS)
def test_auto_greedy_is_lossless_with_lookup_and_skip_steps_mixed(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """auto's choice forced to rotate (lookup where it has a match, the skip draft, nothing), so
    every kind of step follows every other whatever this machine's costs favour."""
    kinds = iter(["lookup", "skip", "none", "skip"] * NEW_TOKENS * 3)
    monkeypatch.setattr(AutoDrafter, "_choose", lambda self, plan, rate: next(kinds) if plan else "skip")
    # Prices held at the calibration's: timed on a busy machine, a slow lookup scan or verify would
    # price lookup runs and branches out of the step, and the kinds would not all be reached.
    monkeypatch.setattr(auto_module, "LOOKUP_TIME_SMOOTHING", 0.0)
    monkeypatch.setattr(AutoState, "observe_verify", lambda self, block, seconds, dense=False: None)
    model = _model(arch)
    prompt = _repetitive_prompt()
    reference, logits = hf_greedy(model, prompt, NEW_TOKENS)
    # The calibration's sizes and precision, its seconds replaced by a curve where every kind of
    # step pays: timed on a busy machine, a slow verify could price lookup runs out of every step.
    policy, models = SkipPolicy.auto_trees(), DraftModels(model)  # trees on: every kind of block
    costs = calibration.prepare_calibration(model, policy, models)
    costs = dataclasses.replace(
        costs,
        plain_step=1.0,
        verify={block: 1.0 + 0.02 * block for block in costs.verify},
        draft_step=dict.fromkeys(costs.draft_step, 0.1),
    )
    decoder = Decoder.for_policy(model, policy, models=models, costs=costs)
    runs = []
    for _ in range(2):  # the second generation starts from what the first one learned
        tokens, stats = decoder.decode(prompt, DecodeSettings(max_new_tokens=NEW_TOKENS))
        assert_same_tokens(tokens, reference, ref_logits=logits, label=f"{arch} auto")
        assert sum(stats.draft_histogram.values()) == stats.steps - 1
        runs.append(stats)
    total = GenerationStats.combined(runs)
    assert total.lookup_steps > 0 and total.head_rows, f"{arch}: lookup {total.lookup_steps}, skip {total.head_rows}"
    assert total.tree_steps > 0, f"{arch}: no token tree was verified"
    assert total.accepted > 0
    assert total.calibration["cached"] in (True, False) and total.calibration["seconds"] >= 0


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_auto_greedy_is_lossless_as_it_chooses(arch: str) -> None:
    model = _model(arch)
    reference, logits = hf_greedy(model, random_prompt(), NEW_TOKENS)
    tokens, _ = Decoder.for_policy(model, SkipPolicy.auto_choice()).decode(
        random_prompt(), DecodeSettings(max_new_tokens=NEW_TOKENS)
    )
    assert_same_tokens(tokens, reference, ref_logits=logits, label=f"{arch} auto")


def test_auto_sampling_returns_the_budget() -> None:
    """Sampled: every token of the budget, drafts proposed. (A seed does not pin auto's output:
    its choices follow measured time, and each choice draws differently from the same law.)"""
    model = _model("gemma2")
    decoder = Decoder.for_policy(model, SkipPolicy.auto_choice())
    settings = DecodeSettings(max_new_tokens=30, sampling=Sampling(temperature=0.9, top_p=0.95), seed=11)
    tokens, stats = decoder.decode(_repetitive_prompt(), settings)
    assert len(tokens) == stats.new_tokens == 30 and stats.drafted > 0


def _costs(draft: dict[int, float], verify: dict[int, float] | None = None) -> DraftCosts:
    verify = verify or {1: 1.0, 2: 1.05, 3: 1.1, 4: 1.12, 5: 1.2, 6: 1.25, 8: 1.4, 12: 1.7, 17: 2.0}
    return DraftCosts(1.0, verify, draft)


def _state(costs: DraftCosts) -> AutoState:
    return AutoState.start(costs, SkipPolicy.auto_choice().draft)


def test_padding_follows_the_verify_curve_and_what_it_measures() -> None:
    slow_small = _state(_costs({0: 0.2}, {1: 1.0, 2: 1.6, 3: 1.7, 4: 1.2, 8: 1.5}))
    assert [slow_small.padded(n) for n in (1, 2, 3, 4, 5, 8)] == [1, 4, 4, 4, 5, 8]
    assert slow_small.verify_seconds(2) == pytest.approx(1.2)  # priced as the block it is padded to
    for _ in range(30):  # a 4-row verify turns out slow while generating: padding to it stops
        slow_small.observe_verify(4, 2.0)
    assert slow_small.padded(2) != 4
    flat = _state(_costs({0: 0.2}))
    assert [flat.padded(n) for n in (2, 3, 4)] == [2, 3, 4]


def test_head_size_follows_cost_and_coverage() -> None:
    """A cheap small head wins while it holds the text's tokens; once the text leaves it, a larger one does."""
    costs = _costs({1024: 0.05, 4096: 0.06, 0: 0.5})
    state = AutoState.start(costs, SkipPolicy.auto_choice().draft)
    state.coverage = HeadCoverage((1024, 4096, 0), {1024: 99.0, 4096: 99.0, 0: 100.0}, 100.0)
    assert state.choose_head([]) == 1024
    state.coverage = HeadCoverage((1024, 4096, 0), {1024: 20.0, 4096: 97.0, 0: 100.0}, 100.0)
    assert state.choose_head([]) == 4096


def test_expected_tokens_and_rate() -> None:
    assert expected_tokens(0.0, 5) == 1.0 and expected_tokens(1.0, 3) == 4.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    costs = _costs({0: 0.1})
    verify = _state(costs).verify_seconds
    assert best_skip_rate(0.9, 0.1, verify, 8) > best_skip_rate(0.3, 0.1, verify, 8)


def test_converged_policy_from_auto_is_a_fixed_policy() -> None:
    model = _model("llama")
    decoder = Decoder.for_policy(model, SkipPolicy.auto_choice())
    decoder.decode(_repetitive_prompt(), DecodeSettings(max_new_tokens=16))
    assert decoder.draft is not None
    fixed = decoder.draft.fixed_policy()
    assert fixed.auto is None and fixed.on_the_fly is None and fixed.draft.lookup_max_ngram
    check_policy_fits(model, fixed.with_model(model))
    tokens, _ = Decoder.for_policy(model, fixed).decode(random_prompt(), DecodeSettings(max_new_tokens=16))
    assert tokens == hf_greedy(model, random_prompt(), 16)[0]


def test_policy_file_with_auto_block_loads(tmp_path: Path) -> None:
    policy = dataclasses.replace(SkipPolicy.auto_choice(), auto=AutoSettings(min_head_rows=512))
    path = tmp_path / "auto.json"
    policy.save(path)
    assert SkipPolicy.load(path).auto == AutoSettings(min_head_rows=512)


def test_generate_cli_defaults_to_auto_and_saves_its_choices(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No --policy: auto. --json says what it chose and how its calibration went; --save-policy
    writes a fixed policy a study can start from; --policy plain drafts nothing."""
    directory = tmp_path / "tiny-llama"
    save_checkpoint(tiny_model("llama"), directory)
    args = ["--model", str(directory), "--prompt", "w1 w2 w3 w1 w2 w3 w1 w2", "--max-new-tokens", "24", "--json"]
    saved = tmp_path / "auto-choices.json"
    result = generate_in_process(capsys, *args, "--save-policy", str(saved))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["policy"] == "auto" and report["auto"]["calibration"]["seconds"] >= 0
    assert set(report["auto"]) >= {"lookup_share", "draft_lengths", "head_rows", "skip_sets", "skip_changes"}
    fixed = SkipPolicy.load(saved)
    assert fixed.auto is None and fixed.on_the_fly is None and fixed.provenance["source"] == "auto"
    assert fixed.tuned_machine is not None
    plain = json.loads(generate_in_process(capsys, *args, "--policy", "plain").stdout)
    assert plain["steps"] == plain["new_tokens"] and "auto" not in plain
    assert plain["text"] == report["text"]


def test_the_plugin_drafts_with_auto_by_default() -> None:
    import layerskip

    model = _model("llama")
    ids = torch.tensor([_repetitive_prompt()])
    plain = model.generate(input_ids=ids, max_new_tokens=20, do_sample=False)
    ours = model.generate(
        input_ids=ids, max_new_tokens=20, do_sample=False, custom_generate=layerskip.custom_generate_path(),
        trust_remote_code=True,
    )  # fmt: skip
    assert ours.tolist() == plain.tolist()
    (decoder,) = model.__dict__["_layerskip_decoders"].values()
    assert decoder.draft is not None and decoder.draft.auto is not None


def test_a_search_starts_from_autos_choices(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """search --warm-start auto: auto generates from the calibration prompts, and its choices (as a
    fixed policy) are the study's first trial."""
    from search_fixtures import load_study, search_in_process

    from layerskip.search.space import trial_policy

    db, out = tmp_path / "w.db", tmp_path / "p.json"
    args = ["--n-trials", "3", "--storage", f"sqlite:///{db}", "--study-name", "w", "--out", str(out)]
    space = ["--lookup", "0,3", "--draft-tokens", "3,10", "--draft-precision", "model,int4"]
    space += ["--tree-matches", "1,4", "--tree-siblings", "0,1", "--lookup-tokens", "8,16"]
    result = search_in_process(capsys, tiny_llama, *args, *space, "--warm-start", "auto")
    assert result.returncode == 0, result.stderr
    study = load_study(f"sqlite:///{db}", "w")
    first = trial_policy(study, study.trials[0])
    assert first.auto is None and first.on_the_fly is None and first.draft.length_by_cost
    assert (first.draft.tree_matches, first.draft.tree_siblings, first.draft.lookup_max_ngram) == (1, 0, 3)
