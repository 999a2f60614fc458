"""Reading and writing the project's files, one way each.

Reading: every JSON file the project reads goes through ``load_json`` (a JSONL file:
``read_text``, then ``parse_json`` per line; ``read_json_file`` to recognise a file): a regular
file only (a FIFO would hang the reader, a link to /dev/zero would read until memory runs out),
at most a size cap, UTF-8, JSON nested at most ``MAX_JSON_DEPTH`` deep, of the type the caller
expects; anything else is one ``LayerskipError`` line that names the file, the problem and the fix.

Writing: atomic (a reader sees the old file or the whole new one, never half of it), and only
over a regular file or a new path, checked before any work (``check_output_file``,
``check_output_dir``) and again at the moment of writing. Links: a file in a folder the project
owns (a cache entry: ``owned=True``) is never written through one, the link itself is replaced
by the file; a path the user named is written through a link to an existing file (their link,
or /dev/stdout, stays), and a link that leads nowhere is replaced.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from layerskip.errors import LayerskipError

MAX_JSON_BYTES = 256 * 2**20  # far above any file the project writes; a bound on what a reader holds
MAX_JSON_DEPTH = 100  # the project's files nest a few levels; deeper is damage (and recursion for every reader)
NOT_REGULAR = "is not a regular file (a FIFO, device or socket)"


class NotRegularFile(LayerskipError):
    """An output path holds something other than a regular file: it is left as it is."""


# -- writing ---------------------------------------------------------------------------------------


def _refuse_special(path: Path, flag: str | None = None, follow_links: bool = True) -> None:
    """Raise NotRegularFile if ``path`` exists as something other than a regular file, a directory
    or (not ``follow_links``) a link, which is then looked at itself rather than what it leads to."""
    try:
        mode = (path.stat() if follow_links else path.lstat()).st_mode
    except OSError:
        return  # absent, or a dangling link: writing makes a new file there
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode)):
        named = f"{flag} {path}" if flag else str(path)
        raise NotRegularFile(f"{named} {NOT_REGULAR}; it is left as it is: name a regular file or a new path")


def replace_file(source: str | os.PathLike[str], path: str | os.PathLike[str], *, owned: bool = False) -> Path:
    """Move the finished file ``source`` onto ``path`` (a rename: atomic; a link at ``path`` is
    replaced, never followed), unless ``path`` is a FIFO, device or socket, or (not ``owned``) a
    link to one, which is never replaced (``source`` is then removed)."""
    path = Path(path)
    try:
        _refuse_special(path, follow_links=not owned)
    except NotRegularFile:
        Path(source).unlink(missing_ok=True)
        raise
    os.replace(source, path)
    return path


def _through_link(path: Path) -> Path:
    """The file a link to an existing file leads to (written in its place, so the link stays: a
    system's link such as /dev/stdout is never replaced); any other path as it is."""
    return Path(os.path.realpath(path)) if path.is_symlink() and path.exists() else path


def _plain_mode() -> int:
    """The mode a plain open() gives a new file (mkstemp and mkdtemp make theirs private)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def write_bytes_atomic(path: str | os.PathLike[str], payload: bytes, *, owned: bool = False) -> Path:
    """Write ``payload`` to ``path`` atomically; returns the path written.

    ``owned``: ``path`` lies in a folder the project owns (a cache), where a link was not put by the
    project and must not carry the write out of it: a link there, to a file, a folder or nowhere,
    is replaced by the regular file and what it led to is left as it is. Otherwise ``path`` is one
    the user named, and a link to an existing file is written through (see ``_through_link``)."""
    path = Path(path)
    if not owned:
        path = _through_link(path)
    _refuse_special(path, follow_links=not owned)  # before the temporary exists: nothing to clean up
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(payload)
        os.chmod(tmp, _plain_mode())
        replace_file(tmp, path, owned=owned)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_text_atomic(path: str | os.PathLike[str], text: str, *, owned: bool = False) -> Path:
    return write_bytes_atomic(path, text.encode(), owned=owned)


def write_json_atomic(path: str | os.PathLike[str], data: Any, *, owned: bool = False) -> Path:
    return write_text_atomic(path, json.dumps(data, indent=2) + "\n", owned=owned)


def _broken_link(path: Path) -> str | None:
    """Why ``path`` leads nowhere, if it is a link that does (to a missing file, or a loop)."""
    if not path.is_symlink():
        return None
    try:
        path.stat()
    except OSError as error:
        return _path_problem(path, error)
    return None


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
    """``path`` does not exist yet: its closest existing ancestor (what a later mkdir would start
    from; a link that leads nowhere counts, since mkdir stops at it too) must be a writable directory."""
    base = path.parent
    while not (base.exists() or base.is_symlink()) and base != base.parent:
        base = base.parent
    problem = _broken_link(base)
    if problem is not None:
        raise LayerskipError(f"{flag} {path}: {base}: {problem}; choose another path")
    if not base.is_dir():
        raise LayerskipError(f"{flag} {path}: {base} is a file, not a directory; choose another path")
    if not _writable(base):
        raise LayerskipError(f"{flag} {path}: directory {base} is not writable; choose another path")


def check_output_file(path: str | os.PathLike[str], flag: str) -> Path:
    """Raise LayerskipError unless a file can be written at ``path``: a new path, or a regular
    file to replace (never a FIFO, device or socket); creates nothing.

    Called before the work starts, so a run never spends minutes and then fails to save.
    """
    if not str(path).strip():
        raise LayerskipError(f"{flag} is empty; name the file to write")
    path = Path(path).expanduser()
    if path.is_dir():
        raise LayerskipError(f"{flag} {path} is a directory; name a file, e.g. {path / 'policy.json'}")
    _refuse_special(path, flag)
    if path.exists():
        # Replaced atomically (a new file in the same directory), so the directory must be writable too.
        if not _writable(_through_link(path).parent):
            raise LayerskipError(f"{flag} {path}: directory {path.parent} is not writable; choose another path")
    else:
        _check_creatable(path, flag)
    return path


def check_output_dir(path: str | os.PathLike[str], flag: str, files: Iterable[str] = ()) -> Path:
    """Raise LayerskipError unless ``files`` can be written into directory ``path`` (each a new
    path or a regular file to replace); creates nothing."""
    if not str(path).strip():
        raise LayerskipError(f"{flag} is empty; name the directory to write into")
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise LayerskipError(f"{flag} {path} is a file; name a directory")
    if path.is_dir():
        if not _writable(path):
            raise LayerskipError(f"{flag} directory {path} is not writable; choose another path")
        for name in files:
            if (path / name).is_dir():
                raise LayerskipError(f"{flag} {path} holds a directory {name} where a file goes; choose another path")
            _refuse_special(path / name, flag)
        return path
    problem = _broken_link(path)
    if problem is not None:  # no directory can be made there: it is the link's name
        raise LayerskipError(f"{flag} {path}: {problem}; choose another path")
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


def write_file_set(directory: str | os.PathLike[str], payloads: dict[str, bytes]) -> list[Path]:
    """Write several files into ``directory`` as a set.

    Every payload is already computed, so a failure to produce one leaves the directory as it
    was. They are first written whole into a staging directory beside it, then each is renamed
    into place (a rename within one file system does not fail half-way), so an earlier run's
    files are replaced together or not at all. A FIFO, device or socket in the way stops the
    set before any file moves.
    """
    directory = Path(directory)
    for name in payloads:
        _refuse_special(directory / name)
    directory.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.staging-", dir=directory.parent))
    try:
        mode = _plain_mode()
        for name, payload in payloads.items():
            (staging / name).write_bytes(payload)
            os.chmod(staging / name, mode)
        written = []
        for name in payloads:
            os.replace(staging / name, directory / name)
            written.append(directory / name)
        return written
    finally:
        shutil.rmtree(staging, ignore_errors=True)


# -- reading ---------------------------------------------------------------------------------------


class UnreadableFile(LayerskipError):
    """A file a reader refused: ``cannot read WHAT PATH: REASON; FIX``. A cache that rebuilds a
    refused entry says ``reason`` in its own words."""

    def __init__(self, what: str, path: Path, reason: str, fix: str) -> None:
        super().__init__(f"cannot read {what} {path}: {reason}; {fix}")
        self.reason = reason


def _path_problem(path: Path, error: OSError) -> str:
    """Why opening ``path`` failed, in words: links that lead nowhere are named as such."""
    if error.errno == errno.ELOOP:
        return "it is a loop of symbolic links"
    if path.is_symlink() and error.errno == errno.ENOENT:
        return f"it is a symbolic link to {os.readlink(path)}, which does not exist"
    if error.errno == errno.ENOENT:
        return "not found"
    return error.strerror or str(error)


def check_regular_file(path: str | os.PathLike[str], what: str, fix: str, limit: int = MAX_JSON_BYTES) -> Path:
    """``path`` if it is a regular file (through links) of at most ``limit`` bytes; else one line.
    Opens nothing: a FIFO or a device is refused before any read could block or run forever."""
    path = Path(path).expanduser()
    try:
        info = path.stat()
    except OSError as error:
        raise UnreadableFile(what, path, _path_problem(path, error), fix) from None
    _check_kind(path, info, what, fix, limit)
    return path


def _check_kind(path: Path, info: os.stat_result, what: str, fix: str, limit: int) -> None:
    if stat.S_ISDIR(info.st_mode):
        raise UnreadableFile(what, path, "it is a directory", fix)
    if not stat.S_ISREG(info.st_mode):
        raise UnreadableFile(what, path, f"it {NOT_REGULAR}", fix)
    if info.st_size > limit:
        raise UnreadableFile(what, path, f"it is larger than {limit / 2**20:g} MiB", fix)


def read_text(path: str | os.PathLike[str], what: str, fix: str, limit: int = MAX_JSON_BYTES) -> str:
    """The UTF-8 text (an optional byte-order mark dropped) of the regular file at ``path`` (at most
    ``limit`` bytes); anything else is one line (``what`` names the file, ``fix`` says what to pass
    instead)."""
    path = check_regular_file(path, what, fix, limit)
    try:
        # Non-blocking: should the path have become a FIFO since the check, opening it does not wait.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as error:
        raise UnreadableFile(what, path, _path_problem(path, error), fix) from None
    with os.fdopen(fd, "rb") as handle:
        _check_kind(path, os.fstat(fd), what, fix, limit)  # what was opened, not what was checked
        try:
            data = handle.read(limit + 1)
        except OSError as error:
            raise UnreadableFile(what, path, error.strerror or str(error), fix) from None
    if len(data) > limit:  # grew since it was checked
        raise UnreadableFile(what, path, f"it is larger than {limit / 2**20:g} MiB", fix)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        reason = f"it is not UTF-8 text (line {line}, byte {error.start})"
        raise UnreadableFile(what, path, reason, "save it as UTF-8") from None


class JsonProblem(ValueError):
    """Why a text is not the JSON a reader accepts, in words, and the fix when it is not the reader's."""

    def __init__(self, reason: str, fix: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.fix = fix


def _without_repeated_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are all different: with a key given twice, json keeps the last
    copy and the other is silently lost."""
    data: dict[str, Any] = {}
    for key, value in pairs:
        if key in data:
            raise JsonProblem(f"it gives key '{key}' twice in one object", "keep the one you mean")
        data[key] = value
    return data


def json_depth(value: Any) -> int:
    """How deep ``value`` nests (a scalar: 0), without recursion."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        if depth > MAX_JSON_DEPTH:
            return depth
        stack.extend((child, depth + 1) for child in children)
    return deepest


_JSON_TYPES = {dict: "an object", list: "a list", str: "a string", bool: "true or false", type(None): "null"}


def _json_type(value: Any) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return "a number"
    return _JSON_TYPES.get(type(value), type(value).__name__)


def parse_json(text: str, expect: type | None = dict, unique_keys: bool = False) -> Any:
    """The JSON value in ``text``: at most ``MAX_JSON_DEPTH`` deep, of type ``expect`` (None: any);
    ``unique_keys``: an object giving a key twice is refused. JsonProblem says what is wrong."""
    try:
        value = json.loads(text, object_pairs_hook=_without_repeated_keys if unique_keys else None)
    except json.JSONDecodeError as error:
        raise JsonProblem(f"not valid JSON ({error.msg}: line {error.lineno} column {error.colno})") from None
    except RecursionError:
        raise JsonProblem(f"it nests deeper than {MAX_JSON_DEPTH} levels") from None
    if json_depth(value) > MAX_JSON_DEPTH:
        raise JsonProblem(f"it nests deeper than {MAX_JSON_DEPTH} levels")
    if expect is not None and not isinstance(value, expect):
        raise JsonProblem(f"it holds {_json_type(value)}, not {_JSON_TYPES.get(expect, expect.__name__)}")
    return value


# -- shapes: what a reader needs of a JSON value, nested values included ---------------------------
#
# A shape is a type (str, int, bool, dict, list: int excludes true and false), or one of the
# classes below. ``check_shape`` walks the value once and names the first part that does not fit,
# by its path (``methods['hf-ar'].overall.speedup``): a file is refused in one line where it is
# read, not by a traceback wherever a table later reads the wrong type.


@dataclass(frozen=True)
class Number:
    """A finite number (not true or false); ``positive``: above 0 (a divisor)."""

    positive: bool = False


@dataclass(frozen=True)
class Obj:
    """An object with ``required`` keys and ``optional`` ones (others are let through unread)."""

    required: dict[str, Any] = field(default_factory=dict)
    optional: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Items:
    """A list whose every item has ``item``'s shape."""

    item: Any


@dataclass(frozen=True)
class Table:
    """An object used as a mapping: every value has ``value``'s shape; ``int_keys``: every key is a
    decimal integer (a row count, a block length)."""

    value: Any
    int_keys: bool = False


@dataclass(frozen=True)
class Maybe:
    """``inner``'s shape, or null."""

    inner: Any


@dataclass(frozen=True)
class Where:
    """``inner``'s shape, and ``test`` holds of the value (``says`` what it requires)."""

    inner: Any
    test: Callable[[Any], bool]
    says: str


SCALAR = (str, int, float, bool, type(None))


def _describe(shape: Any) -> str:
    if isinstance(shape, Number):
        return "a number above 0" if shape.positive else "a number"
    if isinstance(shape, Maybe):
        return f"{_describe(shape.inner)} or null"
    if isinstance(shape, Where):
        return _describe(shape.inner)
    if isinstance(shape, (Obj, Table)):
        return "an object"
    if isinstance(shape, Items):
        return "a list"
    if isinstance(shape, tuple):
        return "a value"
    return {str: "a string", int: "an integer", bool: "true or false", dict: "an object", list: "a list"}[shape]


def _key_path(path: str, key: str) -> str:
    if key.isidentifier():
        return f"{path}.{key}" if path else key
    return f"{path}[{key!r}]"


def check_shape(value: Any, shape: Any, path: str = "") -> None:
    """Raise JsonProblem naming the first part of ``value`` that does not have ``shape``."""
    here = path or "it"
    if isinstance(shape, Maybe):
        if value is not None:
            check_shape(value, shape.inner, path)
        return
    if isinstance(shape, Where):
        check_shape(value, shape.inner, path)
        if not shape.test(value):
            raise JsonProblem(f"{here} {shape.says}")
        return
    if isinstance(shape, Number):
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        number = number and (isinstance(value, int) or math.isfinite(value))
        if not number or (shape.positive and value <= 0):
            shown = _json_type(value) if not number else str(value)
            raise JsonProblem(f"{here} is {shown}, not {_describe(shape)}")
        return
    kind = dict if isinstance(shape, (Obj, Table)) else list if isinstance(shape, Items) else shape
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise JsonProblem(f"{here} is {_json_type(value)}, not {_describe(shape)}")
    if isinstance(shape, Obj):
        for key, inner in shape.required.items():
            if key not in value:
                raise JsonProblem(f"{here} has no '{key}' ({_describe(inner)})")
            check_shape(value[key], inner, _key_path(path, key))
        for key, inner in shape.optional.items():
            if key in value:
                check_shape(value[key], inner, _key_path(path, key))
    elif isinstance(shape, Table):
        for key, inner in value.items():
            if shape.int_keys and not re.fullmatch(r"-?[0-9]{1,18}", key):
                raise JsonProblem(f"{here} has key {key!r}, not an integer")
            check_shape(inner, shape.value, _key_path(path, key))
    elif isinstance(shape, Items):
        for index, item in enumerate(value):
            check_shape(item, shape.item, f"{here}[{index}]")


def load_json(
    path: str | os.PathLike[str],
    what: str,
    fix: str,
    expect: type | None = dict,
    unique_keys: bool = False,
    shape: Any = None,
) -> Any:
    """The JSON document in the file at ``path``, the one way the project reads one: a regular
    file of at most ``MAX_JSON_BYTES``, UTF-8, valid JSON at most ``MAX_JSON_DEPTH`` deep, of type
    ``expect`` and, given one, of ``shape`` (``check_shape``). Anything else is one line:
    ``cannot read WHAT PATH: REASON; FIX``."""
    text = read_text(path, what, fix)
    try:
        value = parse_json(text, expect, unique_keys)
        if shape is not None:
            check_shape(value, shape)
        return value
    except JsonProblem as problem:
        raise UnreadableFile(what, Path(path).expanduser(), problem.reason, problem.fix or fix) from None


def read_json_file(path: Path) -> object:
    """The JSON document in ``path``, or None if it is not one (or not a regular file, or larger
    than ``MAX_JSON_BYTES``): for recognising files, not for loading them."""
    try:
        return load_json(path, "file", "", expect=None)
    except LayerskipError:
        return None
