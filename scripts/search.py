"""Search a skip policy with Optuna: see ``--help`` (same as ``layerskip-search``)."""

from layerskip.search.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
