"""The model as the draft runs it: bypassed sublayers, kept projections in the draft's precision, its head.

Prepared once per model and precision (quantising weights takes time and memory, like loading a
model), then used for any number of generations and skip sets. Projections that share their
input (Q/K/V, gate/up) are kept as one fused low-precision product.

A one-token draft forward runs the lean step (``hf.lean``) where the architecture has one: the
same maths without HF's module calls, masks and per-projection casts. Everything else (a block
of tokens, an exit adapter, an architecture the lean step does not cover) runs HF's forward
with the model patched inside ``active(attention, mlp)`` and restored after it, so the verify
between two draft runs always sees the unmodified full model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from layerskip.drafts.model.exit_adapter import ExitAdapter
from layerskip.drafts.model.head import DraftHead
from layerskip.drafts.model.precision import FusedProjections, check_precision, importance, trained_weights_precision
from layerskip.hf import adapters
from layerskip.hf.cache import RollbackCache
from layerskip.hf.forward import block_hidden, positions, stack_forward
from layerskip.hf.lean import (
    LeanPlan,
    Matmul,
    lean_hidden,
    lean_plan,
    lean_step_function,
    projection_groups,
    step_inputs,
)

SUBLAYER_KINDS = ("attention", "mlp")
# The text the projections' input moments are read on: seeded random token ids (rows, tokens). The
# channels that carry most of a model's activation do so on any text; the model's own greedy text
# moved int4 agreement by at most 0.02 more (drafts/model/precision.py) and costs its generation.
MOMENT_TEXT = (4, 64)
MOMENT_SEED = 0
# The lean step's product names, per sublayer kind, in the order of ``projection_groups``.
LEAN_PRODUCTS = {"attention": ("qkv", "o"), "mlp": ("gate_up", "down")}


class DraftModel:
    """Runs draft forwards of ``model``: some sublayers bypassed, the rest optionally in lower precision.

    ``keep`` limits which sublayers get low-precision copies (a fixed policy needs only the ones
    it keeps; on-the-fly selection may keep any): ``{(layer, "attention" | "mlp"), ...}``, None = all.
    ``exit`` is a trained exit adapter applied to its layer's output in every draft forward
    (the layers after it are bypassed by the skip sets the caller passes). ``lean=False`` keeps
    every forward on HF's modules (for comparisons). ``compile=True`` runs the lean step through
    ``torch.compile`` (one graph per skip set). Compiling takes minutes and need not beat the
    eager lean step, so nothing turns it on by default: scripts/draft_cost.py --compile measures
    it on the machine at hand (docs/floor.md).
    """

    def __init__(
        self,
        model: nn.Module,
        precision: str = "model",
        keep: Iterable[tuple[int, str]] | None = None,
        exit: ExitAdapter | None = None,
        lean: bool = True,
        compile: bool | str = False,
    ) -> None:
        self.model = model
        self.exit = exit
        # While a list, every draft forward appends the exit layer's output (before the
        # adapter) to it: ``[1, q, hidden]`` per forward (an exit draft that reuses K/V keeps them).
        self.exit_outputs: list[torch.Tensor] | None = None
        self.device = next(model.parameters()).device
        check_precision(precision, self.device)
        self.precision = precision
        # Per kept sublayer, its fused low-precision products (none in the model's own precision).
        self.projections: dict[tuple[int, str], list[tuple[list[nn.Module], FusedProjections]]] = {}
        if precision != "model":
            every = ((i, kind) for i in range(adapters.num_layers(model)) for kind in SUBLAYER_KINDS)
            kept = {key: projection_groups(model, *key) for key in sorted(set(every if keep is None else keep))}
            # int4 fits each group's grid to what the model feeds the projection (precision.importance).
            moments = (
                input_moments(model, [g for groups in kept.values() for g in groups]) if precision == "int4" else {}
            )
            for key, groups in kept.items():
                self.projections[key] = [
                    (
                        modules,
                        FusedProjections(
                            modules,
                            [adapters.projection_weight(m) for m in modules],
                            precision,
                            importance(moments.get(id(modules[0]))),
                        ),
                    )
                    for modules in groups
                ]
            if exit is not None:
                # The adapter's own projections run in low precision too (a layer adapter costs as
                # much as one of the model's layers), int8 where the layers run int4: its trained
                # weights are off int4's grid (see trained_weights_precision).
                adapter_precision = trained_weights_precision(precision)
                self.projections[(-1, "exit")] = [
                    ([module], FusedProjections([module], [adapters.projection_weight(module)], adapter_precision))
                    for module in exit.module.modules()
                    if adapters.projection_weight(module) is not None
                ]
        self._head_bias = adapters.lm_head(model).bias
        self._full_head_copy: torch.Tensor | None = None  # the whole head in the draft dtype, made on first use
        self._replacements_key: tuple[tuple[int, ...], tuple[int, ...]] | None = None
        self._replacements: list[tuple[nn.Module, object]] = []
        # The lean one-token step: not with an exit adapter (it runs inside HF's layer call).
        plan, reason = (None, "an exit adapter runs through the HF forward") if exit is not None else lean_plan(model)
        self.lean: LeanPlan | None = plan if lean else None
        self.lean_reason = reason if lean else "turned off"
        self._lean_products: dict[tuple[int, str], Matmul] = {}
        # True means inductor; a string names another torch.compile backend (the tests use "eager",
        # which captures the same graph without minutes of code generation).
        self.compile = bool(compile) and self.lean is not None
        self._compile_backend = compile if isinstance(compile, str) else "inductor"
        self._compiled: dict[tuple[tuple[int, ...], tuple[int, ...]], object] = {}
        self._skip: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
        self._patched = False  # inside ``active`` with the model patched

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype if self.precision == "model" else torch.bfloat16

    @property
    def nbytes(self) -> int:
        """Memory held by the low-precision copies (0 when the draft uses the model's own weights)."""
        copies = sum(group.nbytes for groups in self.projections.values() for _, group in groups)
        head = 0 if self._full_head_copy is None else self._full_head_copy.numel() * self._full_head_copy.element_size()
        return copies + head

    def head(self, rows: torch.Tensor | None, growth: int = 0) -> DraftHead:
        """A head over ``rows`` (None = every row) in the draft's dtype, with room to grow by ``growth`` rows."""
        weight = adapters.lm_head(self.model).weight
        if self.precision != "model" and rows is None:  # a truncated head gathers its rows and casts them itself
            if self._full_head_copy is None:
                self._full_head_copy = weight.detach().to(self.dtype)
            weight = self._full_head_copy
        softcap = adapters.final_logit_softcap(self.model)
        return DraftHead(weight, self._head_bias, softcap, rows, growth, dtype=self.dtype)

    def replacements(self, attention: Iterable[int], mlp: Iterable[int]) -> list[tuple[nn.Module, object]]:
        """Forward replacements for one draft run (cached for the last skip set)."""
        key = (tuple(sorted(set(attention))), tuple(sorted(set(mlp))))
        if key != self._replacements_key:
            bypassed = adapters.bypass_replacements(self.model, *key)
            skipped = {(i, "attention") for i in key[0]} | {(i, "mlp") for i in key[1]}
            low = [
                pair
                for sub, groups in self.projections.items()
                if sub not in skipped
                for _, group in groups
                for pair in group.replacements()
            ]
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

    @property
    def step_kind(self) -> str:
        """How a one-token draft step runs: "lean", or "hf (why not lean)"."""
        return "lean" if self.lean is not None else f"hf ({self.lean_reason})"

    @contextlib.contextmanager
    def active(self, attention: Iterable[int], mlp: Iterable[int]) -> Iterator[None]:
        """Draft forwards inside the block bypass these sublayers (the model is restored after it)."""
        previous, self._skip = self._skip, (tuple(sorted(set(attention))), tuple(sorted(set(mlp))))
        try:
            if self.lean is not None:
                yield  # HF's forward is patched per call, only when a call needs it
            else:
                with self._patches():
                    yield
        finally:
            self._skip = previous

    @contextlib.contextmanager
    def _patches(self) -> Iterator[None]:
        if self._patched:
            yield
            return
        self._patched = True
        try:
            with adapters.patched_forwards(self.replacements(*self._skip)):
                yield
        finally:
            self._patched = False

    def hidden(self, input_ids: torch.Tensor, cache: RollbackCache | None) -> torch.Tensor:
        """The decoder stack's final hidden states ``[B, q, hidden]`` of ``input_ids [B, q]``, row
        ``b`` after the cache's ``lengths[b]`` tokens (no cache: from position 0); the cache's rows
        move on by ``q`` (call inside ``active``). One token per row runs the lean step where the
        model has one (compiled where asked, for rows at one length)."""
        if self.lean is not None and cache is not None and input_ids.shape[1] == 1:
            attention, mlp = self._skip
            if self.compile and cache.common_length is not None:
                return self._compiled_step(input_ids[:, 0], cache)[:, None]
            hidden = lean_hidden(self.lean, self._product, input_ids[:, 0], cache, attention, mlp, self.dtype)
            return hidden[:, None]  # [B, 1, H]
        with self._patches():
            if cache is None:
                where = positions(0, input_ids.shape[1], input_ids.device).expand_as(input_ids)
                return stack_forward(self.model, input_ids, None, where)
            return block_hidden(self.model, input_ids, cache)

    def _compiled_step(self, tokens: torch.Tensor, cache: RollbackCache) -> torch.Tensor:
        attention, mlp = self._skip
        step = self._compiled.get(self._skip)
        if step is None:
            function = lean_step_function(self.lean, self._product, attention, mlp, self.dtype)
            step = self._compiled[self._skip] = torch.compile(
                function, backend=self._compile_backend, dynamic=True, fullgraph=True
            )
        position = cache.longest
        rotations, keys, values = step_inputs(self.lean, position, cache, self.dtype)
        hidden = step(tokens, position, rotations, keys, values)  # [B, H]
        cache.advance(1)
        return hidden

    def _product(self, layer: int, name: str) -> Matmul:
        """The lean step's product ``name`` of ``layer``: a fused low-precision copy, or the model's own weights."""
        key = (layer, name)
        product = self._lean_products.get(key)
        if product is None:
            kind = "attention" if name in LEAN_PRODUCTS["attention"] else "mlp"
            index = LEAN_PRODUCTS[kind].index(name)
            if (layer, kind) in self.projections:
                product = self.projections[(layer, kind)][index][1].matmul
            elif self.precision == "model":
                product = _own_weights(projection_groups(self.model, layer, kind)[index])
            else:
                raise RuntimeError(f"layer {layer}'s {kind} was not kept by this draft model; it cannot run it")
            self._lean_products[key] = product
        return product

    def logits(self, input_ids: torch.Tensor, cache: RollbackCache, head: DraftHead) -> torch.Tensor:
        """The draft's logits for each row's last position, ``[B, n]`` over the head's rows (inside ``active``)."""
        return head(self.hidden(input_ids, cache)[:, -1])


def _own_weights(modules: list[nn.Module]) -> Matmul:
    """The product of a group from the model's own weights (no copy): one linear per member."""
    weights = [adapters.projection_weight(m) for m in modules]
    if len(weights) == 1:
        weight, bias = weights[0]
        return lambda x: nn.functional.linear(x, weight, bias)
    return lambda x: torch.cat([nn.functional.linear(x, w, b) for w, b in weights], dim=-1)


@torch.inference_mode()
def input_moments(model: nn.Module, groups: list[list[nn.Module]]) -> dict[int, torch.Tensor]:
    """Each group's input's mean square per channel ``[in]``, by ``id`` of the group's first
    module (the members share the input), over one forward of ``MOMENT_TEXT``; the hooks are
    removed again whatever happens."""
    sums: dict[int, tuple[torch.Tensor, int]] = {}

    def hook(module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        given = args[0] if args else next(iter(kwargs.values()), None)  # the input, however passed
        if not isinstance(given, torch.Tensor):
            return
        x = given.detach().float().reshape(-1, given.shape[-1])  # [tokens, in]
        total, count = sums.get(id(module), (0.0, 0))
        sums[id(module)] = (total + (x * x).sum(0), count + x.shape[0])

    device = next(model.parameters()).device
    rows, tokens = MOMENT_TEXT
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (rows, tokens), generator=torch.Generator().manual_seed(MOMENT_SEED)).to(device)
    handles = [modules[0].register_forward_pre_hook(hook, with_kwargs=True) for modules in groups]
    try:
        stack_forward(model, ids, None, positions(0, tokens, device).expand_as(ids))
    finally:
        for handle in handles:
            handle.remove()
    return {key: total / max(count, 1) for key, (total, count) in sums.items()}
