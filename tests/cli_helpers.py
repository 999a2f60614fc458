"""Running the command-line scripts as users do, and the one-line-error contract they keep."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def script_env() -> dict[str, str]:
    """Offline, quiet, the repository importable, one torch thread (robust on a busy 2-core machine)."""
    variables = dict(os.environ)
    variables.update(
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )
    return variables


def run_script(script: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """``python scripts/SCRIPT ARGS`` from the repository root."""
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / script), *args],
        cwd=REPO,
        env=script_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_bad_input(result: subprocess.CompletedProcess[str], *fragments: str) -> str:
    """Exit code 2, stderr exactly one line starting with 'error:', no traceback; returns the line."""
    output = result.stdout + result.stderr
    assert "Traceback" not in output, output
    assert result.returncode == 2, output
    lines = result.stderr.strip("\n").splitlines()
    assert len(lines) == 1, f"expected one stderr line, got {len(lines)}:\n{result.stderr}"
    assert lines[0].startswith("error: "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def run_in_process(
    main: Callable[[list[str]], int], capsys: pytest.CaptureFixture[str], *args: str
) -> subprocess.CompletedProcess[str]:
    """``main(argv)``, the function a script calls, in this process: its return value and what it
    printed, as ``run_script`` returns them (an exception that escapes fails the test with its
    traceback). No interpreter start: ~4 s each on a busy 2-core machine."""
    capsys.readouterr()  # drop what the test printed before
    code = main(list(args))
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), code, captured.out, captured.err)
