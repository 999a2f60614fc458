"""Write docs/cli.md from the tools' argparse parsers (``--check``: exit 1 if it is out of date)."""

from __future__ import annotations

import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "cli.md"


def parsers() -> dict:
    """The four tools by their installed names, as docs/cli.md lists them."""
    from layerskip.cli import bench, generate, train_exit
    from layerskip.search import cli as search_cli

    return {
        "layerskip-generate": generate.build_parser(),
        "layerskip-search": search_cli.build_parser(),
        "layerskip-bench": bench.build_parser(),
        "layerskip-train-exit": train_exit.build_parser(),
    }


def main(argv: list[str] | None = None) -> int:
    from layerskip.cli.reference import reference

    check = "--check" in (sys.argv[1:] if argv is None else argv)
    text = reference(parsers())
    if DOC.is_file() and DOC.read_text() == text:
        print(f"{DOC} is up to date", file=sys.stderr)
        return 0
    if check:
        print(f"{DOC} is out of date; run: python scripts/cli_reference.py", file=sys.stderr)
        return 1
    from layerskip.fileio import write_text_atomic

    write_text_atomic(DOC, text)
    print(f"wrote {DOC}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
