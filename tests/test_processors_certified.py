"""Logits processors on the certified head: a greedy verify through processors that touch few
tokens (masks, penalties, biases) takes the processed argmax from the bf16 head and an fp32
recheck of a few tokens, never the full fp32 product; any other processor keeps the full logits.

Each processor's sparse edits equal the processor itself on full rows, bit for bit; the argmax is
compared with the processors applied to the model's own fp32 logits, on rows where the processors
change the winner, on rows the certificate cannot narrow (the fallback), and through the plug-in
against plain ``generate``.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model, tiny_tokenizer
from transformers import (
    LogitsProcessor,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
)

import layerskip
from layerskip.drafts.drafters.auto import AutoState
from layerskip.drafts.policy.skip_policy import DraftSettings, SkipPolicy
from layerskip.drafts.rules.costs import DraftCosts
from layerskip.engine import verify_head
from layerskip.engine.verifiers import verifier_for
from layerskip.engine.verify_head import VerifyHead, engine_verify_head
from layerskip.integration.generate_args import RowProcessors
from layerskip.integration.token_edits import row_edits
from layerskip.sampling import Sampling

POLICY = SkipPolicy.skip_layers([1, 2], draft=DraftSettings(max_draft_tokens=3))


class Doubling(LogitsProcessor):
    """A user's processor: not one the certificate knows, so the verify reads every logit."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return scores * 2.0


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_model("llama")


def _rows(model: torch.nn.Module, count: int = 6, scale: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return scale * torch.randn(count, model.config.hidden_size, generator=generator) * 4  # [q, H]


def _processors(head: VerifyHead, hidden: torch.Tensor, context: list[int]) -> RowProcessors:
    """Processors that change the raw argmax of every row: its winner penalised hard, suppressed or banned."""
    winners = head.logits(hidden).argmax(dim=-1).tolist()
    return RowProcessors(
        (
            RepetitionPenaltyLogitsProcessor(penalty=50.0),
            MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=2, min_new_tokens=100, eos_token_id=winners[1]),
            SuppressTokensLogitsProcessor([winners[2]]),
            NoRepeatNGramLogitsProcessor(2),
            SequenceBiasLogitsProcessor({(winners[3],): -1e4}),
        ),
        (),
    )


def _context(head: VerifyHead, hidden: torch.Tensor) -> list[int]:
    winners = head.logits(hidden).argmax(dim=-1).tolist()
    # Row i follows context[: len - q + 1 + i]; the first winner sits in every row's context, so the
    # penalty moves it; a repeated bigram bans the token after it.
    return [winners[0], 7, 9, 7, *range(20, 20 + hidden.shape[0] - 1)]


def _edits(hook: RowProcessors, context: list[int], rows: int, vocab: int) -> list:
    first = len(context) - rows + 1
    return hook.edits([context[: first + i] for i in range(rows)], vocab)


def test_the_processed_argmax_is_certified_and_exact(model) -> None:
    head = VerifyHead(model, certified=True)
    hidden = _rows(model)
    context = _context(head, hidden)
    hook = _processors(head, hidden, context)
    expected = hook(context, head.logits(hidden)).argmax(dim=-1).tolist()
    assert expected != head.logits(hidden).argmax(dim=-1).tolist()  # the processors change winners
    got = head.argmax(hidden, _edits(hook, context, hidden.shape[0], head.weight.shape[0]))
    assert got == expected
    assert head.stats.certified == hidden.shape[0] and head.stats.fallbacks == 0


def test_rows_the_certificate_cannot_narrow_fall_back_exactly(model, monkeypatch) -> None:
    head = VerifyHead(model, certified=True)
    hidden = _rows(model)
    context = _context(head, hidden)
    hook = _processors(head, hidden, context)
    monkeypatch.setattr(verify_head, "MAX_CANDIDATES", 0)  # no row may be certified
    got = head.argmax(hidden, _edits(hook, context, hidden.shape[0], head.weight.shape[0]))
    assert got == hook(context, head.logits(hidden)).argmax(dim=-1).tolist()
    assert head.stats.fallbacks == hidden.shape[0] and head.stats.certified == 0


def test_near_ties_are_decided_in_fp32(model) -> None:
    """Tiny hidden states put many logits within the bf16 bound of the top: they are rechecked."""
    head = VerifyHead(model, certified=True)
    hidden = _rows(model, scale=0.05)
    context = _context(head, hidden)
    hook = _processors(head, hidden, context)
    got = head.argmax(hidden, _edits(hook, context, hidden.shape[0], head.weight.shape[0]))
    assert got == hook(context, head.logits(hidden)).argmax(dim=-1).tolist()
    assert head.stats.candidates > head.stats.certified  # rows with more than one candidate


SPARSE = {
    "repetition": lambda: RepetitionPenaltyLogitsProcessor(1.3),
    "reward": lambda: RepetitionPenaltyLogitsProcessor(0.7),
    "repetition_padded": lambda: RepetitionPenaltyLogitsProcessor(1.3, prompt_ignore_length=torch.tensor([3])),
    "ngram_1": lambda: NoRepeatNGramLogitsProcessor(1),
    "ngram_3": lambda: NoRepeatNGramLogitsProcessor(3),
    "bad_words": lambda: NoBadWordsLogitsProcessor([[5], [7, 9], [2, 7, 11]], eos_token_id=5),
    "bias": lambda: SequenceBiasLogitsProcessor([[[4], 2.5], [[7, 4], -1.25], [[9, 7, 4], 0.1], [[7, 12], 3.0]]),
    "suppress": lambda: SuppressTokensLogitsProcessor([3, 4]),
    "suppress_begin": lambda: SuppressTokensAtBeginLogitsProcessor([1, 2], begin_index=11),
    "min_length": lambda: MinLengthLogitsProcessor(20, eos_token_id=[2, 6]),
    "min_new_tokens": lambda: MinNewTokensLengthLogitsProcessor(4, 10, eos_token_id=2),
}


@pytest.mark.parametrize("name", sorted(SPARSE))
def test_sparse_edits_equal_the_processor_bit_for_bit(name: str) -> None:
    generator = torch.Generator().manual_seed(1)
    vocab = 40
    for length in (1, 2, 5, 11, 12):
        ids = [0, 0, 0, *[int(t) for t in torch.randint(1, 14, (length,), generator=generator)], 7, 9, 7]
        logits = torch.randn(1, vocab, generator=generator) * 3  # float32
        logits[0, 4] = 0.0  # a zero logit: the penalty leaves it, the bias moves it
        expected = SPARSE[name]()(torch.tensor([ids]), logits.clone())[0]
        edits = row_edits([SPARSE[name]()], ids, vocab)
        got = logits[0].clone()
        got[list(edits.masked)] = -float("inf")
        got[list(edits.tokens)] = edits.apply(logits[0, list(edits.tokens)])
        assert torch.equal(got, expected), (name, length)


def test_processors_that_need_every_logit_have_no_edits() -> None:
    assert RowProcessors((RepetitionPenaltyLogitsProcessor(1.05),), ()).edits([[1, 2]], 40) is not None
    assert RowProcessors((RepetitionPenaltyLogitsProcessor(1.05), Doubling()), ()).edits([[1, 2]], 40) is None


def test_a_verify_that_reads_every_logit_says_so_and_is_priced_dearer() -> None:
    head = engine_verify_head(tiny_model("llama"))
    sparse = RowProcessors((RepetitionPenaltyLogitsProcessor(1.05),), ())
    dense = RowProcessors((RepetitionPenaltyLogitsProcessor(1.05), Doubling()), ())
    assert not verifier_for(head, None, None).needs_logits
    assert not verifier_for(head, None, None, sparse).needs_logits
    assert verifier_for(head, None, None, dense).needs_logits
    assert verifier_for(head, Sampling(temperature=0.7), None, sparse).needs_logits
    # auto prices such a verify with the full head's extra seconds, and learns in the greedy head's terms.
    costs = DraftCosts(0.01, {1: 0.01, 2: 0.012, 9: 0.02}, {0: 0.004}, dense_head={1: 0.002, 8: 0.009, 32: 0.03})
    state = AutoState.start(costs, DraftSettings())
    assert state.verify_seconds(8, dense=True) == pytest.approx(state.verify_seconds(8) + 0.009)
    before = state.verify[8]
    state.observe_verify(8, before + 0.009, dense=True)
    assert state.verify[8] == pytest.approx(before)
    assert DraftCosts.from_dict(costs.to_dict()).dense_head == costs.dense_head


@pytest.mark.parametrize(
    "kwargs, certified",
    [
        (dict(repetition_penalty=1.3), True),
        (dict(no_repeat_ngram_size=2), True),
        (dict(min_new_tokens=12, eos_token_id=3, pad_token_id=0), True),
        (dict(suppress_tokens=[5, 6]), True),
        (dict(bad_words_ids=[[5], [7, 8]], sequence_bias=[[[9], 1.5]]), True),
        (dict(logits_processor=[Doubling()]), False),
    ],
    ids=["repetition", "ngram", "min_new_tokens", "suppress", "bad_words_bias", "unknown"],
)
def test_the_plugin_verifies_per_token_processors_on_the_certified_head(kwargs, certified) -> None:
    model = tiny_model("llama")
    tokenizer = tiny_tokenizer()
    tokenizer.pad_token, tokenizer.padding_side = "[UNK]", "left"
    batch = dict(tokenizer(["w3 w17 w40 hello w5", "w7 w7 w8"], return_tensors="pt", padding=True))
    plain = model.generate(**batch, max_new_tokens=12, do_sample=False, **kwargs)
    head = engine_verify_head(model)
    before = head.stats.rows, head.stats.certified + head.stats.fallbacks
    ours = model.generate(
        **batch,
        max_new_tokens=12,
        do_sample=False,
        custom_generate=layerskip.custom_generate_path(),
        trust_remote_code=True,
        skip_policy=POLICY,
        **kwargs,
    )
    assert torch.equal(ours, plain)
    rows, decided = head.stats.rows - before[0], head.stats.certified + head.stats.fallbacks - before[1]
    assert (rows > 0 and decided == rows) if certified else rows == 0
