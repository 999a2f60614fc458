"""Generate text plainly or self-speculatively: see ``--help`` (same as ``layerskip-generate``)."""

from layerskip.cli.generate import main

if __name__ == "__main__":
    raise SystemExit(main())
