"""Checking a journal file storage before a study resumes on it.

Optuna's journal is one JSON record per line, appended under a lock. A writer killed
mid-append (or a full disk) leaves a last line that is partial or garbage. Optuna reads past
such a *last* line (it is ignored), but its next append lands after it, and the garbage line is
then in the middle, where Optuna refuses to read the file at all: the whole study is lost.

So, before any work, under the journal's own lock (no writer is mid-append while it is held):
- a damaged last record is removed, after the file is copied to ``PATH.damaged-N`` (nothing is
  lost, every complete record is kept), and the caller prints a one-line warning;
- a damaged record with complete records after it cannot be skipped (Optuna replays the
  journal in order): refused in one line naming the line.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from layerskip.errors import LayerskipError


@dataclass(frozen=True)
class Repair:
    """What ``repair_journal`` did: the line it removed and where the original file was kept."""

    line: int
    backup: Path

    def warning(self, path: Path) -> str:
        return (
            f"warning: journal {path} ended in a damaged record (line {self.line}, left by an interrupted write); "
            f"removed it and kept the original as {self.backup}"
        )


def _damaged(line: bytes) -> bool:
    """A line Optuna cannot replay: not newline-terminated, not UTF-8 JSON, or not a record."""
    if not line.endswith(b"\n"):
        return True
    try:
        return not isinstance(json.loads(line), dict)
    except (ValueError, RecursionError):  # JSONDecodeError, UnicodeDecodeError, nesting no reader can follow
        return True


def find_damage(path: Path) -> tuple[int, int, int] | None:
    """``(line number, byte offset, total lines)`` of the first damaged line, or None."""
    with path.open("rb") as handle:
        lines = list(handle)
    offset = 0
    for number, line in enumerate(lines, 1):
        if _damaged(line):
            return number, offset, len(lines)
        offset += len(line)
    return None


def _backup_path(path: Path) -> Path:
    number = 1
    while (candidate := path.with_name(f"{path.name}.damaged-{number}")).exists():
        number += 1
    return candidate


def repair_journal(path: Path) -> Repair | None:
    """Remove a damaged last record of the journal at ``path`` (kept in a backup); refuse damage
    elsewhere. Returns what was done, or None for a whole journal (or none yet). The journal and its
    directory (Optuna locks by creating a file beside it) must be writable: ``check_local_storage``."""
    if not path.is_file():
        return None
    from optuna.storages.journal import JournalFileSymlinkLock

    lock = JournalFileSymlinkLock(str(path))  # the lock Optuna's appends take (the default)
    lock.acquire()
    try:
        damage = find_damage(path)
        if damage is None:
            return None
        line, offset, total = damage
        if line != total:
            raise LayerskipError(
                f"journal {path} line {line} is damaged and {total - line} record(s) follow it, so Optuna cannot "
                "replay the study; restore the file from a backup or start a new journal"
            )
        backup = _backup_path(path)
        shutil.copy2(path, backup)
        with path.open("r+b") as handle:
            handle.truncate(offset)
            handle.flush()
            os.fsync(handle.fileno())
        return Repair(line, backup)
    finally:
        lock.release()
