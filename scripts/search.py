"""Search a skip policy with Optuna: see ``--help`` (same as ``layerskip-search``)."""

import sys
from pathlib import Path

# This file is named like the `search` package; drop its own folder from the import path so
# `import search` finds the package, not this script.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from search.cli import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
