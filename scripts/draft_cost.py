"""Measured draft-step latency against the fraction of weights bypassed, for a few policies.

Checks that bypassing compute really saves time (no compute-and-discard): the draft step of
each policy is timed on the device (median of repeats after warm-up) next to one plain step.

    python scripts/draft_cost.py --model smollm2-135m --out results/draft_cost
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from layerskip.cli.common import add_model_arguments, run_cli
from layerskip.data import builtin_prompts
from layerskip.engine.policy import DraftSettings, SkipPolicy
from layerskip.engine.vocab import DraftVocabulary
from layerskip.fileio import write_json_atomic, write_text_atomic
from layerskip.hf import adapters
from layerskip.hf.models import load_model
from layerskip.hf.prompting import encode_prompt
from layerskip.measure.latency import draft_step_seconds, verify_seconds


def candidate_policies(layers: int) -> dict[str, SkipPolicy]:
    half = list(range(layers // 2, layers))
    odd = [i for i in range(layers) if i % 2]
    return {
        "nothing skipped": SkipPolicy(),
        "early exit 3/4": SkipPolicy.early_exit(layers, 3 * layers // 4),
        "early exit 1/2": SkipPolicy.early_exit(layers, layers // 2),
        "early exit 1/4": SkipPolicy.early_exit(layers, layers // 4),
        "attention of deep half": SkipPolicy(skip_attention=tuple(half)),
        "MLP of deep half": SkipPolicy(skip_mlp=tuple(half)),
        "every other layer": SkipPolicy.skip_layers(odd),
        "nothing skipped, head 4096": SkipPolicy(draft=DraftSettings(draft_vocab_size=4096)),
        "early exit 1/2, head 4096": SkipPolicy.early_exit(
            layers, layers // 2, draft=DraftSettings(draft_vocab_size=4096)
        ),
    }


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default="results/draft_cost")
    args = parser.parse_args(argv)
    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    model, tokenizer = loaded.model, loaded.tokenizer
    context = encode_prompt(tokenizer, builtin_prompts()[6].text, loaded.instruct)  # a ~100-token prompt
    vocabulary = DraftVocabulary.builtin(tokenizer, model)
    plain = verify_seconds(model, context, 1, args.repeats)
    attn, mlp, total = adapters.sublayer_parameter_counts(model)
    head = adapters.lm_head(model).weight
    rows = []
    for name, policy in candidate_policies(adapters.num_layers(model)).items():
        vocab_rows = vocabulary.rows_for(policy, context)
        seconds = draft_step_seconds(model, context, policy.skip_attention, policy.skip_mlp, vocab_rows, args.repeats)
        # Compute per token: the layers' weights plus the head rows scored (embedding lookups are free).
        layer_weights = sum(attn) + sum(mlp)
        kept = layer_weights - sum(attn[i] for i in policy.skip_attention) - sum(mlp[i] for i in policy.skip_mlp)
        head_rows = head.shape[0] if vocab_rows is None else len(vocab_rows)
        compute = (kept + head_rows * head.shape[1]) / (layer_weights + head.numel())
        rows.append(
            {
                "policy": name,
                "fraction_of_weights_bypassed": policy.fraction_bypassed(model),
                "fraction_of_step_compute": compute,
                "draft_step_ms": seconds * 1000,
                "relative_to_plain_step": seconds / plain,
            }
        )
    result = {
        "model": loaded.name,
        "dtype": args.dtype,
        "device": args.device,
        "plain_step_ms": plain * 1000,
        "total_parameters": total,
        "rows": rows,
    }
    out = Path(args.out)
    write_json_atomic(out / "draft_cost.json", result)
    lines = [
        "| policy | weights bypassed | step compute kept | draft step (ms) | vs plain step |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['policy']} | {r['fraction_of_weights_bypassed']:.2f} | {r['fraction_of_step_compute']:.2f} "
            f"| {r['draft_step_ms']:.1f} | {r['relative_to_plain_step']:.2f} |"
        )
    table = "\n".join(lines)
    write_text_atomic(out / "draft_cost.md", table + "\n")
    print(f"plain step: {plain * 1000:.1f} ms ({loaded.name}, {args.dtype}, {args.device})")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(_main))
