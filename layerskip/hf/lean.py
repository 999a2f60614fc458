"""A lean one-token forward for drafting: each kept sublayer as the few tensor ops it needs.

A draft step runs the decoder stack over one token, once per drafted token. Through the
Hugging Face modules that costs more than the arithmetic: on a 2-core CPU an int4 SmolLM2 draft
spent well over half of its time on module calls, mask construction, rotary embeddings computed
for the position, a cast per projection and cache bookkeeping (docs: draft floor). For the
Llama-family pre-norm decoders this module runs the same maths directly:

* Q/K/V in one product and gate/up in one product (``projection_groups`` says which
  projections fuse; the caller supplies the products, e.g. int4 copies built once);
* one cast to the product's dtype per sublayer;
* no attention mask: one query attends to every cached key (the last ``window`` keys on a
  sliding-window layer);
* rotary embeddings read from a table of positions computed once (grown on demand) by the
  model's own rotary module, so every rope scaling variant is honoured;
* K/V written straight into the rollback cache's buffers.

Numerically it is the HF forward with the same skip set (tests/test_lean.py holds the hidden
states together on every tiny architecture it covers). Architectures it does not cover
(``lean_plan`` returns the reason) keep the HF forward.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from layerskip.hf import adapters
from layerskip.hf.cache import RollbackCache

# x [R, in] in the compute dtype -> [R, out] in the compute dtype, for one fused group.
Matmul = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class LeanFamily:
    """What differs between the Llama-family decoders the lean forward covers."""

    norm_offset: float = 0.0  # Gemma's RMSNorm scales by (1 + weight)
    sandwich: bool = False  # Gemma 2/3: a norm after each sublayer, and a pre-feedforward norm
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each head's query and key


_LLAMA = LeanFamily()
LEAN_FAMILIES: dict[str, LeanFamily] = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": LeanFamily(qk_norm=True),
    "phi3": _LLAMA,
    "gemma": LeanFamily(norm_offset=1.0),
    "gemma3_text": LeanFamily(norm_offset=1.0, sandwich=True, qk_norm=True),
}

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}

# Fused groups per sublayer, by the projection attribute names of each layout.
_ATTENTION_GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",))
_ATTENTION_GROUPS_FUSED = (("qkv_proj",), ("o_proj",))  # Phi-3
_MLP_GROUPS = (("gate_proj", "up_proj"), ("down_proj",))
_MLP_GROUPS_FUSED = (("gate_up_proj",), ("down_proj",))  # Phi-3


def projection_groups(model: nn.Module, index: int, kind: str) -> list[list[nn.Module]]:
    """The projections of one sublayer in groups that share their input, in order (Q/K/V then O;
    gate/up then down). Architectures the lean forward does not cover get one group per projection."""
    sublayer = adapters.sublayer(model, index, kind)
    layouts = (_ATTENTION_GROUPS, _ATTENTION_GROUPS_FUSED) if kind == "attention" else (_MLP_GROUPS, _MLP_GROUPS_FUSED)
    for layout in layouts:
        if all(hasattr(sublayer, name) for group in layout for name in group):
            return [[getattr(sublayer, name) for name in group] for group in layout]
    return [[module] for module in adapters.sublayer_projections(model, index, kind)]


def _norm_weight(norm: nn.Module, offset: float) -> tuple[torch.Tensor, float]:
    eps = getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", None) or 1e-6
    return (norm.weight.detach() + offset), float(eps)


@dataclass
class _Attention:
    norm: tuple[torch.Tensor, float]
    q_heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    window: int | None
    rotary_key: str | None  # Gemma 3: the layer type whose rotary table this layer reads
    qk_norm: tuple[torch.Tensor, float] | None  # weight [q_heads + kv_heads, head_dim]
    post_norm: tuple[torch.Tensor, float] | None


@dataclass
class _MLP:
    norm: tuple[torch.Tensor, float]
    activation: Callable[[torch.Tensor], torch.Tensor]
    post_norm: tuple[torch.Tensor, float] | None


class RotaryTable:
    """cos/sin ``[positions, head_dim]`` per layer type, from the model's rotary module, grown on demand."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        self.rotary = adapters.base_model(model).rotary_emb
        self.dtype = dtype
        self.device = next(model.parameters()).device
        self.tables: dict[str | None, tuple[torch.Tensor, torch.Tensor]] = {}

    def at(self, position: int, key: str | None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[head_dim]`` of ``position`` (the rotate-half layout: sin's first half negated)."""
        table = self.tables.get(key)
        if table is None or position >= table[0].shape[0]:
            table = self._build(max(256, 2 * (position + 1)), key)
        return table[0][position], table[1][position]

    def _build(self, count: int, key: str | None) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(count, device=self.device).unsqueeze(0)
        probe = torch.zeros(1, device=self.device, dtype=torch.float32)
        args = (probe, positions) if key is None else (probe, positions, key)
        cos, sin = self.rotary(*args)  # [1, count, head_dim] each, fp32
        half = sin.shape[-1] // 2
        # rotate_half(x) * sin == roll(x, half) * sin_signed with sin_signed = [-sin1, sin2]:
        # one roll instead of two slices, a negation and a concatenation per step.
        signed = torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)
        self.tables[key] = (cos[0].to(self.dtype).contiguous(), signed.to(self.dtype).contiguous())
        return self.tables[key]


class LeanPlan:
    """Everything the lean forward reads from the model, gathered once."""

    def __init__(self, model: nn.Module, family: LeanFamily, activation: Callable[[torch.Tensor], torch.Tensor]):
        self.model = model
        base = adapters.base_model(model)
        self.embed = base.embed_tokens
        self.final_norm = _norm_weight(base.norm, family.norm_offset)
        self.hidden_size = int(self.final_norm[0].shape[0])
        windows = adapters.sliding_windows(model)
        config = model.config.get_text_config(decoder=True)
        layer_types = getattr(config, "layer_types", None)
        # Gemma 3 keeps one rotary table per layer type; the others one for all layers.
        per_type = layer_types is not None and "layer_type" in inspect.signature(base.rotary_emb.forward).parameters
        self.attention: list[_Attention] = []
        self.mlp: list[_MLP] = []

        def norm(module: nn.Module) -> tuple[torch.Tensor, float]:
            return _norm_weight(module, family.norm_offset)

        for i, layer in enumerate(adapters.decoder_layers(model)):
            attn = adapters.sublayer(model, i, "attention")
            q_out = projection_groups(model, i, "attention")[0]
            head_dim = int(attn.head_dim)
            q_heads = (q_out[0].out_features if len(q_out) == 3 else config.num_attention_heads * head_dim) // head_dim
            kv_heads = int(config.num_key_value_heads)
            qk_norm = None
            if family.qk_norm:
                (qw, eps), (kw, _) = norm(attn.q_norm), norm(attn.k_norm)
                qk_norm = (torch.cat([qw.expand(q_heads, head_dim), kw.expand(kv_heads, head_dim)]), eps)
            sandwich = family.sandwich
            self.attention.append(
                _Attention(
                    norm(layer.input_layernorm),
                    q_heads,
                    kv_heads,
                    head_dim,
                    float(attn.scaling),
                    windows[i],
                    layer_types[i] if per_type else None,
                    qk_norm,
                    norm(layer.post_attention_layernorm) if sandwich else None,
                )
            )
            pre_mlp = layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm
            post_mlp = norm(layer.post_feedforward_layernorm) if sandwich else None
            self.mlp.append(_MLP(norm(pre_mlp), activation, post_mlp))
        self.rotary_tables: dict[torch.dtype, RotaryTable] = {}

    def rotary(self, dtype: torch.dtype) -> RotaryTable:
        if dtype not in self.rotary_tables:
            self.rotary_tables[dtype] = RotaryTable(self.model, dtype)
        return self.rotary_tables[dtype]


def lean_plan(model: nn.Module) -> tuple[LeanPlan | None, str]:
    """The model's lean plan, or None and why the lean forward does not cover it."""
    arch = adapters.architecture_of(model)
    family = LEAN_FAMILIES.get(arch)
    if family is None:
        return None, f"no lean draft step for '{arch}' (covered: {', '.join(sorted(LEAN_FAMILIES))})"
    config = model.config.get_text_config(decoder=True)
    if getattr(config, "attn_logit_softcapping", None):
        return None, "attention logit softcapping is not in the lean draft step"
    act_name = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    activation = _ACTIVATIONS.get(str(act_name))
    if activation is None:
        return None, f"activation '{act_name}' is not in the lean draft step"
    if getattr(config, "partial_rotary_factor", 1.0) not in (None, 1.0):
        return None, "partial rotary embeddings are not in the lean draft step"
    base = adapters.base_model(model)
    if not hasattr(base, "rotary_emb") or not hasattr(base, "norm") or not hasattr(base, "embed_tokens"):
        return None, "the decoder stack has no rotary_emb / norm / embed_tokens"
    for i in range(adapters.num_layers(model)):
        for kind in ("attention", "mlp"):
            if [len(g) for g in projection_groups(model, i, kind)] not in ([3, 1], [2, 1], [1, 1]):
                return None, f"layer {i}'s {kind} projections are not in the expected layout"
    return LeanPlan(model, family, activation), ""


def _rms(x: torch.Tensor, norm: tuple[torch.Tensor, float]) -> torch.Tensor:
    # x [..., n] -> normalised in fp32 and scaled (F.rms_norm is several kernels on CPU anyway).
    weight, eps = norm
    x32 = x.float()
    return x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + eps) * weight


@torch.inference_mode()
def lean_hidden(
    plan: LeanPlan,
    matmuls: Callable[[int, str], Matmul],
    tokens: torch.Tensor,
    cache: RollbackCache,
    skip_attention: Sequence[int] | set[int],
    skip_mlp: Sequence[int] | set[int],
    compute_dtype: torch.dtype,
) -> torch.Tensor:
    """The final hidden states ``[R, hidden]`` (after the final norm) of ``tokens [R]``, row ``r`` at
    its position ``cache.lengths[r]``, with the given sublayers bypassed; every kept attention
    writes each row's K/V at its position, and the cache's rows move on by one.

    Every product runs once over all rows. Where the rows' lengths differ, each attends through a
    mask ``[R, 1, 1, L]`` to its own keys up to its position (within the layer's window); where they
    share one length, to the same last keys with no mask. ``matmuls(layer, name)`` gives the
    products, name in "qkv", "o", "gate_up", "down".
    """
    rows = tokens.shape[0]
    device = tokens.device
    model_dtype = plan.final_norm[0].dtype
    rotary = plan.rotary(compute_dtype)
    common = cache.common_length
    longest = cache.longest + 1
    cache.reserve(longest)
    if common is None:
        where = torch.tensor(cache.lengths, device=device)  # [R] positions
        key_positions = torch.arange(longest, device=device)
        seen = key_positions[None, :] <= where[:, None]  # [R, L]
    masks: dict[int | None, torch.Tensor | None] = {}
    rotations: dict[str | None, tuple[torch.Tensor, torch.Tensor]] = {}
    h = plan.embed(tokens).reshape(rows, plan.hidden_size)  # [R, H], the model's dtype
    for i, (attn, mlp) in enumerate(zip(plan.attention, plan.mlp)):
        if i not in skip_attention:
            if attn.rotary_key not in rotations:
                if common is not None:
                    rotations[attn.rotary_key] = rotary.at(common, attn.rotary_key)  # [d] for every row
                else:
                    rotary.at(longest, attn.rotary_key)  # grows the table to every row's position
                    cos, sin = rotary.tables[attn.rotary_key]
                    rotations[attn.rotary_key] = (cos[where][:, None], sin[where][:, None])  # [R, 1, d]
            if attn.window not in masks:
                if common is not None:
                    masks[attn.window] = None
                else:
                    window = seen if attn.window is None else seen & (where[:, None] - key_positions < attn.window)
                    masks[attn.window] = window[:, None, None, :]  # [R, 1, 1, L]
            cos, sin = rotations[attn.rotary_key]
            qk, value = _rotated_qkv(attn, matmuls, i, h, cos, sin, compute_dtype)  # [R, q + kv, d], [R, kv, d]
            keys, values = cache.layers[i].update(qk[:, attn.q_heads :, None], value[:, :, None])
            first = 0 if common is None or attn.window is None else max(0, common + 1 - attn.window)
            grouped = attn.q_heads != attn.kv_heads
            keys, values = keys[:, :, first:], values[:, :, first:]
            out = _attend(attn, matmuls, i, qk, keys, values, masks[attn.window], compute_dtype, grouped)
            h = h + out.to(model_dtype)
        if i not in skip_mlp:
            h = h + _mlp(mlp, matmuls, i, h, compute_dtype).to(model_dtype)
    cache.advance(1)
    return _rms(h, plan.final_norm).to(model_dtype)


def _post_norm(out: torch.Tensor, norm: tuple[torch.Tensor, float] | None) -> torch.Tensor:
    """A sublayer's output through its own norm where the family has one (Gemma 2/3's sandwich)."""
    return out if norm is None else _rms(out, norm)


def _mlp(
    mlp: _MLP, matmuls: Callable[[int, str], Matmul], index: int, h: torch.Tensor, compute_dtype: torch.dtype
) -> torch.Tensor:
    """One MLP sublayer's output ``[R, H]`` for the residual streams ``h [R, H]``."""
    x = _rms(h, mlp.norm).to(compute_dtype)  # [R, H]
    gate, up = matmuls(index, "gate_up")(x).chunk(2, dim=-1)
    return _post_norm(matmuls(index, "down")(mlp.activation(gate) * up), mlp.post_norm)  # [R, H]


def _rotated_qkv(
    attn: _Attention,
    matmuls: Callable[[int, str], Matmul],
    index: int,
    h: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    compute_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries and keys ``[R, q_heads + kv_heads, d]``, normed and rotated, and values ``[R, kv_heads, d]``
    for the residual streams ``h [R, H]`` (``cos``/``sin``: ``[d]`` for every row, or ``[R, 1, d]``)."""
    q_heads, kv_heads, d = attn.q_heads, attn.kv_heads, attn.head_dim
    x = _rms(h, attn.norm).to(compute_dtype)  # [R, H]
    qkv = matmuls(index, "qkv")(x)  # [R, (q_heads + 2 kv_heads) d]
    qk = qkv[:, : (q_heads + kv_heads) * d].reshape(-1, q_heads + kv_heads, d)  # queries and keys rotate together
    value = qkv[:, (q_heads + kv_heads) * d :].reshape(-1, kv_heads, d)
    if attn.qk_norm is not None:
        qk = _rms(qk, attn.qk_norm).to(compute_dtype)
    return torch.addcmul(qk * cos, qk.roll(d // 2, dims=-1), sin), value


def _attend(
    attn: _Attention,
    matmuls: Callable[[int, str], Matmul],
    index: int,
    qk: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    compute_dtype: torch.dtype,
    grouped: bool,
) -> torch.Tensor:
    """The sublayer's output ``[R, H]``: each row's query in ``qk`` over ``keys``/``values``
    ``[R, kv_heads, L, d]`` (through ``mask [R, 1, 1, L]`` where given), then the output projection.
    ``grouped``: fewer K/V heads than query heads, a plain bool (graph capture makes the head
    counts symbolic)."""
    q_heads, d = attn.q_heads, attn.head_dim
    query = qk[:, :q_heads].unsqueeze(2).to(keys.dtype)  # [R, q_heads, 1, d]
    out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=attn.scaling, enable_gqa=grouped)
    return _post_norm(matmuls(index, "o")(out.reshape(-1, q_heads * d).to(compute_dtype)), attn.post_norm)


def lean_step_function(
    plan: LeanPlan,
    matmuls: Callable[[int, str], Matmul],
    skip_attention: Sequence[int],
    skip_mlp: Sequence[int],
    compute_dtype: torch.dtype,
) -> Callable[..., torch.Tensor]:
    """The lean step for one skip set as a pure function, for graph capture (``torch.compile``):
    ``(tokens [R], position, rotations {layer type: (cos, sin)}, key buffers, value buffers) ->
    hidden [R, H]`` for rows that share one ``position``. It writes each kept layer's K/V into its
    buffer at ``position``; the caller moves the cache on. Everything else it reads is fixed when built."""
    skipped_attention, skipped_mlp = set(skip_attention), set(skip_mlp)
    model_dtype = plan.final_norm[0].dtype
    grouped = [a.q_heads != a.kv_heads for a in plan.attention]  # Python bools, fixed before capture

    def step(
        tokens: torch.Tensor,
        position: int,
        rotations: dict[str | None, tuple[torch.Tensor, torch.Tensor]],
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
    ) -> torch.Tensor:
        h = plan.embed(tokens).reshape(tokens.shape[0], plan.hidden_size)
        for i, (attn, mlp) in enumerate(zip(plan.attention, plan.mlp)):
            if i not in skipped_attention:
                cos, sin = rotations[attn.rotary_key]
                qk, value = _rotated_qkv(attn, matmuls, i, h, cos, sin, compute_dtype)
                keys[i][:, :, position] = qk[:, attn.q_heads :]
                values[i][:, :, position] = value
                first = 0 if attn.window is None else max(0, position + 1 - attn.window)
                seen_keys, seen_values = keys[i][:, :, first : position + 1], values[i][:, :, first : position + 1]
                out = _attend(attn, matmuls, i, qk, seen_keys, seen_values, None, compute_dtype, grouped[i])
                h = h + out.to(model_dtype)
            if i not in skipped_mlp:
                h = h + _mlp(mlp, matmuls, i, h, compute_dtype).to(model_dtype)
        return _rms(h, plan.final_norm).to(model_dtype)

    return step


def step_inputs(
    plan: LeanPlan, position: int, cache: RollbackCache, compute_dtype: torch.dtype
) -> tuple[dict[str | None, tuple[torch.Tensor, torch.Tensor]], list[torch.Tensor], list[torch.Tensor]]:
    """The rotations and K/V buffers ``lean_step_function``'s step reads at ``position`` (the
    buffers grown first where they are full)."""
    rotary = plan.rotary(compute_dtype)
    rotations = {a.rotary_key: rotary.at(position, a.rotary_key) for a in plan.attention}
    cache.reserve(position + 1)
    layers = cache.layers[: len(plan.attention)]
    return rotations, [layer.key_buffer for layer in layers], [layer.value_buffer for layer in layers]
