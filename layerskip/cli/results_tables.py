"""Write the published results from the committed result files (docs/results/*.json): the README's
results table (between its marker comments), docs/results.md, and docs/results/figures.csv and
prompts.csv for notebook 03. Run from the repository root:

    python scripts/results_tables.py                                   # regenerate what changed
    python scripts/results_tables.py --check                           # exit 1 if anything is stale
    python scripts/results_tables.py --add results/bench/x/results.json [--name NAME] [--replace]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from layerskip.cli.common import run_cli
from layerskip.errors import LayerskipError
from layerskip.fileio import check_output_file, write_text_atomic
from layerskip.measure.results import RESULTS_DIR, publish, rendered


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="results_tables.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--root", default=".", help="the repository root (default: the current directory)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if an output is out of date")
    parser.add_argument(
        "--add",
        metavar="RESULTS_JSON",
        help="first copy this bench results.json into docs/results/ (checked; policies' draft vocabularies dropped)",
    )
    parser.add_argument("--name", help="with --add: the file's name (default MODEL-DTYPE-CPUFEATURE)")
    parser.add_argument("--replace", action="store_true", help="with --add: overwrite a result file of that name")
    return parser


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    root = Path(args.root)
    if not (root / "README.md").is_file():
        raise LayerskipError(f"no README.md in {root.resolve()}; run from the repository root or pass --root")
    if args.check and args.add:
        raise LayerskipError("--check writes nothing, --add writes a result file; pass one of them")
    if (args.name or args.replace) and not args.add:
        raise LayerskipError("--name and --replace go with --add RESULTS_JSON")
    if args.add:
        print(f"added {publish(args.add, root / RESULTS_DIR, args.name, args.replace)}", file=sys.stderr)
    outputs = rendered(root)
    stale = {path: text for path, text in outputs.items() if not path.is_file() or path.read_text() != text}
    if args.check:
        for path in stale:
            print(f"out of date: {path}", file=sys.stderr)
        if stale:
            print("run: python scripts/results_tables.py", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:  # every output checked before the first is written: all of them, or none
        check_output_file(path, "output")
    for path, text in stale.items():
        write_text_atomic(path, text)
        print(f"wrote {path}", file=sys.stderr)
    if not stale:
        print("up to date", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(_main, argv)


if __name__ == "__main__":
    raise SystemExit(main())
