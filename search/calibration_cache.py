"""What a search computes before its first trial, cached between runs (``layerskip.result_cache``:
JSON files, each written atomically).

references-<key>.json  in the ``search`` cache (``$LAYERSKIP_SEARCH_CACHE`` or ``<model
                       cache>/search``): the full model's greedy references (and, once computed,
                       the ranked space's sublayer order), keyed by the model (shape fingerprint
                       and a sample of its weight values), the prompt token ids, reference length,
                       device, dtype, torch and transformers versions;
latency-<key>.json     in the ``calibration`` cache: the plain-step and verify-block seconds
                       ``auto`` prices its drafts with too, keyed by the model and the machine
                       (``layerskip.engine.calibration.machine_latency``).

An entry is used only when its stored key equals the run's whole key; one that cannot be read or
does not match is ignored with a warning, rebuilt and replaced. Latency is machine-state
dependent: ``--no-cache`` measures it (and the references) again, and a calibration whose
repeated plain-step timings spread widely (a busy machine) is warned about and never cached.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from layerskip.engine.calibration import machine_latency
from layerskip.engine.latency import Latency
from layerskip.hf import adapters
from layerskip.measure.agreement import Reference
from layerskip.result_cache import ResultCache, cache_env, model_key
from layerskip.search.log import to_stderr

FORMAT = 1
CACHE = "search"  # the result cache that holds a search's references
CACHE_ENV = cache_env(CACHE)


class CalibrationCache:
    """The references, sublayer order and latency of one model on this device, cached on disk.

    ``read=False`` (``--no-cache``) measures everything again; fresh results still replace the
    cached ones.
    """

    def __init__(self, model: nn.Module, read: bool = True) -> None:
        self.model = model
        self.files = ResultCache(CACHE, None, "search cache", to_stderr)
        self.read = read
        self.identity: dict[str, Any] = {"format": FORMAT, **model_key(model)}
        # Every sublayer of the model, as a cached order must list them (not part of the key: the
        # fingerprint already fixes the layer count).
        self.sublayers = {(i, kind) for i in range(adapters.num_layers(model)) for kind in ("attention", "mlp")}
        self._references_entry: tuple[dict[str, Any], dict[str, Any]] | None = None  # (key, payload)

    # -- files ----------------------------------------------------------------------------------------------------
    def _store(self, kind: str, key: dict[str, Any], payload: dict[str, Any]) -> None:
        problem = self.files.store(kind, key, payload)
        if problem is not None:  # read-only, or a FIFO in its place: costs time, never the search
            to_stderr(f"warning: {problem}")

    # -- references -----------------------------------------------------------------------------------------------
    def _references_key(self, prompts: Sequence[Sequence[int]], reference_tokens: int) -> dict[str, Any]:
        return {
            **self.identity,
            "kind": "references",
            "prompts": [list(map(int, p)) for p in prompts],
            "reference_tokens": reference_tokens,
        }

    def references(self, prompts: Sequence[Sequence[int]], reference_tokens: int) -> list[Reference] | None:
        key = self._references_key(prompts, reference_tokens)

        def checked(data: dict[str, Any]) -> dict[str, Any]:
            refs = data["references"]
            if len(refs) != len(prompts):
                raise ValueError(f"{len(refs)} references for {len(prompts)} prompts")
            for (prompt, continuation), expected in zip(refs, prompts):
                if list(prompt) != list(expected) or len(continuation) != reference_tokens:
                    raise ValueError("a reference does not match its prompt")
                if not all(isinstance(t, int) for t in continuation):
                    raise ValueError("a reference holds a non-integer token")
            order = data.get("sublayer_order")
            if order is not None:
                self._check_order(order)
            return data

        data = self.files.load("references", key, checked) if self.read else None
        if data is None:
            return None
        self._references_entry = (key, data)
        to_stderr(f"using cached references from {self.files.path('references', key)}")
        return [Reference(tuple(prompt), tuple(continuation)) for prompt, continuation in data["references"]]

    def _check_order(self, order: Any) -> None:
        """A cached sublayer order lists each of this model's sublayers once (a hand-edited or damaged
        one naming layer 999 would make every trial fail)."""
        items = [tuple(item) if isinstance(item, list) and len(item) == 2 else None for item in order]
        if not all(item is not None and isinstance(item[0], int) and not isinstance(item[0], bool) for item in items):
            raise ValueError("its sublayer order holds an entry that is not [layer, kind]")
        strange = [list(item) for item in items if item not in self.sublayers]
        if strange:
            raise ValueError(f"its sublayer order names {strange[0]}, not a sublayer of this model")
        if len(items) != len(self.sublayers) or set(items) != self.sublayers:
            raise ValueError(f"its sublayer order does not list this model's {len(self.sublayers)} sublayers once each")

    def store_references(
        self, prompts: Sequence[Sequence[int]], reference_tokens: int, references: Sequence[Reference]
    ) -> None:
        key = self._references_key(prompts, reference_tokens)
        payload: dict[str, Any] = {"references": [[list(r.prompt), list(r.continuation)] for r in references]}
        self._references_entry = (key, payload)
        self._store("references", key, payload)

    def sublayer_order(self) -> list[tuple[int, str]] | None:
        """The cached order for the references last loaded or stored, if it was computed."""
        if self._references_entry is None:
            return None
        order = self._references_entry[1].get("sublayer_order")
        return None if order is None else [(int(i), str(kind)) for i, kind in order]

    def store_sublayer_order(self, order: Sequence[tuple[int, str]]) -> None:
        if self._references_entry is None:
            return
        key, payload = self._references_entry
        payload = {k: v for k, v in payload.items() if k != "key"}
        payload["sublayer_order"] = [[i, kind] for i, kind in order]
        self._references_entry = (key, payload)
        self._store("references", key, payload)

    # -- latency --------------------------------------------------------------------------------------------------
    def latency(self, blocks: Sequence[int], progress: bool) -> Latency:
        """The plain step and verify curve over ``blocks`` at least: ``auto``'s, measured once per
        model and machine (``machine_latency``), measured again with ``read=False``."""
        latency = machine_latency(self.model, blocks, read=self.read, progress=progress, warn=to_stderr)
        if latency.cached_from is not None:
            to_stderr(
                f"using cached calibration (latency measured {latency.measured_at or '?'}) from "
                f"{latency.cached_from}; --no-cache measures it again"
            )
        return latency
