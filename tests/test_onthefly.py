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
from test_sampling import E2E_SEEDS, E2E_TV_BOUND, E2E_VOCAB, _e2e_model, _exact_laws, tv
from tiny_models import ARCHS, random_prompt, tiny_model

from layerskip.engine.cache import RollbackCache
from layerskip.engine.decoding import Decoder, DecodeSettings
from layerskip.engine.onthefly import SelectionState
from layerskip.engine.policy import DraftSettings, OnTheFlySettings, SkipPolicy
from layerskip.engine.sampling import Sampling
from layerskip.errors import LayerskipError
from layerskip.hf import adapters

NEW_TOKENS = 40

# Re-select after every verify and let the count climb fast, so the set changes many times.
RESTLESS = dict(refresh_every=1, start_fraction=0.25, max_fraction=0.75, raise_above=0.5, lower_below=0.3)
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
    decoder = Decoder(model, restless())
    lengths: list[tuple[list[int], int]] = []

    def observe(cache: RollbackCache, committed: int) -> None:
        lengths.append((cache.layer_lengths(), committed))

    tokens, stats = decoder.decode(random_prompt(), DecodeSettings(NEW_TOKENS), cache_observer=observe)
    assert_same_tokens(tokens, ref, ref_logits=logits, label=f"{arch} on-the-fly")
    assert stats.skip_changes >= 2 and len(stats.skip_sets) >= 2  # it really re-chose mid-generation
    assert 0 < sum(stats.skip_sets.values()) <= stats.steps - 1  # skip-drafted verifies (no prefill)
    for step, (layer_lengths, committed) in enumerate(lengths):
        assert layer_lengths == [committed] * len(layer_lengths), f"step {step}: {layer_lengths} vs {committed}"
    assert not adapters.is_bypassed(model)
    assert _hooks(model) == hooks  # every hook removed


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_hybrid_and_precision_copies(arch: str) -> None:
    model = _model(arch)
    ref, logits = hf_greedy(model, random_prompt(), NEW_TOKENS)
    draft = DraftSettings(max_draft_tokens=4, lookup_max_ngram=2, lookup_min_ngram=1, precision="bfloat16")
    tokens, stats = Decoder(model, restless(draft)).decode(random_prompt(), DecodeSettings(NEW_TOKENS))
    assert_same_tokens(tokens, ref, ref_logits=logits, label=f"{arch} on-the-fly hybrid")
    assert stats.skip_sets


def test_selection_starts_from_a_saved_policy_and_keeps_learning_across_calls() -> None:
    model = _model("llama")
    start = SkipPolicy(skip_mlp=(1, 2), draft=DRAFT, on_the_fly=OnTheFlySettings(refresh_every=2))
    decoder = Decoder(model, start)
    assert (decoder.selection.attention, decoder.selection.mlp) == ((), (1, 2))
    assert decoder.selection.count == 2
    decoder.decode(random_prompt(), DecodeSettings(20))
    refreshes = decoder.selection.refreshes
    assert refreshes > 0 and len(decoder.selection.scores) == 2 * adapters.num_layers(model)
    decoder.decode(random_prompt(seed=1), DecodeSettings(20))
    assert decoder.selection.refreshes > refreshes


def test_the_least_contributing_sublayers_are_bypassed() -> None:
    settings = OnTheFlySettings(max_fraction=0.5)
    state = SelectionState(settings, num_layers=2, count=2)
    record = adapters.ContributionRecord(
        residual={0: torch.ones(3), 1: torch.ones(3)},
        attention={0: torch.full((3,), 0.5), 1: torch.full((3,), 0.01)},
        mlp={0: torch.full((3,), 0.02), 1: torch.full((3,), 0.9)},
    )
    state.learn(record, positions=2)
    assert state.reselect()
    assert (state.attention, state.mlp) == ((1,), (0,))
    state.observe(4, 4)  # every draft accepted: bypass one more, within the budget (2 of 4)
    state.reselect()
    assert state.count == 2
    state.observe(4, 0)
    state.observe(4, 0)
    state.reselect()
    assert state.count == 1 and (state.attention, state.mlp) == ((1,), ())


def test_policy_file_round_trip_and_bad_settings(tmp_path) -> None:
    policy = restless()
    path = policy.save(tmp_path / "otf.json")
    assert SkipPolicy.load(path) == policy
    data = json.loads(path.read_text())
    data["on_the_fly"]["max_fraction"] = 1.0
    path.write_text(json.dumps(data))
    with pytest.raises(LayerskipError, match="max_fraction"):
        SkipPolicy.load(path)
    lookup_only = SkipPolicy(
        draft=DraftSettings(lookup_max_ngram=2, use_skip_draft=False), on_the_fly=OnTheFlySettings()
    )
    with pytest.raises(LayerskipError, match="skip draft"):
        Decoder(_model("llama"), lookup_only)


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
        tokens, stats = Decoder(model, policy).decode(prompt, settings)
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
