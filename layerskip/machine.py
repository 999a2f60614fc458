"""The machine a figure was measured on: device kind, CPU model and the ISA flags our kernels use.

A policy's speedup belongs to the machine it was tuned on: the int4 draft's cost, the bf16 head
and the verify's cost per block length all follow the CPU's vector units, so a policy tuned on
one CPU can lose much of its speedup on another. So the search and ``generate --save-policy``
record ``Machine.to_dict()`` in a policy's provenance, the benchmark records it in its
environment, and ``generate``/``bench`` compare it with the machine at hand.

On Linux the CPU is read from ``/proc/cpuinfo`` (``lscpu``'s "Model name" and flags); elsewhere
``platform.processor()`` names it and no flags are known. ``code_version`` names the code beside
the machine: the git commit of the checkout the package runs from, and whether it had changes.
"""

from __future__ import annotations

import os
import platform
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

CPUINFO = Path("/proc/cpuinfo")
# The checkout the package runs from: its parent holds ``layerskip/`` (a package installed elsewhere is no checkout).
SOURCE_ROOT = Path(__file__).resolve().parents[1]
GIT_TIMEOUT_S = 5.0
# Flags that decide which kernels run fast here: AVX2/FMA (fp32 and int4 matmuls), AVX-512 and
# its VNNI/BF16 extensions, AMX tiles (bf16 and int8 matmuls), and their ARM counterparts.
KERNEL_FLAGS = tuple(
    "fma f16c avx2 avx_vnni avx512f avx512bw avx512_vnni avx512_bf16 avx512_fp16 amx_tile amx_bf16 amx_int8 amx_fp16 "
    "asimd asimddp sve sve2 bf16 i8mm".split()
)


@dataclass(frozen=True)
class Machine:
    device: str  # "cpu", "cuda", ...
    device_name: str  # the accelerator's name; on CPU the CPU model
    cpu_model: str
    cpu_flags: tuple[str, ...]  # the KERNEL_FLAGS this CPU has, in KERNEL_FLAGS order
    cores: int = 0  # CPUs this process may run on (informative: not compared)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "cpu_flags": list(self.cpu_flags)}

    @classmethod
    def from_dict(cls, data: Any) -> Machine | None:
        """The machine a provenance records, or None where it records none (a file older than
        the field, or one edited by hand into another shape)."""
        if not isinstance(data, dict) or not isinstance(data.get("cpu_model"), str):
            return None
        flags = data.get("cpu_flags", [])
        cores = data.get("cores", 0)
        return cls(
            device=str(data.get("device", "cpu")),
            device_name=str(data.get("device_name", data["cpu_model"])),
            cpu_model=data["cpu_model"],
            cpu_flags=tuple(str(f) for f in flags) if isinstance(flags, list) else (),
            cores=cores if isinstance(cores, int) else 0,
        )

    def describe(self) -> str:
        """``AMD EPYC (fma, avx2, avx512f, avx512_bf16)``; a GPU by its name."""
        if self.device != "cpu":
            return f"{self.device} {self.device_name}"
        return f"{self.cpu_model} ({', '.join(self.cpu_flags) or 'no known vector flags'})"

    def differences(self, other: Machine) -> list[str]:
        """What makes ``other`` (the machine at hand) another machine than this one (the tuned-on
        one), as short phrases; empty when they are the same kind of machine."""
        if self.device != other.device:
            return [f"tuned on {self.describe()}, running on {other.describe()}"]
        if self.device != "cpu":
            return [] if self.device_name == other.device_name else [f"{self.device_name} -> {other.device_name}"]
        found = []
        if " ".join(self.cpu_model.split()) != " ".join(other.cpu_model.split()):
            found.append(f"{self.cpu_model} -> {other.cpu_model}")
        gained = [f for f in other.cpu_flags if f not in self.cpu_flags]
        lost = [f for f in self.cpu_flags if f not in other.cpu_flags]
        if gained:
            found.append("this CPU adds " + ", ".join(gained))
        if lost:
            found.append("this CPU lacks " + ", ".join(lost))
        return found


def this_machine(device: str | torch.device = "cpu") -> Machine:
    """The machine this process runs on, for work on ``device``."""
    device = torch.device(device)
    model, flags = cpu_model_and_flags()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else model
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cores = os.cpu_count() or 0
    return Machine(device=device.type, device_name=name, cpu_model=model, cpu_flags=flags, cores=cores)


def cpu_model_and_flags(cpuinfo: Path = CPUINFO) -> tuple[str, tuple[str, ...]]:
    """``lscpu``'s model name and the KERNEL_FLAGS present, from ``/proc/cpuinfo`` (x86 "model
    name"/"flags", ARM "Features"); ``platform.processor()`` and no flags where it cannot be read."""
    model, present = "", set()
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key == "model name" and not model:
            model = value.strip()
        elif key in ("flags", "features") and not present:
            present = set(value.split())
        if model and present:
            break  # every CPU repeats both: the first one's are enough
    model = model or platform.processor() or platform.machine() or "unknown CPU"
    return model, tuple(flag for flag in KERNEL_FLAGS if flag in present)


def code_version(root: Path = SOURCE_ROOT) -> dict[str, Any]:
    """The code that ran, for a result file: ``{"commit": short hash, "dirty": bool}``.

    ``commit`` is ``git rev-parse --short HEAD`` of ``root`` when ``root`` is the top of a git
    checkout (the package run from its repository); ``dirty`` says whether tracked files had
    uncommitted changes then, result files under ``docs/results`` aside (a sitting of several runs
    rewrites its own committed results as it goes; they are data, not the code that ran). Both are
    None where git is missing, slow, or ``root`` is no checkout of its own (an installed package,
    or one inside another project's repository): never raises.
    """
    unknown: dict[str, Any] = {"commit": None, "dirty": None}
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0", "LC_ALL": "C"}  # a status refreshes no index lock

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=GIT_TIMEOUT_S, env=env
            )
        except (OSError, subprocess.SubprocessError, ValueError):
            return None
        return done.stdout if done.returncode == 0 else None

    found = git("rev-parse", "--show-toplevel", "--short", "HEAD")
    lines = (found or "").splitlines()  # the top folder, then the hash
    if len(lines) != 2 or Path(lines[0]).resolve() != root.resolve():
        return unknown
    status = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)docs/results")
    return {"commit": lines[1], "dirty": None if status is None else bool(status.strip())}
