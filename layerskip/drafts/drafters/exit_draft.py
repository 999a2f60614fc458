"""The exit draft: layers 0..L, a trained exit adapter, the final norm and the head.

It is a skip draft whose skip sets bypass every layer after ``L`` (and maybe some sublayers
before it), with the adapter applied to layer ``L``'s output. Two things differ from a plain
skip draft, both about the shared cache, and both done for every row of a batch in its one
verify forward (``exit_verify``, which the prepared draft enters around each verify):

* **Reusing the shallow layers' K/V** (``reuse_kv``, LayerSkip's self-speculation). Where layers
  0..L run the model's own weights, a draft forward of a token computes exactly what the verify
  would compute for it in those layers. So the draft also feeds its last token through them and
  hands each token's layer-``L`` output to the verify with its proposal (``Proposal.entry``); where
  every row's proposal carries one, the verify runs only layers L+1..N-1 over the block, entering
  the stack at layer L+1 with them (a row's fillers enter as zeros: no real position attends to
  them). The shallow layers keep the K/V written while drafting at those very positions; the
  usual rollback then cuts everything to each row's accepted length.
* **The layer adapter's own K/V.** A ``layer`` adapter attends over earlier tokens, so it keeps
  K/V in an extra cache layer. Every verified block's layer-``L`` outputs are run through it
  after the verify (one layer over the block, every row at its own positions), so that layer holds
  every committed token.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace

import torch
from torch import nn

from layerskip.drafts.base import DraftRequest, Proposal
from layerskip.drafts.drafters.skip import ChainDraft, SkipDrafter
from layerskip.drafts.model.exit_adapter import ExitAdapter
from layerskip.hf import adapters
from layerskip.hf.cache import RollbackCache
from layerskip.hf.forward import block_hidden


@contextlib.contextmanager
def entering_after_exit(model: nn.Module, layer: int, hidden: torch.Tensor) -> Iterator[None]:
    """Forwards inside the block skip layers 0..``layer`` and start layer ``layer + 1`` from ``hidden [B, q, H]``."""
    shallow = range(layer)
    replacements = adapters.bypass_replacements(model, shallow, shallow)
    replacements.append(adapters.layer_output_replacement(model, layer, _identity, lambda: hidden))
    with adapters.patched_forwards(replacements):
        yield


@contextlib.contextmanager
def capturing_layer_output(model: nn.Module, layer: int, into: list[torch.Tensor]) -> Iterator[None]:
    """Append layer ``layer``'s output ``[B, q, hidden]`` of every forward inside the block to ``into``."""

    def keep(output: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        into.append(output)
        return output

    with adapters.patched_forwards([adapters.layer_output_replacement(model, layer, keep)]):
        yield


def _identity(output: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return output


def fill_adapter_cache(
    model: nn.Module,
    adapter: ExitAdapter,
    block: torch.Tensor,
    hidden: torch.Tensor,
    cache: RollbackCache,
    committed: list[int],
) -> None:
    """Run the layer adapter over ``hidden [B, q, H]`` (layer L's outputs for ``block [B, q]``, row
    ``b`` at positions from ``committed[b]``), writing its K/V into its cache layer; the model's
    layers, which the verify has just filled, are bypassed (they keep what the verify wrote)."""
    count = adapters.num_layers(model)
    layer = adapter.spec.layer
    others = [i for i in range(count) if i != layer]
    replacements = adapters.bypass_replacements(model, others, others)
    replacements.append(adapters.layer_output_replacement(model, layer, adapter.module, lambda: hidden))
    cache.set_lengths(committed)
    with adapters.patched_forwards(replacements):
        block_hidden(model, block, cache)


@contextlib.contextmanager
def exit_verify(
    model: nn.Module,
    adapter: ExitAdapter,
    reuse_kv: bool,
    cache: RollbackCache,
    committed: list[int],
    block: torch.Tensor,
    proposals: tuple[Proposal, ...] = (),
) -> Iterator[None]:
    """Around the verify forward of ``block [B, q]`` (row ``b`` after ``committed[b]`` tokens, its
    ``proposals[b]``; none at a prefill): entering after the exit layer where every row's proposal
    carries its layer-L outputs (``reuse_kv``), else every layer, and a layer adapter's own K/V
    filled after it (see the module docstring)."""
    layer = adapter.spec.layer
    entries = [p.entry for p in proposals]
    if reuse_kv and entries and all(e is not None and e.shape[1] == len(p) + 1 for e, p in zip(entries, proposals)):
        width = block.shape[1]
        rows = [torch.nn.functional.pad(e, (0, 0, 0, width - e.shape[1])) for e in entries if e is not None]
        with entering_after_exit(model, layer, torch.cat(rows)):  # [B, q, H]
            yield
        return  # the draft wrote the adapter's own K/V for these positions as it drafted them
    if not adapter.uses_cache:
        yield
        return
    captured: list[torch.Tensor] = []
    with capturing_layer_output(model, layer, captured):
        yield
    fill_adapter_cache(model, adapter, block, captured[-1], cache, committed)


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

    def draft_chain(self, request: DraftRequest) -> ChainDraft:
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
        if not draft.tokens:
            return draft
        return replace(draft, entry=torch.cat(outputs, dim=1))  # [1, k+1, H]: pending, d1..dk
