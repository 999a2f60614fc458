"""The dequantised-GGUF cache checks itself: a damaged copy is rebuilt, a racing writer's copy is accepted."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_helpers import assert_bad_input
from safetensors.torch import save_file
from search_fixtures import generate_in_process

from layerskip.errors import LayerskipError
from layerskip.hf import models


def _cached_copy(directory: Path) -> Path:
    """A cache entry as ``_convert_gguf`` writes one: config.json and model.safetensors."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps({"model_type": "llama"}))
    save_file({"a": torch.zeros(64, 64), "b": torch.ones(16)}, str(directory / "model.safetensors"))
    return directory


def test_a_whole_copy_is_used(tmp_path: Path) -> None:
    target = _cached_copy(tmp_path / "m")
    assert models.cache_is_whole(target)
    assert models._usable_cache(target)
    assert not models._usable_cache(tmp_path / "absent")


@pytest.mark.parametrize("damage", ["truncated", "no-weights", "garbage-header", "bad-config"])
def test_a_damaged_copy_is_moved_aside_to_be_rebuilt(
    tmp_path: Path, damage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    target = _cached_copy(tmp_path / "cache" / "m")
    weights = target / "model.safetensors"
    if damage == "truncated":  # a killed copy or a disk fault
        weights.write_bytes(weights.read_bytes()[:-100])
    elif damage == "no-weights":
        weights.unlink()
    elif damage == "garbage-header":
        weights.write_bytes(b"\xff" * 64)
    else:
        (target / "config.json").write_text("{")
    assert not models.cache_is_whole(target)

    assert not models._usable_cache(target)  # the caller converts the GGUF again

    assert not target.exists()
    assert list((tmp_path / "cache").iterdir()) == [], "the damaged copy was left behind"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(target) in err[0] and "rebuilding" in err[0]


def test_a_damaged_copy_that_cannot_be_removed_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = _cached_copy(tmp_path / "m")
    (target / "model.safetensors").write_bytes(b"")

    def refuse(*args: object) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(models.os, "replace", refuse)
    with pytest.raises(LayerskipError, match=f"model cache {target} is damaged.*delete that directory"):
        models._usable_cache(target)


def test_a_racing_writer_that_finished_first_is_accepted(tmp_path: Path) -> None:
    """Two processes convert the same GGUF on a fresh cache: the second rename finds the first's copy."""
    winner = _cached_copy(tmp_path / "m")
    loser = _cached_copy(tmp_path / ".m.staging")
    models._publish(loser, winner)  # no "Directory not empty"
    assert models.cache_is_whole(winner)


def test_a_racing_writer_never_replaces_a_damaged_copy_silently(tmp_path: Path) -> None:
    occupied = tmp_path / "m"
    occupied.mkdir()
    (occupied / "partial").write_text("x")
    with pytest.raises(OSError):
        models._publish(_cached_copy(tmp_path / ".m.staging"), occupied)


def test_concurrent_conversions_of_one_file_dequantise_it_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The second process waits on the conversion lock, then uses the first one's copy."""
    import threading

    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    inside, release = threading.Event(), threading.Event()
    calls: list[Path] = []

    def dequantise(source: Path, target: Path) -> Path:
        calls.append(target)
        inside.set()
        release.wait()
        staging = _cached_copy(target.parent / f".{target.name}.staging")
        models._publish(staging, target)
        return target

    monkeypatch.setattr(models, "_dequantise", dequantise)
    results: list[Path] = []
    first = threading.Thread(target=lambda: results.append(models._convert_gguf(gguf)))
    second = threading.Thread(target=lambda: results.append(models._convert_gguf(gguf)))
    first.start()
    assert inside.wait(60)
    second.start()  # blocks on the lock while the first converts
    release.set()
    first.join(60)
    second.join(60)
    assert len(calls) == 1 and len(results) == 2 and results[0] == results[1] == calls[0]
    assert models.cache_is_whole(calls[0])


def _tiny_gguf(path: Path) -> Path:
    """A small well-formed GGUF (two float tensors): cut short, it fails where a real one would,
    in the GGUF reader's mapping of the tensor data."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((32, 16), dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones(16, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("kept", [0.5, 0.95])
def test_a_truncated_gguf_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], kept: float
) -> None:
    """Not numpy's "cannot reshape array of size ...": the file is named as truncated, nothing is cached."""
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "cache"))
    whole = _tiny_gguf(tmp_path / "whole.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[: int(len(whole) * kept)])
    line = assert_bad_input(
        generate_in_process(capsys, "--model", str(cut), "--prompt", "hi"),
        f"GGUF file {cut} is truncated or damaged",
        "download or copy it again",
    )
    assert "reshape" not in line and "dtype" not in line
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file() and not p.name.endswith(".lock")]
    assert models._gguf_damage(tmp_path / "whole.gguf") is None  # a whole file failing otherwise keeps its error


@pytest.mark.parametrize("how", ["read-only", "read-only-with-models-dir", "file-in-the-way"])
def test_a_cache_that_cannot_be_written_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], how: str
) -> None:
    """A new GGUF needs its dequantised copy written to LAYERSKIP_CACHE. Tests run as root, whom
    chmod does not stop, so a read-only file system is simulated where the conversion writes:
    the cache's mkdir, or (its models/ present) the conversion lock's open."""
    gguf = _tiny_gguf(tmp_path / "new.gguf")
    cache = tmp_path / "cache"

    def refuse(path: object, *args: object, **kwargs: object) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    if how == "file-in-the-way":
        (tmp_path / "file").write_text("mine")
        cache = tmp_path / "file" / "cache"
    elif how == "read-only":
        real_mkdir = os.mkdir

        def mkdir(path: object, *args: object, **kwargs: object) -> None:
            (refuse if Path(path).is_relative_to(cache) else real_mkdir)(path, *args, **kwargs)

        monkeypatch.setattr(os, "mkdir", mkdir)
    else:
        (cache / "models").mkdir(parents=True)  # mkdir(exist_ok=True) passes: the lock file's open() fails
        monkeypatch.setattr(models, "open", refuse, raising=False)  # the lock is the module's only open()
    monkeypatch.setenv(models.CACHE_ENV, str(cache))
    expected = "Not a directory" if how == "file-in-the-way" else "Read-only file system"
    assert_bad_input(
        generate_in_process(capsys, "--model", str(gguf), "--prompt", "hi"),
        f"cannot write to the model cache {cache} ({expected}",
        "set LAYERSKIP_CACHE to a writable directory",
    )
    if how == "file-in-the-way":
        assert (tmp_path / "file").read_text() == "mine"


def test_an_embedded_gguf_assembled_into_a_read_only_cache_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Gemma-3's GGUF is assembled from its package's parts into the cache before it is converted."""
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "cache"))

    def assemble() -> Path:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(tmp_path / "cache" / "gguf"))

    entry = models.EMBEDDED["gemma3-270m"]
    monkeypatch.setitem(models.EMBEDDED, entry.name, dataclasses.replace(entry, locate_gguf=assemble))
    assert_bad_input(
        generate_in_process(capsys, "--model", entry.name, "--prompt", "hi"),
        f"cannot write to the model cache {tmp_path / 'cache'} (Read-only file system",
        "set LAYERSKIP_CACHE",
    )
