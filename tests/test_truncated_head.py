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

import pytest
import torch
from compare import assert_same_tokens, chain_rule_as_tree, hf_greedy
from oracles import engine_chain_verify, is_bypassed
from test_sampling import VerifyFn, always_accept, tv
from tiny_models import VOCAB, random_prompt, tiny_model, tiny_tokenizer

from layerskip.drafts import base
from layerskip.drafts.builder import head_rows
from layerskip.drafts.drafters import skip
from layerskip.drafts.model.head import DraftHead
from layerskip.drafts.model.vocab import DraftVocabulary
from layerskip.drafts.policy.skip_policy import DraftSettings, SkipPolicy
from layerskip.engine import verifiers
from layerskip.engine.decoding import DecodeSettings, decode, generate
from layerskip.sampling import Sampling, sample

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


def _spy_on_skip_drafts(monkeypatch: pytest.MonkeyPatch) -> list[tuple[set[int], list[int]]]:
    """Every skip draft (lookup proposals are not model outputs), with the tokens of the history then."""
    proposed: list[tuple[set[int], list[int]]] = []
    real = skip.SkipDrafter.propose

    def propose(self: skip.SkipDrafter, request: base.DraftRequest) -> base.Proposal:
        draft = real(self, request)
        proposed.append((set(request.history), list(draft.tokens)))
        return draft

    monkeypatch.setattr(skip.SkipDrafter, "propose", propose)
    return proposed


def _fixed_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Truncated heads keep their starting rows (no prompt or emitted tokens added)."""
    monkeypatch.setattr(DraftHead, "add", lambda self, tokens: None)


# -- greedy: lossless ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("combo", ["truncated", "lookup", "hybrid", "hybrid-truncated"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_hf_generate(arch: str, combo: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model(arch)
    ref, logits = _reference(arch)
    rows = _rows(arch)
    policy, vocab_rows = _policy(combo, rows)
    proposed = _spy_on_skip_drafts(monkeypatch)
    tokens, stats = decode(
        model, random_prompt(), policy, DecodeSettings(max_new_tokens=NEW_TOKENS), vocab_rows=vocab_rows
    )
    assert_same_tokens(tokens, ref, ref_logits=logits, label=f"{arch} {combo}")
    assert stats.new_tokens == NEW_TOKENS and not is_bypassed(model)
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
        for history, tokens in proposed:  # the head really is truncated: its rows, the prompt, tokens emitted
            assert set(tokens) <= allowed | history, sorted(set(tokens) - allowed - history)
        assert set(ref) - allowed  # some reference tokens can only come from the verify


def test_generate_uses_the_policy_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """``generate`` with a draft_vocab_size policy truncates the head to the policy's rows (or the
    lowest ids when it has none), then adds the prompt's tokens, and stays lossless."""
    model, tokenizer = _model("llama"), tiny_tokenizer()
    heads: list[DraftHead] = []
    real = DraftHead.__init__

    def init(self: DraftHead, *args: object, **kwargs: object) -> None:
        real(self, *args, **kwargs)
        heads.append(self)

    monkeypatch.setattr(DraftHead, "__init__", init)
    prompt = "hello world w1 w2 w3 w4 w5 hello"
    prompt_ids = tokenizer(prompt)["input_ids"]
    plain = generate(model, tokenizer, prompt, "plain", max_new_tokens=16)
    ranking = (100, 90, 80, 70, 60, 50, 40, 30, 20)
    for ranked, start in (((), set(range(8))), (ranking, set(ranking[:8]))):
        heads.clear()
        policy = SkipPolicy(**SKIP, draft=DraftSettings(draft_vocab_size=8), draft_vocabulary=ranked)
        truncated = generate(model, tokenizer, prompt, policy, max_new_tokens=16)
        assert truncated.tokens == plain.tokens
        assert len(heads) == 1 and heads[0].truncated
        rows = set(_scored(heads[0]))
        assert start | set(prompt_ids) <= rows <= start | set(prompt_ids) | set(plain.tokens)


# -- the growing head ---------------------------------------------------------------------------------


def _scored(head: DraftHead) -> list[int]:
    """The vocabulary ids ``head`` scores now, through its own map from output position to id."""
    return head.token_ids(torch.arange(head.count)).tolist()


def test_draft_head_grows_and_maps_back_to_vocabulary_ids() -> None:
    torch.manual_seed(0)
    weight, bias = torch.randn(VOCAB, 16), torch.randn(VOCAB)
    head = DraftHead(weight, bias, None, torch.tensor([9, 3, 3, 40]), growth=3)
    assert _scored(head) == [3, 9, 40]  # sorted, no duplicates
    hidden = torch.randn(16)
    torch.testing.assert_close(head(hidden), (weight @ hidden + bias)[[3, 9, 40]])
    head.add([40, 7, 7, 120, 5])  # 40 is known; room for 3 new rows: 5, 7, 120
    assert _scored(head) == [3, 9, 40, 5, 7, 120]
    head.add([11])  # full: nothing more is added
    assert head.count == 6
    logits = head(hidden)
    torch.testing.assert_close(logits, (weight @ hidden + bias)[[3, 9, 40, 5, 7, 120]])
    assert head.token_ids(torch.tensor(4)).item() == 7
    full = head.to_full_vocab(torch.full((6,), 1 / 6))
    assert full.shape == (VOCAB,) and float(full.sum()) == pytest.approx(1.0)
    assert full[[3, 9, 40, 5, 7, 120]].tolist() == [pytest.approx(1 / 6)] * 6


def test_full_head_ignores_add() -> None:
    weight = torch.randn(VOCAB, 16)
    head = DraftHead(weight, None, None, None)
    head.add([1, 2, 3])
    assert not head.truncated and head(torch.randn(16)).shape == (VOCAB,)
    assert not DraftHead(weight, None, None, torch.arange(VOCAB)).truncated  # all rows: the full head


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


def test_top_rows() -> None:
    vocabulary = DraftVocabulary(torch.tensor([5, 2, 9, 0, 1, 3, 4, 6, 7, 8]))
    assert vocabulary.top(3) == (5, 2, 9) and vocabulary.top(0) == ()


def test_policy_head_rows() -> None:
    def policy(size: int, ranked: tuple[int, ...] = ()) -> SkipPolicy:
        return SkipPolicy(**SKIP, draft=DraftSettings(draft_vocab_size=size), draft_vocabulary=ranked)

    assert head_rows(policy(0), VOCAB) is None
    assert head_rows(policy(VOCAB), VOCAB) is None and head_rows(policy(VOCAB + 5), VOCAB) is None  # K >= V: full
    assert head_rows(policy(4), VOCAB) == (0, 1, 2, 3)  # no ranking: the lowest ids
    assert head_rows(policy(3, (50, 7, 9, 11)), VOCAB) == (50, 7, 9)


# -- sampling with a truncated head: synthetic distributions ---------------------------------------------

V = 8
SUBSET = [1, 3, 4, 6]  # the ids the truncated draft head scores
OUTSIDE = [t for t in range(V) if t not in SUBSET]
DRAWS = 20_000
TV_BOUND = 0.03  # the empirical TV of 20000 draws over 8 outcomes is ~0.01
TOKEN_BOUND = 0.015  # per token: > 4 standard deviations of a frequency over 20000 draws


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
    first, second = _output_laws(engine_chain_verify, p, q, DRAWS)
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
    _fixed_rows(monkeypatch)
    prompt, _, rows, policy = _e2e_setup()
    policy = SkipPolicy(**SKIP, draft=DraftSettings(max_draft_tokens=3, draft_vocab_size=len(rows)))
    seen: list[tuple[list[int], torch.Tensor]] = []
    real = verifiers.verify_tree_sampled

    def spy(drafted: list[int], attempts: list, p: torch.Tensor, q: torch.Tensor, generator: torch.Generator | None):
        seen.append((list(drafted), q))
        return real(drafted, attempts, p, q, generator)

    monkeypatch.setattr(verifiers, "verify_tree_sampled", spy)
    settings = DecodeSettings(max_new_tokens=20, sampling=Sampling(temperature=1.3), seed=3)
    tokens, _ = decode(_e2e_model(), prompt, policy, settings, vocab_rows=rows)
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
        tokens, stats = decode(model, prompt, policy, settings, vocab_rows=rows)
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
        tokens, _ = decode(model, prompt, None, DecodeSettings(max_new_tokens=2, sampling=Sampling(), seed=seed))
        plain[tokens[1]] += 1
    assert tv(plain / 200, law) < 0.2


def test_end_to_end_with_always_accept_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same check catches a verify that keeps every draft: no token outside the rows ever comes out."""
    _fixed_rows(monkeypatch)
    monkeypatch.setattr(verifiers, "verify_tree_sampled", chain_rule_as_tree(always_accept))
    model = _e2e_model()
    prompt, law, rows, policy = _e2e_setup()
    counts = torch.zeros(E2E_VOCAB)
    for seed in range(200):
        settings = DecodeSettings(max_new_tokens=3, sampling=Sampling(), seed=seed)
        tokens, _ = decode(model, prompt, policy, settings, vocab_rows=rows)
        counts[tokens[1]] += 1
    assert set(counts.nonzero().flatten().tolist()) <= set(rows.tolist())
    assert tv(counts / counts.sum(), law) > 2 * E2E_TV_BOUND
