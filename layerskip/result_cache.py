"""The one cache of what is measured or computed for a model: JSON files keyed by all it depends on.

``<root>/<kind>-<digest of key>.json`` holds ``{"key": key, ...}``, written atomically. An entry is
used only when its stored key equals the key asked for and it passes its reader's checks; one
that cannot be read (missing, not a regular file, damaged, made for other inputs) is passed by, so
that the result is measured again and written over it: a link in its place is replaced by the
file, never written through. A cache named NAME lives in ``$LAYERSKIP_<NAME>_CACHE``, else in
NAME/ under the model cache (``$LAYERSKIP_CACHE``, default ``~/.cache/layerskip``):
``calibration`` holds what a model costs on this machine (its plain and verify curve, read by both
``auto`` and the search, and ``auto``'s draft costs), ``search`` the search's references.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
import transformers
from torch import nn

from layerskip.errors import LayerskipError
from layerskip.fileio import UnreadableFile, load_json, write_json_atomic
from layerskip.hf import adapters
from layerskip.hf.models import cache_dir

T = TypeVar("T")
Log = Callable[[str], None]


def cache_env(name: str) -> str:
    """The variable that moves the cache named ``name``: ``calibration`` -> ``LAYERSKIP_CALIBRATION_CACHE``."""
    return f"LAYERSKIP_{name.upper()}_CACHE"


def model_key(model: nn.Module) -> dict[str, Any]:
    """What a model's results depend on: its architecture and weights (shape fingerprint and a
    sample of their values), dtype, device, and the torch and transformers versions."""
    parameter = next(model.parameters())
    return {
        "architecture": adapters.architecture_of(model),
        "fingerprint": adapters.weights_fingerprint(model),
        "weights_sample": adapters.weights_sample_digest(model),
        "dtype": str(parameter.dtype),
        "device": str(parameter.device),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


class ResultCache:
    """The entries of one cache. ``what`` names an entry in messages (``search cache``); ``warn``,
    when given, is told of every entry passed by as damaged."""

    def __init__(self, name: str, root: str | os.PathLike[str] | None, what: str, warn: Log | None = None) -> None:
        self.root = Path(root if root is not None else os.environ.get(cache_env(name)) or cache_dir() / name)
        self.what = what
        self.warn = warn

    def path(self, kind: str, key: dict[str, Any]) -> Path:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
        return self.root / f"{kind}-{digest}.json"

    def load(self, kind: str, key: dict[str, Any], read: Callable[[dict[str, Any]], T]) -> T | None:
        """``read`` of the entry for ``key`` (it raises ValueError, KeyError or TypeError on content it
        refuses), or None where there is none it can use."""
        path = self.path(kind, key)
        if not (path.exists() or path.is_symlink()):
            return None
        try:
            # The project's one JSON reader: a FIFO, a link to /dev/zero or deep nesting is refused, never a hang.
            data = load_json(path, self.what, "it is rebuilt")
            if data.get("key") != json.loads(json.dumps(key)):
                raise ValueError("it was made for other inputs")
            return read(data)
        except (LayerskipError, ValueError, KeyError, TypeError) as error:
            if self.warn is not None:
                reason = error.reason if isinstance(error, UnreadableFile) else error
                self.warn(f"warning: ignoring damaged {self.what} {path} ({reason}); rebuilding it")
            return None

    def store(self, kind: str, key: dict[str, Any], payload: dict[str, Any]) -> str | None:
        """Write the entry; what kept it from being written (a read-only cache, a FIFO or device in its
        place, which is left as it is), or None. A result not cached costs time later, never now. A
        link in the entry's place is replaced: what it leads to is never written."""
        path = self.path(kind, key)
        try:
            # owned: a link in the cache is replaced, never written through to what it leads to.
            write_json_atomic(path, {"key": key, **payload}, owned=True)
        except OSError as error:
            return f"could not write {self.what} {path}: {error.strerror}"
        except LayerskipError as error:
            return str(error)
        return None
