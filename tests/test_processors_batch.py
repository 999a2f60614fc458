"""Every logits processor plain ``generate`` applies to a batch applies to the plug-in's batch alike.

``generate`` builds some processors for the whole batch (the repetition penalty ignores each
row's left padding, ``prefix_allowed_tokens_fn`` is told each row's prompt index) while the
plug-in runs them one row at a time. Each case runs a batch made by a left-padding tokenizer
(rows of different lengths) and a batch without padding through plain ``generate`` and the
plug-in, greedy in fp32, and asserts the same tokens in every row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from tiny_models import ARCHS, tiny_model, tiny_tokenizer
from transformers import RepetitionPenaltyLogitsProcessor, SynthIDTextWatermarkingConfig, WatermarkingConfig

import layerskip
from layerskip.drafts.policy.skip_policy import DraftSettings, SkipPolicy
from layerskip.engine import verify_head
from layerskip.engine.verify_head import engine_verify_head
from layerskip.errors import LayerskipError

POLICY = SkipPolicy.skip_layers([1, 2], draft=DraftSettings(max_draft_tokens=3))
NEW = 16
PAD = 0  # the tokenizer's "[UNK]", also generate's pad for rows that end first
TEXTS = {
    "padded": ["w3 w17 w40 hello w5", "w9 world w22 w1 w33 w50 w2 w61 w12", "w7 w7 w8"],
    "unpadded": ["w3 w17 w40 hello w5", "w9 world w22 w1 w33", "w7 w7 w8 w30 w2"],
}


def _batch(kind: str) -> dict[str, torch.Tensor]:
    tokenizer = tiny_tokenizer()
    tokenizer.pad_token, tokenizer.padding_side = "[UNK]", "left"
    return dict(tokenizer(TEXTS[kind], return_tensors="pt", padding=True))


def _ours(model: torch.nn.Module, **kwargs: Any) -> torch.Tensor:
    return model.generate(
        custom_generate=layerskip.custom_generate_path(), trust_remote_code=True, skip_policy=POLICY, **kwargs
    )


def _prompt_lengths(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return (batch["attention_mask"] == 0).sum(dim=1)


# Each case: (plain generate's new tokens per row without processors, the batch) -> generate's arguments.
# The tokens the processors act on are taken from that output, so every case changes it.
Case = Callable[[list[list[int]], dict[str, torch.Tensor]], dict[str, Any]]
CASES: dict[str, Case] = {
    "repetition_penalty": lambda ref, batch: dict(repetition_penalty=1.5),
    "repetition_reward": lambda ref, batch: dict(repetition_penalty=0.5),
    "no_repeat_ngram_size": lambda ref, batch: dict(no_repeat_ngram_size=2),
    "bad_words_ids": lambda ref, batch: dict(bad_words_ids=[[ref[0][1]], [ref[1][2], ref[1][3]]]),
    "suppress_tokens": lambda ref, batch: dict(suppress_tokens=[ref[0][1], ref[2][2]]),
    "begin_suppress_tokens": lambda ref, batch: dict(begin_suppress_tokens=[row[0] for row in ref]),
    "sequence_bias": lambda ref, batch: dict(sequence_bias=[[[ref[1][1]], -20.0], [[ref[2][0]], 20.0]]),
    "min_new_tokens": lambda ref, batch: dict(min_new_tokens=6, eos_token_id=[ref[0][2], ref[1][3]], pad_token_id=PAD),
    "min_length": lambda ref, batch: dict(
        min_length=batch["input_ids"].shape[1] + 6, eos_token_id=[ref[0][2], ref[1][3]], pad_token_id=PAD
    ),
    "exponential_decay_length_penalty": lambda ref, batch: dict(
        exponential_decay_length_penalty=(4, 3.0), eos_token_id=ref[2][-1], pad_token_id=PAD
    ),
    "forced_eos_token_id": lambda ref, batch: dict(forced_eos_token_id=ref[0][0]),
    "prefix_allowed_tokens_fn": lambda ref, batch: dict(
        # each prompt its own allowed tokens: the function must be told the row's prompt index
        prefix_allowed_tokens_fn=lambda batch_id, ids: list(range(batch_id, 128, 3 + batch_id))
    ),
    "user_processor_for_the_batch": lambda ref, batch: dict(
        # built for the whole batch, as HF's docs show: one ignored length per row (its prompt)
        logits_processor=[RepetitionPenaltyLogitsProcessor(1.5, prompt_ignore_length=_prompt_lengths(batch))]
    ),
    "watermarking": lambda ref, batch: dict(watermarking_config=WatermarkingConfig(bias=8.0)),
    "renormalize_logits": lambda ref, batch: dict(
        renormalize_logits=True, remove_invalid_values=True, repetition_penalty=1.3
    ),
    "together": lambda ref, batch: dict(
        repetition_penalty=1.3,
        no_repeat_ngram_size=3,
        bad_words_ids=[[ref[1][0]]],
        suppress_tokens=[ref[0][4]],
        min_new_tokens=4,
        eos_token_id=[ref[0][2], ref[2][5]],
        pad_token_id=PAD,
    ),
}


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_model("llama")


@pytest.mark.parametrize("kind", ["padded", "unpadded"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_processor_on_a_batch_matches_generate(model: torch.nn.Module, case: str, kind: str) -> None:
    batch = _batch(kind)
    start = batch["input_ids"].shape[1]
    unprocessed = model.generate(**batch, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD)
    kwargs = CASES[case](unprocessed[:, start:].tolist(), batch)
    kwargs = dict(max_new_tokens=NEW, do_sample=False, **{"pad_token_id": PAD, **kwargs})
    plain = model.generate(**batch, **kwargs)
    assert plain.tolist() != unprocessed.tolist(), "the case must change generate's output to test anything"
    ours = _ours(model, **batch, **kwargs)
    for row, (expected, got) in enumerate(zip(plain.tolist(), ours.tolist(), strict=True)):
        assert got == expected, f"row {row}"
    assert ours.shape == plain.shape


def test_a_watermark_that_counts_its_calls_is_refused(model: torch.nn.Module) -> None:
    # SynthID keeps state from call to call (one call per token in plain generate); the verify
    # calls the processors on drafted positions that may be rejected, so its output would differ.
    config = SynthIDTextWatermarkingConfig(keys=[654, 400, 836, 123, 340], ngram_len=3)
    with pytest.raises(LayerskipError, match="SynthID") as caught:
        _ours(model, **_batch("padded"), max_new_tokens=4, watermarking_config=config)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("undecided", [False, True], ids=["certified", "fallback"])
@pytest.mark.parametrize("arch", ARCHS)
def test_processors_together_on_every_architecture(arch: str, undecided: bool, monkeypatch) -> None:
    """The sparse processors on the certified head (and, where the certificate cannot decide, on the
    full row) give generate's tokens on every architecture, on a padded batch."""
    model = tiny_model(arch)
    if undecided:
        monkeypatch.setattr(verify_head, "MAX_CANDIDATES", 0)  # every row falls back to the fp32 head
    batch = _batch("padded")
    start = batch["input_ids"].shape[1]
    unprocessed = model.generate(**batch, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD)
    kwargs = CASES["together"](unprocessed[:, start:].tolist(), batch)
    kwargs = dict(max_new_tokens=NEW, do_sample=False, **{"pad_token_id": PAD, **kwargs})
    head = engine_verify_head(model)
    before = head.stats.certified, head.stats.fallbacks
    assert _ours(model, **batch, **kwargs).tolist() == model.generate(**batch, **kwargs).tolist()
    certified, fallbacks = head.stats.certified - before[0], head.stats.fallbacks - before[1]
    # Undecided: every row whose other tokens the edited ones do not already beat outright falls back.
    assert fallbacks > 0 if undecided else certified > 0
