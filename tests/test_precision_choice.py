"""auto's draft precision: int4 priced against int8 by agreement on the model's own text and cost."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_model

from layerskip.drafts.builder import DraftModels, prepare_draft
from layerskip.drafts.drafters.auto import best_skip_rate
from layerskip.drafts.policy.skip_policy import AutoSettings, SkipPolicy
from layerskip.drafts.rules.costs import DraftCosts, block_cost
from layerskip.engine import calibration
from layerskip.engine import latency as engine_latency
from layerskip.engine.precision_choice import PrecisionPrice, agreement, candidates, chosen, own_texts, priced_heads
from layerskip.hf import adapters
from layerskip.hf.forward import stack_forward

VERIFY = {1: 1.0, 2: 1.05, 4: 1.12, 8: 1.4, 17: 2.0}


@functools.cache
def _model() -> torch.nn.Module:
    return tiny_model("llama")


def test_an_int4_draft_is_priced_against_int8_unless_the_policy_fixes_it() -> None:
    assert candidates("int4", True) == ("int4", "int8")
    assert candidates("int4", False) == ("int4",)
    assert candidates("model", True) == ("model",) and candidates("bfloat16", True) == ("bfloat16",)
    policy = SkipPolicy.from_dict(SkipPolicy.auto_choice().to_dict())
    assert policy.auto is not None and policy.auto.choose_precision  # a file keeps the setting


def test_the_rate_rises_with_agreement_and_falls_with_the_draft_cost() -> None:
    def rate(acceptance: float, draft_step: float, verify: dict[int, float], cap: int) -> float:
        return best_skip_rate(acceptance, draft_step, lambda block: block_cost(verify, block), cap)

    assert rate(0.95, 0.1, VERIFY, 10) > rate(0.6, 0.1, VERIFY, 10)
    assert rate(0.9, 0.05, VERIFY, 10) > rate(0.9, 0.2, VERIFY, 10)

    # A copy that agrees far more often wins though its step costs more; one that agrees alike does not.
    def price(precision: str, agreement: float, steps: dict[int, float]) -> PrecisionPrice:
        return PrecisionPrice.priced(precision, agreement, steps, lambda block: block_cost(VERIFY, block), 10)

    often = price("int8", 0.95, {0: 0.13})
    rarely = price("int4", 0.6, {0: 0.1})
    alike = price("int4", 0.95, {0: 0.1})
    assert chosen([rarely, often])[0].precision == "int8" and chosen([alike, often])[0].precision == "int4"
    # No margin for the policy's own precision: the faster price wins, a tie keeps the first.
    own = PrecisionPrice("int4", 0.8, {0: 0.1}, 0, 40.0)
    assert chosen([own, PrecisionPrice("int8", 0.9, {0: 0.1}, 0, 40.4)])[0].precision == "int8"
    assert chosen([own, PrecisionPrice("int8", 0.9, {0: 0.1}, 0, 40.0)])[0].precision == "int4"
    assert "int8 priced 1.01x int4" in chosen([own, PrecisionPrice("int8", 0.9, {0: 0.1}, 0, 40.4)])[1]


def test_a_copy_is_priced_at_the_head_it_would_draft_with() -> None:
    # The layers are most of a truncated head's draft token: int8 twice int4's there, alike with the
    # full head. Priced at the full head alone, int8's agreement would win.
    int4 = {2048: 0.2, 0: 0.9}
    int8 = {2048: 0.4, 0: 0.95}
    assert priced_heads((2048, 4096, 0)) == (2048, 0) and priced_heads((0,)) == (0,)

    def price(precision: str, agreement: float, steps: dict[int, float]) -> PrecisionPrice:
        return PrecisionPrice.priced(precision, agreement, steps, lambda block: block_cost(VERIFY, block), 10)

    truncated = chosen([price("int4", 0.85, int4), price("int8", 0.95, int8)])[0]
    assert truncated.precision == "int4" and truncated.head_rows == 2048
    full_only = chosen([price("int4", 0.85, {0: int4[0]}), price("int8", 0.95, {0: int8[0]})])[0]
    assert full_only.precision == "int8" and full_only.head_rows == 0


@torch.inference_mode()
def test_own_texts_are_the_models_greedy_continuations() -> None:
    model = _model()
    texts = own_texts(model, rows=3, tokens=6)
    assert texts.shape == (3, 8) and len({tuple(row.tolist()) for row in texts}) == 3
    for text in texts:  # every token after the two-token start is the model's argmax after its prefix
        hidden = stack_forward(model, text[None, :-1])[0]
        assert torch.equal(adapters.logits_from_hidden(model, hidden).argmax(-1)[1:], text[2:])


def test_a_draft_with_the_models_own_weights_agrees_everywhere() -> None:
    model = _model()
    texts = own_texts(model, rows=3, tokens=6)
    assert agreement(DraftModels(model).get("model"), texts) == 1.0
    assert 0.0 <= agreement(DraftModels(model).get("int4"), texts) <= 1.0


def test_the_calibration_chooses_caches_and_drafts_with_the_faster_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine_latency, "BUSY_SPREAD", float("inf"))
    monkeypatch.setenv(calibration.CACHE_ENV, str(tmp_path / "calibration"))  # nothing cached before
    # int4 agrees rarely here, int8 nearly always: int8 must be chosen whatever the tiny model's timings.
    monkeypatch.setattr(
        calibration, "agreement", lambda draft_model, texts: 0.99 if draft_model.precision == "int8" else 0.01
    )
    model = _model()
    policy = SkipPolicy.auto_choice()
    models = DraftModels(model)
    costs = calibration.prepare_calibration(model, policy, models)
    assert costs is not None and costs.precision == "int8" and costs.info["precisions"]["chosen"] == "int8"
    assert costs.info["precisions"]["why"].startswith("int8 priced")
    assert not models.holds("int4") and models.holds("int8")  # the copy built only to be priced is dropped
    assert prepare_draft(model, policy, models=models, costs=costs).draft_model.precision == "int8"
    again = calibration.calibrate(model, policy, DraftModels(model), root=None)
    assert again.info["cached"] is True and again.precision == "int8"

    # A policy that fixes its precision is neither priced nor moved.
    fixed = dataclasses.replace(SkipPolicy.auto_choice(), auto=AutoSettings(choose_precision=False))
    kept = calibration.calibrate(model, fixed, DraftModels(model), root=tmp_path)
    assert kept.precision == "" and "precisions" not in kept.info
    assert prepare_draft(model, fixed, costs=kept).draft_model.precision == "int4"


def test_a_cached_precision_is_checked() -> None:
    costs = DraftCosts(1.0, {1: 1.0}, {0: 0.1}, {}, "int8")
    assert DraftCosts.from_dict(costs.to_dict()).precision == "int8"
    assert DraftCosts.from_dict(DraftCosts(1.0, {1: 1.0}, {0: 0.1}).to_dict()).precision == ""
    with pytest.raises(ValueError, match="precision"):
        DraftCosts.from_dict({**costs.to_dict(), "precision": "int3"})
