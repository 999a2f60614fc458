"""The search space: what a trial can propose, and that a finished trial's parameters rebuild its policy."""

from __future__ import annotations

import optuna
import pytest

from layerskip.errors import LayerskipError
from search.space import SearchSpace, policy_from_params

LAYERS = 6


def _sampled(space: SearchSpace, n: int = 40) -> list[tuple[dict, object]]:
    """Policies of ``n`` random trials and the warm starts, with the parameters that made them."""
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for params in space.warm_starts():
        study.enqueue_trial(params)
    out = []
    for _ in range(n + len(space.warm_starts())):
        trial = study.ask()
        try:
            policy = space.suggest(trial)
        except optuna.TrialPruned:
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            continue
        study.tell(trial, 1.0)
        out.append((trial.params, policy))
    return out


def test_lookup_only_is_searched_unless_a_skip_draft_is_required() -> None:
    free = SearchSpace(num_layers=LAYERS, lookup_ngram_choices=(0, 3))
    assert any(not p.draft.use_skip_draft for _, p in _sampled(free))
    required = SearchSpace(num_layers=LAYERS, lookup_ngram_choices=(0, 3), require_skip_draft=True)
    policies = [p for _, p in _sampled(required)]
    assert all(p.draft.use_skip_draft for p in policies)
    assert any(p.draft.lookup_max_ngram for p in policies)  # lookup still leads where it matches
    assert all(w.get("use_skip_draft", True) for w in required.warm_starts())


def test_lookup_run_length_has_its_own_choices() -> None:
    tied = SearchSpace(num_layers=LAYERS, lookup_ngram_choices=(3,))
    for _, policy in _sampled(tied, 10):
        assert policy.draft.lookup_max_tokens == policy.draft.max_draft_tokens
    own = SearchSpace(num_layers=LAYERS, lookup_ngram_choices=(3,), lookup_token_choices=(5, 12))
    lengths = {p.draft.lookup_max_tokens for _, p in _sampled(own)}
    assert lengths == {5, 12}


@pytest.mark.parametrize("require", [False, True])
def test_params_rebuild_the_policy(require: bool) -> None:
    space = SearchSpace(
        num_layers=LAYERS,
        lookup_ngram_choices=(0, 3),
        lookup_token_choices=(4, 16),
        lookup_confidence_choices=(0.0, 0.2),
        lookup_min_ngram_choices=(1, 2),
        draft_vocab_choices=(0, 64),
        require_skip_draft=require,
    )
    for params, policy in _sampled(space):
        assert policy_from_params(params, LAYERS) == policy


def test_lookup_cut_and_shortest_ngram_are_searched() -> None:
    space = SearchSpace(
        num_layers=LAYERS,
        lookup_ngram_choices=(3,),
        lookup_confidence_choices=(0.0, 0.2),
        lookup_min_ngram_choices=(1, 2),
    )
    drafts = [p.draft for _, p in _sampled(space)]
    assert {d.lookup_confidence for d in drafts} == {0.0, 0.2}
    assert {d.lookup_min_ngram for d in drafts} == {1, 2}


@pytest.mark.parametrize(
    "field, value, flag",
    [
        ("lookup_token_choices", (0, 4), "--lookup-tokens"),
        ("lookup_confidence_choices", (1.0,), "--lookup-confidence"),
        ("lookup_min_ngram_choices", (0,), "--lookup-min"),
    ],
)
def test_bad_lookup_choices(field: str, value: tuple, flag: str) -> None:
    with pytest.raises(LayerskipError, match=flag):
        SearchSpace(num_layers=LAYERS, **{field: value})
