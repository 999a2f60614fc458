"""Batches decoded together: the ragged cache and masks, the batched draft, every step kind.

Every row of a batch must get what it gets alone: greedy rows token for token what HF ``generate``
gives that prompt, sampled rows the model's law. The batch's choice of step kind is forced to
rotate here, so each kind (plain, lookup, the batched skip draft, each row's own drafter) meets
the verify whatever this machine's timings favour.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import replace

import pytest
import torch
from compare import assert_same_tokens, chain_rule_as_tree, hf_greedy
from oracles import is_bypassed
from test_sampling import E2E_SEEDS, E2E_TV_BOUND, E2E_VOCAB, _e2e_model, _exact_laws, always_accept, tv
from tiny_models import ARCHS, random_prompt, tiny_model

from layerskip.drafts.model.draft_model import DraftModel
from layerskip.drafts.policy.skip_policy import DraftSettings, SkipPolicy
from layerskip.engine import step_kinds as kinds_module
from layerskip.engine import verifiers
from layerskip.engine.decoding import Decoder, DecodeSettings
from layerskip.hf import adapters
from layerskip.hf import cache as cache_module
from layerskip.hf.cache import RollbackCache, model_cache
from layerskip.hf.forward import block_hidden, full_logits, stack_forward
from layerskip.hf.lean import LEAN_FAMILIES
from layerskip.measure.batches import BASELINE, OURS, OURS_ALONE, OURS_PLAIN, run_batches, summarise_batches
from layerskip.measure.report import batch_table
from layerskip.sampling import Sampling

NEW_TOKENS = 30
LENGTHS = (5, 9, 3, 12)  # ragged from the prefill on; 12 is past the tiny sliding window (4)

POLICIES = {
    "plain": None,
    "auto": SkipPolicy.auto_choice(),
    "hybrid": SkipPolicy(skip_attention=(0,), skip_mlp=(2,), draft=DraftSettings(lookup_max_ngram=3)),
    "skip-model-precision": SkipPolicy(skip_mlp=(1, 3), draft=DraftSettings(max_draft_tokens=4)),
}


def _prompts(vocab: int = 128) -> list[list[int]]:
    # Repeats inside each prompt: prompt lookup finds matches.
    return [random_prompt(vocab, n, seed=n) * 2 for n in LENGTHS]


@functools.cache
def _model(arch: str, impl: str = "default") -> torch.nn.Module:
    """The tiny model with its default attention (sdpa, or eager where sdpa is not offered) or ``impl``."""
    return tiny_model(arch) if impl == "default" else tiny_model(arch, attn_implementation=impl)


@functools.cache
def _references(arch: str, impl: str = "default") -> list[tuple[list[int], torch.Tensor]]:
    return [hf_greedy(_model(arch, impl), prompt, NEW_TOKENS) for prompt in _prompts()]


class Rotation:
    """One cycle over every step kind, shared by all batches (so consecutive calls start on
    different kinds); a batch skips the kinds it does not offer."""

    ALL = ("plain", "lookup", "skip:3", "skip:6", "draft")

    def __init__(self) -> None:
        self.ran: list[str] = []
        self.reset()

    def reset(self) -> None:
        self.cycle = itertools.cycle(self.ALL)

    def choose(self, kinds: kinds_module.StepKinds) -> str:
        if len(kinds.kinds) == 1:  # a menu without a choice (one row left) leaves the cycle where it is
            self.ran.append(kinds.kinds[0])
            return kinds.kinds[0]
        kind = next(self.cycle)
        while kind not in kinds.kinds:
            kind = next(self.cycle)
        self.ran.append(kind)
        return kind


@pytest.fixture
def rotate_kinds(monkeypatch: pytest.MonkeyPatch) -> Rotation:
    rotation = Rotation()
    monkeypatch.setattr(kinds_module.StepKinds, "choose", lambda self: rotation.choose(self))
    return rotation


@pytest.mark.parametrize("impl", ["default", "eager"])
@pytest.mark.parametrize("arch", ARCHS)
def test_ragged_forward_equals_each_row_alone(arch: str, impl: str) -> None:
    model = _model(arch, impl)
    prompts = [random_prompt(length=n, seed=n) for n in LENGTHS]
    longest = max(LENGTHS)
    cache = model_cache(model, rows=len(prompts))
    with torch.inference_mode():
        first = block_hidden(model, torch.tensor([p + [p[-1]] * (longest - len(p)) for p in prompts]), cache)
        cache.set_lengths(LENGTHS)
        more = [random_prompt(length=3, seed=20 + r) for r in range(len(prompts))]
        second = block_hidden(model, torch.tensor(more), cache)
        for r, prompt in enumerate(prompts):
            alone = stack_forward(model, torch.tensor([prompt + more[r]]))[0]  # [n + 3, H]
            torch.testing.assert_close(first[r, : len(prompt)], alone[: len(prompt)], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(second[r], alone[len(prompt) :], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("arch", [arch for arch in ARCHS if arch in LEAN_FAMILIES])
def test_batched_lean_draft_equals_the_single_row_step(arch: str) -> None:
    model = _model(arch)
    draft = DraftModel(model)
    prompts = [random_prompt(length=n, seed=n) for n in LENGTHS]
    skip = ((1,), (2,))
    ragged = model_cache(model, rows=len(prompts))
    with torch.inference_mode():
        longest = max(LENGTHS)
        block_hidden(model, torch.tensor([p + [p[-1]] * (longest - len(p)) for p in prompts]), ragged)
        ragged.set_lengths(LENGTHS)
        with draft.active(*skip):
            tokens = torch.tensor([p[-1] for p in prompts])
            for _ in range(3):
                rows = draft.hidden(tokens[:, None], ragged)[:, 0]
                tokens = (tokens * 7 + 3) % 128
        for r, prompt in enumerate(prompts):
            cache = RollbackCache(adapters.sliding_windows(model))
            full_logits(model, torch.tensor([prompt]), cache, 1)
            token = prompt[-1]
            with draft.active(*skip):
                for _ in range(3):
                    alone = draft.hidden(torch.tensor([[token]]), cache)[0, -1]
                    token = (token * 7 + 3) % 128
            torch.testing.assert_close(rows[r], alone, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("policy_name", list(POLICIES))
@pytest.mark.parametrize("arch", ARCHS)
def test_batch_rows_match_hf_alone(arch: str, policy_name: str, rotate_kinds: Rotation) -> None:
    decoder = Decoder.for_policy(_model(arch), POLICIES[policy_name])
    results = decoder.decode_batch(_prompts(), DecodeSettings(max_new_tokens=NEW_TOKENS))
    for r, ((tokens, stats), (ref, logits)) in enumerate(zip(results, _references(arch), strict=True)):
        assert_same_tokens(tokens, ref, ref_logits=logits, label=f"{arch} {policy_name} row {r}")
        assert stats.new_tokens == NEW_TOKENS
    assert not is_bypassed(_model(arch))
    kinds = set(rotate_kinds.ran)
    assert "plain" in kinds
    if decoder.draft is not None:
        assert len(kinds) > 1
        assert any(stats.accepted for _, stats in results), "no draft token was ever accepted"
    if policy_name == "auto" and arch in LEAN_FAMILIES:
        assert {"skip:3", "skip:6", "lookup"} <= kinds  # rows' own drafters: batches of 2 (below)


def test_batches_of_two_also_offer_each_rows_own_drafter(rotate_kinds: Rotation) -> None:
    decoder = Decoder.for_policy(_model("llama"), POLICIES["auto"])
    results = decoder.decode_batch(_prompts()[:2], DecodeSettings(max_new_tokens=NEW_TOKENS))
    for (tokens, _), (ref, logits) in zip(results, _references("llama")[:2], strict=True):
        assert_same_tokens(tokens, ref, ref_logits=logits, label="two rows")
    assert "draft" in rotate_kinds.ran


def test_a_batch_starts_from_the_rates_the_last_batch_of_its_size_measured() -> None:
    decoder = Decoder.for_policy(_model("llama"), POLICIES["auto"])
    settings = DecodeSettings(max_new_tokens=NEW_TOKENS)
    first = decoder.decode_batch(_prompts(), settings)[0][1].batch_steps
    (kinds,) = [kinds for (rows, *_), kinds in decoder.batch_rates.items() if rows == 4]
    assert set(kinds.prices) == set(kinds.kinds)  # auto's calibration priced every kind before any ran
    assert set(first) <= {*kinds.kinds, "draft"}  # the last row: its own drafter
    steps_before = sum(kinds.steps.values())
    second = decoder.decode_batch(_prompts(), settings)
    assert [rows for rows, *_ in decoder.batch_rates].count(4) == 1  # the same size: the same menu and rates
    steps = second[0][1].batch_steps
    # The 4-row menu went on counting from the first batch (steps with fewer rows left count elsewhere).
    assert 0 < sum(kinds.steps.values()) - steps_before <= sum(steps.values())
    decoder.decode_batch(_prompts()[:3], settings)
    three = [kinds for (rows, *_), kinds in decoder.batch_rates.items() if rows == 3]
    assert len(three) == 1 and three[0] is not kinds and three[0].rows == 3  # another size: its own rates


def test_rows_that_finish_early_leave_the_batch(rotate_kinds: Rotation) -> None:
    """Each row stops at its own EOS; the cache drops finished rows and the others go on exactly."""
    model = _model("llama")
    prompts = _prompts()
    references = [ref for ref, _ in _references("llama")]
    eos = references[1][5]  # row 1 stops at its 6th token; others wherever the same id comes first
    settings = DecodeSettings(max_new_tokens=NEW_TOKENS, eos_token_ids=(eos,))
    results = Decoder.for_policy(model, POLICIES["auto"]).decode_batch(prompts, settings)
    for (tokens, _), ref in zip(results, references, strict=True):
        expected = ref[: ref.index(eos) + 1] if eos in ref else ref
        assert tokens == expected
    assert len(results[1][0]) <= 6


@pytest.mark.parametrize("policy_name", ["auto", "plain"])
def test_the_last_row_goes_on_with_its_own_drafter(policy_name: str) -> None:
    """Once the other rows have finished, the last one takes its own drafter's proposals (a batch
    of one row), exactly."""
    references = [ref for ref, _ in _references("llama")[:2]]
    eos = next(token for token in references[0][2:] if token not in references[1])  # row 0 stops early
    settings = DecodeSettings(max_new_tokens=NEW_TOKENS, eos_token_ids=(eos,))
    decoder = Decoder.for_policy(_model("llama"), POLICIES[policy_name])
    results = decoder.decode_batch(_prompts()[:2], settings)
    assert results[0][0] == references[0][: references[0].index(eos) + 1]
    assert results[1][0] == references[1]
    own = "draft" if policy_name == "auto" else "plain"
    assert results[1][1].batch_steps.get(own, 0) > 0


def test_ragged_cache_grows_without_changing_what_it_holds(
    monkeypatch: pytest.MonkeyPatch, rotate_kinds: Rotation
) -> None:
    monkeypatch.setattr(cache_module, "_MIN_CAPACITY", 4)
    decoder = Decoder.for_policy(_model("gemma3_text"), POLICIES["auto"])
    results = decoder.decode_batch(_prompts(), DecodeSettings(max_new_tokens=NEW_TOKENS))
    for (tokens, _), (ref, logits) in zip(results, _references("gemma3_text"), strict=True):
        assert_same_tokens(tokens, ref, ref_logits=logits, label="gemma3 growing")


def _batched_laws(policy: SkipPolicy | None = None) -> list[torch.Tensor]:
    """Token 2's frequencies in each of two rows of one prompt, over ``E2E_SEEDS`` batches (``auto``
    matching single tokens, or ``policy``)."""
    model = _e2e_model()
    auto = SkipPolicy.auto_choice()
    decoder = Decoder.for_policy(model, policy or replace(auto, draft=replace(auto.draft, lookup_min_ngram=1)))
    laws = [torch.zeros(E2E_VOCAB), torch.zeros(E2E_VOCAB)]
    for seed in range(E2E_SEEDS):
        settings = DecodeSettings(max_new_tokens=3, sampling=Sampling(), seed=2 * seed)
        for row, (tokens, _) in enumerate(decoder.decode_batch([SAMPLED_PROMPT, SAMPLED_PROMPT], settings)):
            laws[row][tokens[1]] += 1
    return [law / E2E_SEEDS for law in laws]


SAMPLED_PROMPT = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]


def test_batched_sampling_keeps_each_rows_distribution(rotate_kinds: Rotation) -> None:
    """Every step kind rotating (one-hot lookup q, the batched draft's q, each row's drafter's q)."""
    _, p2, _ = _exact_laws(_e2e_model(), SAMPLED_PROMPT)
    laws = _batched_laws()
    assert len(set(rotate_kinds.ran)) >= 4
    for law in laws:
        assert tv(law, p2) < E2E_TV_BOUND


def test_batched_sampling_with_always_accept_fails(rotate_kinds: Rotation, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same test catches a verify that keeps every draft. The drafts are prompt lookup's, on
    every step kind: one-hot proposals, far from the model's law, that a verify keeping them all
    shows at once (``auto``'s int4 draft is close to the model's law, and whether ``auto`` takes a
    match depends on measured time, so on a busy machine it could propose little to catch)."""
    monkeypatch.setattr(verifiers, "verify_tree_sampled", chain_rule_as_tree(always_accept))
    lookup = SkipPolicy(draft=DraftSettings(use_skip_draft=False, lookup_min_ngram=1, lookup_max_ngram=2))
    _, p2, _ = _exact_laws(_e2e_model(), SAMPLED_PROMPT)
    assert any(tv(law, p2) > E2E_TV_BOUND for law in _batched_laws(lookup))


def test_a_batch_of_sampled_rows_is_reproducible_with_a_seed(rotate_kinds: Rotation) -> None:
    decoder = Decoder.for_policy(_model("llama"), POLICIES["auto"])
    settings = DecodeSettings(max_new_tokens=12, sampling=Sampling(temperature=0.9), seed=5)
    rotate_kinds.reset()
    first = [tokens for tokens, _ in decoder.decode_batch(_prompts(), settings)]
    rotate_kinds.reset()
    again = [tokens for tokens, _ in decoder.decode_batch(_prompts(), settings)]
    assert first == again


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "gpt2"])
def test_prompts_of_one_length_go_in_one_padded_prefill(arch: str, rotate_kinds: Rotation) -> None:
    """Prompts of similar lengths are prefilled in one forward; far apart, row by row: both exact."""
    prompts = [random_prompt(length=9, seed=s) for s in range(3)]
    references = [hf_greedy(_model(arch), prompt, NEW_TOKENS) for prompt in prompts]
    decoder = Decoder.for_policy(_model(arch), POLICIES["auto"])
    results = decoder.decode_batch(prompts, DecodeSettings(max_new_tokens=NEW_TOKENS))
    for (tokens, _), (ref, logits) in zip(results, references, strict=True):
        assert_same_tokens(tokens, ref, ref_logits=logits, label=f"{arch} one length")


def test_the_time_spent_growing_the_ragged_cache_is_counted_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step that grew the buffers is rated without that time (the batch subtracts it)."""
    ticks = itertools.count()
    monkeypatch.setattr(cache_module, "perf_counter", lambda: float(next(ticks)))  # a clock, not timing
    cache = model_cache(_model("llama"), rows=2)
    block_hidden(_model("llama"), torch.tensor([[1, 2, 3], [4, 5, 6]]), cache)
    cache.set_lengths([3, 3])
    capacity, before = cache.capacity, cache.growth_seconds
    cache.reserve(capacity)  # room enough: nothing grows
    assert cache.growth_seconds == before
    cache.reserve(capacity + 1)
    assert cache.capacity >= capacity + 1 and cache.growth_seconds > before


def test_the_cache_holds_the_widest_step_to_the_end_of_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefill reserves room for every row's budget and the widest block a step verifies past
    it: a 6-token batched draft near the end (every row writes the step's width, fillers included)
    never grows the buffers, which would copy all of them."""
    monkeypatch.setattr(cache_module, "_MIN_CAPACITY", 4)
    monkeypatch.setattr(
        kinds_module.StepKinds, "choose", lambda self: "skip:6" if "skip:6" in self.kinds else self.kinds[0]
    )
    capacities: list[int] = []
    decoder = Decoder.for_policy(_model("llama"), POLICIES["auto"])
    results = decoder.decode_batch(
        _prompts(),
        DecodeSettings(max_new_tokens=NEW_TOKENS, eos_token_ids=()),
        step_observer=lambda cache, lengths: capacities.append(cache.capacity),
    )
    for (tokens, _), (ref, logits) in zip(results, _references("llama"), strict=True):
        assert_same_tokens(tokens, ref, ref_logits=logits, label="widest step")
    assert len(capacities) > 2 and len(set(capacities)) == 1
    # Room for the longest prompt, its budget, and a 6-token draft's repeat (12) with its pending token.
    assert capacities[0] >= max(len(p) for p in _prompts()) + NEW_TOKENS + 13


def test_the_batch_bench_runs_hf_our_plain_step_and_ours_on_the_same_batches() -> None:
    """``scripts/bench.py --batch-size``'s measure: three methods per batch, every row identical,
    ours priced against HF's and against the engine's own plain decoding."""
    model = tiny_model("llama")
    prompts = [random_prompt(seed=seed, length=8 + seed) for seed in range(3)]
    policy = SkipPolicy(skip_attention=(1,), draft=DraftSettings(max_draft_tokens=3))
    figures = run_batches(model, prompts, ["a", "b", "c"], [1, 2], ["similar"], 6, [], 0, policy, 1, False)
    assert {f.method for f in figures if f.size == 1} == {BASELINE, OURS, OURS_PLAIN}
    assert {f.method for f in figures if f.size == 2} == {BASELINE, OURS, OURS_PLAIN, OURS_ALONE}
    assert all(f.identical_rows == f.size for f in figures)
    alone = next(f for f in figures if f.method == OURS_ALONE)
    assert len(alone.row_seconds) == 2 and alone.seconds == pytest.approx(sum(alone.row_seconds))
    rows = summarise_batches(figures)
    assert [row["batch_size"] for row in rows] == [1, 2]
    for row in rows:
        # The ratio is of the unrounded rates: within a rounding step of the rounded ones'.
        assert row["vs_plain"] == pytest.approx(
            row["ours_tokens_per_second"] / row["plain_tokens_per_second"], abs=2e-3
        )
    assert "vs_alone" not in rows[0]  # one prompt: nothing to compare
    alone_ratio = rows[1]["ours_tokens_per_second"] / rows[1]["alone_tokens_per_second"]
    assert rows[1]["vs_alone"] == pytest.approx(alone_ratio, rel=2e-3, abs=2e-3)
    assert rows[1]["identical_rows_alone"] == 2
    assert "one at a time" in batch_table({"batches": rows, "runs": []})
