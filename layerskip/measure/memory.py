"""Memory a decoding method needs: the loaded model, its draft copies, and what one call adds at its peak.

Every method of a benchmark runs in one process with every draft built up front, so the process's
peak resident memory (``ru_maxrss``) says nothing about any one method: it is the sum of all of
them, and it only grows. What can be told apart per method is

- what the process holds once the model is loaded (before any draft is built),
- the method's own draft copies (int4 / int8 / bf16 weights, a truncated head), counted by bytes,
- the most one call of the method adds over what the process held when the call began: on Linux
  the resident high-water mark (``VmHWM``) is reset just before the call (writing ``5`` to
  ``/proc/self/clear_refs``) and read after it; on a GPU, ``torch.cuda.max_memory_allocated``
  after a reset. Before a CPU call, the C allocator returns the memory it kept from earlier calls
  (``malloc_trim``), or a method would reuse another's freed pages and seem to need nothing.

Their sum is the peak a process running that method alone would reach (``MethodMemory.peak_mb``).
These calls run after the timed ones, untimed, so returning memory never slows a timed call.
"""

from __future__ import annotations

import ctypes
import functools
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")  # proc(5): writing "5" resets the peak resident set size (VmHWM)


def _status_mb(field: str) -> float | None:
    """A ``kB`` field of /proc/self/status in MiB; None where there is no such file (not Linux)."""
    try:
        match = re.search(rf"^{field}:\s+(\d+) kB", STATUS.read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) / 1024 if match else None


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    # The process's own symbols: glibc's malloc_trim where the C library is glibc, else none.
    try:
        return getattr(ctypes.CDLL(None), "malloc_trim", None)
    except OSError:
        return None


def process_memory_mb(device: torch.device) -> float | None:
    """What the process holds now: resident memory on a CPU, allocated memory on a GPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**20
    if (trim := _malloc_trim()) is not None:
        trim(0)  # hand the memory the C allocator keeps from freed blocks back to the system
    return _status_mb("VmRSS")


@torch.inference_mode()
def loaded_model_mb(model: torch.nn.Module) -> float | None:
    """What the process holds with ``model`` loaded: every weight is read once first, because a
    model loaded from a safetensors file maps it and its pages become resident only when touched."""
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.device.type == "cpu" and tensor.numel():
            tensor.reshape(-1)[:: max(1, 4096 // tensor.element_size())].sum()  # one element a page
    return process_memory_mb(next(model.parameters()).device)


def call_growth_mb(call: Callable[[], Any], device: torch.device) -> float | None:
    """The most ``call`` added at its peak over what the process held when it began, in MiB; None
    where this system cannot tell (no /proc, or a reset the kernel refuses)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        call()
        torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - start) / 2**20
    start = process_memory_mb(device)
    if start is None:
        return None
    try:
        CLEAR_REFS.write_text("5")
    except OSError:  # a kernel that does not allow the reset
        return None
    call()
    peak = _status_mb("VmHWM")
    return None if peak is None else max(0.0, peak - start)


@dataclass(frozen=True)
class MethodMemory:
    """One method's memory, MiB: the loaded model's process, its draft copies, one call's peak growth."""

    loaded_mb: float
    draft_mb: float
    call_mb: float

    @property
    def peak_mb(self) -> float:
        return self.loaded_mb + self.draft_mb + self.call_mb

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "peak_mb": self.peak_mb}
