"""Train exit adapters by self-distillation: see ``--help`` (same as ``layerskip-train-exit``)."""

from layerskip.cli.train_exit import main

if __name__ == "__main__":
    raise SystemExit(main())
