"""Write the README's results table, docs/results.md and notebook 03's data from docs/results/*.json:
see ``--help``."""

from layerskip.cli.results_tables import main

if __name__ == "__main__":
    raise SystemExit(main())
