"""``--help`` everywhere a user can ask for it: every script in scripts/, every ``python -m`` module
and every installed console script prints its usage and exits 0, creating nothing in the working
folder or in the cache.

Each runs in this process as its command line would (``runpy`` with ``__name__ == "__main__"``,
``sys.argv`` set, the working folder and the caches empty temporary folders): an interpreter start
per command would import torch fourteen times over (about a minute of CPU) for the same check.
"""

from __future__ import annotations

import ast
import os
import runpy
import sys
import tomllib
from collections.abc import Callable
from functools import partial
from importlib import metadata
from pathlib import Path

import pytest
from cli_helpers import script_env

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(ROOT.glob("scripts/*.py"))
# Source files with a __main__ guard, by the module `python -m` runs (search/ installs as layerskip.search).
SOURCES = sorted([*ROOT.glob("layerskip/**/*.py"), *ROOT.glob("search/**/*.py")])


def _has_main_guard(tree: ast.Module) -> bool:
    return any(_is_main_guard(node) for node in tree.body)


def _is_main_guard(node: ast.stmt) -> bool:
    return isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) and "__name__" in ast.unparse(node.test)


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(("layerskip", *parts) if parts[0] == "search" else parts)


GUARDED = {path: ast.parse(path.read_text()) for path in SOURCES}
GUARDED = {path: tree for path, tree in GUARDED.items() if _has_main_guard(tree)}
CONSOLE_SCRIPTS = sorted(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"].get("scripts", {}))


def _isolated_env(cache: Path) -> dict[str, str]:
    """The scripts' environment, offline, with every layerskip cache in ``cache``."""
    env = {key: value for key, value in script_env().items() if not key.startswith("LAYERSKIP_")}
    return {**env, "HF_HUB_OFFLINE": "1", "LAYERSKIP_CACHE": str(cache)}


def _snapshot(folder: Path) -> list[str]:
    return sorted(str(path.relative_to(folder)) for path in folder.rglob("*"))


def _commands() -> list[str]:
    """Each script, ``-m MODULE`` for each module with a __main__ guard, and each console script
    pyproject.toml names."""
    scripts = [str(path.relative_to(ROOT)) for path in SCRIPTS]
    return scripts + [f"-m {_module(path)}" for path in GUARDED] + CONSOLE_SCRIPTS


def _entry_point(command: str) -> Callable[[], object]:
    """What ``command`` runs, to call in this process as its command line would run it."""
    if command.endswith(".py"):
        return partial(runpy.run_path, str(ROOT / command), run_name="__main__")
    if command.startswith("-m "):
        return partial(runpy.run_module, command.removeprefix("-m "), run_name="__main__", alter_sys=True)
    installed = {point.name: point for point in metadata.entry_points(group="console_scripts")}
    assert command in installed, f"{command} is not installed; run: pip install -e ."
    return installed[command].load()


# runpy's note that the module was imported before (by this test session) and is run afresh.
@pytest.mark.filterwarnings("ignore:.*found in sys.modules after import:RuntimeWarning")
@pytest.mark.parametrize("command", _commands())
def test_every_command_prints_help_and_touches_nothing(
    command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    cwd, cache = tmp_path / "cwd", tmp_path / "cache"
    cwd.mkdir()
    cache.mkdir()
    for key in list(os.environ):
        if key.startswith("LAYERSKIP_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("LAYERSKIP_CACHE", str(cache))
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", [command, "--help"])
    with pytest.raises(SystemExit) as exit_:
        _entry_point(command)()
    assert exit_.value.code == 0 and "usage" in capsys.readouterr().out.lower()
    assert _snapshot(cwd) == [] and _snapshot(cache) == []


@pytest.mark.parametrize("path", sorted(GUARDED), ids=lambda path: _module(path))
def test_a_main_guard_is_the_modules_last_statement(path: Path) -> None:
    """Above a function it calls, the guard runs ``main`` before that function exists (a NameError
    that ``--help`` never reaches)."""
    assert _is_main_guard(GUARDED[path].body[-1]), f"{path}: move the __main__ guard to the end of the module"


def test_cli_reference_help_leaves_a_stale_page_alone(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from layerskip.cli.reference import main

    stale = tmp_path / "cli.md"
    stale.write_text("out of date\n")
    with pytest.raises(SystemExit) as exit_:
        main(stale, lambda: pytest.fail("--help built the parsers"), ["--help"])
    assert exit_.value.code == 0 and "usage" in capsys.readouterr().out
    assert stale.read_text() == "out of date\n" and os.listdir(tmp_path) == ["cli.md"]
