"""Atomic file writes (a reader sees the old file or the whole new one, never half of it), and
checks, made before any work, that an output path can be written."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from layerskip.errors import LayerskipError


def write_bytes_atomic(path: str | os.PathLike[str], payload: bytes) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(payload)
        # mkstemp makes the file private (0600); give it the mode a plain open() would.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_text_atomic(path: str | os.PathLike[str], text: str) -> Path:
    return write_bytes_atomic(path, text.encode())


def write_json_atomic(path: str | os.PathLike[str], data: Any) -> Path:
    return write_text_atomic(path, json.dumps(data, indent=2) + "\n")


def _nearest_existing(path: Path) -> Path:
    """``path`` or its closest ancestor that exists (what a later mkdir would start from)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _writable(directory: Path) -> bool:
    """Whether a file can be created in ``directory``. Permission bits first; then a real try,
    since they do not tell everything (root passes them everywhere, /proc and read-only mounts
    included). The try's file is removed at once."""
    if not os.access(directory, os.W_OK | os.X_OK):
        return False
    try:
        fd, name = tempfile.mkstemp(prefix=".layerskip-write-check-", dir=directory)
    except OSError:
        return False
    os.close(fd)
    os.unlink(name)
    return True


def _check_creatable(path: Path, flag: str) -> None:
    """``path`` does not exist yet: its closest existing ancestor must be a writable directory."""
    base = _nearest_existing(path.parent)
    if not base.is_dir():
        raise LayerskipError(f"{flag} {path}: {base} is a file, not a directory; choose another path")
    if not _writable(base):
        raise LayerskipError(f"{flag} {path}: directory {base} is not writable; choose another path")


def check_output_file(path: str | os.PathLike[str], flag: str) -> Path:
    """Raise LayerskipError unless a file can be written at ``path``; creates nothing.

    Called before the work starts, so a run never spends minutes and then fails to save.
    """
    path = Path(path).expanduser()
    if path.is_dir():
        raise LayerskipError(f"{flag} {path} is a directory; name a file, e.g. {path / 'policy.json'}")
    if path.exists():
        # Replaced atomically (a new file in the same directory), so the directory must be writable too.
        if not _writable(path.parent):
            raise LayerskipError(f"{flag} {path}: directory {path.parent} is not writable; choose another path")
        return path
    _check_creatable(path, flag)
    return path


def check_output_dir(path: str | os.PathLike[str], flag: str) -> Path:
    """Raise LayerskipError unless files can be written into directory ``path``; creates nothing."""
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise LayerskipError(f"{flag} {path} is a file; name a directory")
    if path.is_dir():
        if not _writable(path):
            raise LayerskipError(f"{flag} directory {path} is not writable; choose another path")
        return path
    _check_creatable(path, flag)
    return path


def check_replaceable(
    path: str | os.PathLike[str], flag: str, ours: Callable[[Path], bool], what: str, force: bool = False
) -> None:
    """Raise LayerskipError if ``path`` holds a file that ``ours`` does not recognise as one this
    tool wrote (``what`` names such a file), unless ``force``: a mistyped output path must not
    destroy someone's data. Reads, writes nothing."""
    path = Path(path).expanduser()
    if force or not path.is_file() or ours(path):
        return
    raise LayerskipError(f"{flag} {path} exists and is not {what}; pass --force to replace it, or choose another path")


def read_json_file(path: Path, limit: int = 256 * 2**20) -> object:
    """The JSON document in ``path`` (UTF-8, an optional byte-order mark), or None if it is not one
    or is larger than ``limit`` bytes: for recognising files, not for loading them."""
    try:
        if path.stat().st_size > limit:
            return None
        return json.loads(path.read_text(encoding="utf-8-sig"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None


def write_file_set(directory: str | os.PathLike[str], payloads: dict[str, bytes]) -> list[Path]:
    """Write several files into ``directory`` as a set.

    Every payload is already computed, so a failure to produce one leaves the directory as it
    was. They are first written whole into a staging directory beside it, then each is renamed
    into place (a rename within one file system does not fail half-way), so an earlier run's
    files are replaced together or not at all.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.staging-", dir=directory.parent))
    try:
        umask = os.umask(0)
        os.umask(umask)
        for name, payload in payloads.items():
            (staging / name).write_bytes(payload)
            os.chmod(staging / name, 0o666 & ~umask)
        written = []
        for name in payloads:
            os.replace(staging / name, directory / name)
            written.append(directory / name)
        return written
    finally:
        shutil.rmtree(staging, ignore_errors=True)
