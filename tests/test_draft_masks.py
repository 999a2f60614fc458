"""Drafts apply what the user's processors do next (an EOS masked before ``min_new_tokens``,
suppressed tokens, a repetition penalty): the verify would reject what ignored them. Proposals
only: the output stays the verify's."""

from __future__ import annotations

import torch
from tiny_models import random_prompt, tiny_model

from layerskip.drafts.base import DraftRequest
from layerskip.drafts.builder import DraftRun
from layerskip.drafts.policy.skip_policy import DraftSettings, SkipPolicy
from layerskip.engine.decoding import Decoder, DecodeSettings
from layerskip.engine.verify_head import TokenEdits
from layerskip.hf.cache import model_cache
from layerskip.hf.forward import block_hidden

POLICY = SkipPolicy(skip_attention=(1,), draft=DraftSettings(max_draft_tokens=3))
CPU = torch.device("cpu")


def _prefilled_drafter(prompt: list[int]) -> tuple:
    """A row's drafter of ``POLICY`` on the tiny Llama, and a cache holding all of ``prompt`` but its last token."""
    model = tiny_model("llama")
    drafter = Decoder.for_policy(model, POLICY)._drafter(
        len(prompt), DecodeSettings(8, eos_token_ids=()), None, dense=False
    )
    cache = model_cache(model)
    block_hidden(model, torch.tensor([prompt[:-1]]), cache)
    return drafter, cache


@torch.inference_mode()
def test_a_rows_drafter_leaves_out_masked_tokens() -> None:
    prompt = random_prompt()
    drafter, cache = _prefilled_drafter(prompt)
    first = drafter.propose(DraftRequest(prompt, cache, 3, CPU)).tokens
    cache.rollback(len(prompt) - 1)
    masked = TokenEdits((), lambda v: v, masked=(first[0],))
    again = drafter.propose(DraftRequest(prompt, cache, 3, CPU, lambda drafted: masked)).tokens
    assert first and again and again[0] != first[0]
    cache.rollback(len(prompt) - 1)
    penalised = TokenEdits((first[0],), lambda v: v - 1e4)  # a penalty that pushes it far down
    assert drafter.propose(DraftRequest(prompt, cache, 3, CPU, lambda drafted: penalised)).tokens[0] != first[0]


@torch.inference_mode()
def test_the_batched_draft_leaves_out_each_rows_masked_tokens() -> None:
    model = tiny_model("gemma3_text")
    prompts = [random_prompt(seed=1), random_prompt(seed=2)]
    decoder = Decoder.for_policy(model, POLICY)
    draft = decoder.draft.batch_draft(DraftRun(len(prompts[0]), 8, None, None), prompts)
    cache = model_cache(model, rows=2)
    block_hidden(model, torch.tensor([p[:-1] for p in prompts]), cache)
    free = draft.propose_rows(cache, prompts, [3, 3], 3, [None, None], [None, None]).rows
    banned = TokenEdits((), lambda v: v, masked=(free[0].tokens[0],))
    masked = [lambda drafted: banned, None]
    again = draft.propose_rows(cache, prompts, [3, 3], 3, [None, None], masked).rows
    assert again[0].tokens[0] != free[0].tokens[0]
    assert again[1].tokens == free[1].tokens  # row 1 had nothing masked
    assert cache.lengths == [len(prompts[0]) - 1] * 2


@torch.inference_mode()
def test_each_drafted_position_gets_its_own_edits() -> None:
    """A processor whose mask depends on the text (no_repeat_ngram_size) is asked again after
    every drafted token, with the tokens drafted so far."""
    prompt = random_prompt()
    drafter, cache = _prefilled_drafter(prompt)
    free = drafter.propose(DraftRequest(prompt, cache, 3, CPU)).tokens
    asked: list[list[int]] = []

    def after(drafted: list[int]) -> TokenEdits | None:
        asked.append(list(drafted))
        return TokenEdits((), lambda v: v, masked=(free[1],)) if len(drafted) == 1 else None

    cache.rollback(len(prompt) - 1)
    again = drafter.propose(DraftRequest(prompt, cache, 3, CPU, after)).tokens
    assert asked[:2] == [[], free[:1]]
    assert again[0] == free[0] and again[1] != free[1]
