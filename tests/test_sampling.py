"""Sampling: the transform matches HF's warpers, and rejection sampling yields exactly the target p.

The statistical tests draw from seeded ``torch.Generator``s, so they are deterministic; the bounds
leave several standard deviations of room, and each test also shows that a deliberately broken
acceptance rule fails the same bound (the test can fail).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
from compare import chain_rule_as_tree
from oracles import engine_chain_verify, is_bypassed
from tiny_models import random_prompt, tiny_model

from layerskip.drafts.drafters.auto import AutoDrafter
from layerskip.drafts.policy.skip_policy import DraftSettings, SkipPolicy
from layerskip.engine import verifiers
from layerskip.engine.decoding import Decoder, DecodeSettings, decode
from layerskip.errors import LayerskipError
from layerskip.hf import adapters
from layerskip.sampling import Sampling, sample
from layerskip.stats import GenerationStats

V = 8
DRAWS = 10_000
TV_BOUND = 0.03  # the empirical TV of 10000 draws over 8 outcomes is ~0.014; broken rules give > 0.15

VerifyFn = Callable[[list[int], torch.Tensor, torch.Tensor, torch.Generator | None], tuple[int, int]]


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().sum() / 2)


def always_accept(drafted: list[int], p: torch.Tensor, q: torch.Tensor, generator: torch.Generator | None):
    """Broken: keeps every draft token (the output follows q, not p)."""
    return len(drafted), int(sample(p[len(drafted)], generator))


def resample_from_p(drafted: list[int], p: torch.Tensor, q: torch.Tensor, generator: torch.Generator | None):
    """Broken: the right acceptance test, but after a rejection it draws from p instead of max(0, p - q)."""
    for i, token in enumerate(drafted):
        ratio = float(p[i, token] / q[i, token])
        if float(torch.rand((), generator=generator)) >= ratio:
            return i, int(sample(p[i], generator))
    return len(drafted), int(sample(p[len(drafted)], generator))


def _logit_pair(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target and draft logits ``[2, V]`` (two block positions) that disagree a lot."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(2, V, generator=g) * 1.5
    draft = target + torch.randn(2, V, generator=g) * 2.0
    return target, draft


def _output_distributions(
    verify: VerifyFn, p: torch.Tensor, q: torch.Tensor, seed: int, draws: int = DRAWS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run draft (2 tokens from q) + verify ``draws`` times; empirical laws of output tokens 1 and 2.

    p: ``[3, V]`` target probabilities per block position; q: ``[2, V]`` draft proposals. Since p
    does not depend on the context here, token 1 must follow p[0] and token 2 (when produced) p[1].
    """
    g = torch.Generator().manual_seed(seed)
    first = torch.zeros(V)
    second = torch.zeros(V)
    drafts = sample(q.expand(draws, -1, -1), g)  # [draws, 2]
    for row in drafts.tolist():
        accepted, nxt = verify(row, p, q, g)
        out = [*row[:accepted], nxt]
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    return first / first.sum(), second / second.sum()


SAMPLINGS = {
    "plain": Sampling(),
    "temperature-0.7": Sampling(temperature=0.7),
    "temperature-1.6": Sampling(temperature=1.6),
    "top-k-4": Sampling(top_k=4),
    "top-p-0.8": Sampling(top_p=0.8),
    "all": Sampling(temperature=0.8, top_k=6, top_p=0.9),
}


@pytest.mark.parametrize("name", list(SAMPLINGS))
def test_rejection_sampling_outputs_the_target_distribution(name: str) -> None:
    sampling = SAMPLINGS[name]
    target, draft = _logit_pair(seed=list(SAMPLINGS).index(name))
    p = sampling.probs(torch.cat([target, target[:1]]))  # [3, V]: positions 0, 1 and the bonus one
    q = sampling.probs(draft)  # [2, V]
    first, second = _output_distributions(engine_chain_verify, p, q, seed=1)
    assert tv(first, p[0]) < TV_BOUND, (first, p[0])
    assert tv(second, p[1]) < TV_BOUND, (second, p[1])
    # The same check catches a sampler that keeps every draft token.
    broken, _ = _output_distributions(always_accept, p, q, seed=1, draws=5_000)
    assert tv(broken, p[0]) > 2 * TV_BOUND


def test_broken_acceptance_rules_fail_the_same_bound() -> None:
    sampling = SAMPLINGS["plain"]
    target, draft = _logit_pair(seed=3)
    p = sampling.probs(torch.cat([target, target[:1]]))
    q = sampling.probs(draft)
    assert tv(p[0], q[0]) > 0.2  # the draft really is different
    for broken in (always_accept, resample_from_p):
        first, _ = _output_distributions(broken, p, q, seed=1, draws=5_000)
        assert tv(first, p[0]) > 2 * TV_BOUND, broken.__name__
    first, _ = _output_distributions(engine_chain_verify, p, q, seed=1, draws=5_000)
    assert tv(first, p[0]) < 2 * TV_BOUND


def test_one_hot_proposals_from_prompt_lookup() -> None:
    """Lookup drafts are deterministic (q one-hot): the output still follows p."""
    sampling = Sampling()
    target, _ = _logit_pair(seed=5)
    p = sampling.probs(torch.cat([target, target[:1]]))
    q = torch.zeros(2, V)
    q[0, int(p[0].argmax())] = 1.0  # accepted with probability p[0].max(), else residual sampling
    q[1, int(p[1].argsort()[V // 2])] = 1.0  # a middling token: mostly rejected

    def lookup(drafted: list[int], p: torch.Tensor, q: torch.Tensor, generator: torch.Generator | None):
        return engine_chain_verify(drafted, p, None, generator)  # the engine's lookup chain carries no q

    first, second = _output_distributions(lookup, p, q, seed=2)
    assert tv(first, p[0]) < TV_BOUND
    assert tv(second, p[1]) < TV_BOUND
    broken, _ = _output_distributions(resample_from_p, p, q, seed=2, draws=5_000)
    assert tv(broken, p[0]) > 2 * TV_BOUND


def test_verify_with_no_draft_samples_from_p() -> None:
    p = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    assert engine_chain_verify([], p, None, torch.Generator().manual_seed(0)) == (0, 2)


def test_verify_identical_draft_is_always_accepted() -> None:
    g = torch.Generator().manual_seed(0)
    probs = Sampling().probs(torch.randn(4, V, generator=g))
    for _ in range(200):
        drafted = sample(probs[:3], g).tolist()
        accepted, _ = engine_chain_verify(drafted, probs, probs[:3], g)
        assert accepted == 3


# -- the transform ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SAMPLINGS))
def test_probs_match_hf_logits_warpers(name: str) -> None:
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    sampling = SAMPLINGS[name]
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0)) * 3
    scores = logits.clone()
    if sampling.temperature != 1.0:
        scores = TemperatureLogitsWarper(sampling.temperature)(None, scores)
    if sampling.top_k:
        scores = TopKLogitsWarper(sampling.top_k)(None, scores)
    if sampling.top_p < 1.0:
        scores = TopPLogitsWarper(sampling.top_p)(None, scores)
    torch.testing.assert_close(sampling.probs(logits), scores.softmax(-1))


def test_probs_filters() -> None:
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    assert (Sampling(top_k=2).probs(logits) > 0).tolist() == [True, True, False, False, False]
    p = logits.softmax(-1)  # ~[0.64, 0.24, 0.09, 0.03, 0.01]
    assert (Sampling(top_p=0.5).probs(logits) > 0).sum() == 1
    assert (Sampling(top_p=0.7).probs(logits) > 0).sum() == 2
    assert (Sampling(top_p=float(p[:2].sum()) + 0.01).probs(logits) > 0).sum() == 3
    torch.testing.assert_close(Sampling(temperature=2.0).probs(logits), (logits / 2).softmax(-1))
    torch.testing.assert_close(Sampling(top_k=10).probs(logits), p)  # k >= V: no filter


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=0),
        dict(temperature=-1),
        dict(top_k=-1),
        dict(top_p=-0.1),
        dict(top_p=1.5),
        dict(top_p=float("nan")),
    ],
)
def test_invalid_sampling_settings(kwargs: dict) -> None:
    with pytest.raises(LayerskipError):
        Sampling(**kwargs)


def test_top_p_zero_keeps_only_the_most_likely_token() -> None:
    """As transformers' top-p warper does with 0 (which plain generate takes)."""
    logits = torch.tensor([[0.5, 2.0, 1.0, -1.0]])
    assert Sampling(top_p=0.0).probs(logits).tolist() == [[0.0, 1.0, 0.0, 0.0]]


# -- end to end on a tiny model --------------------------------------------------------------------

E2E_VOCAB = 16
E2E_SEEDS = 500
# The empirical TV of 500 draws over 16 outcomes is ~0.07 (sd ~0.01); this draft's law is 0.34 away.
E2E_TV_BOUND = 0.12


def _e2e_model() -> torch.nn.Module:
    # Strong sublayers, so that a depth-1 draft's next-token law is far from the model's.
    return tiny_model("llama", vocab_size=E2E_VOCAB, embed_scale=16.0, out_scale=8.0)


def _exact_laws(model: torch.nn.Module, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The model's law of token 1, the marginal law of token 2, and what a depth-1 draft would give for it."""
    with torch.inference_mode():
        p1 = model(input_ids=torch.tensor([prompt])).logits[0, -1].softmax(-1)
        batch = torch.tensor([[*prompt, x] for x in range(E2E_VOCAB)])
        p2 = model(input_ids=batch).logits[:, -1].softmax(-1)  # [x1, x2]
        layers = range(1, adapters.num_layers(model))
        with adapters.bypass(model, layers, layers):
            q2 = model(input_ids=batch).logits[:, -1].softmax(-1)
    return p1, p1 @ p2, p1 @ q2


def _e2e_laws(seeds: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    model = _e2e_model()
    prompt = random_prompt(E2E_VOCAB, 6)
    policy = SkipPolicy.early_exit(adapters.num_layers(model), 1, draft=DraftSettings(max_draft_tokens=1))
    first = torch.zeros(E2E_VOCAB)
    second = torch.zeros(E2E_VOCAB)
    accepted = 0
    for seed in range(seeds):
        settings = DecodeSettings(max_new_tokens=3, sampling=Sampling(), seed=seed)
        tokens, stats = decode(model, prompt, policy, settings)
        assert len(tokens) == 3
        first[tokens[0]] += 1
        second[tokens[1]] += 1  # token 2 is the first one that went through draft + verify
        accepted += stats.accepted
    return first / seeds, second / seeds, accepted


def test_end_to_end_sampling_follows_the_model() -> None:
    model = _e2e_model()
    p1, p2, q2 = _exact_laws(model, random_prompt(E2E_VOCAB, 6))
    assert tv(p2, q2) > 2 * E2E_TV_BOUND  # the draft's law really differs
    first, second, accepted = _e2e_laws(E2E_SEEDS)
    assert 0 < accepted < E2E_SEEDS  # drafts were both accepted and rejected
    assert tv(first, p1) < E2E_TV_BOUND
    assert tv(second, p2) < E2E_TV_BOUND


def test_end_to_end_with_always_accept_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(verifiers, "verify_tree_sampled", chain_rule_as_tree(always_accept))
    p1, p2, q2 = _exact_laws(_e2e_model(), random_prompt(E2E_VOCAB, 6))
    _, second, _ = _e2e_laws(E2E_SEEDS)
    assert tv(second, p2) > E2E_TV_BOUND
    assert tv(second, q2) < E2E_TV_BOUND  # it follows the draft instead


@pytest.mark.parametrize(
    "policy",
    [
        SkipPolicy.skip_layers([1, 2], draft=DraftSettings(max_draft_tokens=3)),
        SkipPolicy(skip_attention=(0,), draft=DraftSettings(adaptive=True)),
        SkipPolicy(draft=DraftSettings(lookup_max_ngram=2, use_skip_draft=False)),
        SkipPolicy(skip_mlp=(2,), draft=DraftSettings(lookup_max_ngram=2, lookup_min_ngram=1)),
    ],
    ids=["layers", "adaptive", "lookup", "hybrid"],
)
@pytest.mark.parametrize("max_new_tokens", [2, 3, 25])
def test_sampled_decode_returns_the_budget_and_is_reproducible(policy: SkipPolicy, max_new_tokens: int) -> None:
    model = tiny_model("gemma2")
    prompt = random_prompt()
    settings = DecodeSettings(max_new_tokens=max_new_tokens, sampling=Sampling(temperature=0.9, top_p=0.95), seed=7)
    tokens, stats = decode(model, prompt, policy, settings)
    assert len(tokens) == stats.new_tokens == max_new_tokens
    assert not is_bypassed(model)
    again, _ = decode(model, prompt, policy, settings)
    assert again == tokens
    plain, _ = decode(model, prompt, None, settings)
    assert len(plain) == max_new_tokens


def test_sampled_decode_with_a_truncated_draft_head() -> None:
    """q lives on a subset of the vocabulary (zeros elsewhere): still runs, still reproducible."""
    model = tiny_model("llama")
    rows = torch.arange(0, 128, 2)
    policy = SkipPolicy(skip_mlp=(1, 2), draft=DraftSettings(max_draft_tokens=3, draft_vocab_size=len(rows)))
    settings = DecodeSettings(max_new_tokens=20, sampling=Sampling(temperature=0.8), seed=3)
    tokens, stats = decode(model, random_prompt(), policy, settings, vocab_rows=rows)
    assert len(tokens) == 20 and stats.drafted > 0
    again, _ = decode(model, random_prompt(), policy, settings, vocab_rows=rows)
    assert again == tokens


def _auto_laws(seeds: int, monkeypatch: pytest.MonkeyPatch) -> tuple[torch.Tensor, torch.Tensor, GenerationStats]:
    """Token 1 and 2 frequencies under ``auto``, over ``seeds`` sampled generations of one decoder.
    Its choice is forced to rotate through lookup (unigram matches: one-hot q), the skip draft and
    none, so that each kind of draft meets the verify whatever this machine's costs favour."""
    kinds = iter(["lookup", "skip", "none"] * seeds)
    monkeypatch.setattr(AutoDrafter, "_choose", lambda self, plan, rate: next(kinds) if plan else "skip")
    model = _e2e_model()
    auto = SkipPolicy.auto_choice()
    policy = replace(auto, draft=replace(auto.draft, lookup_min_ngram=1))
    decoder = Decoder.for_policy(model, policy)
    first, second = torch.zeros(E2E_VOCAB), torch.zeros(E2E_VOCAB)
    runs = []
    for seed in range(seeds):
        tokens, stats = decoder.decode(AUTO_PROMPT, DecodeSettings(max_new_tokens=3, sampling=Sampling(), seed=seed))
        first[tokens[0]] += 1
        second[tokens[1]] += 1
        runs.append(stats)
    return first / seeds, second / seeds, GenerationStats.combined(runs)


AUTO_PROMPT = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]  # most next tokens have an earlier unigram match


def test_end_to_end_sampling_with_auto_follows_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    p1, p2, _ = _exact_laws(_e2e_model(), AUTO_PROMPT)
    first, second, stats = _auto_laws(E2E_SEEDS, monkeypatch)
    assert stats.lookup_steps > 0 and stats.head_rows and 0 < stats.accepted < stats.drafted
    assert tv(first, p1) < E2E_TV_BOUND
    assert tv(second, p2) < E2E_TV_BOUND


def test_end_to_end_sampling_with_auto_and_always_accept_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    _, p2, _ = _exact_laws(_e2e_model(), AUTO_PROMPT)
    monkeypatch.setattr(verifiers, "verify_tree_sampled", chain_rule_as_tree(always_accept))
    _, second, _ = _auto_laws(E2E_SEEDS, monkeypatch)
    assert tv(second, p2) > E2E_TV_BOUND


# Every token of the vocabulary, each followed by two others: a unigram match finds several continuations.
TREE_PROMPT = [t for i in range(E2E_VOCAB) for t in (i, (i + 1) % E2E_VOCAB, i, (i + 5) % E2E_VOCAB)]


def _tree_laws(seeds: int) -> tuple[torch.Tensor, GenerationStats]:
    """Token 2's frequencies when prompt lookup proposes a token tree (unigram matches: up to 4
    continuations, one-hot proposals tested one after another against the residual)."""
    model = _e2e_model()
    policy = SkipPolicy(
        draft=DraftSettings(lookup_max_ngram=2, lookup_min_ngram=1, use_skip_draft=False, tree_matches=4)
    )
    decoder = Decoder.for_policy(model, policy)
    second = torch.zeros(E2E_VOCAB)
    runs = []
    for seed in range(seeds):
        tokens, stats = decoder.decode(TREE_PROMPT, DecodeSettings(max_new_tokens=3, sampling=Sampling(), seed=seed))
        second[tokens[1]] += 1
        runs.append(stats)
    return second / seeds, GenerationStats.combined(runs)


def test_end_to_end_sampling_with_token_trees_follows_the_model() -> None:
    _, p2, _ = _exact_laws(_e2e_model(), TREE_PROMPT)
    second, stats = _tree_laws(E2E_SEEDS)
    assert stats.tree_steps > 0 and stats.off_branch_steps > 0  # trees verified, siblings accepted
    assert tv(second, p2) < E2E_TV_BOUND


def test_end_to_end_sampling_with_token_trees_and_always_accept_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    _, p2, _ = _exact_laws(_e2e_model(), TREE_PROMPT)
    monkeypatch.setattr(verifiers, "verify_tree_sampled", lambda tokens, attempts, p, q, generator: ([0], 0))
    second, _ = _tree_laws(E2E_SEEDS)
    assert tv(second, p2) > E2E_TV_BOUND


def test_a_seed_repeats_plain_decoding_and_the_docs_say_what_it_does_not_fix() -> None:
    """A seed fixes plain decoding's sampled text. With ``auto`` it cannot: the draft's choices
    (priced by timings, learned across calls) change how many random draws each step makes, and
    rejection sampling is not changed to hide that. The docs where sampling is explained say so."""
    from pathlib import Path

    model = tiny_model("llama")
    settings = DecodeSettings(max_new_tokens=24, sampling=Sampling(temperature=1.0), seed=5)
    plain = Decoder.for_policy(model, None)
    assert len({tuple(plain.decode(random_prompt(), settings)[0]) for _ in range(3)}) == 1
    docs = Path(__file__).resolve().parents[1] / "docs"
    concepts = " ".join((docs / "concepts.md").read_text().split())
    section = concepts[concepts.index('<a id="what-a-seed-fixes"></a>') :][:1200]
    for said in ("fixes the distribution", "the text of plain decoding", "With a draft it does not fix the text"):
        assert said in section, said
    assert "concepts.md#what-a-seed-fixes" in (docs / "troubleshooting.md").read_text()
