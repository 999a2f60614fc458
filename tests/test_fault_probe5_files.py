"""Paths that are not what they are named as: one line that says what is wrong, exit 2, no traceback.

The twin maker's seed and --out are checked before the model loads; a ``.gguf`` path that is
missing, a link that leads nowhere or a FIFO is named as such, not as an unknown model.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from cli_helpers import assert_bad_input

from layerskip.cli import twin
from layerskip.errors import LayerskipError
from layerskip.hf import models


def twin_in_process(capsys: pytest.CaptureFixture[str], *args: str) -> subprocess.CompletedProcess[str]:
    """``scripts/make_twin.py ARGS`` through its ``main``, in this process."""
    capsys.readouterr()
    code = twin.main(list(args))
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), code, captured.out, captured.err)


@pytest.mark.parametrize("seed", ["99999999999999999999999", "-1"])
def test_a_twin_seed_out_of_range_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], seed: str) -> None:
    result = twin_in_process(
        capsys, "--model", str(tmp_path / "no-model"), "--out", str(tmp_path / "t"), "--seed", seed
    )
    assert_bad_input(result, f"--seed must be between 0 and {2**63 - 1} (got {seed})")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kind", ["dangling", "loop"])
def test_a_twin_out_that_is_a_link_to_nowhere_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    """Refused before the model loads (the model named here does not exist): nothing is made
    where the link leads."""
    out = tmp_path / "twin"
    if kind == "dangling":
        out.symlink_to(tmp_path / "gone")
    else:
        (tmp_path / "other").symlink_to(out)
        out.symlink_to(tmp_path / "other")
    reason = "symbolic link to" if kind == "dangling" else "loop of symbolic links"
    result = twin_in_process(capsys, "--model", str(tmp_path / "no-model"), "--out", str(out))
    assert_bad_input(result, f"--out {out}", reason, "choose another path")
    assert out.is_symlink() and not (tmp_path / "gone").exists()
    result = twin_in_process(capsys, "--model", str(tmp_path / "no-model"), "--out", str(out / "inner"))
    assert_bad_input(result, f"--out {out / 'inner'}", reason)


def _gguf_path(tmp_path: Path, kind: str) -> Path:
    path = tmp_path / "model.gguf"
    if kind == "dangling":
        path.symlink_to(tmp_path / "deleted.gguf")
    elif kind == "loop":
        (tmp_path / "other.gguf").symlink_to(path)
        path.symlink_to(tmp_path / "other.gguf")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "link-to-fifo":
        os.mkfifo(tmp_path / "pipe")
        path.symlink_to(tmp_path / "pipe")
    elif kind == "directory":
        path.mkdir()
    return path


GGUF_PROBLEMS = {
    "missing": "not found",
    "dangling": "it is a symbolic link to",
    "loop": "it is a loop of symbolic links",
    "fifo": "it is not a regular file (a FIFO, device or socket)",
    "link-to-fifo": "it is not a regular file (a FIFO, device or socket)",
    "directory": "it is a directory",
}


@pytest.mark.parametrize("kind", list(GGUF_PROBLEMS))
def test_a_gguf_path_that_is_no_file_says_what_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "cache"))
    path = _gguf_path(tmp_path, kind)
    with pytest.raises(LayerskipError) as info:
        models.load_model(str(path))
    line = str(info.value)
    assert line.startswith(f"cannot read GGUF file {path}: {GGUF_PROBLEMS[kind]}")
    assert line.endswith("pass the path of a .gguf file") and "unknown model" not in line
    result = twin_in_process(capsys, "--model", str(path), "--out", str(tmp_path / "twin"))
    assert_bad_input(result, f"GGUF file {path}: {GGUF_PROBLEMS[kind]}")
    assert not (tmp_path / "cache").exists() and not (tmp_path / "twin").exists()


def test_a_missing_gguf_named_without_a_folder_is_not_looked_for_on_the_hub(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``model.gguf`` is shaped like a hub id too; named as a file, it is a file that is missing."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(LayerskipError, match=r"^cannot read GGUF file model.gguf: not found"):
        models.load_model("model.gguf")
