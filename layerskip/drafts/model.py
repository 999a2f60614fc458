"""The model as the draft runs it: bypassed sublayers, kept projections in the draft's precision, its head.

Prepared once per model and precision (quantising weights takes time and memory, like loading a
model), then used for any number of generations and skip sets. ``active(attention, mlp)``
patches the model for one draft run and restores it on exit, so the verify between two draft
runs always sees the unmodified full model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from layerskip.drafts.exit_adapter import ExitAdapter
from layerskip.drafts.head import DraftHead
from layerskip.drafts.precision import LowPrecisionProjection, check_precision, trained_weights_precision
from layerskip.hf import adapters
from layerskip.hf.cache import RollbackCache
from layerskip.hf.forward import positions

SUBLAYER_KINDS = ("attention", "mlp")


class DraftModel:
    """Runs draft forwards of ``model``: some sublayers bypassed, the rest optionally in lower precision.

    ``keep`` limits which sublayers get low-precision copies (a fixed policy needs only the ones
    it keeps; on-the-fly selection may keep any): ``{(layer, "attention" | "mlp"), ...}``, None = all.
    ``exit`` is a trained exit adapter applied to its layer's output in every draft forward
    (the layers after it are bypassed by the skip sets the caller passes).
    """

    def __init__(
        self,
        model: nn.Module,
        precision: str = "model",
        keep: Iterable[tuple[int, str]] | None = None,
        exit: ExitAdapter | None = None,
    ) -> None:
        self.model = model
        self.exit = exit
        # While a list, every draft forward appends the exit layer's output (before the
        # adapter) to it: ``[1, q, hidden]`` per forward (an exit draft that reuses K/V keeps them).
        self.exit_outputs: list[torch.Tensor] | None = None
        self.device = next(model.parameters()).device
        check_precision(precision, self.device)
        self.precision = precision
        self.projections: dict[tuple[int, str], list[tuple[nn.Module, LowPrecisionProjection]]] = {}
        if precision != "model":
            wanted = (
                {(i, kind) for i in range(adapters.num_layers(model)) for kind in SUBLAYER_KINDS}
                if keep is None
                else set(keep)
            )
            for index, kind in sorted(wanted):
                self.projections[(index, kind)] = [
                    (module, LowPrecisionProjection(*adapters.projection_weight(module), precision))
                    for module in adapters.sublayer_projections(model, index, kind)
                ]
            if exit is not None:
                # The adapter's own projections run in low precision too (a layer adapter costs as
                # much as one of the model's layers), int8 where the layers run int4: its trained
                # weights are off int4's grid (see trained_weights_precision).
                adapter_precision = trained_weights_precision(precision)
                self.projections[(-1, "exit")] = [
                    (module, LowPrecisionProjection(*adapters.projection_weight(module), adapter_precision))
                    for module in exit.module.modules()
                    if adapters.projection_weight(module) is not None
                ]
        head = adapters.lm_head(model)
        self._head_bias = head.bias
        self._full_head_copy: torch.Tensor | None = None  # the whole head in the draft dtype, made on first use
        self._replacements_key: tuple[tuple[int, ...], tuple[int, ...]] | None = None
        self._replacements: list[tuple[nn.Module, object]] = []

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype if self.precision == "model" else torch.bfloat16

    @property
    def nbytes(self) -> int:
        """Memory held by the low-precision copies (0 when the draft uses the model's own weights)."""
        copies = sum(p.nbytes for pairs in self.projections.values() for _, p in pairs)
        head = 0 if self._full_head_copy is None else self._full_head_copy.numel() * self._full_head_copy.element_size()
        return copies + head

    def _head_weight(self, truncated: bool) -> torch.Tensor:
        weight = adapters.lm_head(self.model).weight
        if self.precision == "model" or truncated:
            return weight  # a truncated head gathers its rows and casts them itself
        if self._full_head_copy is None:
            self._full_head_copy = weight.detach().to(self.dtype)
        return self._full_head_copy

    def head(self, rows: torch.Tensor | None, growth: int = 0) -> DraftHead:
        """A head over ``rows`` (None = every row) in the draft's dtype, with room to grow by ``growth`` rows."""
        truncated = rows is not None
        return DraftHead(
            self._head_weight(truncated),
            self._head_bias,
            adapters.final_logit_softcap(self.model),
            rows,
            growth,
            dtype=self.dtype,
        )

    def replacements(self, attention: Iterable[int], mlp: Iterable[int]) -> list[tuple[nn.Module, object]]:
        """Forward replacements for one draft run (cached for the last skip set)."""
        key = (tuple(sorted(set(attention))), tuple(sorted(set(mlp))))
        if key != self._replacements_key:
            bypassed = adapters.bypass_replacements(self.model, *key)
            skipped = {(i, "attention") for i in key[0]} | {(i, "mlp") for i in key[1]}
            low = [pair for sub, pairs in self.projections.items() if sub not in skipped for pair in pairs]
            exit_layer = [] if self.exit is None else [self._exit_replacement()]
            self._replacements_key, self._replacements = key, bypassed + low + exit_layer
        return self._replacements

    def _exit_replacement(self) -> tuple[nn.Module, object]:
        adapter = self.exit
        assert adapter is not None

        def through_adapter(output: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
            if self.exit_outputs is not None:
                self.exit_outputs.append(output)
            return adapter.module(output, *args, **kwargs)

        return adapters.layer_output_replacement(self.model, adapter.spec.layer, through_adapter)

    @contextlib.contextmanager
    def active(self, attention: Iterable[int], mlp: Iterable[int]) -> Iterator[None]:
        with adapters.patched_forwards(self.replacements(attention, mlp)):
            yield

    def hidden(self, input_ids: torch.Tensor, cache: RollbackCache | None, start: int) -> torch.Tensor:
        """The decoder stack's final hidden states ``[1, q, hidden]`` (call inside ``active``)."""
        where = positions(start, input_ids.shape[1], input_ids.device)
        return adapters.stack_hidden(self.model, input_ids, cache, where)

    def logits(self, input_ids: torch.Tensor, cache: RollbackCache, start: int, head: DraftHead) -> torch.Tensor:
        """The draft's logits for the last input position, ``[n]`` over the head's rows (inside ``active``)."""
        return head(self.hidden(input_ids, cache, start)[0, -1])
