"""Turning user text into token ids (chat template or raw) and finding the stop tokens."""

from __future__ import annotations

from torch import nn

from layerskip.errors import LayerskipError


def encode_prompt(tokenizer: object, prompt: str, chat: bool) -> list[int]:
    """Token ids for ``prompt``; with ``chat`` it is wrapped as one user turn of the chat template.
    Whitespace is a prompt like any other (the plug-in decodes whatever ids it is given); only a
    text with no token to condition on is refused."""
    if not prompt:
        raise LayerskipError("the prompt is empty; pass some text to continue")
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise LayerskipError("this tokenizer has no chat template; drop --chat to use the raw prompt")
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    else:
        ids = list(tokenizer(prompt)["input_ids"])
    if not ids:
        raise LayerskipError("the prompt is empty: it encodes to no token; pass some text to continue")
    return ids


def eos_token_ids(model: nn.Module, tokenizer: object | None = None) -> tuple[int, ...]:
    """Every token that ends a generation: the generation config's EOS ids (what HF's ``generate``
    stops at) and, when one is given, the tokenizer's."""
    ids: set[int] = set()
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif configured:
        ids.update(int(i) for i in configured)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))


def first_token_id(model: nn.Module) -> int:
    """A token to start the model's own text from: its beginning-of-sequence id (1 without one)."""
    config = model.config.get_text_config(decoder=True)
    bos = getattr(config, "bos_token_id", None)
    if isinstance(bos, list):  # some configs list several
        bos = bos[0] if bos else None
    return bos if isinstance(bos, int) else 1
