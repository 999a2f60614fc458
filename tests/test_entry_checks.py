"""A model's limits are checked below the entry points: the CLI, ``layerskip.generate``, ``Decoder``
and the plug-in (``model.generate(custom_generate=...)``) refuse the same input with the same line.

Each test collects the message of every entry point that can be given the input and requires them
to be one and the same ``LayerskipError`` (the CLI: exit code 2, that line, no traceback).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from cli_helpers import assert_bad_input, run_in_process
from tiny_models import save_checkpoint, tiny_model, tiny_tokenizer

import layerskip
from layerskip.drafts.policy.skip_policy import DraftSettings, SkipPolicy
from layerskip.engine.decoding import Decoder, DecodeSettings
from layerskip.errors import LayerskipError
from layerskip.sampling import Sampling

PATH = layerskip.custom_generate_path()
POLICY = SkipPolicy.skip_layers([1, 2], draft=DraftSettings(max_draft_tokens=3))
LIMIT = 32  # the tiny models' positions here
NEW = 20
POSITION_FIELD = {"gpt2": "n_positions", "llama": "max_position_embeddings"}  # learned, rotary


def _words(count: int, first: int = 0) -> str:
    return " ".join(f"w{i}" for i in range(first, first + count))  # one token per word


def _refusal(call: Callable[[], object]) -> str:
    with pytest.raises(LayerskipError) as info:
        call()
    return str(info.value)


def _cli(capsys: pytest.CaptureFixture[str], tool: str, *args: str) -> str:
    """The CLI's one line (exit 2, no traceback), without its ``error: `` prefix."""
    if tool == "generate":
        from layerskip.cli.generate import main
    else:
        from layerskip.cli.bench import main
    line = assert_bad_input(run_in_process(main, capsys, *args))
    return line.removeprefix("error: ")


def _plugin(model: torch.nn.Module, ids: torch.Tensor, form: object = PATH, **kwargs: object) -> object:
    extra = {"trust_remote_code": True} if form == PATH else {}
    return model.generate(ids, custom_generate=form, skip_policy=POLICY, **extra, **kwargs)


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def short_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[object, str]:
    """A tiny model with 32 positions (GPT-2's learned ones, Llama's rotary ones) and its checkpoint."""
    model = tiny_model(request.param, **{POSITION_FIELD[request.param]: LIMIT})
    directory = tmp_path_factory.mktemp("models") / request.param
    save_checkpoint(model, directory)
    return model, str(directory)


def test_a_prompt_past_the_positions_is_refused_alike(short_model, capsys, tmp_path: Path) -> None:
    """GPT-2 ended in an IndexError and a rotary model generated past its positions unchecked,
    everywhere but the CLI."""
    model, directory = short_model
    tokenizer = tiny_tokenizer()
    text = _words(24)
    ids = tokenizer(text)["input_ids"]
    expected = (
        "the prompt has 24 tokens; with 20 new tokens that is 44, past the model's 32 positions; "
        "shorten the prompt or lower the number of new tokens"
    )
    cli = ["--model", directory, "--no-chat", "--max-new-tokens", str(NEW), "--policy", "plain"]
    messages = {
        "cli": _cli(capsys, "generate", *cli, "--prompt", text),
        "generate": _refusal(lambda: layerskip.generate(model, tokenizer, text, POLICY, max_new_tokens=NEW)),
        "decoder": _refusal(lambda: Decoder(model).decode(ids, DecodeSettings(NEW))),
        "plugin": _refusal(lambda: _plugin(model, torch.tensor([ids]), max_new_tokens=NEW)),
    }
    assert messages == dict.fromkeys(messages, expected)

    # In a batch the row is named as the CLI's --batch-size counts it.
    short = tokenizer("hello world")["input_ids"]
    lines = tmp_path / "prompts.txt"
    lines.write_text(f"hello world\n{text}\n")
    padded = torch.tensor([[0] * (len(ids) - len(short)) + short, ids])
    mask = torch.tensor([[0] * (len(ids) - len(short)) + [1] * len(short), [1] * len(ids)])
    messages = {
        "cli": _cli(capsys, "generate", *cli, "--prompt-file", str(lines), "--batch-size", "2"),
        "generate": _refusal(lambda: layerskip.generate(model, tokenizer, ["hello world", text], max_new_tokens=NEW)),
        "decoder": _refusal(lambda: Decoder(model).decode_batch([short, ids], DecodeSettings(NEW))),
        "plugin": _refusal(lambda: _plugin(model, padded, attention_mask=mask, max_new_tokens=NEW)),
    }
    assert messages == dict.fromkeys(messages, expected.replace("the prompt has", "prompt 2 has"))


def test_a_prompt_that_just_fits_decodes(short_model) -> None:
    """Prompt plus new tokens equal to the positions is allowed, drafts and batches included: the
    last new token is never fed to the model."""
    model, _ = short_model
    fits = torch.tensor([list(range(2, 2 + LIMIT - NEW))])
    plain = model.generate(fits, max_new_tokens=NEW, do_sample=False)
    assert _plugin(model, fits, max_new_tokens=NEW).tolist() == plain.tolist()
    decoder = Decoder.for_policy(model, POLICY)
    rows = [fits[0].tolist(), list(range(5, 13))]
    for (tokens, _), row in zip(decoder.decode_batch(rows, DecodeSettings(NEW)), rows, strict=True):
        assert tokens == decoder.decode(row, DecodeSettings(NEW))[0]
    assert len(tokens) == NEW


def test_no_prompts_are_refused_alike() -> None:
    """An empty list ended in ``max()`` of nothing, the plug-in's zero rows in an IndexError."""
    model, tokenizer = tiny_model("llama"), tiny_tokenizer()
    none = torch.zeros((0, 4), dtype=torch.long)
    messages = {
        "generate": _refusal(lambda: layerskip.generate(model, tokenizer, [], max_new_tokens=4)),
        "decoder": _refusal(lambda: Decoder(model).decode_batch([], DecodeSettings(4))),
        "plugin": _refusal(lambda: _plugin(model, none, max_new_tokens=4)),
        "plugin-callable": _refusal(
            lambda: _plugin(model, none, form=layerskip.self_speculative_generate, max_new_tokens=4)
        ),
    }
    assert messages == dict.fromkeys(messages, "no prompts given: the batch is empty; pass at least one prompt")


@pytest.mark.parametrize(
    "prompt, expected",
    [
        (["hello", 5], "prompt 2 is of type int, not text; pass every prompt as a str"),
        (["hello", None], "prompt 2 is None, not text; pass every prompt as a str"),
        ([b"hello"], "prompt 1 is of type bytes, not text; pass every prompt as a str"),
        (b"hello", "the prompt is of type bytes, not text; pass a str, or a list of str"),
        (None, "the prompt is None, not text; pass a str, or a list of str"),
    ],
    ids=["int", "none-in-list", "bytes-in-list", "bytes", "none"],
)
def test_prompts_that_are_not_text_are_refused(prompt: object, expected: str) -> None:
    """Text prompts reach the engine through ``generate`` only (the CLI reads strings): a number or
    bytes was a transformers traceback, and None was told to use --prompt."""
    model, tokenizer = tiny_model("llama"), tiny_tokenizer()
    assert _refusal(lambda: layerskip.generate(model, tokenizer, prompt, max_new_tokens=4)) == expected


def test_a_temperature_too_small_for_float32_is_refused_alike(capsys, tmp_path: Path) -> None:
    """1e-300 passed as "finite and > 0" and its NaN probabilities failed in the sampler (and in
    HF's warper, the bench's baseline). Python callers meet it building the ``Sampling`` that
    ``generate`` and ``Decoder`` take; the tools before any model loads."""
    model = tiny_model("llama")
    missing = str(tmp_path / "no-model")
    messages = {
        "sampling": _refusal(lambda: Sampling(temperature=1e-300)),
        "cli": _cli(capsys, "generate", "--model", missing, "--prompt", "hi", "--sample", "--temperature", "1e-300"),
        "bench": _cli(capsys, "bench", "--model", missing, "--out", str(tmp_path / "o"), "--temperature", "1e-300"),
        "plugin": _refusal(
            lambda: _plugin(model, torch.tensor([[3, 4, 5]]), do_sample=True, temperature=1e-300, max_new_tokens=4)
        ),
    }
    expected = (
        "temperature must be at least 1e-30, got 1e-300: logits divided by it overflow float32; "
        "use greedy decoding, which so small a temperature amounts to"
    )
    assert messages == dict.fromkeys(messages, expected)
    Sampling(temperature=1e-30)  # the smallest allowed: greedy in effect (tests/test_cli_generate.py)


@pytest.mark.parametrize("row", [[1, "a"], "hi", [1.5, 2.0], torch.tensor([1.0, 2.0]), [None]])
def test_token_rows_that_are_not_integers_are_refused(row: object) -> None:
    """A row of token ids holding text or floats ended in ``int()``'s own ValueError."""
    model = tiny_model("llama")
    message = _refusal(lambda: Decoder(model).decode_batch([[1, 2], row], DecodeSettings(4)))
    assert "pass a list of ints" in message or "pass integer token ids" in message


def test_an_empty_text_prompt_names_no_cli_flag() -> None:
    """A Python caller was told to use --prompt or --prompt-file."""
    model, tokenizer = tiny_model("llama"), tiny_tokenizer()
    message = _refusal(lambda: layerskip.generate(model, tokenizer, ["hi", ""], max_new_tokens=4))
    assert "prompt is empty" in message and "--" not in message
