"""What a search computes before its first trial, cached between runs.

Two entries, JSON files under ``$LAYERSKIP_SEARCH_CACHE`` or ``<model cache>/search``
(``layerskip.hf.models.cache_dir()``), each written atomically:

references-<key>.json  the full model's greedy references (and, once computed, the ranked
                       space's sublayer order), keyed by the model (shape fingerprint and a
                       sample of its weight values), the prompt token ids, reference length,
                       device, dtype, torch and transformers versions;
latency-<key>.json     the measured plain-step and verify-block seconds, keyed by all that, the
                       timing context, block lengths, repeats, torch threads and the machine.

An entry is used only when its stored key equals the run's whole key; one that cannot be read or
does not match is ignored with a warning, rebuilt and replaced. Latency is machine-state
dependent: ``--no-cache`` measures it (and the references) again, and a calibration whose
repeated plain-step timings spread widely (a busy machine) is warned about and never cached.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from layerskip.drafts.costs import DraftCosts
from layerskip.engine.latency import PLAIN_REPEATS, VERIFY_PATH, VERIFY_REPEATS, Latency
from layerskip.errors import LayerskipError
from layerskip.fileio import UnreadableFile, load_json, write_json_atomic
from layerskip.hf import adapters
from layerskip.measure.agreement import Reference
from layerskip.search.log import Log, to_stderr

FORMAT = 1
CACHE_ENV = "LAYERSKIP_SEARCH_CACHE"


def cache_root() -> Path:
    from layerskip.hf.models import cache_dir

    return Path(os.environ.get(CACHE_ENV) or cache_dir() / "search")


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


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
        self.root = Path(root) if root is not None else cache_root()
        self.read = read
        self.enabled = enabled
        self.log = log
        parameter = next(model.parameters())
        import transformers

        self.identity: dict[str, Any] = {
            "format": FORMAT,
            "architecture": adapters.architecture_of(model),
            "fingerprint": adapters.weights_fingerprint(model),
            "weights_sample": adapters.weights_sample_digest(model),
            "device": str(parameter.device),
            "dtype": str(parameter.dtype),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        }
        # Every sublayer of the model, as a cached order must list them (not part of the key: the
        # fingerprint already fixes the layer count).
        self.sublayers = {(i, kind) for i in range(adapters.num_layers(model)) for kind in ("attention", "mlp")}
        self._references_entry: tuple[dict[str, Any], dict[str, Any]] | None = None  # (key, payload)

    # -- files ----------------------------------------------------------------------------------------------------
    def path(self, kind: str, key: dict[str, Any]) -> Path:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
        return self.root / f"{kind}-{digest}.json"

    def _load(self, kind: str, key: dict[str, Any], check: Callable[[dict[str, Any]], None]) -> dict[str, Any] | None:
        path = self.path(kind, key)
        if not (self.enabled and self.read) or not (path.exists() or path.is_symlink()):
            return None
        try:
            # The project's one JSON reader: a FIFO, a link to /dev/zero or deep nesting is refused, never a hang.
            data = load_json(path, "search cache", "it is rebuilt")
            if data.get("key") != json.loads(json.dumps(key)):
                raise ValueError("it was made for other inputs")
            check(data)
        except UnreadableFile as error:
            self.log(f"warning: ignoring damaged search cache {path} ({error.reason}); rebuilding it")
            return None
        except (ValueError, KeyError, TypeError) as error:
            self.log(f"warning: ignoring damaged search cache {path} ({error}); rebuilding it")
            return None
        return data

    def _store(self, kind: str, key: dict[str, Any], payload: dict[str, Any]) -> Path | None:
        if not self.enabled:
            return None
        path = self.path(kind, key)
        try:
            write_json_atomic(path, {"key": key, **payload})
        except (OSError, LayerskipError) as error:  # read-only, or a FIFO in its place: costs time, never the search
            self.log(f"warning: could not write search cache {path} ({error})")
            return None
        return path

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
        device = torch.device(self.identity["device"])
        machine = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
        return {
            **self.identity,
            "kind": "latency",
            "context": list(map(int, context)),
            "blocks": list(blocks),
            "repeats": [PLAIN_REPEATS, VERIFY_REPEATS],
            "verify": VERIFY_PATH,
            "threads": torch.get_num_threads(),
            "host": platform.node(),
            "machine": machine,
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
