"""Exit drafts (a trained adapter after a shallow layer) are lossless, with and without K/V reuse.

The adapters here are untrained but perturbed (random, non-zero maps), so drafts are sometimes
accepted and sometimes not; correctness cannot depend on how good the adapter is.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from compare import assert_same_tokens, hf_greedy
from oracles import is_bypassed, row_lengths
from test_sampling import E2E_SEEDS, E2E_TV_BOUND, E2E_VOCAB, _exact_laws, tv
from tiny_models import ARCHS, random_prompt, tiny_model

from layerskip.drafts.builder import check_policy_fits, exit_verify
from layerskip.drafts.model.exit_adapter import ExitAdapter, ExitSpec
from layerskip.drafts.policy.skip_policy import DraftSettings, ExitSettings, SkipPolicy
from layerskip.engine.decoding import Decoder, DecodeSettings, decode
from layerskip.errors import LayerskipError
from layerskip.hf import adapters
from layerskip.hf.cache import model_cache
from layerskip.hf.forward import block_hidden
from layerskip.sampling import Sampling

NEW_TOKENS = 30
EXIT_LAYER = 2


@functools.cache
def _model(arch: str) -> torch.nn.Module:
    return tiny_model(arch)


def _perturbed(model: torch.nn.Module, spec: ExitSpec, seed: int = 0) -> ExitAdapter:
    adapter = ExitAdapter.fresh(model, spec)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in adapter.module.parameters():
            parameter.add_(0.02 * torch.randn(parameter.shape, generator=generator).to(parameter.dtype))
    return adapter


def exit_policy(
    model: torch.nn.Module, directory: Path, kind: str, reuse_kv: bool = False, layer: int = EXIT_LAYER, **draft: object
) -> SkipPolicy:
    """A policy exiting after ``layer`` through a perturbed adapter saved under ``directory``."""
    adapter = _perturbed(model, ExitSpec(layer=layer, kind=kind, rank=8))
    path = directory / f"exit-{kind}-{layer}.safetensors"
    sha = adapter.save(path)
    count = adapters.num_layers(model)
    settings = DraftSettings(**{"max_draft_tokens": 4, **draft})
    policy = SkipPolicy.early_exit(count, layer + 1, draft=settings)
    return replace(policy, exit=ExitSettings(str(path), sha, layer, kind, reuse_kv)).with_model(model)


CASES = [("linear", False), ("linear", True), ("layer", False), ("layer", True)]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(("kind", "reuse"), CASES, ids=[f"{k}-{'reuse' if r else 'recompute'}" for k, r in CASES])
def test_exit_draft_is_lossless(arch: str, kind: str, reuse: bool, tmp_path: Path) -> None:
    model = _model(arch)
    prompt = random_prompt()
    policy = exit_policy(model, tmp_path, kind, reuse)
    reference, logits = hf_greedy(model, prompt, NEW_TOKENS)
    lengths: list[tuple[list[int], int]] = []
    tokens, stats = decode(
        model,
        prompt,
        policy,
        DecodeSettings(NEW_TOKENS),
        cache_observer=lambda cache, committed: lengths.append((row_lengths(cache), committed)),
    )
    assert_same_tokens(tokens, reference, ref_logits=logits)
    assert stats.drafted > 0
    assert stats.accepted > 0 or arch == "gpt2"
    for step, (held, committed) in enumerate(lengths):
        assert held == [committed], f"step {step}: {held} vs {committed}"
    assert not is_bypassed(model)


@pytest.mark.parametrize("ending", ["adaptive", "length_by_cost", "hybrid"])
def test_exit_draft_with_every_draft_ending(ending: str, tmp_path: Path) -> None:
    model = _model("llama")
    prompt = random_prompt()
    draft = {
        "adaptive": dict(adaptive=True, initial_threshold=0.2, max_draft_tokens=6),
        "length_by_cost": dict(length_by_cost=True, max_draft_tokens=6),
        "hybrid": dict(lookup_max_ngram=3),
    }[ending]
    policy = exit_policy(model, tmp_path, "layer", reuse_kv=True, **draft)
    reference, logits = hf_greedy(model, prompt, NEW_TOKENS)
    tokens, _ = decode(model, prompt, policy, DecodeSettings(NEW_TOKENS))
    assert_same_tokens(tokens, reference, ref_logits=logits)


def test_exit_draft_with_on_the_fly_selection(tmp_path: Path) -> None:
    model = _model("qwen2")
    prompt = random_prompt()
    policy = replace(
        exit_policy(model, tmp_path, "linear", layer=2), on_the_fly=SkipPolicy.adaptive_selection().on_the_fly
    )
    reference, logits = hf_greedy(model, prompt, NEW_TOKENS)
    tokens, _ = Decoder.for_policy(model, policy).decode(prompt, DecodeSettings(NEW_TOKENS))
    assert_same_tokens(tokens, reference, ref_logits=logits)


def test_exit_draft_sampling_follows_the_model(tmp_path: Path) -> None:
    """Rejection sampling with an exit draft keeps the full model's law (as test_sampling's end-to-end check)."""
    model = tiny_model("llama", vocab_size=E2E_VOCAB, embed_scale=16.0, out_scale=8.0)
    prompt = random_prompt(E2E_VOCAB, 6)
    policy = exit_policy(model, tmp_path, "layer", reuse_kv=True, layer=0, max_draft_tokens=1)
    decoder = Decoder.for_policy(model, policy)
    p1, p2, _ = _exact_laws(model, prompt)
    first, second = torch.zeros(E2E_VOCAB), torch.zeros(E2E_VOCAB)
    accepted = 0
    for seed in range(E2E_SEEDS):
        tokens, stats = decoder.decode(prompt, DecodeSettings(max_new_tokens=3, sampling=Sampling(), seed=seed))
        first[tokens[0]] += 1
        second[tokens[1]] += 1
        accepted += stats.accepted
    assert 0 < accepted < E2E_SEEDS
    assert tv(first / E2E_SEEDS, p1) < E2E_TV_BOUND
    assert tv(second / E2E_SEEDS, p2) < E2E_TV_BOUND


def test_save_load_round_trip(tmp_path: Path) -> None:
    model = _model("gemma3_text")
    adapter = _perturbed(model, ExitSpec(layer=1, kind="layer"))
    sha = adapter.save(tmp_path / "a.safetensors")
    loaded = ExitAdapter.load(tmp_path / "a.safetensors", model, sha)
    assert loaded.spec == adapter.spec
    for (name, a), (_, b) in zip(adapter.module.state_dict().items(), loaded.module.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    policy = exit_policy(model, tmp_path, "linear")
    relative = replace(policy, exit=replace(policy.exit, adapter=policy.exit_adapter_path().name), root=str(tmp_path))
    relative.save(tmp_path / "sub" / "policy.json")
    again = SkipPolicy.load(tmp_path / "sub" / "policy.json")
    assert again.exit.adapter == f"../{policy.exit_adapter_path().name}"
    assert again.exit_adapter_path().resolve() == policy.exit_adapter_path().resolve()
    Decoder.for_policy(model, again)  # finds and checks the file


def test_wrong_model_and_changed_file_fail_in_one_line(tmp_path: Path) -> None:
    model = _model("llama")
    policy = exit_policy(model, tmp_path, "linear")
    other = _model("qwen2")
    with pytest.raises(LayerskipError, match="another model"):
        ExitAdapter.load(policy.exit_adapter_path(), other)
    path = policy.exit_adapter_path()
    path.write_bytes(path.read_bytes()[:-4] + b"\0\0\0\0")
    with pytest.raises(LayerskipError, match="has changed") as caught:
        Decoder.for_policy(model, policy)
    assert "\n" not in str(caught.value)
    path.write_bytes(b"not a safetensors file")
    with pytest.raises(LayerskipError, match="not a readable"):
        ExitAdapter.load(path, model)


@pytest.mark.parametrize("spec", ["not json", "[" * 100_000 + "]" * 100_000, "[1, 2]"], ids=["text", "deep", "list"])
def test_adapter_metadata_that_is_no_spec_is_one_line(spec: str, tmp_path: Path) -> None:
    """The spec in an adapter's metadata is JSON read like every other: text, deep nesting (a
    RecursionError before) or a list are one line naming the file."""
    from safetensors.torch import load, save

    from layerskip.drafts.model.exit_adapter import _metadata

    model = _model("llama")
    payload = _perturbed(model, ExitSpec(layer=1, kind="linear")).to_bytes()
    path = tmp_path / "a.safetensors"
    path.write_bytes(save(load(payload), metadata={**_metadata(payload), "spec": spec}))
    with pytest.raises(LayerskipError, match="has damaged metadata") as caught:
        ExitAdapter.load(path, model)
    assert str(path) in str(caught.value) and "\n" not in str(caught.value)


def test_exit_policy_checks(tmp_path: Path) -> None:
    model = _model("llama")
    policy = exit_policy(model, tmp_path, "linear")
    with pytest.raises(LayerskipError, match="must bypass layers"):
        check_policy_fits(model, replace(policy, skip_attention=()))
    with pytest.raises(LayerskipError, match="reuse_kv"):
        replace(policy, exit=replace(policy.exit, reuse_kv=True), draft=replace(policy.draft, precision="int4"))
        check_policy_fits(
            model,
            replace(policy, exit=replace(policy.exit, reuse_kv=True), draft=replace(policy.draft, precision="int4")),
        )
    assert set(policy.ablations()) >= {"no-adapter"}
    assert policy.ablations()["no-adapter"].exit is None


@pytest.mark.parametrize("kind", ["linear", "layer"])
def test_exit_draft_in_int4_is_lossless(kind: str, tmp_path: Path) -> None:
    """Layers 0..L in int4 and the adapter's own projections in int8 (its trained weights are off
    int4's grid), a truncated head: still exact."""
    model = _model("qwen2")
    prompt = random_prompt()
    policy = exit_policy(model, tmp_path, kind, precision="int4", draft_vocab_size=64)
    decoder = Decoder.for_policy(model, policy)
    assert decoder.draft_model is not None
    assert {p.precision for _, p in decoder.draft_model.projections[(-1, "exit")]} == {"int8"}
    assert {p.precision for _, p in decoder.draft_model.projections[(0, "mlp")]} == {"int4"}
    reference, logits = hf_greedy(model, prompt, NEW_TOKENS)
    tokens, stats = decoder.decode(prompt, DecodeSettings(NEW_TOKENS))
    assert_same_tokens(tokens, reference, ref_logits=logits)
    assert stats.drafted > 0


def _adapter_keys(model: torch.nn.Module, adapter: ExitAdapter, blocks: list[list[list[int]]], back: list[int]) -> list:
    """The layer adapter's keys of each row after verifying ``blocks`` (per step, one block per row)
    with ``exit_verify``, each row going ``back`` tokens before its second block (a rejection)."""
    windows = adapters.sliding_windows(model)
    cache = model_cache(model, [*windows, windows[adapter.spec.layer]], rows=len(blocks[0]))
    for step, rows in enumerate(blocks):
        if step:
            cache.set_lengths([length - b for length, b in zip(cache.lengths, back, strict=True)])
        committed, block = list(cache.lengths), torch.tensor(rows)
        with exit_verify(model, adapter, False, cache, committed, block):
            block_hidden(model, block, cache)
        cache.set_lengths([c + block.shape[1] for c in committed])
    buffer = cache.layers[-1].key_buffer
    return [buffer[b, :, :length] for b, length in enumerate(cache.lengths)]


def test_a_layer_adapter_keeps_its_own_kv_for_every_row_of_a_batch() -> None:
    """A batch's verify fills the adapter's K/V of every row at its own positions, as each row alone would."""
    model = _model("llama")
    adapter = _perturbed(model, ExitSpec(layer=EXIT_LAYER, kind="layer"))
    prompts = [random_prompt(length=9, seed=s) for s in (1, 2)]
    blocks = [random_prompt(length=3, seed=s) for s in (3, 4)]
    back = [2, 0]  # row 0 drops its last two tokens before the second block; row 1 keeps all
    together = _adapter_keys(model, adapter, [prompts, blocks], back)
    for b in range(2):
        alone = _adapter_keys(model, adapter, [[prompts[b]], [blocks[b]]], [back[b]])[0]
        assert together[b].shape == alone.shape
        assert torch.allclose(together[b], alone, atol=1e-5), f"row {b}"
