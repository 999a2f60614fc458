"""A loaded policy's path from ``Decoder.for_policy`` through a generation: which modules receive it.

The prepared draft owns the policy once it is loaded: preparing enters the builder once and never
hands the policy out and back, so the checks, the draft forward and the head rows are decided in
one place.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import pytest
from tiny_models import random_prompt, tiny_model

from layerskip.drafts.policy import DraftSettings, OnTheFlySettings, SkipPolicy
from layerskip.engine.decoding import Decoder, DecodeSettings

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
