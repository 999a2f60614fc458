"""On-the-fly skip selection: the bypassed set changes while generating, the output does not.

Greedy output equals HF ``generate`` on every tiny architecture (Mistral and Gemma 2/3 use
sliding windows shorter than the generation) with a skip set that changes mid-generation; the
cache's per-layer lengths stay right across every change; sampling still follows the model.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch
from compare import assert_same_tokens, hf_greedy
from oracles import is_bypassed, row_lengths
from test_sampling import E2E_SEEDS, E2E_TV_BOUND, E2E_VOCAB, _e2e_model, _exact_laws, tv
from tiny_models import ARCHS, random_prompt, tiny_model

from layerskip.drafts.drafters.onthefly import SelectionState, converged_policy
from layerskip.drafts.policy.skip_policy import DraftSettings, OnTheFlySettings, SkipPolicy
from layerskip.engine.decoding import Decoder, DecodeSettings
from layerskip.errors import LayerskipError
from layerskip.hf import adapters
from layerskip.hf.cache import RollbackCache
from layerskip.sampling import Sampling

NEW_TOKENS = 40

# Re-select after every verify, price a count after one step and swap on any score change, so
# the set changes many times (the count's first moves are explorations, whatever the timings).
RESTLESS = dict(refresh_every=1, start_fraction=0.25, max_fraction=0.75, min_steps=1, swap_margin=0.0)
DRAFT = DraftSettings(max_draft_tokens=4, adaptive=True, initial_threshold=0.1)


def restless(draft: DraftSettings = DRAFT, **overrides: object) -> SkipPolicy:
    return SkipPolicy.adaptive_selection(draft, **{**RESTLESS, **overrides})


@functools.cache
def _model(arch: str) -> torch.nn.Module:
    return tiny_model(arch)


def _hooks(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_hf_while_the_skip_set_changes(arch: str) -> None:
    model = _model(arch)
    ref, logits = hf_greedy(model, random_prompt(), NEW_TOKENS)
    hooks = _hooks(model)
    decoder = Decoder.for_policy(model, restless())
    lengths: list[tuple[list[int], int]] = []

    def observe(cache: RollbackCache, committed: int) -> None:
        lengths.append((row_lengths(cache), committed))

    tokens, stats = decoder.decode(random_prompt(), DecodeSettings(NEW_TOKENS), cache_observer=observe)
    assert_same_tokens(tokens, ref, ref_logits=logits, label=f"{arch} on-the-fly")
    assert stats.skip_changes >= 2 and len(stats.skip_sets) >= 2  # it really re-chose mid-generation
    assert 0 < sum(stats.skip_sets.values()) <= stats.steps - 1  # skip-drafted verifies (no prefill)
    for step, (held, committed) in enumerate(lengths):
        assert held == [committed] * len(held), f"step {step}: {held} vs {committed}"
    assert not is_bypassed(model)
    assert _hooks(model) == hooks  # every hook removed


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_hybrid_and_precision_copies(arch: str) -> None:
    model = _model(arch)
    ref, logits = hf_greedy(model, random_prompt(), NEW_TOKENS)
    draft = DraftSettings(max_draft_tokens=4, lookup_max_ngram=2, lookup_min_ngram=1, precision="bfloat16")
    tokens, stats = Decoder.for_policy(model, restless(draft)).decode(random_prompt(), DecodeSettings(NEW_TOKENS))
    assert_same_tokens(tokens, ref, ref_logits=logits, label=f"{arch} on-the-fly hybrid")
    assert stats.skip_sets


def test_selection_starts_from_a_saved_policy_and_keeps_learning_across_calls() -> None:
    model = _model("llama")
    start = SkipPolicy(skip_mlp=(1, 2), draft=DRAFT, on_the_fly=OnTheFlySettings(refresh_every=2))
    decoder = Decoder.for_policy(model, start)
    assert (decoder.selection.attention, decoder.selection.mlp) == ((), (1, 2))
    assert decoder.selection.count == 2
    decoder.decode(random_prompt(), DecodeSettings(20))
    refreshes = decoder.selection.refreshes
    assert refreshes > 0 and len(decoder.selection.scores) == 2 * adapters.num_layers(model)
    decoder.decode(random_prompt(seed=1), DecodeSettings(20))
    assert decoder.selection.refreshes > refreshes


def _record(attention: list[float], mlp: list[float]) -> adapters.ContributionRecord:
    """Contributions at 3 positions of a model with ``len(attention)`` layers, residual norm 1."""
    layers = range(len(attention))
    return adapters.ContributionRecord(
        residual={i: torch.ones(3) for i in layers},
        attention={i: torch.full((3,), attention[i]) for i in layers},
        mlp={i: torch.full((3,), mlp[i]) for i in layers},
    )


def test_the_least_contributing_sublayers_are_bypassed_with_hysteresis() -> None:
    state = SelectionState(OnTheFlySettings(max_fraction=0.5, momentum=0.0, swap_margin=0.2), num_layers=2, count=2)
    state.learn(_record([0.5, 0.01], [0.02, 0.9]), positions=2)
    assert state.reselect()
    assert (state.attention, state.mlp) == ((1,), (0,))
    # MLP 0 now scores a little above attention 0: within the margin, the set stays.
    state.learn(_record([0.09, 0.01], [0.1, 0.9]), positions=2)
    assert not state.reselect() and (state.attention, state.mlp) == ((1,), (0,))
    # Clearly above: attention 0 takes its place.
    state.learn(_record([0.05, 0.01], [0.3, 0.9]), positions=2)
    assert state.reselect() and (state.attention, state.mlp) == ((0, 1), ())


def test_the_count_climbs_on_measured_speed_and_settles() -> None:
    """Tokens per second decide the count: try one more bypassed, keep it if faster, try the next,
    come back when that is slower, then stay."""
    settings = OnTheFlySettings(max_fraction=0.75, min_steps=3, gain_margin=0.05)
    state = SelectionState(settings, num_layers=4, count=1)
    state.learn(_record([0.1, 0.2, 0.3, 0.4], [0.5, 0.6, 0.7, 0.8]), positions=3)
    speed = {0: 8.0, 1: 10.0, 2: 15.0, 3: 12.0}  # tokens/s at each count

    def run(steps: int) -> None:
        for _ in range(steps):
            state.observe(tokens=3, seconds=3 / speed[state.count])
            state.reselect()

    run(2)
    assert state.count == 1  # not priced yet
    run(1)
    assert state.count == 2 and state.attention == (0, 1)  # priced: try one more bypassed
    run(3)
    assert state.count == 3  # 2 is faster than 1: keep going
    run(3)
    assert state.count == 2 and state.attention == (0, 1)  # 3 is slower: back
    run(20)
    assert state.count == 2 and state.settled  # both neighbours measured, neither faster
    assert state.speed[2].rate == pytest.approx(15.0) and state.speed[1].steps == 3


def test_a_faster_count_within_the_margin_does_not_move_it() -> None:
    state = SelectionState(OnTheFlySettings(max_fraction=0.5, min_steps=2, gain_margin=0.1), num_layers=2, count=1)
    state.learn(_record([0.1, 0.2], [0.3, 0.4]), positions=3)
    speed = {0: 10.4, 1: 10.0, 2: 5.0}
    for _ in range(30):
        state.observe(tokens=2, seconds=2 / speed[state.count])
        state.reselect()
    assert state.count == 1 and state.settled  # 0 is 4 % faster: inside the 10 % margin


def test_policy_file_round_trip_and_bad_settings(tmp_path) -> None:
    policy = restless()
    path = policy.save(tmp_path / "otf.json")
    assert SkipPolicy.load(path) == policy
    data = json.loads(path.read_text())
    data["on_the_fly"]["max_fraction"] = 1.0
    path.write_text(json.dumps(data))
    with pytest.raises(LayerskipError, match="max_fraction"):
        SkipPolicy.load(path)
    data["on_the_fly"].update(max_fraction=0.5, min_steps=0)
    path.write_text(json.dumps(data))
    with pytest.raises(LayerskipError, match="min_steps"):
        SkipPolicy.load(path)
    lookup_only = SkipPolicy(
        draft=DraftSettings(lookup_max_ngram=2, use_skip_draft=False), on_the_fly=OnTheFlySettings()
    )
    with pytest.raises(LayerskipError, match="skip draft"):
        Decoder.for_policy(_model("llama"), lookup_only)


def test_sampling_follows_the_model_while_selecting() -> None:
    model = _e2e_model()
    prompt = random_prompt(E2E_VOCAB, 6)
    p1, p2, _ = _exact_laws(model, prompt)
    layers = adapters.num_layers(model)
    # Starts as an early exit at depth 1; the prefill re-chooses the set, so token 2's draft
    # (the first one verified) comes from a set picked on the fly.
    policy = SkipPolicy.early_exit(
        layers,
        1,
        draft=DraftSettings(max_draft_tokens=1),
        on_the_fly=OnTheFlySettings(refresh_every=1, max_fraction=0.9),
    )
    first, second = torch.zeros(E2E_VOCAB), torch.zeros(E2E_VOCAB)
    changes = accepted = 0
    for seed in range(E2E_SEEDS):
        settings = DecodeSettings(max_new_tokens=3, sampling=Sampling(), seed=seed)
        tokens, stats = Decoder.for_policy(model, policy).decode(prompt, settings)
        first[tokens[0]] += 1
        second[tokens[1]] += 1
        changes += stats.skip_changes
        accepted += stats.accepted
    assert changes > 0 and 0 < accepted < 2 * E2E_SEEDS
    assert tv(first / E2E_SEEDS, p1) < E2E_TV_BOUND
    assert tv(second / E2E_SEEDS, p2) < E2E_TV_BOUND


@pytest.mark.parametrize("arch", ARCHS)
def test_recorded_contributions_are_what_each_sublayer_adds(arch: str) -> None:
    """With every MLP bypassed, a layer's output minus its input is exactly its attention's
    contribution (after Gemma's post-attention norm): the recorded norms must match it."""
    model = _model(arch)
    layers = range(adapters.num_layers(model))
    ids = torch.tensor([random_prompt()])
    with torch.inference_mode():
        model(input_ids=ids, output_hidden_states=True)  # transformers adds its own capture hooks once
    hooks = _hooks(model)
    with torch.inference_mode(), adapters.bypass(model, mlp=layers):
        with adapters.sublayer_contributions(model) as record:
            hidden = model(input_ids=ids, output_hidden_states=True).hidden_states
    for i in layers[:-1]:  # the last entry of hidden_states has the final norm applied
        expected = torch.linalg.vector_norm(hidden[i + 1][0] - hidden[i][0], dim=-1)
        torch.testing.assert_close(record.attention[i], expected, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(record.residual[i], torch.linalg.vector_norm(hidden[i][0], dim=-1))
        assert float(record.mlp[i].abs().max()) == 0.0
    assert _hooks(model) == hooks


def test_the_set_it_ends_on_is_saved_as_a_fixed_lossless_policy(tmp_path) -> None:
    model = _model("llama")
    start = restless()
    decoder = Decoder.for_policy(model, start)
    decoder.decode(random_prompt(), DecodeSettings(30))
    state = decoder.selection
    fixed = converged_policy(start, state)
    assert fixed.on_the_fly is None and fixed.draft == start.draft
    assert (fixed.skip_attention, fixed.skip_mlp) == (state.attention, state.mlp)
    learned = fixed.provenance["selection"]
    assert fixed.provenance["source"] == "on-the-fly" and learned["count"] == state.count
    ranking = [tuple(item) for item in learned["sublayer_ranking"]]
    assert sorted(ranking) == sorted(state.scores) and ranking[0] == min(state.scores, key=state.scores.get)
    reloaded = SkipPolicy.load(fixed.save(tmp_path / "fixed.json"))
    assert reloaded == fixed
    ref, logits = hf_greedy(model, random_prompt(seed=3), NEW_TOKENS)
    tokens, _ = Decoder.for_policy(model, reloaded).decode(random_prompt(seed=3), DecodeSettings(NEW_TOKENS))
    assert_same_tokens(tokens, ref, ref_logits=logits, label="fixed from on-the-fly")


def test_the_default_draft_is_cheap_on_the_cpu() -> None:
    cpu = SkipPolicy.adaptive_selection().draft
    assert (cpu.precision, cpu.draft_vocab_size, cpu.max_draft_tokens, cpu.adaptive) == ("int4", 8192, 6, True)
    gpu = SkipPolicy.adaptive_selection(device="cuda").draft  # int4 kernels are CPU-only
    assert (gpu.precision, gpu.draft_vocab_size) == ("model", 0)
    model = _model("llama")
    ref, logits = hf_greedy(model, random_prompt(seed=5), NEW_TOKENS)
    tokens, _ = Decoder.for_policy(model, SkipPolicy.adaptive_selection(refresh_every=1)).decode(
        random_prompt(seed=5), DecodeSettings(NEW_TOKENS)
    )
    assert_same_tokens(tokens, ref, ref_logits=logits, label="default on-the-fly draft")
