"""The search space: what a trial can propose, and that a finished trial gives back the very policy it evaluated."""

from __future__ import annotations

from dataclasses import replace

import optuna
import pytest

from layerskip.drafts.policy.skip_policy import DraftSettings, ExitSettings, SkipPolicy
from layerskip.errors import LayerskipError
from layerskip.search.checks import check_arguments
from layerskip.search.settings import SearchSettings
from layerskip.search.space import (
    POLICY_ATTR,
    ExitChoice,
    SearchSpace,
    exportable,
    policy_attr,
    trial_policy,
    with_vocabulary,
)

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
def test_trials_give_back_the_policy_they_evaluated(require: bool) -> None:
    space = SearchSpace(
        num_layers=LAYERS,
        lookup_ngram_choices=(0, 3),
        lookup_token_choices=(4, 16),
        lookup_confidence_choices=(0.0, 0.2),
        lookup_min_ngram_choices=(1, 2),
        draft_vocab_choices=(0, 64),
        precision_choices=("model", "bfloat16"),
        require_skip_draft=require,
    )
    ranking = tuple(range(99, -1, -1))
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    study.set_user_attr("draft_vocab_ranking", list(ranking))
    evaluated = {}
    for _ in range(30):
        trial = study.ask()
        try:
            policy = with_vocabulary(space.suggest(trial), ranking)
        except optuna.TrialPruned:
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            continue
        trial.set_user_attr(POLICY_ATTR, policy_attr(policy))
        study.tell(trial, 1.0)
        evaluated[trial.number] = policy
    for frozen in study.get_trials(states=(optuna.trial.TrialState.COMPLETE,)):
        assert trial_policy(study, frozen) == evaluated[frozen.number]
    assert any(p.draft_vocabulary == ranking[:64] for p in evaluated.values())
    assert {p.draft.precision for p in evaluated.values() if p.draft.use_skip_draft} == {"model", "bfloat16"}
    # How drafts end: fixed k, adaptive threshold, or length by cost, never both of the last two.
    endings = {(p.draft.adaptive, p.draft.length_by_cost) for p in evaluated.values()}
    assert endings == {(False, False), (True, False), (False, True)}


def test_single_choice_knobs_reach_the_policy() -> None:
    """A knob given one value is no Optuna parameter, yet the evaluated policy carries it."""
    space = SearchSpace(
        num_layers=LAYERS,
        lookup_ngram_choices=(3,),
        lookup_min_ngram_choices=(1,),
        lookup_confidence_choices=(0.2,),
        verify_pad_choices=(5,),
        precision_choices=("int4",),
    )
    for params, policy in _sampled(space, 10):
        assert "min_verify_block" not in params and "lookup_min_ngram" not in params
        d = policy.draft
        assert (d.min_verify_block, d.lookup_min_ngram, d.lookup_confidence) == (5, 1, 0.2)
        assert d.precision == ("int4" if d.use_skip_draft else "model")


def test_exportable() -> None:
    assert not exportable(SkipPolicy(draft=DraftSettings(precision="int4", draft_vocab_size=64)))  # bypasses nothing
    assert exportable(SkipPolicy(skip_mlp=(2,)))
    assert exportable(SkipPolicy(draft=DraftSettings(use_skip_draft=False, lookup_max_ngram=3)))  # lookup only
    assert not exportable(SkipPolicy(draft=DraftSettings(lookup_max_ngram=3)))  # lookup + the full model drafting


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
    "setting, value, flag",
    [
        ("lookup_tokens", (0, 4), "--lookup-tokens"),
        ("lookup_confidence", (1.0,), "--lookup-confidence"),
        ("lookup_min", (0,), "--lookup-min"),
        ("lookup_min", (), "--lookup-min needs at least one choice"),
        ("draft_precision", ("int3",), "--draft-precision"),
    ],
)
def test_bad_lookup_choices(setting: str, value: tuple, flag: str) -> None:
    with pytest.raises(LayerskipError, match=flag):
        check_arguments(SearchSettings(**{setting: value}))


ORDER = ((4, "attention"), (1, "mlp"), (5, "attention"), (0, "attention"), (3, "mlp"), (2, "attention"))


def test_ranked_space_bypasses_a_prefix_of_the_order() -> None:
    space = SearchSpace(num_layers=LAYERS, sublayer_order=ORDER, never_skip=(0,))
    ranked = [item for item in ORDER if item[0] != 0]
    seen = set()
    for params, policy in _sampled(space):
        count = params["skip_count"]
        chosen = ranked[:count]
        assert sorted(policy.skip_attention) == sorted(i for i, kind in chosen if kind == "attention")
        assert sorted(policy.skip_mlp) == sorted(i for i, kind in chosen if kind == "mlp")
        assert 0 not in policy.skip_attention
        assert not any(k.startswith(("attn_", "mlp_")) for k in params)
        seen.add(count)
    assert len(seen) > 2
    counts = {w["skip_count"] for w in space.warm_starts()}
    assert counts >= {0, 1, 2, 4}


def test_ranked_space_respects_skip_fraction_bounds() -> None:
    space = SearchSpace(num_layers=LAYERS, sublayer_order=ORDER, min_fraction=0.25, max_fraction=0.5)
    low, high = space.skip_count_range
    assert (low, high) == (3, 6)
    for params, policy in _sampled(space):
        assert 3 <= params["skip_count"] <= 6
        assert 0.25 <= (len(policy.skip_attention) + len(policy.skip_mlp)) / (2 * LAYERS) <= 0.5


# -- warm starts from a saved policy (search.py --warm-start) ----------------------------------------------------------
def _rebuilt(space: SearchSpace, params: dict) -> SkipPolicy:
    return space.suggest(optuna.trial.FixedTrial(params))


def test_a_warm_start_policy_is_what_its_trial_evaluates() -> None:
    # lookup_max_tokens = k: with lookup off the space ties it to the draft length.
    draft = DraftSettings(
        max_draft_tokens=3,
        adaptive=True,
        target_acceptance=0.8,
        draft_vocab_size=64,
        precision="int4",
        lookup_max_tokens=3,
    )
    wanted = SkipPolicy(skip_attention=(2, 4), skip_mlp=(3,), draft=draft)
    switches = SearchSpace(
        num_layers=LAYERS, draft_token_choices=(2, 3), draft_vocab_choices=(0, 64), precision_choices=("model", "int4")
    )
    params, notes = switches.params_for_policy(wanted)
    got = _rebuilt(switches, params)
    assert notes == [] and (got.skip_attention, got.skip_mlp, got.draft) == (
        wanted.skip_attention,
        wanted.skip_mlp,
        draft,
    )

    # Ranked: a new study's order is led by the policy's sublayers, so its set is the ranked prefix.
    ranked = SearchSpace(num_layers=LAYERS, sublayer_order=ORDER, draft_token_choices=(2, 3), draft_vocab_choices=(64,))
    with pytest.raises(LayerskipError, match="not the first 3 of this study's ranked order"):
        ranked.params_for_policy(wanted)
    led = ranked.with_leading([(2, "attention"), (4, "attention"), (3, "mlp")])
    assert sorted(led.sublayer_order) == sorted(ORDER)
    params, notes = led.params_for_policy(wanted)
    got = _rebuilt(led, params)
    assert params["skip_count"] == 3 and (got.skip_attention, got.skip_mlp) == ((2, 4), (3,))
    assert notes == ["warm-start policy: precision int4 is not a choice of this search; the trial uses model"]


def test_a_warm_start_with_length_by_cost_keeps_it() -> None:
    wanted = SkipPolicy(
        skip_attention=(1,), draft=DraftSettings(max_draft_tokens=3, length_by_cost=True, lookup_max_tokens=3)
    )
    space = SearchSpace(num_layers=LAYERS, draft_token_choices=(2, 3))
    params, notes = space.params_for_policy(wanted)
    assert notes == [] and _rebuilt(space, params).draft == wanted.draft
    fixed_only = SearchSpace(num_layers=LAYERS, draft_token_choices=(2, 3), tune_adaptive=False)
    _, notes = fixed_only.params_for_policy(wanted)
    assert notes == ["warm-start policy: length_by_cost True is not a choice of this search; the trial uses False"]


def test_a_warm_start_outside_the_space_is_refused_or_noted() -> None:
    wanted = SkipPolicy(skip_attention=(0, 1), draft=DraftSettings(max_draft_tokens=5))
    with pytest.raises(LayerskipError, match="--never-skip layers \\[0\\]"):
        SearchSpace(num_layers=LAYERS, never_skip=(0,)).params_for_policy(wanted)
    with pytest.raises(LayerskipError, match="outside --min/--max-skip-fraction"):
        SearchSpace(num_layers=LAYERS, max_fraction=0.1).params_for_policy(wanted)
    params, notes = SearchSpace(num_layers=LAYERS, draft_token_choices=(2, 4, 8)).params_for_policy(wanted, "p.json")
    assert params["max_draft_tokens"] == 4
    assert notes == ["p.json: max_draft_tokens 5 is not a choice of this search; the trial uses 4"]


def _exit_space(**kwargs: object) -> SearchSpace:
    """Two trained exits (after layers 2 and 4 of 6) offered beside the switches."""
    exits = tuple(
        ExitChoice(f"L{i}-layer", i, "layer", f"/exits/exit-L{i}-layer.safetensors", f"{i:064x}") for i in (2, 4)
    )
    return SearchSpace(num_layers=LAYERS, exit_choices=exits, exit_threshold_choices=(0.3, 0.5, 0.7), **kwargs)


def _exit_policy(layer: int, threshold: float = 0.65, sha: str | None = None) -> SkipPolicy:
    draft = DraftSettings(max_draft_tokens=4, adaptive=True, initial_threshold=threshold, target_acceptance=0.8)
    exit_settings = ExitSettings(f"exit-L{layer}-layer.safetensors", sha or f"{layer:064x}", layer, "layer")
    return SkipPolicy.early_exit(LAYERS, layer + 1, draft=draft, exit=exit_settings)


def test_every_trained_exit_is_a_warm_start_outside_the_switch_limits() -> None:
    """Each exit is tried early, as a whole exit draft, even where the switch limits would prune its
    bypassed fraction (they bound the switches, which an exit draft does not use)."""
    space = _exit_space(min_fraction=0.1, max_fraction=0.3)
    starts = space.warm_starts()
    assert all("exit" in params for params in starts)
    assert sorted(p["exit"] for p in starts if p["exit"] != "none") == ["L2-layer", "L4-layer"]
    sampled = _sampled(space, 0)
    exits = [policy for _, policy in sampled if policy.exit is not None]
    assert sorted(policy.exit.layer for policy in exits) == [2, 4]  # none pruned
    for policy in exits:
        deep = tuple(range(policy.exit.layer + 1, LAYERS))
        assert (policy.skip_attention, policy.skip_mlp) == (deep, deep)
        assert policy.draft.adaptive and policy.draft.initial_threshold == 0.5
    assert all(policy.exit is None for params, policy in sampled if params.get("exit") == "none")


def test_an_exit_policy_warm_starts_its_own_exit() -> None:
    space = _exit_space()
    params, notes = space.params_for_policy(_exit_policy(4), "seed")
    evaluated = space.suggest(optuna.trial.FixedTrial(params))
    assert evaluated.exit is not None and evaluated.exit.sha256 == f"{4:064x}"
    assert evaluated.skip_attention == evaluated.skip_mlp == (5,)
    assert evaluated.draft.initial_threshold == 0.7  # nearest choice to 0.65, and said so
    assert any("initial_threshold" in note for note in notes)


def test_an_exit_policy_the_space_cannot_hold_is_one_line() -> None:
    space = _exit_space()
    with pytest.raises(LayerskipError, match="not among this search's --exit-adapters"):
        space.params_for_policy(_exit_policy(4, sha="f" * 64), "seed")
    shallow_bypass = replace(_exit_policy(4), skip_attention=(1, 5))
    with pytest.raises(LayerskipError, match="bypasses sublayers before its exit"):
        space.params_for_policy(shallow_bypass, "seed")
