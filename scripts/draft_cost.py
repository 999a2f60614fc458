"""What a draft step costs, against what it keeps, its physical floor, and where its milliseconds go.

For a set of drafts (bypassed sublayers, draft precision, truncated head; add your own with
--policy) the draft step is timed on the device (median of repeats after warm-up) next to one
plain step (a full forward of one token with every logit, as HF ``generate`` takes it), with the
fraction of the step's weights it still reads and its bandwidth floor: the bytes it must read
(kept weights in the draft's precision, its head rows, the K/V it attends to) over the memory
bandwidth a large copy measures on this machine. On the CPU each step is also split
(torch.profiler self times) into the LM head, the kept projections, attention kernels, the other
tensor ops (norms, rotary, residual adds, casts, cache writes) and the rest of the wall time
(Python, module calls, dispatch).

The verify curve t(n)/t(1), n = 1..8, is timed for the greedy verify as the engine runs it (its
head certified from bf16 on the CPU), in fp32 and in bf16 (a bf16 copy of the model), each also
against the plain step of its dtype.

    python scripts/draft_cost.py --model smollm2-135m --out results/draft_cost/smollm2-fp32
"""

from __future__ import annotations

import copy
import os
import sys
import tempfile
import time
from pathlib import Path
from unittest.mock import patch

import torch

from layerskip.cli.common import check_policies, load_policies, measured_run, model_parser, run_cli
from layerskip.data import builtin_prompts
from layerskip.drafts.builder import DraftModels, head_rows
from layerskip.drafts.policy.skip_policy import DraftSettings, SkipPolicy
from layerskip.engine.latency import DraftStep, draft_step_seconds, median_seconds, verify_seconds
from layerskip.engine.verify_head import engine_verify_head
from layerskip.errors import LayerskipError
from layerskip.fileio import check_output_dir, write_json_atomic, write_text_atomic
from layerskip.hf import adapters
from layerskip.hf.models import load_model, resolve_device
from layerskip.hf.prompting import encode_prompt
from layerskip.machine import this_machine
from layerskip.measure.latency import copy_bandwidth, draft_bytes_read, draft_step_breakdown
from layerskip.measure.report import table as markdown_table

OUTPUT_FILES = ("draft_cost.json", "draft_cost.md")
BREAKDOWN = ("head_ms", "layer_projections_ms", "attention_kernels_ms", "other_ops_ms", "python_and_dispatch_ms")


def candidate_policies(layers: int, cpu: bool) -> dict[str, SkipPolicy]:
    half = list(range(layers // 2, layers))
    odd = [i for i in range(layers) if i % 2]
    low = "int4" if cpu else "bfloat16"
    head = DraftSettings(draft_vocab_size=4096)
    cheap = DraftSettings(draft_vocab_size=4096, precision=low)
    return {
        "nothing skipped": SkipPolicy(),
        "early exit 3/4": SkipPolicy.early_exit(layers, 3 * layers // 4),
        "early exit 1/2": SkipPolicy.early_exit(layers, layers // 2),
        "early exit 1/4": SkipPolicy.early_exit(layers, layers // 4),
        "attention of deep half": SkipPolicy(skip_attention=tuple(half)),
        "MLP of deep half": SkipPolicy(skip_mlp=tuple(half)),
        "every other layer": SkipPolicy.skip_layers(odd),
        "nothing skipped, head 4096": SkipPolicy(draft=head),
        "early exit 1/2, head 4096": SkipPolicy.early_exit(layers, layers // 2, draft=head),
        "nothing skipped, bfloat16": SkipPolicy(draft=DraftSettings(precision="bfloat16")),
        f"nothing skipped, {low}, head 4096": SkipPolicy(draft=cheap),
        f"early exit 3/4, {low}, head 4096": SkipPolicy.early_exit(layers, 3 * layers // 4, draft=cheap),
        f"early exit 1/2, {low}, head 4096": SkipPolicy.early_exit(layers, layers // 2, draft=cheap),
    }


VERIFY_BLOCKS = range(1, 9)


def verify_curve(model: torch.nn.Module, context: list[int], repeats: int) -> dict[str, object]:
    """The engine's greedy verify of n = 1..8 tokens: t(n)/t(1), and t(n) over the plain step
    (one token, every logit: HF's step) of the same model."""
    plain = verify_seconds(model, context, 1, repeats)
    greedy = engine_verify_head(model)
    seconds = {n: verify_seconds(model, context, n, repeats, greedy) for n in VERIFY_BLOCKS}
    return {
        "plain_step_seconds": plain,
        "verify_seconds": {str(n): s for n, s in seconds.items()},
        "relative": {str(n): s / seconds[1] for n, s in seconds.items()},
        "to_plain_step": {str(n): s / plain for n, s in seconds.items()},
        "certified_head": greedy.certified,
    }


def compile_measurement(model: torch.nn.Module, context: list[int], precision: str, repeats: int) -> dict[str, object]:
    """The whole lean draft step (nothing bypassed, a 4096-row head) eager and through torch.compile:
    compile time with an empty inductor cache (a fresh temporary directory), then again from that
    on-disk cache (in-memory caches reset), and the median step of each. The caller's inductor
    cache setting is restored afterwards."""
    import torch._dynamo

    rows = list(range(4096))
    eager = DraftModels(model).get(precision)
    result: dict[str, object] = {"precision": precision, "inductor_cache": "a fresh temporary directory"}
    try:
        with tempfile.TemporaryDirectory() as cold, patch.dict(os.environ, {"TORCHINDUCTOR_CACHE_DIR": cold}):
            for label in ("cold", "cached"):
                torch._dynamo.reset()
                compiled = DraftModels(model).get(precision, compile=True)  # a fresh one: compiled anew
                start = time.perf_counter()
                draft_step_seconds(compiled, context, (), (), rows, repeats=1)  # compiles on its first step
                result[f"compile_and_first_steps_s_{label}"] = time.perf_counter() - start
            result["compiled_step_ms"] = 1000 * draft_step_seconds(compiled, context, (), (), rows, repeats)
    finally:
        torch._dynamo.reset()
    result["eager_step_ms"] = 1000 * draft_step_seconds(eager, context, (), (), rows, repeats)
    result["pays"] = result["compiled_step_ms"] < 0.95 * result["eager_step_ms"]
    return result


def _main(argv: list[str] | None) -> int:
    parser = model_parser(__doc__, raw=True)
    parser.add_argument("--policy", action="append", default=[], help="also time this policy's draft (repeatable)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default="results/draft_cost")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="also time the lean int4 draft step through torch.compile: compile time (cold, then from the "
        "on-disk cache) and the step against the eager one",
    )
    args = parser.parse_args(argv)
    if args.repeats < 1:
        raise LayerskipError(f"--repeats must be >= 1 (got {args.repeats})")
    check_output_dir(args.out, "--out", OUTPUT_FILES)  # before any work: a run that cannot be saved is not started
    extra = load_policies(args.policy, resolve_device(args.device))
    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    model, tokenizer = loaded.model, loaded.tokenizer
    check_policies(extra, model)
    device = next(model.parameters()).device
    cpu = device.type == "cpu"
    context = encode_prompt(tokenizer, builtin_prompts()[6].text, loaded.instruct)  # a ~100-token prompt
    bandwidth = copy_bandwidth(device)
    curves = {args.dtype: verify_curve(model, context, args.repeats)}
    if args.dtype == "float32":  # the same model in bf16, for its curve
        curves["bfloat16"] = verify_curve(copy.deepcopy(model).to(torch.bfloat16), context, args.repeats)
    plain = curves[args.dtype]["plain_step_seconds"]
    plain_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    attn, mlp, total = adapters.sublayer_parameter_counts(model)
    head = adapters.lm_head(model).weight
    rows = []
    draft_models = DraftModels(model)
    memory_mb: dict[str, float] = {}  # per draft precision: the copies its draft model keeps
    for name, policy in {**candidate_policies(adapters.num_layers(model), cpu), **extra}.items():
        precision = policy.draft.precision
        draft_model = draft_models.for_policy(policy, all_sublayers=True)
        memory_mb[precision] = max(memory_mb.get(precision, 0.0), draft_model.nbytes / 2**20)
        head_ids = head_rows(policy, head.shape[0])
        with torch.inference_mode():  # the step timed, profiled and counted in bytes below
            step = DraftStep(
                draft_model, context, attention=policy.skip_attention, mlp=policy.skip_mlp, head_rows=head_ids
            )
            seconds = median_seconds(step, step.device, args.repeats)
        read = draft_bytes_read(step)
        # Compute per token: the layers' weights plus the head rows scored (embedding lookups are free).
        layer_weights = sum(attn) + sum(mlp)
        kept = layer_weights - sum(attn[i] for i in policy.skip_attention) - sum(mlp[i] for i in policy.skip_mlp)
        scored = head.shape[0] if head_ids is None else len(set(head_ids) | set(context))
        row = {
            "policy": name,
            "precision": precision,
            "fraction_of_weights_bypassed": policy.fraction_bypassed(model),
            "fraction_of_step_compute": (kept + scored * head.shape[1]) / (layer_weights + head.numel()),
            "draft_step_ms": seconds * 1000,
            "relative_to_plain_step": seconds / plain,
            "draft_step": draft_model.step_kind,
            "bytes_read_mb": read / 1e6,
            "bandwidth_floor_ms": 1000 * read / bandwidth,
            "floor_relative_to_plain_step": read / bandwidth / plain,
        }
        if cpu:
            row.update(draft_step_breakdown(step, repeats=args.repeats))
        rows.append(row)
    compiled = (
        compile_measurement(model, context, "int4" if cpu else "bfloat16", args.repeats) if args.compile else None
    )
    result = {
        "compiled_lean_step": compiled,
        **measured_run("draft_cost.py", argv, loaded, args.dtype),
        "machine": this_machine(device).describe(),
        "plain_step_ms": plain * 1000,
        "plain_step_bandwidth_floor_ms": 1000 * plain_bytes / bandwidth,
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "total_parameters": total,
        "verify_relative": curves[args.dtype]["relative"],
        "verify_relative_to_plain_step": curves[args.dtype]["to_plain_step"],
        "verify_curves": curves,
        "draft_memory_mb": memory_mb,
        "rows": rows,
    }
    header = ["policy", "weights bypassed", "step compute kept", "draft step (ms)", "vs plain step", "floor (ms)"]
    header += ["floor vs plain step", "step"]
    header += ["head", "projections", "attention", "other ops", "Python & dispatch"] if cpu else []
    cells = [
        [r["policy"], *(f"{r[key]:.2f}" for key in ("fraction_of_weights_bypassed", "fraction_of_step_compute"))]
        + [f"{r['draft_step_ms']:.1f}", f"{r['relative_to_plain_step']:.2f}", f"{r['bandwidth_floor_ms']:.1f}"]
        + [f"{r['floor_relative_to_plain_step']:.2f}", r["draft_step"]]
        + [f"{r[key]:.1f}" for key in (BREAKDOWN if cpu else ())]
        for r in rows
    ]
    curve_cells = [
        [f"{dtype} {label}", *(f"{curve[key][str(n)]:.2f}" for n in VERIFY_BLOCKS)]
        for dtype, curve in curves.items()
        for key, label in (("relative", "t(n)/t(1)"), ("to_plain_step", "t(n) / plain step"))
    ]
    table = markdown_table(header, cells) + "\n\n" + markdown_table(["verify block n", *VERIFY_BLOCKS], curve_cells)
    out = Path(args.out)
    write_json_atomic(out / OUTPUT_FILES[0], result)
    write_text_atomic(out / OUTPUT_FILES[1], table + "\n")
    print(
        f"plain step: {plain * 1000:.1f} ms ({loaded.name}, {args.dtype}, {result['device']}); "
        f"copy bandwidth {bandwidth / 1e9:.1f} GB/s; {result['machine']}"
    )
    print(table)
    if compiled is not None:
        print(
            f"lean int4 step through torch.compile: {compiled['compiled_step_ms']:.1f} ms against "
            f"{compiled['eager_step_ms']:.1f} ms eager; compile {compiled['compile_and_first_steps_s_cold']:.0f} s "
            f"cold, {compiled['compile_and_first_steps_s_cached']:.0f} s from its cache"
        )
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(_main))
