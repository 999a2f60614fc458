"""Draft length by cost: the rule's decisions, its replay in the search, and the engine with
drafts of varying length (greedy identical, cache lengths, sampling law). Also the early-exit
frontier, the measurement behind not building early exit with confidence."""

from __future__ import annotations

import json

import pytest
import torch
from cli_helpers import assert_bad_input, run_script
from compare import assert_same_tokens, hf_greedy
from oracles import row_lengths
from test_replay import list_predictor
from test_sampling import E2E_TV_BOUND, E2E_VOCAB, _e2e_model, _exact_laws, tv
from tiny_models import random_prompt, save_checkpoint, tiny_model

from layerskip.drafts.model.draft_model import DraftModel
from layerskip.drafts.policy.skip_policy import DraftSettings, SkipPolicy
from layerskip.drafts.rules import draft_length
from layerskip.drafts.rules.draft_length import WARM_UP_STEPS, DraftLengthByCost
from layerskip.engine.decoding import DecodeSettings, decode
from layerskip.errors import LayerskipError
from layerskip.hf import adapters
from layerskip.hf.cache import RollbackCache
from layerskip.measure.agreement import Reference, early_exit_frontier, simulate_greedy
from layerskip.sampling import Sampling

BY_COST = DraftSettings(max_draft_tokens=6, length_by_cost=True)


def _rule(draft_cost: float, verify: dict[int, float], cap: int = 6, pad_to: int = 0) -> DraftLengthByCost:
    return DraftLengthByCost(cap, pad_to, draft_cost=draft_cost, verify_cost=dict(verify))


def _taught(rule: DraftLengthByCost, counts: dict[float, tuple[int, int]], rate: float) -> DraftLengthByCost:
    """As if past the warm-up: per confidence, (accepted, rejected) drafts; ``rate`` tokens per unit cost so far."""
    for confidence, (right, wrong) in counts.items():
        b = draft_length._bin(confidence)
        rule.right[b], rule.reached[b] = right, right + wrong
    rule.steps, rule.step_tokens, rule.step_cost = WARM_UP_STEPS, 100 * rate, 100.0
    return rule


def test_drafts_to_the_cap_until_measured() -> None:
    rule = DraftLengthByCost(cap=4)
    assert all(rule.draft_more([0.0] * i) for i in range(1, 4))
    assert not rule.draft_more([0.0] * 4)
    rule = _rule(10.0, {5: 1.0})  # priced, but no step seen yet: no rate to compare with
    assert rule.draft_more([0.0])


def test_stops_when_a_token_costs_more_than_it_is_expected_to_bring() -> None:
    # A plain step costs 1 and produces 1 token; rate so far 1.5 tokens per unit.
    cheap = _taught(_rule(0.05, {b: 1.0 for b in range(2, 8)}), {0.95: (90, 10)}, rate=1.5)
    dear = _taught(_rule(0.8, {b: 1.0 for b in range(2, 8)}), {0.95: (90, 10)}, rate=1.5)
    assert cheap.draft_more([0.95] * 3)  # 0.9^4 * 0.9 = 0.59 tokens for 0.05: pays
    assert not dear.draft_more([0.95])  # 0.81 tokens for 0.8 at 1.5 per unit: does not


def test_confidence_of_the_drafted_tokens_decides() -> None:
    rule = _taught(_rule(0.3, {b: 1.0 for b in range(2, 8)}), {0.95: (95, 5), 0.15: (2, 18)}, rate=1.5)
    assert rule.acceptance(0.95) > 0.9 and rule.acceptance(0.15) < 0.2
    assert rule.draft_more([0.95])
    assert not rule.draft_more([0.15])  # the token drafted is probably wrong: the next one is wasted


def test_looks_past_a_dear_block_length_to_a_cheaper_longer_one() -> None:
    """On CPU a 3-row verify can cost more than a 5-row one: one more token alone does not pay,
    two more do, so the rule drafts on (a one-token look-ahead would stop)."""
    verify = {2: 1.0, 3: 1.6, 4: 1.6, 5: 1.0}
    rule = _taught(_rule(0.2, verify, cap=4), {0.95: (90, 10)}, rate=1.5)
    assert rule.draft_more([0.95])
    one_ahead = 0.2 + verify[3] - verify[2]  # what the next token alone costs
    assert rule.acceptance(0.95) * rule.pooled_acceptance < 1.5 * one_ahead
    padded = _rule(0.2, {5: 1.0}, cap=4, pad_to=5)  # padding: every block of 2..5 costs a 5-row verify
    assert padded.verify_price(2) == padded.verify_price(4) == 1.0


def test_unmeasured_block_lengths_cost_as_the_nearest_measured_one() -> None:
    rule = _rule(0.1, {3: 1.0, 6: 2.0})
    assert rule.verify_price(2) == 1.0 and rule.verify_price(5) == 2.0 and rule.verify_price(9) == 2.0
    assert rule.verify_price(4) == 1.0  # nearer to 3
    rule.observe_verify(200, 50.0)  # a prompt's prefill says nothing about draft blocks
    assert 200 not in rule.verify_cost
    rule.observe_verify(6, 1.0)
    assert 1.0 < rule.verify_cost[6] < 2.0  # smoothed, not replaced


def test_a_step_counts_the_tokens_reached_and_right() -> None:
    rule = DraftLengthByCost(cap=4)
    rule.observe_step([0.95, 0.55, 0.05, 0.05], accepted=1, cost=2.0)  # 0.95 right, 0.55 wrong, rest unseen
    assert rule.reached[9] == rule.right[9] == 1
    assert rule.reached[5] == 1 and rule.right[5] == 0
    assert rule.reached[0] == 0
    assert (rule.steps, rule.step_tokens, rule.step_cost) == (1, 2, 2.0)


def test_policy_takes_one_stop_rule() -> None:
    with pytest.raises(LayerskipError, match="one of them"):
        DraftSettings(adaptive=True, length_by_cost=True).validate()
    assert "by cost" in SkipPolicy(skip_attention=(1,), draft=BY_COST).describe()


def test_replay_prices_the_rule_like_the_engine() -> None:
    continuation = tuple(range(10, 90))
    reference = Reference((1, 2, 3), continuation)
    always_right = list_predictor(continuation, [0.9] * len(continuation))
    flat = {b: 1.0 for b in range(2, 10)}.get
    cheap = simulate_greedy(reference, BY_COST, always_right, (0.05, flat))
    dear = simulate_greedy(reference, BY_COST, always_right, (1.5, flat))
    after_warm_up = slice(1 + WARM_UP_STEPS, None)
    assert set(cheap.blocks[after_warm_up][:-1]) == {7}  # right and cheap: every draft runs to the cap
    assert set(dear.blocks[after_warm_up][:-1]) == {2}  # a draft token dearer than a plain step: one at a time
    with pytest.raises(ValueError, match="prices"):
        simulate_greedy(reference, BY_COST, always_right)


def _varying_lengths(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decisions that vary with the draft's own tokens (its confidences), as the real rule's do,
    without depending on this machine's timings."""
    # Stops after about a third of the tokens, chosen by the digits of their confidence.
    monkeypatch.setattr(DraftLengthByCost, "draft_more", lambda self, c: len(c) < self.cap and int(c[-1] * 1e4) % 3 > 0)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "gpt2"])
def test_greedy_identical_with_varying_draft_lengths(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _varying_lengths(monkeypatch)
    model = tiny_model(arch)
    prompt = random_prompt()
    reference, logits = hf_greedy(model, prompt, 40)
    lengths: list[tuple[list[int], int]] = []

    def observe(cache: RollbackCache, committed: int) -> None:
        lengths.append((row_lengths(cache), committed))

    policy = SkipPolicy(skip_attention=(1,), skip_mlp=(3,), draft=BY_COST)
    tokens, stats = decode(model, prompt, policy, DecodeSettings(40), cache_observer=observe)
    assert_same_tokens(tokens, reference, ref_logits=logits, label=f"{arch} by cost")
    assert all(held == [committed] * len(held) for held, committed in lengths)
    drafted_per_step = {length - 1 for length in stats.block_histogram}
    assert len(drafted_per_step) > 1, "draft lengths never varied"
    assert stats.accepted > 0


def test_greedy_identical_with_the_measured_rule() -> None:
    """The rule as shipped, on this machine's clock (whatever lengths it picks, the output is the model's)."""
    model = tiny_model("qwen2")
    prompt = random_prompt()
    reference, logits = hf_greedy(model, prompt, 40)
    policy = SkipPolicy(skip_attention=(0,), draft=DraftSettings(max_draft_tokens=5, length_by_cost=True))
    tokens, _ = decode(model, prompt, policy, DecodeSettings(40))
    assert_same_tokens(tokens, reference, ref_logits=logits, label="qwen2 by cost")


def test_sampling_keeps_the_model_law_when_the_draft_decides_its_length(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stop that depends on the draft's sampled tokens leaves the output law the model's own."""
    _varying_lengths(monkeypatch)
    model = _e2e_model()
    prompt = random_prompt(E2E_VOCAB, 6)
    p1, p2, _ = _exact_laws(model, prompt)
    draft = DraftSettings(max_draft_tokens=2, length_by_cost=True)
    policy = SkipPolicy.early_exit(adapters.num_layers(model), 1, draft=draft)
    seeds = 800
    first, second = torch.zeros(E2E_VOCAB), torch.zeros(E2E_VOCAB)
    blocks: set[int] = set()
    for seed in range(seeds):
        # 4 tokens: the prefill gives the first, so the first draft may hold 1 or 2 (the budget).
        settings = DecodeSettings(max_new_tokens=4, sampling=Sampling(), seed=seed)
        tokens, stats = decode(model, prompt, policy, settings)
        first[tokens[0]] += 1
        second[tokens[1]] += 1  # the first token that went through draft + verify
        blocks |= set(stats.block_histogram)
    assert {2, 3} <= blocks  # drafts of both lengths ran
    assert tv(first / seeds, p1) < E2E_TV_BOUND
    assert tv(second / seeds, p2) < E2E_TV_BOUND


# -- early exit with confidence: measured, not built (scripts/early_exit.py) ------------------------------------------
def test_early_exit_frontier_counts_exits_and_agreement() -> None:
    model = tiny_model("llama")
    reference, _ = hf_greedy(model, random_prompt(), 30)
    references = [Reference(tuple(random_prompt()), tuple(reference))]
    draft_model = DraftModel(model)
    whole, points = early_exit_frontier(draft_model, references, depths=(1, 3), thresholds=(0.0, 0.5, 0.999))
    assert whole == 1.0  # the whole stack in the model's own precision is the model
    by_key = {(p.depth, p.threshold): p for p in points}
    for depth in (1, 3):
        assert by_key[(depth, 0.0)].coverage == 1.0  # threshold 0: every position exits
        assert by_key[(depth, 0.999)].coverage <= by_key[(depth, 0.5)].coverage <= 1.0
        assert by_key[(depth, 0.999)].agreement >= by_key[(depth, 0.0)].agreement
    exit_everywhere = by_key[(1, 0.0)]
    assert exit_everywhere.agreement == exit_everywhere.agreement_when_exiting < 1.0


def test_early_exit_script_end_to_end_and_bad_input(tmp_path) -> None:
    model = tiny_model("llama")
    save_checkpoint(model, tmp_path / "tiny")
    common = ["--model", str(tmp_path / "tiny"), "--reference-tokens", "8", "--repeats", "1"]
    out = tmp_path / "out"
    result = run_script("early_exit.py", *common, "--depths", "1,2", "--out", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((out / "early_exit.json").read_text())
    assert report["rows"][0]["depth"] == "whole draft" and len(report["rows"]) == 1 + 2 * 4
    assert (out / "early_exit.csv").read_text().startswith("depth,threshold,coverage")
    assert_bad_input(run_script("early_exit.py", *common, "--thresholds", "1.0", "--out", str(out)), "--thresholds")
