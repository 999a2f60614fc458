"""What a search says on stderr besides its errors: warning and note lines (``to_stderr``), and one
line per phase (``phase``: it times one phase of the search and, with progress on, says when it ends
what it did)."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator


def to_stderr(line: str) -> None:
    print(line, file=sys.stderr)


@contextlib.contextmanager
def phase(name: str, progress: bool) -> Iterator[dict[str, str]]:
    """One line when the phase ends: ``search: NAME: DETAIL (X.X s)``; the body may set ``detail``."""
    info = {"detail": ""}
    start = time.perf_counter()
    yield info
    if progress:
        detail = f": {info['detail']}" if info["detail"] else ""
        to_stderr(f"search: {name}{detail} ({time.perf_counter() - start:.1f} s)")
