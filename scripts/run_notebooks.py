"""Execute the notebooks in notebooks/ headless (nbclient) and save them with their outputs.

    python scripts/run_notebooks.py                 # every notebooks/NN_*.ipynb, in place
    python scripts/run_notebooks.py --small         # tiny settings (LAYERSKIP_NOTEBOOK_SMALL=1), as CI runs them
    python scripts/run_notebooks.py --no-save       # execute into temporary copies; the notebooks are not rewritten
    python scripts/run_notebooks.py --jobs 3        # several kernels at once (one torch thread each: --threads 1)
    python scripts/run_notebooks.py notebooks/01_quickstart.ipynb --timeout 300

Each notebook runs in a fresh ``python3`` kernel of this interpreter, with notebooks/ as its
working directory. Exit 1 if a cell raises or a saved notebook is larger than --max-mb.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
KERNEL = "python3"
SMALL_ENV = "LAYERSKIP_NOTEBOOK_SMALL"


def default_notebooks() -> list[Path]:
    return sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


def ensure_kernel() -> None:
    """Make kernel ``python3`` start this interpreter (the venv), whatever else is registered."""
    try:
        import ipykernel.kernelspec
        from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel
    except ImportError:
        raise SystemExit("error: nbclient, nbformat and ipykernel are needed; run: pip install -e '.[dev]'") from None
    try:
        argv0 = KernelSpecManager().get_kernel_spec(KERNEL).argv[0]
    except NoSuchKernel:
        argv0 = ""
    if argv0 in ("python", "python3") or os.path.abspath(argv0) == os.path.abspath(sys.executable):
        return  # jupyter_client resolves a bare "python" to this interpreter
    # Another "python3" kernel is registered (a user-level one shadows the venv's): put a spec
    # for this interpreter first on JUPYTER_PATH, for this process and the kernels it starts.
    spec_root = Path(tempfile.mkdtemp(prefix="layerskip-kernel-"))
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    ipykernel.kernelspec.write_kernel_spec(spec_root / "kernels" / KERNEL, overrides={"argv": argv})
    os.environ["JUPYTER_PATH"] = os.pathsep.join(filter(None, [str(spec_root), os.environ.get("JUPYTER_PATH")]))


@dataclass
class Outcome:
    notebook: Path
    saved: Path
    seconds: float
    size_bytes: int
    error: str | None = None


def kernel_env(small: bool = False, threads: int | None = None) -> dict[str, str]:
    """The environment a kernel starts with: this process's, offline, small mode on or off."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    env.pop(SMALL_ENV, None)
    if small:
        env[SMALL_ENV] = "1"
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def execute(
    notebook: Path, *, out: Path | None = None, timeout: int = 600, small: bool = False, threads: int | None = None
) -> Outcome:
    """Run every cell of ``notebook`` (working directory: its folder) and write the result to
    ``out`` (default: in place). A failing cell is reported in ``error``; what ran is then saved
    to ``out`` or, when that is the notebook itself, to a temporary file (the notebook is kept)."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    notebook = Path(notebook).resolve()
    out = Path(out) if out is not None else notebook
    nb = nbformat.read(notebook, as_version=4)
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name=KERNEL,
        record_timing=False,  # no timestamps in the saved notebook: reruns diff cleanly
        resources={"metadata": {"path": str(notebook.parent)}},
    )
    error = None
    start = time.perf_counter()
    try:
        client.execute(env=kernel_env(small, threads))
    except (CellExecutionError, CellTimeoutError, DeadKernelError) as exc:
        error = str(exc).strip() or type(exc).__name__
    seconds = time.perf_counter() - start
    nb.metadata.pop("widgets", None)
    if error is not None and out == notebook:
        out = Path(tempfile.mkdtemp(prefix="layerskip-failed-")) / notebook.name
    out.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, out)
    return Outcome(notebook, out, seconds, out.stat().st_size, error)


def execute_all(
    notebooks: list[Path], *, out_dir: Path | None = None, jobs: int = 1, **options: object
) -> list[Outcome]:
    """``execute`` each notebook (into ``out_dir`` when given, else in place), ``jobs`` kernels at a time."""

    def run(notebook: Path) -> Outcome:
        print(f"{notebook}: running", file=sys.stderr, flush=True)
        return execute(notebook, out=out_dir / Path(notebook).name if out_dir is not None else None, **options)

    if jobs <= 1:
        return [run(notebook) for notebook in notebooks]
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(run, notebooks))


def image_bytes(path: Path) -> int:
    """Bytes of base64 image data in a saved notebook's outputs."""
    total = 0
    for cell in json.loads(Path(path).read_text())["cells"]:
        for output in cell.get("outputs", []):
            for mime, data in output.get("data", {}).items():
                if mime.startswith("image/"):
                    total += len("".join(data) if isinstance(data, list) else data)
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("notebooks", nargs="*", type=Path, help="default: notebooks/NN_*.ipynb")
    parser.add_argument("--small", action="store_true", help=f"tiny settings, as CI runs them ({SMALL_ENV}=1)")
    parser.add_argument("--no-save", action="store_true", help="execute into temporary copies; leave the notebooks")
    parser.add_argument("--timeout", type=int, default=600, help="seconds allowed per cell (default 600)")
    parser.add_argument("--threads", type=int, help="OMP_NUM_THREADS for the kernels (default: torch's own choice)")
    parser.add_argument("--jobs", type=int, default=1, help="notebooks run at once, each in its own kernel")
    parser.add_argument("--max-mb", type=float, default=2.0, help="fail if a saved notebook is larger (default 2)")
    args = parser.parse_args(argv)
    notebooks = args.notebooks or default_notebooks()
    missing = [str(p) for p in notebooks if not Path(p).is_file()]
    if missing or not notebooks:
        print(f"error: no notebook at {', '.join(missing) or NOTEBOOKS}", file=sys.stderr)
        return 2
    ensure_kernel()
    out_dir = Path(tempfile.mkdtemp(prefix="layerskip-notebooks-")) if args.no_save else None
    outcomes = execute_all(
        notebooks, out_dir=out_dir, jobs=args.jobs, timeout=args.timeout, small=args.small, threads=args.threads
    )
    failed = 0
    for outcome in outcomes:
        size_mb = outcome.size_bytes / 2**20
        status = "ok"
        if outcome.error:
            status = "FAILED"
            print(outcome.error, file=sys.stderr)
        elif size_mb > args.max_mb:
            status = f"FAILED: larger than {args.max_mb} MB"
        failed += status != "ok"
        print(
            f"{outcome.notebook}: {status} in {outcome.seconds:.1f} s -> {outcome.saved} "
            f"({size_mb:.2f} MB, images {image_bytes(outcome.saved) / 2**10:.0f} KiB)",
            file=sys.stderr,
            flush=True,
        )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
