"""Would token trees pay here? The extra tokens per step a tree could add, with its verify for free.

Decodes the prompts greedily with ``auto``'s chains while recording each step's draft (its chain
and the draft's best other tokens), then scores every step against the text the model produced:
how often the draft's next choices held the model's token where the chain failed, how much
longer another lookup match would have run. See ``layerskip.measure.tree_ceiling``.

Beside it, what widening costs on this machine: a greedy verify of ``b`` rows and a draft
forward over ``r`` rows (the draft's whole head), each over one row. A tree pays only where its
extra tokens per step outgrow those costs.

    python scripts/tree_ceiling.py --model smollm2-135m --prompts ../shared/data/spec_bench/question.jsonl \\
        --per-category 3 --out results/tree_ceiling/smollm2-fp32
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from layerskip.cli.common import int_list, measured_run, model_parser, run_cli
from layerskip.data import builtin_prompts, load_prompts
from layerskip.drafts.builder import DraftRun
from layerskip.drafts.model.draft_model import DraftModel
from layerskip.drafts.policy.skip_policy import SkipPolicy
from layerskip.engine.decoding import Decoder, DecodeSettings
from layerskip.engine.latency import curve_timings, median_seconds, prefilled_cache
from layerskip.engine.verify_head import engine_verify_head
from layerskip.errors import LayerskipError
from layerskip.fileio import check_output_dir, write_json_atomic, write_text_atomic
from layerskip.hf.models import load_model
from layerskip.hf.prompting import encode_prompt, eos_token_ids
from layerskip.machine import this_machine
from layerskip.measure.report import table
from layerskip.measure.tree_ceiling import RecordingDrafter, TreeCeiling

OUTPUT_FILES = ("tree_ceiling.json", "tree_ceiling.md")


def draft_row_costs(
    draft_model: DraftModel, context: list[int], rows: tuple[int, ...], repeats: int
) -> dict[int, float]:
    """Seconds of one draft forward (nothing bypassed, the whole head) over ``r`` rows, over one row's."""
    cache, device = prefilled_cache(draft_model.model, context)
    length = len(context)
    head = draft_model.head(None)
    seconds = {}
    for count in rows:
        block = torch.tensor([[context[-1]] * count], device=device)

        def step(block: torch.Tensor = block) -> None:
            draft_model.logits(block, cache, head)
            cache.rollback(length)

        seconds[count] = median_seconds(step, device, repeats)
    return {count: value / seconds[1] for count, value in seconds.items()}


def verify_row_costs(
    model: torch.nn.Module, context: list[int], rows: tuple[int, ...], repeats: int
) -> dict[int, float]:
    """Seconds of a greedy verify over ``b`` rows (as the engine runs it), over one row's."""
    timed = curve_timings(model, context, sorted({1, *rows}), repeats, engine_verify_head(model))
    one = statistics.median(timed[1])
    return {count: statistics.median(timed[count]) / one for count in rows}


def markdown(summary: dict, verify: dict[int, float], draft: dict[int, float]) -> str:
    lines = [
        f"chain: {summary['steps']} steps, {summary['tau_chain']:.2f} tokens per step "
        f"({summary['skip_steps']} skip drafts, {summary['skip_failures']} of them rejected a token; "
        f"{summary['lookup_steps']} lookup drafts)",
        "",
    ]
    extra = summary["extra_tokens_per_step"].items()
    cells = [[name, f"{e:.3f}", f"{e / summary['tau_chain']:.1%}"] for name, e in extra]
    lines.append(table(["tree candidate", "extra tokens per step (free verify)", "share of the chain's"], cells))
    cost = lambda costs, count: f"{costs[count]:.2f}" if count in costs else "-"  # noqa: E731
    cells = [[count, cost(verify, count), cost(draft, count)] for count in sorted(set(verify) | set(draft))]
    lines += ["", table(["rows", "verify / one row", "draft forward / one row"], cells)]
    return "\n".join(lines) + "\n"


def _main(argv: list[str] | None) -> int:
    parser = model_parser(__doc__, raw=True)
    parser.add_argument("--prompts", default="builtin", help="'builtin', 'code' or a Spec-Bench JSONL")
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--siblings", type=int, default=7, help="the draft's other choices recorded per position (1-8)")
    parser.add_argument("--matches", type=int, default=8, help="lookup continuations considered per step (1-16)")
    parser.add_argument("--verify-rows", type=int_list, default=(1, 2, 4, 8, 12, 16, 24))
    parser.add_argument("--draft-rows", type=int_list, default=(1, 2, 4, 8))
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", default="results/tree_ceiling")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    check_output_dir(args.out, "--out", OUTPUT_FILES)  # before any work: a run that cannot be saved is not started
    if not 1 <= args.siblings <= 8 or not 1 <= args.matches <= 16:
        raise LayerskipError("--siblings must be 1..8 and --matches 1..16")
    if args.max_new_tokens < 2 or min(args.verify_rows + args.draft_rows, default=0) < 1:
        raise LayerskipError("--max-new-tokens must be >= 2 and every row count >= 1")
    prompts = load_prompts(args.prompts, per_category=args.per_category)
    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    model, device = loaded.model, next(loaded.model.parameters()).device
    auto = SkipPolicy.auto_trees(device)
    policy = replace(auto, draft=replace(auto.draft, tree_siblings=args.siblings, tree_matches=args.matches))
    decoder = Decoder.for_policy(model, policy)
    assert decoder.draft is not None
    s = policy.draft
    widths = tuple(w for w in (2, 4, 8) if w <= 1 + args.siblings)
    ceiling = TreeCeiling(widths=widths)
    eos = eos_token_ids(model, loaded.tokenizer)
    for prompt in tqdm(prompts, desc="generating", disable=args.no_progress):
        ids = encode_prompt(loaded.tokenizer, prompt.text, loaded.instruct)
        drafter = RecordingDrafter(decoder.draft.start(DraftRun(len(ids), args.max_new_tokens)))
        settings = DecodeSettings(max_new_tokens=args.max_new_tokens, eos_token_ids=eos)
        generated, _ = decoder.decode(ids, settings, drafter=drafter)
        ngrams = (s.lookup_min_ngram, s.lookup_max_ngram)
        ceiling.add(drafter.records, ids + generated, ngrams, s.lookup_max_tokens, args.matches)

    context = encode_prompt(loaded.tokenizer, builtin_prompts()[6].text, loaded.instruct)  # a ~100-token prompt
    with torch.inference_mode():
        verify = verify_row_costs(model, context, args.verify_rows, args.repeats)
        draft = (
            draft_row_costs(decoder.draft_model, context, args.draft_rows, args.repeats) if decoder.draft_model else {}
        )
    summary = ceiling.summary()
    result = {
        **measured_run("tree_ceiling.py", argv, loaded, args.dtype),
        "machine": this_machine(device).describe(),
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "draft_precision": s.precision,
        **summary,
        "verify_rows_cost": {str(k): v for k, v in verify.items()},
        "draft_rows_cost": {str(k): v for k, v in draft.items()},
    }
    table = markdown(summary, verify, draft)
    out = Path(args.out)
    write_json_atomic(out / OUTPUT_FILES[0], result)
    write_text_atomic(out / OUTPUT_FILES[1], table)
    print(f"{loaded.name} {args.dtype} on {result['machine']}, {len(prompts)} prompts")
    print(table, end="")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(_main))
