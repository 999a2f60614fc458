"""The divergence check: real defects injected into a bf16 run are classed ``defect``; a genuine bf16
near-tie is classed ``rounding``; fp32 runs stay identical.

A tiny random Mistral (sliding window 4, so a stale cache entry changes what attention sees) in
bf16, greedy, 16 new tokens. Each defect is injected by patching the engine for one decode; the
same decode without the patch is identical to HF ``generate`` on these prompts (checked), so the
divergence is the defect's. If the classifier were "always rounding", each defect test fails.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from types import SimpleNamespace

import pytest
import torch
from oracles import one_past_the_mismatch
from tiny_models import random_prompt, tiny_model

from layerskip.drafts.model.draft_model import DraftModel
from layerskip.drafts.policy.skip_policy import DraftSettings, SkipPolicy
from layerskip.engine import verifiers
from layerskip.engine.decoding import Decoder, DecodeSettings
from layerskip.hf.cache import RollbackCache
from layerskip.integration.baselines import hf_generate
from layerskip.measure import divergence as divergence_module
from layerskip.measure.divergence import DEFECT, ROUNDING, Divergence, DivergenceCheck, first_divergence, half_ulp
from layerskip.sampling import accept_tree_greedy

NEW_TOKENS = 16
PROMPTS = [random_prompt(seed=0), random_prompt(seed=2)]
SKIP = SkipPolicy(skip_attention=(0, 2), draft=DraftSettings(max_draft_tokens=4))
LOOKUP = SkipPolicy(
    draft=DraftSettings(
        use_skip_draft=False, lookup_max_ngram=3, lookup_min_ngram=1, lookup_max_tokens=10, max_draft_tokens=10
    )
)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_model("mistral").to(torch.bfloat16)


def _decode(model: torch.nn.Module, policy: SkipPolicy | None, prompt: list[int]) -> list[int]:
    return Decoder.for_policy(model, policy, threads=1).decode(prompt, DecodeSettings(NEW_TOKENS))[0]


def _classify(
    check: DivergenceCheck, prompt: Sequence[int], tokens: Sequence[int], reference: Sequence[int]
) -> Divergence | None:
    """The class of ``tokens``' first divergence from ``reference`` after ``prompt`` (None if identical)."""
    return check.classify_many(prompt, reference, {"method": tokens})["method"]


# -- the defects ---------------------------------------------------------------------------------------


def _rollback_one_short(cache: RollbackCache, length: int) -> None:
    """Every row cut to one token more than asked: a rejected draft's K/V stays in the cache."""
    cache.set_lengths([min(n, length + 1) for n in cache.lengths])


_KEEP_PATHS = RollbackCache.keep_paths


def _keep_one_row_too_many(cache: RollbackCache, starts: Sequence[int], paths: Sequence[Sequence[int]]) -> None:
    """Each accepted path kept with the block row after it: a rejected draft's K/V stays in the cache."""
    paths = [
        [*rows, rows[-1] + 1] if length >= start + rows[-1] + 2 else rows
        for length, start, rows in zip(cache.lengths, starts, paths, strict=True)
    ]
    _KEEP_PATHS(cache, starts, paths)


def _read_the_draft_logits(patch: pytest.MonkeyPatch) -> None:
    """The verify decides the drafted positions from the draft's own logits (the full model's
    only for the token after them)."""
    draft_choices: list[int] = []
    draft_logits = DraftModel.logits

    def recording(self, input_ids, cache, head):  # noqa: ANN001, ANN202
        logits = draft_logits(self, input_ids, cache, head)
        draft_choices.append(int(head.token_ids(logits[0].argmax())))
        return logits

    def verify(drafted: list[int], parents: list[int], targets: list[int]) -> tuple[list[int], int]:
        mixed = [*draft_choices[len(draft_choices) - len(drafted) :], targets[len(drafted)]] if drafted else targets
        return accept_tree_greedy(drafted, parents, mixed)

    patch.setattr(DraftModel, "logits", recording)
    patch.setattr(verifiers, "accept_tree_greedy", verify)


INJECT = {
    "accepted past the mismatch": lambda patch: patch.setattr(verifiers, "accept_tree_greedy", one_past_the_mismatch),
    "cache rolled back one short": lambda patch: (
        patch.setattr(RollbackCache, "rollback", _rollback_one_short),
        patch.setattr(RollbackCache, "keep_paths", _keep_one_row_too_many),
    ),
    "verify reads the draft's logits": _read_the_draft_logits,
}


def _defective_run(model: torch.nn.Module, policy: SkipPolicy, prompt: list[int], defect: str) -> list[int]:
    with pytest.MonkeyPatch.context() as patch:
        INJECT[defect](patch)
        return _decode(model, policy, prompt)


DEFECTS = [
    ("accepted past the mismatch", SKIP),
    ("cache rolled back one short", LOOKUP),  # lookup drafts only: every layer's length moves together
    ("verify reads the draft's logits", SKIP),
]


@pytest.mark.parametrize("defect, policy", DEFECTS, ids=[d for d, _ in DEFECTS])
@pytest.mark.parametrize("prompt", PROMPTS, ids=["prompt0", "prompt2"])
def test_an_injected_defect_is_classed_defect(
    model: torch.nn.Module, defect: str, policy: SkipPolicy, prompt: list[int]
) -> None:
    reference = hf_generate(model, prompt, NEW_TOKENS)
    assert _decode(model, policy, prompt) == reference  # without the defect: identical, here, in bf16
    tokens = _defective_run(model, policy, prompt, defect)
    assert tokens != reference, "the defect must change the output, or this test proves nothing"
    with DivergenceCheck(model) as check:
        # With a rerun the defect verdict is checked again against the run's own forward schedule:
        # replayed as a correct computation, it must not explain the defect away either.
        rerun = {"method": lambda: _defective_run(model, policy, prompt, defect)}
        found = check.classify_many(prompt, reference, {"method": tokens}, rerun)["method"]
    assert found is not None and found.position == first_divergence(tokens, reference)
    assert any(name.startswith("the method's own forwards") for name in found.gaps), found.gaps
    assert (found.reference_token, found.method_token) == (reference[found.position], tokens[found.position])
    assert found.verdict == DEFECT, found
    assert found.fp32_gap > found.error_bound > 0, found  # fp32 sides with the reference, beyond rounding
    assert found.witness is None  # no correct bf16 computation of that position picks the defect's token
    assert found.reference_replayed and found.dtype == "bfloat16"
    assert found.to_dict()["class"] == DEFECT


def test_a_recorded_schedule_replays_the_computation_that_chose_the_token() -> None:
    """HF prompt lookup's forwards, recorded, replayed over a fresh cache: at each position the
    replay's logits are the ones HF's own run chose from, to the bit (its irregular verify blocks
    included). Llama: no sliding window, whose HF cache keeps fewer keys than ours and so rounds
    attention differently."""
    from layerskip.hf import adapters

    model = tiny_model("llama").to(torch.bfloat16)

    prompt = [*PROMPTS[0], *PROMPTS[0][:6]]  # a repeat, so lookup proposes candidates
    ids = torch.tensor([prompt])
    common = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, prompt_lookup_num_tokens=4)
    with torch.inference_mode(), adapters.recorded_forwards(model) as calls:
        out = model.generate(ids, output_logits=True, return_dict_in_generate=True, **common)
    tokens, logits = out.sequences[0, len(prompt) :].tolist(), torch.cat(out.logits).float()
    assert calls[0][0] == 0 and calls[0][1] >= len(prompt)  # the prefill (with lookup's first candidates)
    assert all(start <= before + width for (before, width), (start, _) in zip(calls, calls[1:]))
    assert any(width > 1 for _, width in calls[1:]), "lookup never verified a block: the test proves nothing"
    with DivergenceCheck(model) as check, torch.inference_mode():
        for position in range(1, NEW_TOKENS):
            r, m = logits[position].topk(2).indices.tolist()

            def gap(row: torch.Tensor, r: int = r, m: int = m) -> float:
                return float(row[r].float() - row[m].float())

            prefix = [*prompt, *tokens[:position]]
            replayed = check._schedule_gaps(prompt, prefix, tokens, calls, gap)
            linear = next(g for name, g in replayed.items() if name.endswith("F.linear head"))
            assert linear == gap(logits[position]), (position, replayed, gap(logits[position]))
        assert check._schedule_gaps(prompt, prefix, tokens, [(0, 2), (5, 1)], gap) == {}  # a gap in the history


# -- rounding ------------------------------------------------------------------------------------------


def test_a_genuine_bf16_near_tie_is_classed_rounding(model: torch.nn.Module) -> None:
    """Two head rows one bf16 step apart in one weight: wherever one of the two tokens is chosen,
    the other trails it in fp32 by far less than bf16 resolves, and a method that picks it there
    diverges by rounding."""
    tied = copy.deepcopy(model)
    prompt = PROMPTS[0]
    reference = hf_generate(tied, prompt, NEW_TOKENS)
    chosen = reference[3]
    other = next(t for t in range(tied.config.vocab_size) if t not in reference)
    head = tied.get_output_embeddings().weight
    with torch.no_grad():
        head[other] = head[chosen]
        weight = float(head[other, 0])
        head[other, 0] = weight + 2 * half_ulp(weight, torch.bfloat16)  # the next bf16 value up
    assert not torch.equal(head[other], head[chosen])
    reference = hf_generate(tied, prompt, NEW_TOKENS)
    position = next(i for i, t in enumerate(reference) if t in (chosen, other))
    runner_up = other if reference[position] == chosen else chosen
    tokens = [*reference[:position], runner_up]
    with DivergenceCheck(tied) as check:
        found = _classify(check, prompt, tokens, reference)
    assert found is not None and found.position == position
    assert found.verdict == ROUNDING, found
    assert abs(found.fp32_gap) < 1e-3 < found.error_bound, found  # a real near-tie, below bf16's resolution


def test_correct_methods_diverge_only_by_rounding() -> None:
    """Correct methods on a model with flat logits (many near-ties): every divergence from HF
    ``generate`` in bf16 is rounding. Where they diverge depends on the CPU's bf16 kernels; the
    constructed near-tie above is the check that always runs."""
    flat = tiny_model("llama", embed_scale=1.0, vocab_size=2048).to(torch.bfloat16)
    found = []
    with DivergenceCheck(flat) as check:
        for seed in (2, 3):
            prompt = random_prompt(2048, seed=seed)
            reference = hf_generate(flat, prompt, NEW_TOKENS)
            outputs = {name: _decode(flat, policy, prompt) for name, policy in (("skip", SKIP), ("lookup", LOOKUP))}
            found += [d for d in check.classify_many(prompt, reference, outputs).values() if d is not None]
    assert all(d.verdict == ROUNDING and d.fp32_gap is not None for d in found), found


# -- fp32: the contract stays identity -----------------------------------------------------------------


def test_fp32_runs_are_identical_and_an_fp32_defect_is_a_defect() -> None:
    model = tiny_model("mistral")
    prompt = PROMPTS[1]
    reference = hf_generate(model, prompt, NEW_TOKENS)
    with DivergenceCheck(model) as check:
        for policy in (None, SKIP, LOOKUP):
            assert _classify(check, prompt, _decode(model, policy, prompt), reference) is None
        tokens = _defective_run(model, SKIP, prompt, "accepted past the mismatch")
        found = _classify(check, prompt, tokens, reference)
        assert check._fp32 is None  # an fp32 model is its own fp32 copy
    assert found is not None and found.verdict == DEFECT and found.dtype == "float32"
    assert found.error_bound < 1e-4 < found.fp32_gap  # fp32's own rounding is ~1e-7 of these logits


# -- the check itself ------------------------------------------------------------------------------------


def test_a_length_difference_is_a_defect_without_any_forward(model: torch.nn.Module) -> None:
    reference = [5, 6, 7, 8]
    with DivergenceCheck(model) as check:
        shorter = _classify(check, [1, 2, 3], [5, 6], reference)
        longer = _classify(check, [1, 2, 3], [*reference, 9], reference)
        assert check._fp32 is None  # no token competed: nothing was computed
    assert shorter.position == 2 and shorter.method_token is None and shorter.verdict == DEFECT
    assert longer.position == 4 and longer.reference_token is None and longer.verdict == DEFECT
    assert "ended" in shorter.reason and shorter.fp32_gap is None
    assert _classify(check, [1, 2, 3], reference, reference) is None


def test_the_fp32_copy_is_made_once_and_the_model_is_left_as_it_was(
    model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = {name: p.clone() for name, p in model.state_dict().items()}
    copies = []

    def counted(module: torch.nn.Module) -> torch.nn.Module:
        copies.append(module)
        return copy.deepcopy(module)

    monkeypatch.setattr(divergence_module, "copy", SimpleNamespace(deepcopy=counted))
    prompt = PROMPTS[0]
    reference = hf_generate(model, prompt, 6)
    wrong = [*reference[:2], (reference[2] + 1) % model.config.vocab_size]
    with DivergenceCheck(model) as check:
        outputs = {"a": wrong, "b": [*reference[:4], (reference[4] + 1) % model.config.vocab_size]}
        found = check.classify_many(prompt, reference, outputs)
        again = _classify(check, prompt, wrong, reference)
        assert next(check._fp32.parameters()).dtype == torch.float32
    assert check._fp32 is None and len(copies) == 1  # made lazily, once, freed on exit
    assert [found["a"].position, found["b"].position, again.position] == [2, 4, 2]
    assert found["a"].fp32_gap == again.fp32_gap
    assert next(model.parameters()).dtype == torch.bfloat16
    assert all(torch.equal(before[name], p) for name, p in model.state_dict().items())


def test_half_ulp() -> None:
    assert half_ulp(1.0, torch.bfloat16) == 2**-8
    assert half_ulp(-3.0, torch.bfloat16) == 2**-7
    assert half_ulp(20.0, torch.bfloat16) == 2**-4  # Gemma-3's logits: bf16 steps of 0.125 there
    assert half_ulp(1.0, torch.float32) == 2**-24
