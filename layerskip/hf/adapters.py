"""The one module that knows Hugging Face model internals.

Everything else in layerskip asks this module where a model's decoder layers are, which
submodule of a layer is its attention and which its MLP, how many layers use a sliding
window, and how to bypass a sublayer. Supporting a new architecture means adding one entry
to ``ARCHITECTURES`` (and a tiny-config test), nothing else.

Bypassing a sublayer means its contribution to the residual stream is zero: the module's
forward is replaced by one that returns zeros of the input's shape without touching the
weights or the KV cache, so a draft's cost falls with what it skips.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from layerskip.errors import LayerskipError, few


@dataclass(frozen=True)
class ArchitectureSpec:
    """Where one model family keeps its decoder layers and their sublayers."""

    layers_path: str  # dotted path from the *ForCausalLM module to the nn.ModuleList of layers
    attention: str  # attribute of a layer holding self-attention; its forward returns (output, weights)
    mlp: str  # attribute of a layer holding the feed-forward block; its forward returns a tensor
    base_model_path: str  # dotted path to the decoder stack (embeddings + layers + final norm)
    # Norms a layer applies to a sublayer's output before adding it to the residual stream
    # (Gemma 2/3 "sandwich" norms); None where the sublayer's output is added as it is.
    attention_output_norm: str | None = None
    mlp_output_norm: str | None = None


_LLAMA_LIKE = ArchitectureSpec("model.layers", "self_attn", "mlp", "model")
_GEMMA_SANDWICH = ArchitectureSpec(
    "model.layers", "self_attn", "mlp", "model", "post_attention_layernorm", "post_feedforward_layernorm"
)

# Keyed by ``config.model_type``. In transformers 5.x every attention here returns
# ``(attn_output, attn_weights)`` and every MLP returns one tensor of the input's shape.
ARCHITECTURES: dict[str, ArchitectureSpec] = {
    "llama": _LLAMA_LIKE,
    "mistral": _LLAMA_LIKE,
    "qwen2": _LLAMA_LIKE,
    "qwen3": _LLAMA_LIKE,
    "gemma": _LLAMA_LIKE,
    "gemma2": _GEMMA_SANDWICH,
    "gemma3_text": _GEMMA_SANDWICH,
    "phi3": _LLAMA_LIKE,
    "gpt_neox": ArchitectureSpec("gpt_neox.layers", "attention", "mlp", "gpt_neox"),
    "gpt2": ArchitectureSpec("transformer.h", "attn", "mlp", "transformer"),
}


def architecture_of(model: nn.Module) -> str:
    return str(getattr(model.config, "model_type", type(model).__name__))


def spec_for(model: nn.Module) -> ArchitectureSpec:
    arch = architecture_of(model)
    spec = ARCHITECTURES.get(arch)
    if spec is None:
        raise LayerskipError(
            f"unsupported architecture '{arch}'; layerskip supports {', '.join(sorted(ARCHITECTURES))} "
            "(add an entry to layerskip/hf/adapters.py ARCHITECTURES to support another)"
        )
    return spec


def _resolve(root: nn.Module, dotted: str) -> nn.Module:
    module = root
    for name in dotted.split("."):
        module = getattr(module, name)
    return module


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    return _resolve(model, spec_for(model).layers_path)


def num_layers(model: nn.Module) -> int:
    return len(decoder_layers(model))


def sublayer(model: nn.Module, index: int, kind: str) -> nn.Module:
    """Layer ``index``'s attention (``kind`` "attention") or MLP ("mlp")."""
    spec = spec_for(model)
    return getattr(decoder_layers(model)[index], spec.attention if kind == "attention" else spec.mlp)


def base_model(model: nn.Module) -> nn.Module:
    """The decoder stack without the LM head: returns hidden states, accepts past_key_values."""
    return _resolve(model, spec_for(model).base_model_path)


@contextlib.contextmanager
def recorded_forwards(model: nn.Module) -> Iterator[list[tuple[int, int]]]:
    """Every forward of the decoder stack while inside, as ``(first position, rows)`` in call
    order: HF ``generate`` (plain, prompt lookup) and our engine's prefill and verify blocks all
    run through it. The list fills as the forwards run; the hook is removed on leaving."""
    calls: list[tuple[int, int]] = []

    def record(module: nn.Module, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        where = kwargs.get("position_ids")
        if where is None:
            where = kwargs.get("cache_position")
        if where is not None:
            start = int(where.reshape(-1)[0])
        else:  # no positions given: the stack continues its cache
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            start = int(cache.get_seq_length()) if cache is not None else 0
        calls.append((start, int(ids.shape[1])))

    handle = base_model(model).register_forward_pre_hook(record, with_kwargs=True)
    try:
        yield calls
    finally:
        handle.remove()


# HF's "sdpa" attention copies each layer's K/V once per query group (``repeat_kv``) wherever a
# mask is given and more than one position is queried: every verify of a draft, and every forward
# of left-padded rows. On CPU, torch's SDPA reads the groups in place (``enable_gqa``), the same
# to the bit; sixteen rows of SmolLM2 at 768 tokens spent 3/4 of a 4-wide verify in the copy
# (580 ms, 154 ms without). Other devices keep HF's own path: a GPU's fused kernels may not take
# grouped heads with a mask, and fall back to a slower one.
GROUPED_SDPA = "layerskip_grouped_sdpa"
# Arguments that only HF's own attention handles (logit soft-capping, position biases, sinks).
_HF_ONLY = ("softcap", "position_bias", "s_aux", "sinks")


def _grouped_sdpa(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """HF's sdpa attention (query ``[B, heads, q, d]``, key/value ``[B, kv_heads, L, d]``), its
    grouped heads read in place where a mask is given and ``q > 1`` on CPU."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    hf_path = (
        attention_mask is None  # HF's causal fast path (a prefill)
        or query.shape[2] == 1  # HF packs one position's groups itself
        or query.device.type != "cpu"
        or getattr(module, "num_key_value_groups", 1) == 1
        or any(kwargs.get(name) is not None for name in _HF_ONLY)
    )
    if hf_path:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )  # [B, heads, q, d]
    return out.transpose(1, 2).contiguous(), None


@functools.cache
def _register_grouped_sdpa() -> None:
    """``_grouped_sdpa`` under ``GROUPED_SDPA`` in HF's attention and mask interfaces, once per
    process (every forward of the stack enters ``grouped_attention``)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GROUPED_SDPA, _grouped_sdpa)
    AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)


@contextlib.contextmanager
def grouped_attention(model: nn.Module) -> Iterator[None]:
    """Inside, a model loaded with ``sdpa`` attention runs ``_grouped_sdpa`` (registered with HF's
    attention and mask interfaces under ``GROUPED_SDPA``, its masks sdpa's); its configuration
    names ``sdpa`` again on leaving. Other implementations are left as they are."""
    config = base_model(model).config
    if getattr(config, "_attn_implementation", None) != "sdpa":
        yield
        return
    _register_grouped_sdpa()
    config._attn_implementation = GROUPED_SDPA
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"


def lm_head(model: nn.Module) -> nn.Linear:
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise LayerskipError(f"the LM head of '{architecture_of(model)}' is not a linear layer; it cannot be truncated")
    return head


def logits_from_hidden(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The LM head over final hidden states ``[q, hidden] -> [q, V]``, as the model's forward computes it.

    On CPU the product is taken as ``W @ h^T``: the same sums in another order (fp32 rounding
    apart, the same logits), but for 2-8 rows of a wide head the BLAS path behind
    ``F.linear`` can be several times slower than this one, and a verify block is exactly that.
    """
    head = lm_head(model)
    if hidden.device.type == "cpu":
        logits = (head.weight @ hidden.to(head.weight.dtype).T).T  # [V, H] @ [H, q] -> [q, V]
        if head.bias is not None:
            logits = logits + head.bias
    else:
        logits = head(hidden)
    cap = final_logit_softcap(model)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def final_logit_softcap(model: nn.Module) -> float | None:
    """Gemma 2/3 squash logits with ``cap * tanh(logits / cap)``; others return None."""
    return getattr(model.config, "final_logit_softcapping", None)


def max_positions(model: nn.Module) -> int | None:
    """The longest sequence the model's position scheme allows (None if the config does not say)."""
    config = model.config.get_text_config(decoder=True)
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


def sliding_windows(model: nn.Module) -> list[int | None]:
    """Per decoder layer: its sliding-window size, or None for full attention."""
    config = model.config.get_text_config(decoder=True)
    count = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return [window if kind == "sliding_attention" else None for kind in layer_types[:count]]
    # Without ``layer_types`` (Mistral, Phi3) a configured window applies to every layer.
    return [window] * count


def sublayer_parameter_counts(model: nn.Module) -> tuple[list[int], list[int], int]:
    """(attention params per layer, MLP params per layer, all params): for 'fraction bypassed'."""
    attn = [sum(p.numel() for p in sublayer(model, i, "attention").parameters()) for i in range(num_layers(model))]
    mlp = [sum(p.numel() for p in sublayer(model, i, "mlp").parameters()) for i in range(num_layers(model))]
    total = sum(p.numel() for p in model.parameters())
    return attn, mlp, total


# Width fields of HF configs (names differ between families) -> the overhead twin's width,
# in multiples of its hidden size (8 per head); head_dim is fixed at 8.
_TWIN_WIDTHS = {"hidden_size": 1, "n_embd": 1, "intermediate_size": 2, "n_inner": 2}
TWIN_HEAD_DIM = 8
TWIN_VOCAB = 512


def overhead_twin(model: nn.Module) -> nn.Module:
    """A random model of the same family, depth, heads and layer types, but 8-wide heads.

    Its forward runs the same Python, module calls and kernel launches as the real model with
    almost no arithmetic, so its step time is the per-step framework cost (the floor that no
    draft can remove). Token ids given to it must be below ``TWIN_VOCAB``.
    """
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.config)
    text = config.get_text_config(decoder=True)
    heads = getattr(text, "num_attention_heads", None) or getattr(text, "n_head", None) or 1
    hidden = TWIN_HEAD_DIM * heads
    for name, multiple in _TWIN_WIDTHS.items():
        if getattr(text, name, None) is not None:
            setattr(text, name, multiple * hidden)
    if getattr(text, "head_dim", None) is not None:
        text.head_dim = TWIN_HEAD_DIM
    text.vocab_size = TWIN_VOCAB
    parameter = next(model.parameters())
    twin = AutoModelForCausalLM.from_config(config, dtype=parameter.dtype)
    return twin.to(parameter.device).eval()


def weights_fingerprint(model: nn.Module) -> str:
    """A short hash of parameter names and shapes: tells models of another shape apart (a
    fine-tune of the same shape has the same one; ``weights_sample_digest`` tells those apart)."""
    digest = hashlib.sha256(architecture_of(model).encode())
    for name, param in model.state_dict().items():
        digest.update(f"{name}:{tuple(param.shape)};".encode())
    return digest.hexdigest()[:16]


def weights_sample_digest(model: nn.Module) -> str:
    """A hash of up to 256 evenly spaced values of every tensor: tells apart two checkpoints with
    the same shapes (a fine-tune, another random init) without hashing every weight.

    The values are hashed as bfloat16, so one checkpoint loaded in float32 or bfloat16 gives one
    digest (a float32 weight loaded as bfloat16 is that rounding); float16 rounds (and flushes
    tiny values) otherwise, so a float16 copy gives another."""
    digest = hashlib.sha256()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            flat = tensor.detach().reshape(-1)
            step = max(1, flat.numel() // 256)
            sample = flat[::step][:256].to(device="cpu", dtype=torch.bfloat16).contiguous()
            digest.update(name.encode())
            digest.update(sample.view(torch.int16).numpy().tobytes())  # numpy has no bfloat16
    return digest.hexdigest()[:16]


def _zero_attention(hidden_states: torch.Tensor, *args: object, **kwargs: object) -> tuple[torch.Tensor, None]:
    # The residual stream passes unchanged; no K/V is computed or written to the cache.
    return torch.zeros_like(hidden_states), None


def _zero_mlp(hidden_states: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return torch.zeros_like(hidden_states)


def _pass_through(hidden_states: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    # A whole decoder layer bypassed: in transformers 5.x every layer here returns its hidden
    # states, and with both sublayers contributing zero (Gemma's post-norms map zero to zero)
    # the layer's output is its input, exactly. Skipping the call also skips its norms and
    # Python overhead, so the draft costs what it keeps.
    return hidden_states


@contextlib.contextmanager
def patched_forwards(replacements: Iterable[tuple[nn.Module, Callable[..., object]]]) -> Iterator[None]:
    """Run each module with a replacement ``forward`` inside the ``with`` block; always restored.

    The replacement is an instance attribute shadowing the class's ``forward``; deleting it
    restores the original, so nothing of the model is left changed, even on an exception.
    """
    patched: list[nn.Module] = []
    try:
        for module, forward in replacements:
            if "forward" in module.__dict__:
                raise RuntimeError(f"{type(module).__name__} is already patched; nested patches of one module")
            module.forward = forward
            patched.append(module)
        yield
    finally:
        for module in patched:
            if "forward" in module.__dict__:
                del module.forward


def bypass_replacements(
    model: nn.Module, attention: Iterable[int] = (), mlp: Iterable[int] = ()
) -> list[tuple[nn.Module, Callable[..., object]]]:
    """(module, zero forward) pairs that bypass the given sublayers; a layer losing both is skipped whole."""
    attention, mlp = set(attention), set(mlp)
    layers = decoder_layers(model)
    spec = spec_for(model)
    replacements: list[tuple[nn.Module, Callable[..., object]]] = []
    for index in sorted(attention | mlp):
        layer = layers[index]
        if index in attention and index in mlp:
            replacements.append((layer, _pass_through))
            continue
        if index in attention:
            replacements.append((getattr(layer, spec.attention), _zero_attention))
        if index in mlp:
            replacements.append((getattr(layer, spec.mlp), _zero_mlp))
    return replacements


@contextlib.contextmanager
def bypass(model: nn.Module, attention: Iterable[int] = (), mlp: Iterable[int] = ()) -> Iterator[None]:
    """Bypass the given attention / MLP sublayers inside the ``with`` block; always restored."""
    with patched_forwards(bypass_replacements(model, attention, mlp)):
        yield


def projection_weight(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``(weight [out, in], bias [out] | None)`` of a linear projection, or None for any other module.

    GPT-2's ``Conv1D`` stores its weight as ``[in, out]``; it computes the same affine map.
    """
    if isinstance(module, nn.Linear):
        return module.weight, module.bias
    if type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None:
        return module.weight.t(), module.bias
    return None


def sublayer_projections(model: nn.Module, index: int, kind: str) -> list[nn.Module]:
    """The linear projections inside one sublayer (``kind`` = "attention" or "mlp") of layer ``index``."""
    return [module for module in sublayer(model, index, kind).modules() if projection_weight(module) is not None]


def check_indices(model: nn.Module, attention: Sequence[int], mlp: Sequence[int]) -> None:
    count = num_layers(model)
    for kind, indices in (("attention", attention), ("mlp", mlp)):
        bad = [i for i in indices if not 0 <= i < count]
        if bad:
            raise LayerskipError(
                f"policy skips {kind} layer(s) {few(bad)} but the model has {count} layers (valid 0..{count - 1}); "
                "fix the indices in the policy file"
            )


@dataclass
class ContributionRecord:
    """Per-position norms ``[q]`` from one full forward, per layer: the residual stream entering the
    layer and what its attention and its MLP add to it."""

    residual: dict[int, torch.Tensor]
    attention: dict[int, torch.Tensor]
    mlp: dict[int, torch.Tensor]


@contextlib.contextmanager
def sublayer_contributions(model: nn.Module) -> Iterator[ContributionRecord]:
    """Record, for every forward inside the block, how much each sublayer adds to the residual
    stream at each position (hooks; removed on exit). Norms stay on the device: no sync."""
    spec = spec_for(model)
    record = ContributionRecord({}, {}, {})
    handles = []

    def norms(hidden: torch.Tensor) -> torch.Tensor:  # [1, q, hidden] -> [q]
        return torch.linalg.vector_norm(hidden[0].float(), dim=-1)

    def watch(target: dict[int, torch.Tensor], index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: object, output: object) -> None:
            target[index] = norms(output[0] if isinstance(output, tuple) else output)  # attention: (output, weights)

        return hook

    def watch_input(index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            hidden = args[0] if args else kwargs["hidden_states"]
            record.residual[index] = norms(hidden)

        return hook

    try:
        for index, layer in enumerate(decoder_layers(model)):
            handles.append(layer.register_forward_pre_hook(watch_input(index), with_kwargs=True))
            for attr, norm, target in (
                (spec.attention, spec.attention_output_norm, record.attention),
                (spec.mlp, spec.mlp_output_norm, record.mlp),
            ):
                module = getattr(layer, norm or attr)
                handles.append(module.register_forward_hook(watch(target, index)))
        yield record
    finally:
        for handle in handles:
            handle.remove()


def copy_decoder_layer(model: nn.Module, source: int, cache_slot: int) -> nn.Module:
    """A copy of decoder layer ``source`` whose attention keeps its K/V in cache layer ``cache_slot``.

    The copy shares nothing with the model (training it leaves the model untouched); it is
    called with the keyword arguments the decoder stack passes to the layer it follows, so its
    masks and rotary embeddings must be of the same kind (``same_kind_layers``).
    """
    layer = copy.deepcopy(decoder_layers(model)[source])
    attention = getattr(layer, spec_for(model).attention)
    if hasattr(attention, "layer_idx"):
        attention.layer_idx = cache_slot
    return layer


def same_kind_layers(model: nn.Module, index: int) -> list[int]:
    """Layers whose attention is of the same kind as ``index``'s (full, or the same sliding window)."""
    windows = sliding_windows(model)
    return [i for i, window in enumerate(windows) if window == windows[index]]


def layer_output_replacement(
    model: nn.Module,
    index: int,
    transform: Callable[..., torch.Tensor],
    replace_output: Callable[[], torch.Tensor | None] | None = None,
) -> tuple[nn.Module, Callable[..., torch.Tensor]]:
    """(layer ``index``, a forward that returns ``transform(output, *args, **kwargs)``).

    ``output`` is what the layer computes (transformers 5.x layers return their hidden states),
    or, where ``replace_output()`` gives a tensor ``[1, q, hidden]``, that tensor, and the layer
    does not run at all: a verify that reuses hidden states a draft computed enters the stack
    there. ``args`` / ``kwargs`` are what the decoder stack passed to the layer (mask, rotary
    embeddings, cache), so ``transform`` may run a layer of its own with them.
    """
    layer = decoder_layers(model)[index]
    original = type(layer).forward

    def forward(hidden_states: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        given = replace_output() if replace_output is not None else None
        output = given if given is not None else original(layer, hidden_states, *args, **kwargs)
        return transform(output, *args, **kwargs)

    return layer, forward
