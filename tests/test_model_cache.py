"""The dequantised-GGUF cache checks itself: a damaged copy is rebuilt, a racing writer's copy is accepted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

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
