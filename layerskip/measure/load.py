"""Competing busy processes, to measure how a method holds up on a machine that is not idle."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator

BUSY_LOOP = "while True: pass"


@contextlib.contextmanager
def busy_processes(count: int) -> Iterator[list[subprocess.Popen]]:
    """Run ``count`` single-threaded spinning Python processes for the duration of the block.

    They are killed and reaped on exit, also when the block raises or is interrupted.
    """
    if count < 0:
        raise ValueError(f"busy process count must be >= 0 (got {count})")
    started: list[subprocess.Popen] = []
    try:
        for _ in range(count):
            started.append(subprocess.Popen([sys.executable, "-c", BUSY_LOOP], stdin=subprocess.DEVNULL))
        yield started
    finally:
        for process in started:
            process.kill()
        for process in started:
            process.wait()
