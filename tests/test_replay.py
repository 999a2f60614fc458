"""The search's replay of greedy decoding follows the engine's own rules, and the draft's
teacher-forced predictions see the rows its head would score at that point of a generation."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from tiny_models import VOCAB, random_prompt, tiny_model

from layerskip.drafts.drafters.skip import top2_confidence
from layerskip.drafts.model.draft_model import DraftModel
from layerskip.drafts.policy.skip_policy import DraftSettings, SkipPolicy
from layerskip.engine.decoding import DecodeSettings, decode
from layerskip.measure.agreement import Predictor, Reference, TeacherForcedDraft, simulate_greedy


def list_predictor(tokens: Sequence[int], confidence: Sequence[float] | None = None) -> Predictor:
    """A predictor from fixed per-position predictions: the replay driven without a model."""
    confidence = list(confidence) if confidence is not None else [1.0] * len(tokens)
    return lambda start, stop, known: (list(tokens[start:stop]), confidence[start:stop])


def test_replay_moves_the_adaptive_threshold_as_the_engine_does() -> None:
    """Always-right drafts at confidence 0.55 with a 0.6 threshold: the first steps stop after one
    token, then acceptance above target lowers the threshold by 0.01 per step until the drafts
    reach k (a fixed threshold would keep every draft at one token)."""
    continuation = tuple(range(10, 70))
    reference = Reference((1, 2, 3), continuation)
    draft = DraftSettings(max_draft_tokens=4, adaptive=True, initial_threshold=0.6, target_acceptance=0.7)
    run = simulate_greedy(reference, draft, list_predictor(continuation, [0.55] * len(continuation)))
    blocks = run.blocks[1:]
    assert blocks[:5] == [2] * 5  # 0.6, 0.59, .., 0.56: stop after the first token
    assert blocks[6] == 5  # 0.54 < 0.55: all k drafted
    assert run.accepted == run.drafted


def test_teacher_forced_predictions_use_the_rows_known_then() -> None:
    model = tiny_model("llama")
    prompt = random_prompt()
    continuation, _ = decode(model, prompt, None, DecodeSettings(max_new_tokens=30))
    reference = Reference(tuple(prompt), tuple(continuation))
    base = tuple(range(0, VOCAB, 7))
    view = TeacherForcedDraft(DraftModel(model), reference, attention=(0, 2), head_rows=base)
    for known in (0, 5, 20):
        tokens, confidence = view.predict(0, len(continuation), known)
        allowed = set(base) | set(prompt) | set(continuation[:known])
        assert set(tokens) <= allowed
        assert all(0.0 <= c < 1.0 for c in confidence)
    full = TeacherForcedDraft(DraftModel(model), reference, attention=(0, 2))
    matches, total = full.agreement()
    truncated_matches, _ = view.agreement()
    assert total == len(continuation) and 0 < truncated_matches <= matches


def test_confidence_does_not_depend_on_the_head_size() -> None:
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(0))
    top2 = logits.topk(2).indices
    subset = torch.cat([top2, torch.arange(0, VOCAB, 9)]).unique()
    assert float(top2_confidence(logits)) == pytest.approx(float(top2_confidence(logits[subset])))
    assert 0.0 <= float(top2_confidence(logits)) < 1.0


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_accepted_counts_stop_at_the_eos(arch: str) -> None:
    """Drafts accepted by the verify but cut by an EOS before them were never used: not counted."""
    model = tiny_model(arch)
    reference, _ = decode(model, random_prompt(), None, DecodeSettings(max_new_tokens=40))
    policy = SkipPolicy(skip_attention=(0,), draft=DraftSettings(max_draft_tokens=8))
    for eos in sorted(set(reference[5:35])):
        tokens, stats = decode(model, random_prompt(), policy, DecodeSettings(40, eos_token_ids=(eos,)))
        assert tokens == reference[: reference.index(eos) + 1]
        # Each step emits its accepted drafts and one token of its own, except a step cut inside its drafts.
        assert stats.new_tokens - (stats.accepted + stats.steps) in (0, -1)
        assert stats.accepted <= stats.drafted
