"""Profile where decoding time goes: forward cost per block size, the framework floor, and a
per-token split (prefill / draft / verify forward / verify rest / loop) for plain decoding and
each policy, generated interleaved on the same prompts.

    python scripts/profile_decode.py --model smollm2-135m --prompts ../shared/data/spec_bench/question.jsonl \
        --per-category 2 --max-new-tokens 128 --policy policies/smollm2-135m-fp32-hybrid.json \
        --out results/profile/smollm2
"""

from __future__ import annotations

import sys
from pathlib import Path

from layerskip.cli.common import check_policies, load_policies, measured_run, model_parser, run_cli
from layerskip.data import load_prompts
from layerskip.drafts.policy.skip_policy import SkipPolicy
from layerskip.errors import LayerskipError
from layerskip.fileio import check_output_dir, write_json_atomic, write_text_atomic
from layerskip.hf.models import load_model, resolve_device
from layerskip.hf.prompting import encode_prompt, eos_token_ids
from layerskip.measure.profiling import csv_text, forward_costs, markdown, profile_configs, profile_report

OUTPUT_FILES = ("profile.json", "profile.md", "profile.csv")


def _main(argv: list[str] | None) -> int:
    parser = model_parser(__doc__, raw=True)
    parser.add_argument("--prompts", default="builtin")
    parser.add_argument("--per-category", type=int)
    parser.add_argument("--n-prompts", type=int)
    parser.add_argument("--seed", type=int, default=0, help="seed for sampling prompts per category")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--policy", action="append", default=[], help="policy JSON (repeat for several)")
    parser.add_argument("--ablate", action="store_true", help="also profile each policy with each ingredient off")
    parser.add_argument("--repeats", type=int, default=9, help="repeats per forward-cost measurement")
    parser.add_argument("--out", default="results/profile")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    check_output_dir(args.out, "--out", OUTPUT_FILES)  # before any work: a run that cannot be saved is not started
    if args.max_new_tokens <= 0:
        raise LayerskipError(f"--max-new-tokens must be > 0 (got {args.max_new_tokens})")
    prompts = load_prompts(args.prompts, n=args.n_prompts, per_category=args.per_category, seed=args.seed)
    configs: dict[str, SkipPolicy | None] = {"plain": None}
    for label, policy in load_policies(args.policy, resolve_device(args.device)).items():
        configs[label] = policy
        if args.ablate:
            configs.update({f"{label}-{k}": v for k, v in policy.ablations().items()})
    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    model, tokenizer = loaded.model, loaded.tokenizer
    check_policies(configs, model)
    prompt_ids = [encode_prompt(tokenizer, p.text, loaded.instruct) for p in prompts]
    context = max(prompt_ids, key=len)[:256]  # a realistic cache length for the block timings
    costs = forward_costs(model, context, repeats=args.repeats)
    profiles = profile_configs(
        model, prompt_ids, configs, eos_token_ids(model, tokenizer), args.max_new_tokens, progress=not args.no_progress
    )
    report = profile_report(costs, profiles)
    report.update(measured_run("profile_decode.py", argv, loaded, args.dtype))
    report["prompts"] = {"source": args.prompts, "n": len(prompts)}
    out = Path(args.out)
    text = markdown(report)
    print(f"wrote {write_json_atomic(out / OUTPUT_FILES[0], report)}", file=sys.stderr)
    print(f"wrote {write_text_atomic(out / OUTPUT_FILES[1], text + chr(10))}", file=sys.stderr)
    print(f"wrote {write_text_atomic(out / OUTPUT_FILES[2], csv_text(report))}", file=sys.stderr)
    print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(_main, argv)


if __name__ == "__main__":
    raise SystemExit(main())
