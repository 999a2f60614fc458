"""The truncated draft head (the draft scores only some vocabulary rows) and prompt lookup.

Greedy: every combination of truncated head, lookup only, lookup + skip draft and lookup + skip
draft + truncated head produces token for token what HF ``generate`` does, on a tiny Llama and a
tiny Gemma 3 (sliding window 4, mixed sliding / full layers). Sampling: with a draft law q that
is zero outside the subset, rejection sampling still outputs the full model's law p, including
the tokens the truncated head can never propose (they can only come from the residual).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import pytest
import torch
from compare import assert_same_tokens, hf_greedy
from tiny_models import VOCAB, random_prompt, tiny_model, tiny_tokenizer

from layerskip.engine import decoding, drafters
from layerskip.engine.decoding import DecodeSettings, decode_autoregressive, decode_speculative, generate
from layerskip.engine.policy import DraftSettings, SkipPolicy
from layerskip.engine.sampling import Sampling, sample, verify_sampled
from layerskip.engine.vocab import DraftVocabulary
from layerskip.hf import adapters

NEW_TOKENS = 30
ARCHS = ["llama", "gemma3_text"]
LOOKUP = dict(lookup_max_ngram=3, lookup_min_ngram=1)
SKIP = dict(skip_attention=(0, 2))  # bypasses two attention sublayers: drafts accepted and rejected


@functools.cache
def _model(arch: str, **overrides: object) -> torch.nn.Module:
    return tiny_model(arch, **overrides)


@functools.cache
def _reference(arch: str) -> tuple[list[int], torch.Tensor]:
    return hf_greedy(_model(arch), random_prompt(), NEW_TOKENS)


def _rows(arch: str) -> torch.Tensor:
    """A subset of the vocabulary holding half of the reference's distinct tokens (and not the other half)."""
    distinct = sorted(set(_reference(arch)[0]))
    keep, drop = set(distinct[::2]), set(distinct[1::2])
    return torch.tensor(sorted((keep | set(range(0, VOCAB, 3))) - drop))


def _policy(combo: str, rows: torch.Tensor) -> tuple[SkipPolicy, torch.Tensor | None]:
    if combo == "truncated":
        return SkipPolicy(**SKIP, draft=DraftSettings(draft_vocab_size=len(rows))), rows
    if combo == "lookup":
        return SkipPolicy(draft=DraftSettings(use_skip_draft=False, **LOOKUP)), None
    if combo == "hybrid":
        return SkipPolicy(**SKIP, draft=DraftSettings(**LOOKUP)), None
    if combo == "hybrid-truncated":
        return SkipPolicy(**SKIP, draft=DraftSettings(draft_vocab_size=len(rows), **LOOKUP)), rows
    raise ValueError(combo)


def _spy_on_skip_drafts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every token the skip draft proposes (lookup proposals are not model outputs)."""
    proposed: list[int] = []
    real = drafters.SkipDrafter.propose

    def propose(self: drafters.SkipDrafter, request: drafters.DraftRequest) -> drafters.Draft:
        draft = real(self, request)
        proposed.extend(draft.tokens)
        return draft

    monkeypatch.setattr(drafters.SkipDrafter, "propose", propose)
    return proposed


# -- greedy: lossless ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("combo", ["truncated", "lookup", "hybrid", "hybrid-truncated"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_hf_generate(arch: str, combo: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model(arch)
    ref, logits = _reference(arch)
    rows = _rows(arch)
    policy, vocab_rows = _policy(combo, rows)
    proposed = _spy_on_skip_drafts(monkeypatch)
    tokens, stats = decode_speculative(
        model, random_prompt(), policy, DecodeSettings(max_new_tokens=NEW_TOKENS), vocab_rows=vocab_rows
    )
    assert_same_tokens(tokens, ref, ref_logits=logits, label=f"{arch} {combo}")
    assert stats.new_tokens == NEW_TOKENS and not adapters.is_bypassed(model)
    assert 0 < stats.accepted < stats.drafted  # drafts were both kept and rejected
    if policy.draft.lookup_max_ngram:
        assert stats.lookup_steps > 0  # lookup found matches
    else:
        assert stats.lookup_steps == 0
    if policy.draft.use_skip_draft:
        assert proposed, "the skip draft never ran"
    else:
        assert not proposed
    if vocab_rows is not None:
        allowed = set(rows.tolist())
        assert set(proposed) <= allowed, sorted(set(proposed) - allowed)  # the head really is truncated
        assert set(ref) - allowed  # some reference tokens can only come from the verify


def test_generate_builds_the_rows_from_the_builtin_vocabulary(monkeypatch: pytest.MonkeyPatch) -> None:
    """``generate`` with a draft_vocab_size policy truncates the head itself and stays lossless."""
    model, tokenizer = _model("llama"), tiny_tokenizer()
    heads: list[torch.Tensor | None] = []
    real = adapters.draft_head

    def draft_head(model: torch.nn.Module, rows: torch.Tensor | None = None) -> adapters.DraftHead:
        heads.append(rows)
        return real(model, rows)

    monkeypatch.setattr(adapters, "draft_head", draft_head)
    prompt = "hello world w1 w2 w3 w4 w5 hello"
    policy = SkipPolicy(**SKIP, draft=DraftSettings(draft_vocab_size=8))
    plain = generate(model, tokenizer, prompt, max_new_tokens=16)
    truncated = generate(model, tokenizer, prompt, policy, max_new_tokens=16)
    assert truncated.tokens == plain.tokens
    assert len(heads) == 1 and heads[0] is not None
    prompt_ids = tokenizer(prompt)["input_ids"]
    assert set(prompt_ids) <= set(heads[0].tolist()) and len(heads[0]) <= 8 + len(set(prompt_ids))


# -- DraftVocabulary --------------------------------------------------------------------------------------


def test_ranking_counts_then_ascending_ids() -> None:
    tokenizer = tiny_tokenizer()  # "w1" is id 3, "w5" 7, "hello" 64, "world" 65
    vocabulary = DraftVocabulary.from_texts(tokenizer, ["hello hello world w1", "w1 w1 w5"], _model("llama"))
    ranking = vocabulary.ranking.tolist()
    assert sorted(ranking) == list(range(VOCAB))  # every id exactly once
    assert ranking[:4] == [3, 64, 7, 65]  # by count (3, 2, 1, 1), ties by id
    assert ranking[4:] == sorted(set(range(VOCAB)) - {3, 64, 7, 65})


def test_ranking_drops_ids_beyond_the_head() -> None:
    small = tiny_model("llama", vocab_size=64)  # the tokenizer's "hello" (64) and "world" (65) do not fit
    vocabulary = DraftVocabulary.from_texts(tiny_tokenizer(), ["world world hello w0"], small)
    assert vocabulary.ranking.tolist() == [2, *[i for i in range(64) if i != 2]]


def test_builtin_ranking_is_a_permutation() -> None:
    ranking = DraftVocabulary.builtin(tiny_tokenizer(), _model("llama")).ranking.tolist()
    assert sorted(ranking) == list(range(VOCAB))
    assert ranking[0] == 0  # nearly every word of the built-in prompts is [UNK] for the tiny tokenizer


@pytest.mark.parametrize("size", [1, 5, 40, VOCAB - 1])
def test_rows(size: int) -> None:
    ranking = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(size))
    vocabulary = DraftVocabulary(ranking)
    prompt = [5, 99, 5, 17, 120, 99]
    rows = vocabulary.rows(size, prompt)
    values = rows.tolist()
    assert values == sorted(set(values))  # sorted, no duplicates
    assert set(prompt) <= set(values)
    assert set(ranking[:size].tolist()) <= set(values)
    assert set(values) == set(ranking[:size].tolist()) | set(prompt)  # nothing else
    assert vocabulary.rows(size).tolist() == sorted(ranking[:size].tolist())
    assert rows.dtype == torch.long


def test_rows_for_the_full_head_is_none() -> None:
    vocabulary = DraftVocabulary(torch.arange(VOCAB))
    assert vocabulary.rows(0) is None
    assert vocabulary.rows(0, [1, 2, 3]) is None
    assert vocabulary.rows(VOCAB) is None and vocabulary.rows(VOCAB + 5) is None  # K >= V: the full head
    assert vocabulary.rows_for(SkipPolicy(**SKIP), [1, 2]) is None
    assert vocabulary.rows_for(SkipPolicy(draft=DraftSettings(draft_vocab_size=4)), [9]).tolist() == [0, 1, 2, 3, 9]


# -- sampling with a truncated head: synthetic distributions ---------------------------------------------

V = 8
SUBSET = [1, 3, 4, 6]  # the ids the truncated draft head scores
OUTSIDE = [t for t in range(V) if t not in SUBSET]
DRAWS = 20_000
TV_BOUND = 0.03  # the empirical TV of 20000 draws over 8 outcomes is ~0.01
TOKEN_BOUND = 0.015  # per token: > 4 standard deviations of a frequency over 20000 draws

VerifyFn = Callable[[list[int], torch.Tensor, torch.Tensor, torch.Generator | None], tuple[int, int]]


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().sum() / 2)


def always_accept(drafted: list[int], p: torch.Tensor, q: torch.Tensor, generator: torch.Generator | None):
    """Broken: keeps every draft token, so the output follows q (never a token outside the subset)."""
    return len(drafted), int(sample(p[len(drafted)], generator))


def residual_within_subset(drafted: list[int], p: torch.Tensor, q: torch.Tensor, generator: torch.Generator | None):
    """Broken: the right acceptance test, but the residual max(0, p - q) is taken over the subset only."""
    mask = torch.zeros(p.shape[-1])
    mask[SUBSET] = 1.0
    for i, token in enumerate(drafted):
        if float(torch.rand((), generator=generator)) >= float(p[i, token] / q[i, token]):
            residual = (p[i] - q[i]).clamp_min(0) * mask
            return i, int(sample(residual / residual.sum(), generator))
    return len(drafted), int(sample(p[len(drafted)], generator))


def _laws() -> tuple[torch.Tensor, torch.Tensor]:
    """p ``[3, V]`` over the full vocabulary; q ``[2, V]`` zero outside SUBSET, renormalised over it."""
    g = torch.Generator().manual_seed(0)
    p = torch.randn(3, V, generator=g).mul(1.2).softmax(-1)
    draft_logits = torch.randn(2, V, generator=g).mul(1.2)
    q = torch.zeros(2, V)
    q[:, SUBSET] = draft_logits[:, SUBSET].softmax(-1)
    return p, q


def _output_laws(verify: VerifyFn, p: torch.Tensor, q: torch.Tensor, draws: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft 2 tokens from q and verify, ``draws`` times: empirical laws of output tokens 1 and 2."""
    g = torch.Generator().manual_seed(1)
    first, second = torch.zeros(V), torch.zeros(V)
    for row in sample(q.expand(draws, -1, -1), g).tolist():  # [draws, 2]
        assert set(row) <= set(SUBSET)
        accepted, nxt = verify(row, p, q, g)
        out = [*row[:accepted], nxt]
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    return first / first.sum(), second / second.sum()


def test_rejection_sampling_with_a_truncated_draft_outputs_p() -> None:
    p, q = _laws()
    assert float(p[:2, OUTSIDE].sum(-1).min()) > 0.3  # much of p lies where q is zero
    first, second = _output_laws(verify_sampled, p, q, DRAWS)
    assert tv(first, p[0]) < TV_BOUND, (first, p[0])
    assert tv(second, p[1]) < TV_BOUND, (second, p[1])
    for token in OUTSIDE:  # tokens the draft can never propose still come out, as often as p says
        assert abs(float(first[token] - p[0, token])) < TOKEN_BOUND, (token, first[token], p[0, token])
        assert abs(float(second[token] - p[1, token])) < TOKEN_BOUND, (token, second[token], p[1, token])
        assert first[token] > 0


@pytest.mark.parametrize("broken", [always_accept, residual_within_subset], ids=lambda f: f.__name__)
def test_broken_rules_fail_the_same_bound(broken: VerifyFn) -> None:
    p, q = _laws()
    first, _ = _output_laws(broken, p, q, 5_000)
    assert tv(first, p[0]) > 3 * TV_BOUND
    assert float(first[OUTSIDE].sum()) == 0.0  # it never outputs a token outside the subset


# -- sampling with a truncated head: end to end on a tiny model --------------------------------------------

E2E_VOCAB = 16
E2E_SEEDS = 600
E2E_TV_BOUND = 0.12  # the empirical TV of 600 draws over 16 outcomes is ~0.05
E2E_BUDGET_S = 20.0


def _e2e_model() -> torch.nn.Module:
    return _model("llama", vocab_size=E2E_VOCAB, embed_scale=16.0, out_scale=8.0)


def _e2e_setup() -> tuple[list[int], torch.Tensor, torch.Tensor, SkipPolicy]:
    """The prompt, the exact law of output token 2 (the first drafted-then-verified one), the rows and the policy."""
    model = _e2e_model()
    prompt = random_prompt(E2E_VOCAB, 6)
    with torch.inference_mode():
        p1 = model(input_ids=torch.tensor([prompt])).logits[0, -1].softmax(-1)
        batch = torch.tensor([[*prompt, x] for x in range(E2E_VOCAB)])
        p2 = model(input_ids=batch).logits[:, -1].softmax(-1)  # [token 1, token 2]
    law = p1 @ p2
    ranked = law.argsort(descending=True)
    rows = ranked[1::2].sort().values  # 8 rows, without the most likely token
    policy = SkipPolicy(**SKIP, draft=DraftSettings(max_draft_tokens=1, draft_vocab_size=len(rows)))
    return prompt, law, rows, policy


def test_sampled_truncated_draft_proposes_from_the_rows_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a truncated head the draft's q is a distribution over the rows: zero elsewhere, summing to 1."""
    prompt, _, rows, policy = _e2e_setup()
    policy = SkipPolicy(**SKIP, draft=DraftSettings(max_draft_tokens=3, draft_vocab_size=len(rows)))
    seen: list[tuple[list[int], torch.Tensor]] = []
    real = decoding.verify_sampled

    def spy(drafted: list[int], p: torch.Tensor, q: torch.Tensor, generator: torch.Generator | None):
        seen.append((list(drafted), q))
        return real(drafted, p, q, generator)

    monkeypatch.setattr(decoding, "verify_sampled", spy)
    settings = DecodeSettings(max_new_tokens=20, sampling=Sampling(temperature=1.3), seed=3)
    tokens, _ = decode_speculative(_e2e_model(), prompt, policy, settings, vocab_rows=rows)
    assert len(tokens) == 20
    outside = torch.ones(E2E_VOCAB, dtype=torch.bool)
    outside[rows] = False
    drafted = [(d, q) for d, q in seen if d]
    assert drafted
    for tokens_drafted, q in drafted:
        assert set(tokens_drafted) <= set(rows.tolist())
        assert q.shape == (len(tokens_drafted), E2E_VOCAB)
        assert float(q[:, outside].abs().max()) == 0.0
        torch.testing.assert_close(q.sum(-1), torch.ones(len(tokens_drafted)))


def test_end_to_end_sampling_with_a_truncated_head_follows_the_model() -> None:
    model = _e2e_model()
    prompt, law, rows, policy = _e2e_setup()
    outside = [t for t in range(E2E_VOCAB) if t not in set(rows.tolist())]
    assert float(law[outside].sum()) > 0.3  # much of the law lies outside the draft's rows
    counts = torch.zeros(E2E_VOCAB)
    accepted = 0
    start = time.perf_counter()
    for seed in range(E2E_SEEDS):
        settings = DecodeSettings(max_new_tokens=3, sampling=Sampling(), seed=seed)
        tokens, stats = decode_speculative(model, prompt, policy, settings, vocab_rows=rows)
        assert len(tokens) == 3 and stats.drafted >= 1
        counts[tokens[1]] += 1  # token 1 comes from the prefill; token 2 was drafted, then verified
        accepted += stats.accepted
        if seed == 24 and (time.perf_counter() - start) * E2E_SEEDS / 25 > E2E_BUDGET_S:
            pytest.skip(f"the end-to-end check would take over {E2E_BUDGET_S:.0f} s on this machine now")
    empirical = counts / E2E_SEEDS
    assert 0 < accepted < E2E_SEEDS  # drafts were both accepted and rejected
    assert tv(empirical, law) < E2E_TV_BOUND, (empirical, law)
    assert abs(float(empirical[outside].sum() - law[outside].sum())) < 0.08
    # Plain sampling from the same seeds agrees in law too (a sanity check of the reference law).
    plain = torch.zeros(E2E_VOCAB)
    for seed in range(200):
        tokens, _ = decode_autoregressive(
            model, prompt, DecodeSettings(max_new_tokens=2, sampling=Sampling(), seed=seed)
        )
        plain[tokens[1]] += 1
    assert tv(plain / 200, law) < 0.2


def test_end_to_end_with_always_accept_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same check catches a verify that keeps every draft: no token outside the rows ever comes out."""
    monkeypatch.setattr(decoding, "verify_sampled", always_accept)
    model = _e2e_model()
    prompt, law, rows, policy = _e2e_setup()
    counts = torch.zeros(E2E_VOCAB)
    for seed in range(200):
        settings = DecodeSettings(max_new_tokens=3, sampling=Sampling(), seed=seed)
        tokens, _ = decode_speculative(model, prompt, policy, settings, vocab_rows=rows)
        counts[tokens[1]] += 1
    assert set(counts.nonzero().flatten().tolist()) <= set(rows.tolist())
    assert tv(counts / counts.sum(), law) > 2 * E2E_TV_BOUND
