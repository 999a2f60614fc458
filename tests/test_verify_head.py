"""The certified bf16 verify head: its argmax is the fp32 head's, near-ties and flat rows included."""

from __future__ import annotations

import pytest
import torch
from compare import assert_same_tokens, hf_greedy
from tiny_models import random_prompt, tiny_model
from torch import nn

from layerskip.drafts.policy.skip_policy import DraftSettings, SkipPolicy
from layerskip.engine.decoding import Decoder, DecodeSettings
from layerskip.engine.verify_head import VerifyHead


class _HeadOnly(nn.Module):
    """Just enough of a causal LM for ``VerifyHead``: a config and an output embedding."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.head = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        self.head.weight.data.copy_(weight)
        self.config = type("Config", (), {"model_type": "llama"})()

    def get_output_embeddings(self) -> nn.Linear:
        return self.head


def _fp32_argmax(weight: torch.Tensor, hidden: torch.Tensor) -> list[int]:
    return (hidden @ weight.T).argmax(dim=-1).tolist()


def test_argmax_equals_the_fp32_heads_on_random_rows() -> None:
    torch.manual_seed(0)
    weight = torch.randn(3000, 96)
    hidden = 4 * torch.randn(64, 96)
    head = VerifyHead(_HeadOnly(weight))
    assert head.argmax(hidden) == _fp32_argmax(weight, hidden)
    assert head.stats.certified == 64 and head.stats.fallbacks == 0


def test_a_near_tie_that_bf16_gets_wrong_is_decided_in_fp32() -> None:
    """Two head rows whose fp32 logits differ by far less than bf16's rounding: the bf16 product
    alone picks the wrong one (checked), the certified head the fp32 winner."""
    torch.manual_seed(1)
    width = 64
    base = torch.randn(width)
    hidden = base[None] + 0.1 * torch.randn(1, width)  # the two near-twins lead by far
    other = torch.randn(200, width) * 0.1
    wrong = 0
    for trial in range(200):
        nudge = torch.randn(width) * 3e-3
        weight = torch.cat([other, base[None], (base + nudge)[None]])
        exact = _fp32_argmax(weight, hidden)
        bf16 = (hidden.bfloat16() @ weight.bfloat16().T).float().argmax(dim=-1).tolist()
        wrong += bf16 != exact
        assert VerifyHead(_HeadOnly(weight)).argmax(hidden) == exact, f"trial {trial}"
    assert wrong > 0, "no trial had bf16 pick the other token: the test proves nothing"


def test_a_flat_row_falls_back_to_the_fp32_head() -> None:
    torch.manual_seed(2)
    weight = torch.ones(500, 32) + 1e-4 * torch.randn(500, 32)  # every logit within rounding of the rest
    hidden = torch.randn(3, 32)
    head = VerifyHead(_HeadOnly(weight))
    assert head.argmax(hidden) == _fp32_argmax(weight, hidden)
    assert head.stats.fallbacks == 3


def test_the_bound_covers_every_bf16_error() -> None:
    torch.manual_seed(3)
    weight = torch.randn(4000, 128) * torch.rand(4000, 1) * 3
    hidden = torch.randn(16, 128) * 10
    head = VerifyHead(_HeadOnly(weight))
    exact = hidden @ weight.T
    scores = (hidden.bfloat16() @ head.low.T).float()
    norms = torch.linalg.vector_norm(hidden, dim=1, keepdim=True)
    bound = head.coefficient * norms * head.row_norms + head.output_coefficient * scores.abs()
    assert bool(((scores - exact).abs() <= bound).all())


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "gpt2"])
def test_greedy_decoding_is_identical_with_and_without_the_certified_head(arch: str) -> None:
    model = tiny_model(arch)
    prompt = random_prompt()
    policy = SkipPolicy(skip_attention=(1,), skip_mlp=(2,), draft=DraftSettings(max_draft_tokens=4))
    reference, logits = hf_greedy(model, prompt, 24)
    for certified in (True, False):
        decoder = Decoder.for_policy(model, policy, certified_head=certified)
        tokens, stats = decoder.decode(prompt, DecodeSettings(max_new_tokens=24))
        assert_same_tokens(tokens, reference, ref_logits=logits, label=f"{arch} certified_head={certified}")
        assert decoder.head.certified == certified
        step = "draft step: hf (no lean draft step for 'gpt2'" if arch == "gpt2" else "draft step: lean"
        assert any(path.startswith(step) for path in stats.paths), stats.paths
        assert ("verify head: certified bf16" in stats.paths) == certified
    assert decoder.head.stats.rows == 0  # the uncertified head never took the bf16 route
