"""Write docs/cli.md from the tools' argparse parsers (``--check``: exit 1 if it is out of date)."""

from __future__ import annotations

import argparse
from pathlib import Path

from layerskip.cli.reference import main

DOC = Path(__file__).resolve().parents[1] / "docs" / "cli.md"


def parsers() -> dict[str, argparse.ArgumentParser]:
    """The four tools by their installed names, as docs/cli.md lists them."""
    from layerskip.cli import bench, generate, train_exit
    from layerskip.search import cli as search_cli

    return {
        "layerskip-generate": generate.build_parser(),
        "layerskip-search": search_cli.build_parser(),
        "layerskip-bench": bench.build_parser(),
        "layerskip-train-exit": train_exit.build_parser(),
    }


if __name__ == "__main__":
    raise SystemExit(main(DOC, parsers))
