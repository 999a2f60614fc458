"""The exit draft: layers 0..L, a trained exit adapter, the final norm and the head.

It is a skip draft whose skip sets bypass every layer after ``L`` (and maybe some sublayers
before it), with the adapter applied to layer ``L``'s output. Two things differ from a plain
skip draft, both about the shared cache:

* **Reusing the shallow layers' K/V** (``reuse_kv``, LayerSkip's self-speculation). Where layers
  0..L run the model's own weights, a draft forward of a token computes exactly what the verify
  would compute for it in those layers. So the draft also feeds its last token through them,
  keeps each token's layer-``L`` output, and the verify runs only layers L+1..N-1 over the
  block, entering the stack at layer L+1 with those hidden states. The shallow layers keep the
  K/V written while drafting at those very positions (the cache's rows share one length across
  layers); the usual rollback then cuts everything to the accepted length.
* **The layer adapter's own K/V.** A ``layer`` adapter attends over earlier tokens, so it keeps
  K/V in an extra cache layer. Every verified block's layer-``L`` outputs are run through it
  after the verify (one layer over the block), so that layer holds every committed token.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from layerskip.drafts.base import DraftRequest
from layerskip.drafts.drafters.skip import ChainDraft, SkipDrafter
from layerskip.drafts.model.exit_adapter import ExitAdapter
from layerskip.hf import adapters
from layerskip.hf.cache import RollbackCache
from layerskip.hf.forward import positions, stack_forward


@contextlib.contextmanager
def entering_after_exit(model: nn.Module, layer: int, hidden: torch.Tensor) -> Iterator[None]:
    """Forwards inside the block skip layers 0..``layer`` and start layer ``layer + 1`` from ``hidden``."""
    shallow = range(layer)
    replacements = adapters.bypass_replacements(model, shallow, shallow)
    replacements.append(adapters.layer_output_replacement(model, layer, _identity, lambda: hidden))
    with adapters.patched_forwards(replacements):
        yield


@contextlib.contextmanager
def capturing_layer_output(model: nn.Module, layer: int, into: list[torch.Tensor]) -> Iterator[None]:
    """Append layer ``layer``'s output ``[1, q, hidden]`` of every forward inside the block to ``into``."""

    def keep(output: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        into.append(output)
        return output

    with adapters.patched_forwards([adapters.layer_output_replacement(model, layer, keep)]):
        yield


def _identity(output: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return output


def fill_adapter_cache(
    model: nn.Module, adapter: ExitAdapter, block: torch.Tensor, hidden: torch.Tensor, cache: RollbackCache, start: int
) -> None:
    """Run the layer adapter over ``hidden [1, q, H]`` (layer L's outputs for ``block [1, q]`` at
    positions start..start+q-1), writing its K/V into its cache layer; the model's layers, which
    the verify has just filled to start+q, are bypassed (they keep what the verify wrote)."""
    count = adapters.num_layers(model)
    layer = adapter.spec.layer
    others = [i for i in range(count) if i != layer]
    replacements = adapters.bypass_replacements(model, others, others)
    replacements.append(adapters.layer_output_replacement(model, layer, adapter.module, lambda: hidden))
    cache.rollback(start)
    with adapters.patched_forwards(replacements):
        stack_forward(model, block, cache, positions(start, block.shape[1], block.device))


class ExitDrafter(SkipDrafter):
    """A skip drafter whose draft model carries an exit adapter (see the module docstring)."""

    def __init__(self, *args: object, reuse_kv: bool = False, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        adapter = self.draft_model.exit
        assert adapter is not None, "an exit drafter needs a draft model with an exit adapter"
        self.adapter = adapter
        self.reuse_kv = reuse_kv
        count = adapters.num_layers(self.draft_model.model)
        self.deep_layers = tuple(range(adapter.spec.layer + 1, count))  # always bypassed (on-the-fly keeps them)
        self._block_hidden: torch.Tensor | None = None  # [1, k+1, H] of the last draft (reuse_kv)
        self._start = 0  # where that block starts

    def draft_chain(self, request: DraftRequest) -> ChainDraft:
        self._block_hidden = None
        if not self.reuse_kv:
            return super().draft_chain(request)
        outputs: list[torch.Tensor] = []
        self.draft_model.exit_outputs = outputs
        try:
            draft = super().draft_chain(request)
            if draft.tokens:
                # The last drafted token has not been through layers 0..L yet: the verify needs
                # its K/V and its layer-L output too. Its head is not needed.
                last = torch.tensor([[draft.tokens[-1]]], device=request.device)
                with self.draft_model.active(self.attention, self.mlp):
                    self.draft_model.hidden(last, request.cache)
        finally:
            self.draft_model.exit_outputs = None
        if draft.tokens:
            self._block_hidden = torch.cat(outputs, dim=1)  # [1, k+1, H]: pending, d1..dk
            self._start = request.position
        return draft

    @contextlib.contextmanager
    def around_verify(self, cache: RollbackCache, start: int, block: torch.Tensor) -> Iterator[None]:
        model = self.draft_model.model
        layer = self.adapter.spec.layer
        hidden = self._block_hidden
        self._block_hidden = None
        if hidden is not None and start == self._start and hidden.shape[1] == block.shape[1]:
            # The shallow layers keep the K/V the draft wrote at these very positions.
            with entering_after_exit(model, layer, hidden):
                yield
            return
        if not self.adapter.uses_cache:
            yield
            return
        captured: list[torch.Tensor] = []
        with capturing_layer_output(model, layer, captured):
            yield
        fill_adapter_cache(model, self.adapter, block, captured[-1], cache, start)
