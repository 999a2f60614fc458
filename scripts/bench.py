"""Benchmark against HF baselines: see ``--help`` (same as ``layerskip-bench``)."""

from layerskip.cli.bench import main

if __name__ == "__main__":
    raise SystemExit(main())
