"""What a search computes before its first trial, cached between runs.

Two entries in the ``search`` result cache (``layerskip.engine.result_cache``, auto's calibration's
mechanism: JSON files under ``$LAYERSKIP_SEARCH_CACHE`` or ``<model cache>/search``, each written
atomically):

references-<key>.json  the full model's greedy references (and, once computed, the ranked
                       space's sublayer order), keyed by the model (shape fingerprint and a
                       sample of its weight values), the prompt token ids, reference length,
                       device, dtype, torch and transformers versions;
latency-<key>.json     the measured plain-step and verify-block seconds, keyed by all that, the
                       timing context, block lengths, repeats, torch threads and the machine
                       record (``layerskip.machine.this_machine``).

An entry is used only when its stored key equals the run's whole key; one that cannot be read or
does not match is ignored with a warning, rebuilt and replaced. Latency is machine-state
dependent: ``--no-cache`` measures it (and the references) again, and a calibration whose
repeated plain-step timings spread widely (a busy machine) is warned about and never cached.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from layerskip.drafts.costs import DraftCosts
from layerskip.engine.latency import PLAIN_REPEATS, VERIFY_PATH, VERIFY_REPEATS, Latency
from layerskip.engine.result_cache import ResultCache, cache_env, model_key
from layerskip.hf import adapters
from layerskip.machine import this_machine
from layerskip.measure.agreement import Reference
from layerskip.search.log import Log, to_stderr

FORMAT = 1
CACHE = "search"  # the result cache that holds a search's references and latency
CACHE_ENV = cache_env(CACHE)


class CalibrationCache:
    """The references, sublayer order and latency of one model on this device, cached on disk.

    ``read=False`` (``--no-cache``) measures everything again; fresh results still replace the
    cached ones. ``enabled=False`` neither reads nor writes.
    """

    def __init__(
        self,
        model: nn.Module,
        root: str | os.PathLike[str] | None = None,
        read: bool = True,
        enabled: bool = True,
        log: Log = to_stderr,
    ) -> None:
        self.files = ResultCache(CACHE, root, "search cache", log)
        self.root = self.files.root
        self.read = read
        self.enabled = enabled
        self.log = log
        self.identity: dict[str, Any] = {"format": FORMAT, **model_key(model)}
        # Every sublayer of the model, as a cached order must list them (not part of the key: the
        # fingerprint already fixes the layer count).
        self.sublayers = {(i, kind) for i in range(adapters.num_layers(model)) for kind in ("attention", "mlp")}
        self._references_entry: tuple[dict[str, Any], dict[str, Any]] | None = None  # (key, payload)

    # -- files ----------------------------------------------------------------------------------------------------
    def path(self, kind: str, key: dict[str, Any]) -> Path:
        return self.files.path(kind, key)

    def _load(self, kind: str, key: dict[str, Any], check: Callable[[dict[str, Any]], None]) -> dict[str, Any] | None:
        if not (self.enabled and self.read):
            return None

        def checked(data: dict[str, Any]) -> dict[str, Any]:
            check(data)
            return data

        return self.files.load(kind, key, checked)

    def _store(self, kind: str, key: dict[str, Any], payload: dict[str, Any]) -> None:
        problem = self.files.store(kind, key, payload) if self.enabled else None
        if problem is not None:  # read-only, or a FIFO in its place: costs time, never the search
            self.log(f"warning: {problem}")

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

        def check(data: dict[str, Any]) -> None:
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

        data = self._load("references", key, check)
        if data is None:
            return None
        self._references_entry = (key, data)
        self.log(f"using cached references from {self.path('references', key)}")
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
    def _latency_key(self, context: Sequence[int], blocks: Sequence[int]) -> dict[str, Any]:
        return {
            **self.identity,
            "kind": "latency",
            "context": list(map(int, context)),
            "blocks": list(blocks),
            "repeats": [PLAIN_REPEATS, VERIFY_REPEATS],
            "verify": VERIFY_PATH,
            "threads": torch.get_num_threads(),
            "host": platform.node(),
            "machine": this_machine(self.identity["device"]).to_dict(),
        }

    def latency(self, context: Sequence[int], blocks: Sequence[int]) -> Latency | None:
        key = self._latency_key(context, blocks)

        def check(data: dict[str, Any]) -> None:
            # The checks a cached calibration of auto gets: finite positive seconds, exactly these blocks.
            DraftCosts.from_dict(
                {"plain_step": data["plain_step_seconds"], "verify": data["verify_seconds"], "draft_step": {"0": 1.0}},
                blocks=[1, *blocks],
            )
            if not all(isinstance(t, (int, float)) for t in data.get("plain_timings", [])):
                raise ValueError("plain timings are not numbers")

        data = self._load("latency", key, check)
        if data is None:
            return None
        path = self.path("latency", key)
        self.log(
            f"using cached calibration (latency measured {data.get('measured_at', '?')}) from {path}; "
            "--no-cache measures it again"
        )
        return Latency(
            float(data["plain_step_seconds"]),
            {int(b): float(s) for b, s in data["verify_seconds"].items()},
            [float(t) for t in data.get("plain_timings", [])],
            None,
            str(data.get("measured_at", "")),
            str(path),
        )

    def store_latency(self, context: Sequence[int], blocks: Sequence[int], latency: Latency) -> None:
        if latency.warning is not None:
            return  # measured on a busy machine: used by this run only
        payload = {
            "plain_step_seconds": latency.plain_step_seconds,
            "verify_seconds": {str(b): s for b, s in latency.verify_seconds.items()},
            "plain_timings": latency.plain_timings,
            "measured_at": latency.measured_at,
        }
        self._store("latency", self._latency_key(context, blocks), payload)
