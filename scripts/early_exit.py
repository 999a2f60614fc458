"""Early exit with confidence: would stopping the draft at an intermediate layer pay?

For each exit depth and confidence threshold, the draft (the model in the draft's precision)
exits after ``depth`` layers where its top-2 confidence there is at least the threshold, and
runs its whole stack elsewhere. Measured: coverage (positions that exit), teacher-forced top-1
agreement with the full model over greedy references, and the draft step's time at each depth.
Projected from those: the draft's cost per token and the speedup of k-token drafts, assuming
independent acceptance (the same model the search's cheap proxy uses, without its replay).

    python scripts/early_exit.py --model smollm2-135m --prompts ../shared/data/spec_bench/question.jsonl \\
        --per-category 1 --out results/early_exit/smollm2-fp32
"""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path

from layerskip.cli.common import csv_text, float_list, int_list, measured_run, model_parser, run_cli
from layerskip.data import builtin_prompts, load_prompts
from layerskip.drafts.builder import DraftModels
from layerskip.drafts.model.precision import PRECISIONS
from layerskip.drafts.rules.costs import expected_tokens
from layerskip.engine.latency import draft_step_seconds, verify_seconds
from layerskip.errors import LayerskipError
from layerskip.fileio import check_output_dir, write_json_atomic, write_text_atomic
from layerskip.hf import adapters
from layerskip.hf.models import load_model
from layerskip.hf.prompting import encode_prompt
from layerskip.measure.agreement import build_references, early_exit_frontier
from layerskip.measure.report import table as markdown_table

OUTPUT_FILES = ("early_exit.json", "early_exit.csv", "early_exit.md")


def projected_speedup(acceptance: float, draft_cost: float, verify_cost: float, k: int) -> float:
    """Tokens per plain-step time of k-token drafts with independent per-token ``acceptance``."""
    return expected_tokens(acceptance, k) / (k * draft_cost + verify_cost)


def _main(argv: list[str] | None) -> int:
    parser = model_parser(__doc__, raw=True)
    parser.add_argument("--prompts", default="builtin", help="'builtin' or a Spec-Bench JSONL")
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--reference-tokens", type=int, default=48, help="greedy tokens per prompt to score")
    parser.add_argument("--depths", type=int_list, default=None, help="exit depths (default: 1/4 .. 5/6 of the layers)")
    parser.add_argument("--thresholds", type=float_list, default=(0.5, 0.8, 0.9, 0.95))
    parser.add_argument("--precision", default=None, help=f"draft precision, one of {', '.join(PRECISIONS)}")
    parser.add_argument("--draft-tokens", type=int, default=4, help="k of the projected speedup")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", default="results/early_exit")
    args = parser.parse_args(argv)
    check_output_dir(args.out, "--out", OUTPUT_FILES)  # before any work: a run that cannot be saved is not started
    if args.precision is not None and args.precision not in PRECISIONS:
        raise LayerskipError(f"--precision must be one of {', '.join(PRECISIONS)}")
    if args.reference_tokens < 2 or args.draft_tokens < 1:
        raise LayerskipError("--reference-tokens must be >= 2 and --draft-tokens >= 1")
    if not all(0.0 <= t < 1.0 for t in args.thresholds):
        raise LayerskipError("--thresholds must lie in [0, 1): a top-2 confidence never reaches 1")
    prompts = load_prompts(args.prompts, per_category=args.per_category)
    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    model = loaded.model
    layers = adapters.num_layers(model)
    depths = args.depths or tuple(sorted({layers // 4, layers // 2, 2 * layers // 3, 3 * layers // 4, 5 * layers // 6}))
    if not all(1 <= d < layers for d in depths):
        raise LayerskipError(f"--depths must lie in 1..{layers - 1} for this {layers}-layer model")
    cpu = next(model.parameters()).device.type == "cpu"
    precision = args.precision or ("int4" if cpu else "model")
    draft_model = DraftModels(model).get(precision)

    ids = [encode_prompt(loaded.tokenizer, p.text, loaded.instruct) for p in prompts]
    references = build_references(model, ids, args.reference_tokens, progress=True)
    whole_agreement, points = early_exit_frontier(draft_model, references, depths, args.thresholds)

    context = encode_prompt(loaded.tokenizer, builtin_prompts()[6].text, loaded.instruct)  # a ~100-token prompt
    plain = verify_seconds(model, context, 1, args.repeats)
    verify = verify_seconds(model, context, args.draft_tokens + 1, args.repeats) / plain
    cost = {
        d: draft_step_seconds(draft_model, context, range(d, layers), range(d, layers), repeats=args.repeats) / plain
        for d in (0, *depths, layers)
    }
    whole = cost[layers]
    rows = [
        {
            "depth": "whole draft",
            "threshold": "",
            "coverage": 0.0,
            "agreement": whole_agreement,
            "agreement_when_exiting": "",
            "draft_cost": whole,
            "projected_speedup": projected_speedup(whole_agreement, whole, verify, args.draft_tokens),
        }
    ]
    for p in points:
        # A position that does not exit has paid for a head at the exit for nothing (cost[0]:
        # embedding, final norm, head and the call itself) on top of the whole draft.
        draft_cost = p.coverage * cost[p.depth] + (1 - p.coverage) * (whole + cost[0])
        rows.append(
            {
                **asdict(p),
                "draft_cost": draft_cost,
                "projected_speedup": projected_speedup(p.agreement, draft_cost, verify, args.draft_tokens),
            }
        )
    result = {
        **measured_run("early_exit.py", argv, loaded, args.dtype),
        "precision": precision,
        "prompts": len(prompts),
        "reference_tokens": args.reference_tokens,
        "plain_step_ms": plain * 1000,
        "verify_cost": {"block": args.draft_tokens + 1, "plain_steps": verify},
        "draft_cost_by_depth": {str(d): c for d, c in cost.items()},
        "rows": rows,
    }
    header = [f"exit depth (of {layers})", "threshold", "coverage", "agreement", "agreement when exiting"]
    header += ["draft cost (plain steps)", f"projected speedup, k={args.draft_tokens}"]
    cells = [
        [r["depth"], r["threshold"], f"{r['coverage']:.2f}", f"{r['agreement']:.3f}"]
        + [f"{when:.3f}" if isinstance(when := r["agreement_when_exiting"], float) else "-"]
        + [f"{r['draft_cost']:.3f}", f"{r['projected_speedup']:.2f}x"]
        for r in rows
    ]
    table = markdown_table(header, cells)
    out = Path(args.out)
    write_json_atomic(out / OUTPUT_FILES[0], result)
    write_text_atomic(out / OUTPUT_FILES[1], csv_text(rows))
    write_text_atomic(out / OUTPUT_FILES[2], table + "\n")
    depth_costs = ", ".join(f"{d}: {c:.2f}" for d, c in cost.items())
    print(f"plain step {plain * 1000:.1f} ms; draft cost by exit depth (plain steps) {depth_costs}")
    print(f"verify of {args.draft_tokens + 1}: {verify:.2f} plain steps")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(_main))
