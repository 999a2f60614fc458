"""Search a skip policy with Optuna: see ``--help`` (same as ``layerskip-search``)."""

import os
import sys

if not sys.flags.safe_path:
    # This folder holds this file, search.py, which Python would import in place of the
    # installed `search` package; run again with -P, which keeps the script's folder off the path.
    os.execv(sys.executable, [sys.executable, "-P", *sys.orig_argv[1:]])

from search.cli import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
