"""layerskip-twin: save an off-grid twin of a model (its decoder weights moved off any 4-bit grid)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from layerskip.cli.common import check_seed, run_cli
from layerskip.drafts.model.precision import int4_rounding_error
from layerskip.errors import LayerskipError
from layerskip.fileio import check_output_dir, write_json_atomic
from layerskip.hf.models import load_model, save_model_directory
from layerskip.hf.twin import decoder_projection_weights, off_grid_
from layerskip.machine import code_version


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="layerskip-twin", description=__doc__)
    parser.add_argument("--model", default="smollm2-135m", help="embedded name, a local HF directory or a .gguf file")
    parser.add_argument("--out", required=True, help="directory to write the twin to (must not exist yet)")
    parser.add_argument(
        "--scale", type=float, default=0.5, help="noise as a share of one 4-bit step of each block of 32 (0.5)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the noise")
    return parser


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if not 0 < args.scale <= 4:
        raise LayerskipError(f"--scale must be in (0, 4] (got {args.scale}); 0.5 is one int4 rounding's size")
    check_seed(args.seed)
    out = Path(args.out).expanduser()
    if out.exists():
        raise LayerskipError(f"--out {out} exists; choose a new directory (a twin is never written over anything)")
    check_output_dir(out, "--out")  # a link that leads nowhere is refused too: no directory can be made there
    loaded = load_model(args.model)
    before = int4_rounding_error(decoder_projection_weights(loaded.model))
    changed = off_grid_(loaded.model, args.scale, args.seed)
    after = int4_rounding_error(decoder_projection_weights(loaded.model))
    save_model_directory(loaded.model, loaded.tokenizer, out)
    note = {
        "twin_of": loaded.name,
        "scale": args.scale,
        "seed": args.seed,
        "weights_changed": changed,
        "int4_rounding_error": {"model": round(before, 4), "twin": round(after, 4)},
        **code_version(),  # "commit", "dirty": the code that made it
    }
    write_json_atomic(out / "twin.json", note)
    print(f"wrote {out} ({changed:,} decoder weights moved off the 4-bit grid)", file=sys.stderr)
    print(
        f"an int4 copy's median relative error: {before:.3f} on the model, {after:.3f} on the twin "
        "(about 0 on a 4-bit grid, about 0.08 off it)",
        file=sys.stderr,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(_main, argv)


if __name__ == "__main__":
    raise SystemExit(main())
