"""The one exception type the command-line tools turn into a one-line message and exit code 2."""

from __future__ import annotations

from collections.abc import Sequence


class LayerskipError(Exception):
    """A problem with the user's input: the message names the problem and how to fix it."""


def few(values: Sequence[object], shown: int = 5) -> str:
    """``values`` for a one-line message: the first ``shown`` and a count of the rest, so a file with
    millions of bad entries still gets a short error."""
    head = ", ".join(str(v) for v in values[:shown])
    rest = len(values) - shown
    return f"[{head}]" if rest <= 0 else f"[{head}] and {rest} more"


def first_line(error: BaseException) -> str:
    """The first line of ``error``'s message (its type's name where it has none), for a one-line report."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
