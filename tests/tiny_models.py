"""Tiny random models of every supported architecture, built from a config (nothing downloaded).

The default init is rescaled per architecture (``SCALES``) so that greedy comparisons are
robust: the embeddings and LM head are scaled (peaked logits: no float near-ties between the
top two tokens) and each sublayer's output is scaled, so the continuation depends on the
context and a draft that bypasses some sublayers agrees with the full model often, not always.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from layerskip.hf import adapters

HIDDEN = 64
LAYERS = 4
HEADS = 4
KV_HEADS = 2
VOCAB = 128
SLIDING_WINDOW = 4

# Names of the tiny configs the tests iterate over; gpt_neox comes in both residual variants.
ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "gpt_neox", "gpt_neox_serial", "gpt2"]

# (embedding/head scale, sublayer-output scale, seed) per config, tuned so that the greedy
# continuation of ``random_prompt()`` is varied (10+ distinct tokens for most), the top-2 logit
# gap of the reference stays above ~1e-3 (fp32 rounding is ~1e-6), and every skip policy
# the tests use gets acceptances and rejections. Tied-embedding models (Gemma, GPT-2) need
# stronger sublayers, or the residual stream is dominated by the current token's embedding and
# the model just repeats it.
SCALES: dict[str, tuple[float, float, int]] = {
    "llama": (5.0, 1.0, 0),
    "mistral": (3.0, 1.0, 0),
    "qwen2": (5.0, 1.0, 0),
    "qwen3": (5.0, 1.0, 0),
    "gemma2": (8.0, 2.0, 0),
    "gemma3_text": (8.0, 4.0, 1),
    "phi3": (5.0, 1.0, 0),
    "gpt_neox": (5.0, 1.0, 1),
    "gpt_neox_serial": (5.0, 1.0, 1),
    "gpt2": (0.5, 4.0, 0),
}


def _config(arch: str, overrides: dict[str, Any]):
    import transformers as tf

    common: dict[str, Any] = dict(vocab_size=VOCAB, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    llama_like: dict[str, Any] = dict(
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=256,
        **common,
    )
    if arch == "llama":
        kwargs, cls = llama_like, tf.LlamaConfig
    elif arch == "mistral":
        kwargs, cls = dict(llama_like, sliding_window=SLIDING_WINDOW), tf.MistralConfig
    elif arch == "qwen2":
        kwargs, cls = llama_like, tf.Qwen2Config
    elif arch == "qwen3":
        kwargs, cls = dict(llama_like, head_dim=HIDDEN // HEADS), tf.Qwen3Config
    elif arch in ("gemma2", "gemma3_text"):
        kwargs = dict(
            llama_like,
            head_dim=HIDDEN // HEADS,
            sliding_window=SLIDING_WINDOW,
            layer_types=["sliding_attention", "full_attention"] * (LAYERS // 2),
            pad_token_id=0,
        )
        if arch == "gemma3_text":
            kwargs["layer_types"] = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
        cls = tf.Gemma2Config if arch == "gemma2" else tf.Gemma3TextConfig
    elif arch == "phi3":
        kwargs, cls = dict(llama_like, pad_token_id=0), tf.Phi3Config
    elif arch in ("gpt_neox", "gpt_neox_serial"):
        kwargs = dict(
            hidden_size=HIDDEN,
            intermediate_size=2 * HIDDEN,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            max_position_embeddings=256,
            use_parallel_residual=arch == "gpt_neox",
            **common,
        )
        cls = tf.GPTNeoXConfig
    elif arch == "gpt2":
        kwargs = dict(n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=256, n_inner=2 * HIDDEN, **common)
        cls = tf.GPT2Config
    else:
        raise ValueError(f"no tiny config for {arch!r}")
    kwargs.update(overrides)
    return cls(**kwargs)


def _model_class(config):
    import transformers as tf

    return {
        "llama": tf.LlamaForCausalLM,
        "mistral": tf.MistralForCausalLM,
        "qwen2": tf.Qwen2ForCausalLM,
        "qwen3": tf.Qwen3ForCausalLM,
        "gemma2": tf.Gemma2ForCausalLM,
        "gemma3_text": tf.Gemma3ForCausalLM,
        "phi3": tf.Phi3ForCausalLM,
        "gpt_neox": tf.GPTNeoXForCausalLM,
        "gpt2": tf.GPT2LMHeadModel,
    }[config.model_type]


def _out_projections(model: nn.Module, index: int) -> list[nn.Linear]:
    """The last linear layer of a sublayer: the one writing into the residual stream."""
    found = []
    for module in (adapters.sublayer(model, index, "attention"), adapters.sublayer(model, index, "mlp")):
        linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
        conv1d = [m for m in module.modules() if type(m).__name__ == "Conv1D"]  # GPT-2
        found.append((linears or conv1d)[-1])
    return found


def tiny_model(
    arch: str,
    seed: int | None = None,
    embed_scale: float | None = None,
    out_scale: float | None = None,
    **overrides: Any,
) -> nn.Module:
    """A tiny random ``*ForCausalLM`` of ``arch`` (one of ``ARCHS``) in fp32 and eval mode.

    ``overrides`` go to its config; ``seed``, ``embed_scale`` and ``out_scale`` default to
    the tuned values in ``SCALES``.
    """
    config = _config(arch, overrides)
    default_embed, default_out, default_seed = SCALES[arch]
    embed_scale = default_embed if embed_scale is None else embed_scale
    out_scale = default_out if out_scale is None else out_scale
    torch.manual_seed(default_seed if seed is None else seed)
    model = _model_class(config)(config)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(embed_scale)
        head = model.get_output_embeddings()
        if head.weight is not model.get_input_embeddings().weight:
            head.weight.mul_(embed_scale)
        for i in range(adapters.num_layers(model)):
            layer = adapters.decoder_layers(model)[i]
            post_norms = [getattr(layer, n, None) for n in ("post_attention_layernorm", "post_feedforward_layernorm")]
            if all(norm is not None for norm in post_norms) and hasattr(layer, "pre_feedforward_layernorm"):
                # Gemma 2/3 normalise each sublayer's output: scale the post-norms' (1 + weight).
                for norm in post_norms:
                    norm.weight.copy_((1 + norm.weight) * out_scale - 1)
            else:
                for proj in _out_projections(model, i):
                    proj.weight.mul_(out_scale)
    return model.float().eval()


def random_prompt(vocab_size: int = VOCAB, length: int = 8, seed: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=generator).tolist()


def tiny_tokenizer():
    """A word-level fast tokenizer: "[UNK]", "[EOS]", "w0".."w61", "hello", "world" (ids 0..65)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "[EOS]": 1, **{f"w{i}": i + 2 for i in range(62)}, "hello": 64, "world": 65}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="[EOS]")


def save_checkpoint(model: nn.Module, directory) -> None:
    """Write ``model`` and the tiny tokenizer as a local HF directory that ``load_model`` accepts."""
    model.save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
