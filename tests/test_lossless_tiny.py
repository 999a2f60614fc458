"""Greedy self-speculative decoding is lossless: token for token what HF ``generate`` produces.

Every supported architecture (tiny random configs, see tiny_models.py) x every kind of draft:
attention-only skips (with layer 0's attention), MLP-only, whole layers, early exit, adaptive
draft length, draft length by cost, prompt lookup alone and lookup + skip. 40 new tokens from an 8-token prompt run
far past the sliding window (4) of Mistral / Gemma 2 / Gemma 3.
"""

from __future__ import annotations

import functools
import inspect

import pytest
import torch
from compare import assert_same_tokens, hf_greedy, mismatch_message
from oracles import is_bypassed
from tiny_models import ARCHS, LAYERS, random_prompt, tiny_model, tiny_tokenizer

from layerskip.drafts.model.draft_model import DraftModel
from layerskip.drafts.policy.skip_policy import DraftSettings, SkipPolicy
from layerskip.engine.decoding import Decoder, DecodeSettings, decode, generate
from layerskip.errors import LayerskipError
from layerskip.hf import adapters

NEW_TOKENS = 40

POLICIES: dict[str, SkipPolicy] = {
    "attention-0-2": SkipPolicy(skip_attention=(0, 2)),
    "attention-0": SkipPolicy(skip_attention=(0,)),
    "mlp-1-3": SkipPolicy(skip_mlp=(1, 3)),
    "layers-1-2": SkipPolicy.skip_layers([1, 2]),
    "early-exit-2": SkipPolicy.early_exit(LAYERS, 2),
    "early-exit-1-k1": SkipPolicy.early_exit(LAYERS, 1, draft=DraftSettings(max_draft_tokens=1)),
    "mixed-k8": SkipPolicy(skip_attention=(3,), skip_mlp=(0, 2), draft=DraftSettings(max_draft_tokens=8)),
    "adaptive": SkipPolicy(skip_attention=(1,), skip_mlp=(3,), draft=DraftSettings(max_draft_tokens=6, adaptive=True)),
    # A low confidence threshold: drafts of varying length, so both "continue" and "stop" run.
    "adaptive-low": SkipPolicy(
        skip_attention=(1,),
        skip_mlp=(3,),
        draft=DraftSettings(max_draft_tokens=6, adaptive=True, initial_threshold=0.1, target_acceptance=0.5),
    ),
    # Draft length by cost, on this machine's clock (tests/test_draft_length.py forces varied lengths).
    "by-cost": SkipPolicy(
        skip_attention=(1,), skip_mlp=(3,), draft=DraftSettings(max_draft_tokens=6, length_by_cost=True)
    ),
    "lookup": SkipPolicy(draft=DraftSettings(lookup_max_ngram=3, use_skip_draft=False)),
    "lookup-hybrid": SkipPolicy(skip_attention=(0,), skip_mlp=(2,), draft=DraftSettings(lookup_max_ngram=3)),
    # Lookup runs cut by their learned chance of acceptance (unigram matches: many misses to learn from).
    "lookup-cut": SkipPolicy(
        draft=DraftSettings(lookup_max_ngram=3, lookup_min_ngram=1, use_skip_draft=False, lookup_confidence=0.3)
    ),
    # Token trees: several lookup matches (unigrams: many), the draft's siblings, both.
    "lookup-tree": SkipPolicy(
        draft=DraftSettings(lookup_max_ngram=3, lookup_min_ngram=1, use_skip_draft=False, tree_matches=4)
    ),
    "sibling-tree": SkipPolicy(
        skip_attention=(1,), skip_mlp=(3,), draft=DraftSettings(max_draft_tokens=5, tree_siblings=2, tree_margin=0.9)
    ),
    "hybrid-tree": SkipPolicy(
        skip_attention=(0,),
        draft=DraftSettings(lookup_max_ngram=3, lookup_min_ngram=1, tree_matches=3, tree_siblings=1, tree_margin=0.9),
    ),
    "lookup-cut-hybrid": SkipPolicy(
        skip_attention=(0,), draft=DraftSettings(lookup_max_ngram=3, lookup_min_ngram=1, lookup_confidence=0.3)
    ),
}


@functools.cache
def _model(arch: str) -> torch.nn.Module:
    return tiny_model(arch)


@functools.cache
def _reference(arch: str) -> tuple[list[int], torch.Tensor]:
    return hf_greedy(_model(arch), random_prompt(), NEW_TOKENS)


def _check(arch: str, got: list[int], label: str) -> None:
    ref, logits = _reference(arch)
    assert_same_tokens(got, ref, ref_logits=logits, label=f"{arch} {label}")


@pytest.mark.parametrize("arch", ARCHS)
def test_autoregressive_matches_hf(arch: str) -> None:
    tokens, stats = decode(_model(arch), random_prompt(), None, DecodeSettings(max_new_tokens=NEW_TOKENS))
    _check(arch, tokens, "autoregressive")
    assert stats.new_tokens == NEW_TOKENS and stats.steps == NEW_TOKENS


@pytest.mark.parametrize("policy_name", list(POLICIES))
@pytest.mark.parametrize("arch", ARCHS)
def test_speculative_matches_hf(arch: str, policy_name: str) -> None:
    model = _model(arch)
    policy = POLICIES[policy_name]
    streamed: list[int] = []
    tokens, stats = decode(
        model, random_prompt(), policy, DecodeSettings(max_new_tokens=NEW_TOKENS), on_tokens=streamed.extend
    )
    _check(arch, tokens, policy_name)
    assert streamed == tokens
    assert not is_bypassed(model)
    # Bookkeeping: every step is the prefill or one verify; tau = tokens per full forward.
    assert stats.new_tokens == NEW_TOKENS
    assert sum(stats.accept_histogram.values()) == stats.steps
    assert 0 <= stats.accepted <= stats.drafted
    assert stats.steps == NEW_TOKENS - stats.accepted  # each verify adds its own token + the accepted drafts
    # The draft is exercised: it gets tokens accepted, so the test covers multi-token commits.
    assert stats.accepted > 0, f"{arch} {policy_name}: no draft token was ever accepted"
    if policy.draft.lookup_max_ngram:
        assert stats.lookup_steps > 0
    assert sum(stats.block_histogram.values()) == stats.steps - 1  # every verify forward, by its length
    if policy_name == "adaptive-low":
        verifies = stats.steps - 1
        assert verifies < stats.drafted < verifies * policy.draft.max_draft_tokens, "draft lengths never varied"


@pytest.mark.parametrize("arch", ARCHS)
def test_drafts_get_rejected_too(arch: str) -> None:
    """The tiny models are not so easy that every draft is accepted: the rollback path runs."""
    model = _model(arch)
    rejected = 0
    for name in ("layers-1-2", "early-exit-2", "mlp-1-3"):
        _, stats = decode(model, random_prompt(), POLICIES[name], DecodeSettings(max_new_tokens=NEW_TOKENS))
        rejected += stats.drafted - stats.accepted
    assert rejected > 0


@pytest.mark.parametrize("arch", ["mistral", "gemma2", "gemma3_text"])
def test_sliding_window_matters(arch: str) -> None:
    """The window-4 reference differs from the same weights without a window: the window is exercised."""
    unwindowed = tiny_model(arch, sliding_window=512)
    ref, _ = _reference(arch)
    other, _ = hf_greedy(unwindowed, random_prompt(), NEW_TOKENS)
    assert other != ref


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gpt2"])
def test_truncated_draft_head_is_lossless(arch: str) -> None:
    """A draft head scoring only some vocabulary rows (Gemma 2: with logit softcapping; GPT-2: tied) is lossless."""
    model = _model(arch)
    ref, _ = _reference(arch)
    rows = torch.tensor(sorted(set(ref) | set(range(0, 128, 3))))  # include the reference tokens: acceptances
    policy = SkipPolicy(skip_mlp=(1,), skip_attention=(3,), draft=DraftSettings(draft_vocab_size=len(rows)))
    tokens, stats = decode(model, random_prompt(), policy, DecodeSettings(max_new_tokens=NEW_TOKENS), vocab_rows=rows)
    _check(arch, tokens, "truncated head")
    assert stats.accepted > 0


@pytest.mark.parametrize("policy_name", ["attention-0-2", "early-exit-2", "lookup-hybrid"])
@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_eos_stops_inside_an_accepted_block(arch: str, policy_name: str) -> None:
    """With an EOS id, output ends right after its first occurrence, as HF generate does."""
    model = _model(arch)
    ref, _ = _reference(arch)
    eos = ref[len(ref) // 2]
    expected = ref[: ref.index(eos) + 1]
    settings = DecodeSettings(max_new_tokens=NEW_TOKENS, eos_token_ids=(eos,))
    tokens, _ = decode(model, random_prompt(), POLICIES[policy_name], settings)
    assert tokens == expected, mismatch_message(tokens, expected, label=f"{arch} {policy_name} eos={eos}")
    plain, _ = decode(model, random_prompt(), None, settings)
    assert plain == expected


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 5])
def test_short_budgets(max_new_tokens: int) -> None:
    """The token budget is exact even when a draft block could overshoot it."""
    ref, _ = _reference("llama")
    for name in ("attention-0-2", "mixed-k8", "lookup"):
        tokens, stats = decode(
            _model("llama"), random_prompt(), POLICIES[name], DecodeSettings(max_new_tokens=max_new_tokens)
        )
        assert tokens == ref[:max_new_tokens], name
        assert stats.new_tokens == max_new_tokens


def test_long_generation_past_initial_cache_capacity() -> None:
    """Prompt + generation exceed the rollback cache's initial 256-token buffers: it grows, still lossless."""
    model = tiny_model("mistral", max_position_embeddings=1024)
    prompt = random_prompt(length=200, seed=1)
    ref, logits = hf_greedy(model, prompt, 80)
    tokens, stats = decode(model, prompt, POLICIES["mixed-k8"], DecodeSettings(max_new_tokens=80))
    assert_same_tokens(tokens, ref, ref_logits=logits, label="mistral 200+80")
    assert stats.accepted > 0


def test_tensor_prompt_is_accepted() -> None:
    ref, _ = _reference("qwen2")
    prompt = torch.tensor([random_prompt()])  # [1, T] as HF tokenizers return it
    tokens, _ = decode(_model("qwen2"), prompt, POLICIES["layers-1-2"], DecodeSettings(max_new_tokens=10))
    assert tokens == ref[:10]


# -- bypass is always undone -------------------------------------------------------------------


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([random_prompt()])).logits


@pytest.mark.parametrize("arch", ["llama", "gpt_neox", "gpt2"])
def test_bypass_is_restored_after_an_exception(arch: str) -> None:
    model = _model(arch)
    before = _logits(model)
    with pytest.raises(RuntimeError, match="boom"):
        with adapters.bypass(model, attention=[0, 1], mlp=[2, 3]):
            assert is_bypassed(model)
            changed = _logits(model)
            raise RuntimeError("boom")
    assert not is_bypassed(model)
    assert not torch.equal(changed, before)  # the bypass did something
    torch.testing.assert_close(_logits(model), before, rtol=0, atol=0)


def test_bypass_with_a_bad_index_restores_what_it_patched() -> None:
    model = _model("llama")
    with pytest.raises(IndexError):
        with adapters.bypass(model, attention=[0, 1, 99]):
            pass
    assert not is_bypassed(model)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])  # the lean draft step (patches nothing), HF's forward (patches)
def test_bypass_is_restored_when_drafting_fails(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model(arch)
    real = DraftModel.logits
    calls = []

    def failing(self: DraftModel, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 3:
            assert is_bypassed(model) == (self.lean is None)
            raise RuntimeError("draft failed")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(DraftModel, "logits", failing)
    with pytest.raises(RuntimeError, match="draft failed"):
        decode(model, random_prompt(), POLICIES["mixed-k8"], DecodeSettings(max_new_tokens=NEW_TOKENS))
    assert not is_bypassed(model)
    monkeypatch.undo()
    tokens, _ = decode(model, random_prompt(), POLICIES["mixed-k8"], DecodeSettings(NEW_TOKENS))
    _check(arch, tokens, "after a failed decode")


# -- text level: stop strings and the generate() entry point ------------------------------------------


@functools.cache
def _word_model() -> torch.nn.Module:
    return tiny_model("llama", vocab_size=66)  # ids 0..65: exactly the tiny tokenizer's vocabulary


def test_stop_strings_cut_speculative_and_plain_output_alike() -> None:
    tokenizer = tiny_tokenizer()
    model = _word_model()
    prompt = tokenizer("hello world w1 w2 w3 w4")["input_ids"]
    full, _ = decode(model, prompt, None, DecodeSettings(max_new_tokens=30))
    words = tokenizer.decode(full, skip_special_tokens=True).split()
    stop = words[len(words) // 2]
    # Output ends with the token that completes the stop string.
    end = next(i for i in range(len(full)) if stop in tokenizer.decode(full[: i + 1], skip_special_tokens=True))
    expected = full[: end + 1]
    assert 1 < len(expected) < len(full)
    settings = DecodeSettings(max_new_tokens=30, stop_strings=(stop,))
    plain, _ = decode(model, prompt, None, settings, tokenizer=tokenizer)
    assert plain == expected
    for name in ("attention-0-2", "mixed-k8", "lookup-hybrid"):
        tokens, _ = decode(model, prompt, POLICIES[name], settings, tokenizer=tokenizer)
        assert tokens == expected, name


def test_stop_strings_need_a_tokenizer() -> None:
    with pytest.raises(LayerskipError, match="tokenizer"):
        decode(_word_model(), [1, 2, 3], POLICIES["mlp-1-3"], DecodeSettings(max_new_tokens=4, stop_strings=("x",)))


@pytest.mark.parametrize("bad", [[], torch.zeros(1, 0, dtype=torch.long)], ids=["list", "tensor"])
def test_empty_prompt_ids_are_refused(bad: object) -> None:
    with pytest.raises(LayerskipError, match="empty"):
        decode(_model("llama"), bad, POLICIES["mlp-1-3"], DecodeSettings(max_new_tokens=4))
    with pytest.raises(LayerskipError, match="empty"):
        decode(_model("llama"), bad, None, DecodeSettings(max_new_tokens=4))


def test_zero_budget_is_refused() -> None:
    with pytest.raises(LayerskipError, match="max_new_tokens"):
        decode(_model("llama"), random_prompt(), POLICIES["mlp-1-3"], DecodeSettings(max_new_tokens=0))


def test_invalid_policy_is_refused_before_decoding() -> None:
    with pytest.raises(LayerskipError, match="every sublayer"):
        decode(_model("llama"), random_prompt(), SkipPolicy.early_exit(LAYERS, 0), DecodeSettings(4))


def test_decoding_stops_at_the_models_eos_unless_told_not_to() -> None:
    """``DecodeSettings`` stops where HF ``generate`` does, at the generation config's EOS ids,
    alone or in a batch, plain or drafted; ``eos_token_ids=()`` runs the whole budget."""
    model = tiny_model("llama")  # its own: its generation config changes below
    prompt = random_prompt()
    full, _ = decode(model, prompt, None, DecodeSettings(NEW_TOKENS))  # no EOS configured yet
    assert len(full) == NEW_TOKENS
    eos = full[NEW_TOKENS // 2]
    model.generation_config.eos_token_id = eos
    hf = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=eos)
    expected = hf[0, len(prompt) :].tolist()
    assert expected == full[: full.index(eos) + 1]
    for policy in (None, POLICIES["mixed-k8"]):
        decoder = Decoder.for_policy(model, policy)
        assert decoder.decode(prompt, DecodeSettings(NEW_TOKENS))[0] == expected
        rows = decoder.decode_batch([prompt, prompt], DecodeSettings(NEW_TOKENS))
        assert [tokens for tokens, _ in rows] == [expected, expected]
    assert decode(model, prompt, None, DecodeSettings(NEW_TOKENS, eos_token_ids=()))[0] == full


def test_generate_drafts_with_auto_unless_told_plain() -> None:
    """``generate`` and ``Decoder.for_policy`` default to ``auto``, as the CLI and the plug-in do;
    ``"plain"`` (the CLI's word) and None prepare no draft."""
    for function in (generate, Decoder.for_policy):
        assert inspect.signature(function).parameters["policy"].default == "auto"
    assert Decoder.for_policy(_word_model(), "plain").draft is None
    assert Decoder.for_policy(_word_model(), None).draft is None
    assert Decoder(_word_model()).draft is None


def test_generate_text_entry_point() -> None:
    tokenizer = tiny_tokenizer()
    model = _word_model()
    streamed: list[int] = []
    plain = generate(model, tokenizer, "hello world w7", "plain", max_new_tokens=12)
    fast = generate(
        model, tokenizer, "hello world w7", POLICIES["layers-1-2"], max_new_tokens=12, stream=streamed.extend
    )
    assert fast.tokens == plain.tokens == streamed
    assert fast.text == plain.text == tokenizer.decode(plain.tokens, skip_special_tokens=True)
    assert fast.prompt_tokens == 3 and fast.stats.new_tokens == len(fast.tokens)
    with pytest.raises(LayerskipError, match="empty"):
        generate(model, tokenizer, "   ", max_new_tokens=4)
