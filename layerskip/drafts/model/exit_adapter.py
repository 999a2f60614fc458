"""A trained exit: maps the residual stream after a shallow layer to what the whole stack would give.

Intermediate layers of an ordinary checkpoint are confidently wrong when read through the final
norm and head (docs/concepts.md#exit-adapters), so a plain early exit drafts badly. An exit
adapter sits at the output of layer ``L`` and is trained by self-distillation (layerskip/distill)
so that ``head(norm(adapter(h_L)))`` matches the full model's next-token distribution. The full
model still verifies every token, so the output does not depend on the adapter at all.

Two kinds:

* ``linear``: ``h + up(down(rmsnorm(h) * g))`` (rank ``rank``; 0 = one full square map). The
  output map starts at zero, so an untrained adapter is exactly the plain early exit.
* ``layer``: a copy of one of the model's own decoder layers (Kangaroo's choice of a
  one-layer adapter, initialised from the model). Its attention keeps K/V in an extra cache
  layer (index ``num_layers``), filled for every committed token.

The artefact is a safetensors file whose metadata holds the model's fingerprint (shapes) and a
digest of a sample of its weights' values, the exit layer, the kind and how it was trained; a
policy points at it by relative path and SHA-256.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from layerskip.errors import LayerskipError
from layerskip.fileio import JsonProblem, parse_json, write_bytes_atomic
from layerskip.hf import adapters

KINDS = ("linear", "layer")
ARTEFACT_FORMAT = "layerskip-exit-adapter"


@dataclass(frozen=True)
class ExitSpec:
    """Where the exit is and what it is made of."""

    layer: int  # the draft runs layers 0..layer, then the adapter, the final norm and the head
    kind: str = "linear"
    rank: int = 64  # linear: rank of the residual map (0 = full square map)
    source_layer: int = -1  # layer: the decoder layer copied (-1: the deepest of the exit layer's kind)

    def validate(self, num_layers: int) -> None:
        if self.kind not in KINDS:
            raise LayerskipError(f"unknown exit adapter kind '{self.kind}'; use one of {', '.join(KINDS)}")
        if not 0 <= self.layer < num_layers - 1:
            raise LayerskipError(
                f"exit layer {self.layer} is out of range for a {num_layers}-layer model (valid 0..{num_layers - 2})"
            )
        if self.rank < 0:
            raise LayerskipError(f"exit adapter rank must be >= 0 (0 = full); got {self.rank}")
        if self.source_layer >= num_layers:
            raise LayerskipError(f"exit adapter source layer {self.source_layer} is out of range (< {num_layers})")


class LinearExit(nn.Module):
    """``h + up(down(rmsnorm(h) * gain))`` over ``[..., hidden]``; zero-initialised output map."""

    def __init__(self, hidden: int, rank: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.gain = nn.Parameter(torch.ones(hidden))
        inner = rank or hidden
        self.down = nn.Linear(hidden, inner, bias=False)
        self.up = nn.Linear(inner, hidden, bias=False)
        nn.init.normal_(self.down.weight, std=hidden**-0.5)
        nn.init.zeros_(self.up.weight)

    def forward(self, hidden: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        x = hidden.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.gain
        return hidden + self.up(self.down(x.to(self.down.weight.dtype))).to(hidden.dtype)


class LayerExit(nn.Module):
    """A decoder layer of the model's own kind, run on the exit layer's output with its arguments."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, hidden: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        return self.layer(hidden, *args, **kwargs)


def _source_layer(model: nn.Module, spec: ExitSpec) -> int:
    if spec.source_layer >= 0:
        return spec.source_layer
    return max(adapters.same_kind_layers(model, spec.layer))


def build_module(model: nn.Module, spec: ExitSpec) -> nn.Module:
    """A fresh adapter for ``model`` (linear: the plain exit; layer: a copy of a model layer)."""
    spec.validate(adapters.num_layers(model))
    parameter = next(model.parameters())
    if spec.kind == "linear":
        hidden = adapters.lm_head(model).weight.shape[1]
        module: nn.Module = LinearExit(hidden, spec.rank)
    else:
        module = LayerExit(adapters.copy_decoder_layer(model, _source_layer(model, spec), adapters.num_layers(model)))
    return module.to(device=parameter.device, dtype=parameter.dtype)


@dataclass
class ExitAdapter:
    """A trained (or fresh) exit for one model: its spec, its module and where it came from."""

    spec: ExitSpec
    module: nn.Module
    fingerprint: str  # adapters.weights_fingerprint of the model it was trained for
    provenance: dict[str, Any] = field(default_factory=dict)
    weights_sample: str = ""  # adapters.weights_sample_digest of that model (files before it have none)

    @classmethod
    def fresh(cls, model: nn.Module, spec: ExitSpec, provenance: dict[str, Any] | None = None) -> ExitAdapter:
        fingerprint, sample = adapters.weights_fingerprint(model), adapters.weights_sample_digest(model)
        return cls(spec, build_module(model, spec), fingerprint, dict(provenance or {}), sample)

    @property
    def uses_cache(self) -> bool:
        """The layer kind attends over earlier tokens: it needs its own cache layer."""
        return self.spec.kind == "layer"

    def to_bytes(self) -> bytes:
        from safetensors.torch import save

        tensors = {name: t.detach().contiguous().cpu() for name, t in self.module.state_dict().items()}
        metadata = {
            "format": ARTEFACT_FORMAT,
            "fingerprint": self.fingerprint,
            "spec": json.dumps(asdict(self.spec)),
            "provenance": json.dumps(self.provenance),
            **({"weights_sample": self.weights_sample} if self.weights_sample else {}),
        }
        return save(tensors, metadata=metadata)

    def save(self, path: str | os.PathLike[str]) -> str:
        """Write the safetensors file atomically; returns its SHA-256 (the policy records it)."""
        payload = self.to_bytes()
        write_bytes_atomic(path, payload)
        return hashlib.sha256(payload).hexdigest()

    @classmethod
    def load(cls, path: str | os.PathLike[str], model: nn.Module, sha256: str = "") -> ExitAdapter:
        """Load for ``model``; one-line errors for a missing or changed file or another model."""
        from safetensors.torch import load

        path = Path(path)
        if not path.is_file():
            raise LayerskipError(f"exit adapter {path} not found; train one with layerskip-train-exit")
        payload = path.read_bytes()
        if sha256 and hashlib.sha256(payload).hexdigest() != sha256:
            raise LayerskipError(
                f"exit adapter {path} has changed since the policy was made (SHA-256 differs); "
                "retrain it or point the policy at the file it was made with"
            )
        try:
            tensors = load(payload)
            metadata = _metadata(payload)
        except Exception as exc:  # safetensors raises its own error type, not exported in every version
            raise LayerskipError(f"exit adapter {path} is not a readable safetensors file ({exc})") from None
        if metadata.get("format") != ARTEFACT_FORMAT:
            raise LayerskipError(f"{path} is not a layerskip exit adapter; train one with layerskip-train-exit")
        fingerprint = adapters.weights_fingerprint(model)
        if metadata.get("fingerprint") != fingerprint:
            raise LayerskipError(
                f"exit adapter {path} was trained for another model (fingerprint {metadata.get('fingerprint')}, "
                f"this model {fingerprint}); train one for this model"
            )
        # Trained on other weights of the same shape, it would still be exact, but draft worse.
        sample = adapters.weights_sample_digest(model)
        if metadata.get("weights_sample", sample) != sample:
            raise LayerskipError(
                f"exit adapter {path} was trained for another model of the same shape (weights differ, as a "
                "fine-tune's do); train one for this model"
            )
        try:
            # The metadata's JSON is read as every JSON the project reads (depth and type checked).
            described = parse_json(metadata.get("spec", "")), parse_json(metadata.get("provenance", "{}"))
        except JsonProblem as problem:
            raise LayerskipError(
                f"exit adapter {path} has damaged metadata ({problem.reason}); train it again with layerskip-train-exit"
            ) from None
        try:
            spec = ExitSpec(**described[0])
            adapter = cls(spec, build_module(model, spec), fingerprint, described[1], sample)
            adapter.module.load_state_dict(tensors, strict=True)
        except (KeyError, TypeError, RuntimeError) as exc:
            raise LayerskipError(f"exit adapter {path} does not fit this model ({str(exc).splitlines()[0]})") from None
        adapter.module.eval().requires_grad_(False)
        return adapter


def _metadata(payload: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors payload (its JSON header)."""
    length = int.from_bytes(payload[:8], "little")
    header = json.loads(payload[8 : 8 + length])
    return dict(header.get("__metadata__") or {})
