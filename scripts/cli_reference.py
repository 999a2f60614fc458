"""Write docs/cli.md from the tools' argparse parsers (``--check``: exit 1 if it is out of date)."""

from layerskip.cli.reference import main, parsers  # noqa: F401  (parsers: the tools docs/cli.md lists)

if __name__ == "__main__":
    raise SystemExit(main())
