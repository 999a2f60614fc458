"""A loaded policy's path from ``Decoder.for_policy`` (or the search's confirmation) through a
generation: which modules receive it.

The prepared draft owns the policy once it is loaded: preparing enters the builder once and never
hands the policy out and back, so the checks, the draft forward and the head rows are decided in
one place. An ``auto`` policy's calibration is prepared before, as a value handed to the builder.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from tiny_models import random_prompt, tiny_model

from layerskip.drafts.policy.skip_policy import DraftSettings, OnTheFlySettings, SkipPolicy
from layerskip.engine.decoding import Decoder, DecodeSettings
from layerskip.measure.timing import TimedRun

OURS = ("layerskip", "search")


def _stays(policy: SkipPolicy, run: Callable[[], object]) -> list[str]:
    """The modules, in call order with repeats merged, of every call of our code that receives
    ``policy`` as an argument (or as ``self``)."""
    modules: list[str] = []

    def watch(frame, event, arg) -> None:  # noqa: ANN001  (sys.setprofile's signature)
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if not module.startswith(OURS):
            return
        code = frame.f_code
        names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        if any(frame.f_locals.get(name) is policy for name in names) and (not modules or modules[-1] != module):
            modules.append(module)

    sys.setprofile(watch)
    try:
        run()
    finally:
        sys.setprofile(None)
    return modules


def _returns(stays: list[str]) -> int:
    """How many times the policy comes back to a module it had left."""
    left: set[str] = set()
    returns = 0
    for before, module in zip([None, *stays], stays):
        returns += module in left
        if before is not None:
            left.add(before)
    return returns


POLICIES = {
    "hybrid": SkipPolicy(
        skip_attention=(1,), skip_mlp=(2,), draft=DraftSettings(lookup_max_ngram=3, length_by_cost=True)
    ),
    "on-the-fly": SkipPolicy(
        draft=DraftSettings(precision="int4", draft_vocab_size=64, lookup_max_ngram=3), on_the_fly=OnTheFlySettings()
    ),
    "auto": SkipPolicy.auto_choice(),  # its calibration included: measured (or read) first, then handed on
    "auto-trees": SkipPolicy.auto_trees(),
}


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_preparing_a_draft_enters_the_builder_once(name: str) -> None:
    model, policy = tiny_model("llama"), POLICIES[name]

    def prepare_and_generate() -> None:
        decoder = Decoder.for_policy(model, policy)
        decoder.decode(random_prompt(), DecodeSettings(max_new_tokens=16))

    stays = _stays(policy, prepare_and_generate)
    assert stays.count("layerskip.drafts.builder") == 1, stays
    assert _returns(stays) <= 4, stays


@pytest.mark.parametrize("name", ["hybrid", "auto"])
def test_a_confirmed_policy_enters_the_builder_once(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """From the search's confirmation (``confirm_window``) through a generation: a policy read from
    its file, and ``auto`` with its calibration, each pass every module once, the builder once."""
    from layerskip.search import confirmation
    from layerskip.search.objective import Calibration

    def timed(run: Callable, ids: list[int], max_new: int) -> TimedRun:
        tokens, stats = run(ids, max_new)  # a real generation, timed as one second (timing is not checked)
        return TimedRun(tokens, 1.0, stats)

    def one_round(runners, prompts, max_new, device, rounds, warmup, progress, desc):  # noqa: ANN001, ANN202
        return [[{key: timed(run, ids, max_new) for key, run in runners.items()} for ids in prompts]]

    monkeypatch.setattr(confirmation, "run_rounds", one_round)
    model = tiny_model("llama")
    policy = POLICIES[name]
    if name != "auto":
        policy = SkipPolicy.load(policy.save(tmp_path / "policy.json"))
    prompts = [random_prompt()]
    calibration = Calibration(prompts, [], 1.0, {}, prompts[0])

    stays = _stays(policy, lambda: confirmation.confirm_window(model, calibration, {1: policy}, 8, rounds=1))
    assert stays[0] == "layerskip.engine.decoding", stays  # the window hands it on in a mapping
    assert stays.count("layerskip.drafts.builder") == 1, stays
    assert _returns(stays) <= 4, stays
