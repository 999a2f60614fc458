"""layerskip-bench: Spec-Bench-style benchmark of self-speculative decoding against HF baselines."""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from layerskip.cli.common import (
    THREADS_HELP,
    add_chat_argument,
    add_prompt_arguments,
    check_policies,
    command_line,
    encode_prompts,
    load_policies,
    model_parser,
    run_cli,
    str_list,
    thread_settings,
    warn_if_tuned_elsewhere,
)
from layerskip.data import prompts_selected_by
from layerskip.drafts.policy.skip_policy import ABLATIONS, SkipPolicy
from layerskip.errors import LayerskipError
from layerskip.fileio import check_output_dir, load_json
from layerskip.hf.models import load_model, resolve_device
from layerskip.hf.prompting import eos_token_ids
from layerskip.measure import llamacpp
from layerskip.measure.batches import LAYOUTS, figures_as_dicts, run_batches, summarise_batches
from layerskip.measure.bench import (
    METHODS,
    BenchConfig,
    build_methods,
    check_methods,
    environment,
    measure_memory,
    rows_as_dicts,
    rows_from_dicts,
    run_benchmark,
    summarise,
    tuning_categories,
)
from layerskip.measure.load import busy_processes
from layerskip.measure.memory import loaded_model_mb
from layerskip.measure.report import (
    BATCH_FILES,
    OUTPUT_FILES,
    batch_markdown,
    check_outputs_replaceable,
    markdown_report,
    write_batch_outputs,
    write_outputs,
)
from layerskip.sampling import Sampling


def build_parser() -> argparse.ArgumentParser:
    parser = model_parser(__doc__, prog="layerskip-bench")
    add_prompt_arguments(parser)
    parser.add_argument("--per-category", type=int, help="prompts per category")
    parser.add_argument("--categories", type=str_list, default=(), help="only these prompt categories, e.g. qa,rag")
    parser.add_argument("--n-prompts", type=int, help="cap on the number of prompts")
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed for choosing prompts per category; with --temperature, also of each prompt's draws",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        metavar="T",
        help="sample instead of decoding greedily, every method alike (HF's with generate(do_sample=True)), "
        "each prompt's draws seeded from --seed and the prompt; outputs are then not compared token for token",
    )
    parser.add_argument("--top-p", type=float, metavar="P", help="with --temperature: nucleus mass kept (default 1)")
    parser.add_argument("--top-k", type=int, metavar="K", help="with --temperature: most likely tokens kept (0 = all)")
    parser.add_argument(
        "--generation-config",
        metavar="JSON",
        help="a JSON object of HF generate arguments that add logits processors (e.g. a model's "
        "generation_config.json: repetition_penalty, no_repeat_ngram_size, min_new_tokens, bad_words_ids ...), "
        "given to every method alike; the flags below override its keys",
    )
    parser.add_argument(
        "--ignore-eos",
        action="store_true",
        help="every method writes --max-new-tokens tokens (no method stops at the model's EOS): "
        "figures of equal length, with no processor involved",
    )
    parser.add_argument("--min-new-tokens", type=int, metavar="N", help="generate's min_new_tokens, every method")
    parser.add_argument("--repetition-penalty", type=float, metavar="P", help="generate's repetition_penalty")
    parser.add_argument("--no-repeat-ngram-size", type=int, metavar="N", help="generate's no_repeat_ngram_size")
    parser.add_argument(
        "--suppress-tokens", type=str_list, metavar="IDS", help="generate's suppress_tokens: comma-separated token ids"
    )
    parser.add_argument("--methods", default="hf-ar,ar,self-spec", help=f"comma-separated, from: {', '.join(METHODS)}")
    parser.add_argument(
        "--policy",
        action="append",
        default=[],
        help="for self-spec (repeat for several): a policy JSON, 'auto', 'auto-trees', 'on-the-fly' or "
        "'on-the-fly:PATH'",
    )
    parser.add_argument(
        "--ablate",
        nargs="?",
        const=True,
        default=False,
        type=str_list,
        metavar="NAMES",
        help="also run each policy with each drafting ingredient off (lookup, skip draft, truncated head, exit "
        "adapter); with NAMES (e.g. no-adapter,full-head) only those ablations",
    )
    parser.add_argument(
        "--tree-ablation",
        action="store_true",
        help="also run each policy that drafts token trees with trees off, as 'METHOD (chain)', interleaved",
    )
    parser.add_argument(
        "--threads",
        type=thread_settings,
        default=("auto",),
        help=THREADS_HELP + ". A list (e.g. auto,1,2) runs every method again under each further setting, "
        "named NAME@t1 ...; HF methods take counts only and the hf-ar baseline keeps the process's count",
    )
    parser.add_argument(
        "--busy-processes",
        type=int,
        default=0,
        metavar="N",
        help="run N spinning processes during the timed runs, to measure on a machine that is not idle",
    )
    parser.add_argument("--assistant-model", help="a second, smaller model for hf-assistant")
    parser.add_argument(
        "--gguf",
        metavar="PATH",
        help="the GGUF file methods llama.cpp and llama.cpp-lookup run (default: the file --model was loaded from, "
        "an embedded model's or a .gguf path); needs llama-cpp-python: " + llamacpp.INSTALL,
    )
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens per prompt at most")
    add_chat_argument(parser)
    parser.add_argument(
        "--batch-size",
        type=str_list,
        metavar="SIZES",
        help="measure batches instead of one prompt at a time: e.g. 1,2,4,8,16 runs HF's batched generate and "
        "the self-speculative plug-in (the first --policy, default auto) on the same left-padded batches "
        "(writes batches.json, batches.csv, batches.md)",
    )
    parser.add_argument(
        "--batch-layouts",
        type=str_list,
        default=("similar", "mixed"),
        help="with --batch-size: 'similar' (prompts of neighbouring lengths) and/or 'mixed' (shortest to longest)",
    )
    parser.add_argument("--batch-repeats", type=int, default=2, help="with --batch-size: timed runs per method")
    parser.add_argument("--out", required=True, help="directory for results.json, results.csv, results.md, speedup.png")
    parser.add_argument("--force", action="store_true", help="replace report files in --out that no bench run wrote")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument(
        "--from-results",
        metavar="RESULTS_JSON",
        help="re-summarise a saved run's per-prompt rows (no model, no timing) and write the reports to --out",
    )
    return parser


def resummarise(path: str) -> dict:
    """A saved run's figures recomputed from its per-prompt rows and the policies it recorded."""
    results = load_json(path, "--from-results file", "pass a results.json that bench wrote", expect=None)
    if not isinstance(results, dict):
        raise LayerskipError(f"{path} is not a layerskip-bench results.json; pass the file bench wrote")
    try:
        rows = rows_from_dicts(results["per_prompt"])
        # Only the provenance matters here; a run saved by an older version may hold fields since renamed.
        recorded = results["policies"].items()
        policies = {label: SkipPolicy(provenance=dict(data["provenance"])) for label, data in recorded}
        return {**results, "methods": summarise(rows, _tuned_on(rows, policies))}
    except (KeyError, TypeError, AttributeError, IndexError, ValueError) as error:
        # A hand-edited or truncated file: rows of the wrong shape fail anywhere in the summary.
        detail = (str(error).strip().splitlines() or [""])[0]
        problem = f"missing {error}" if isinstance(error, KeyError) else f"{type(error).__name__}: {detail}"
        raise LayerskipError(f"not a layerskip-bench results.json ({problem}); pass the file bench wrote") from None


def _tuned_on(rows: list, policies: dict[str, SkipPolicy]) -> dict[str, frozenset[str]]:
    # Method names as build_methods gave them: "self-spec" for a lone policy, else "self-spec:LABEL".
    tuned_on = {}
    for name in {row.method for row in rows}:
        base, _, label = name.partition(":")
        if base != "self-spec":
            continue
        policy = policies.get(label) if label else next(iter(policies.values()), None)
        if (cats := tuning_categories(policy)) is not None:
            tuned_on[name] = cats
    return tuned_on


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    check_output_dir(args.out, "--out", OUTPUT_FILES)  # before any work: a run that cannot be saved is not started
    check_outputs_replaceable(args.out, args.force)
    if args.from_results:
        results = resummarise(args.from_results)
        return _report(write_outputs(results, args.out), markdown_report(results))
    command = command_line("layerskip-bench", argv)
    if args.max_new_tokens <= 0:
        raise LayerskipError(f"--max-new-tokens must be > 0 (got {args.max_new_tokens})")
    sampling = _sampling(args)
    args.generation = _generation(args)
    if args.batch_size is not None:  # "," included: refused as naming no size, never the per-prompt run
        if args.gguf is not None:
            raise LayerskipError("--batch-size measures HF batched generate and the plug-in; drop --gguf")
        if sampling is not None:
            raise LayerskipError("--batch-size measures greedy decoding; drop --temperature, --top-p and --top-k")
        return run_batch_bench(args, command)
    if args.busy_processes < 0:
        raise LayerskipError(f"--busy-processes must be >= 0 (got {args.busy_processes})")
    names = [n.strip() for n in args.methods.split(",") if n.strip()]
    check_methods(names, bool(args.policy), bool(args.assistant_model))
    llamacpp.check_request(names, args.model, args.gguf, sampling is not None, args.generation)
    if not isinstance(args.ablate, bool) and (unknown := sorted(set(args.ablate) - set(ABLATIONS))):
        raise LayerskipError(f"unknown --ablate name(s) {unknown}; choose from {', '.join(ABLATIONS)}")
    prompts = prompts_selected_by(args.prompts, args)
    policies = load_policies(args.policy, resolve_device(args.device))
    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    model, tokenizer = loaded.model, loaded.tokenizer
    device = next(model.parameters()).device
    loaded_mb = loaded_model_mb(model)  # the model loaded, no draft built yet (measure.memory)
    check_policies(policies, model)
    warn_if_tuned_elsewhere(policies, device, args)
    helper = load_model(args.assistant_model, args.dtype, args.device) if args.assistant_model else None
    prompt_ids = encode_prompts(loaded, args, [p.text for p in prompts], [f"prompt {p.id}" for p in prompts])
    gguf = _gguf_peer(args, names, prompt_ids)
    methods = build_methods(
        model,
        names,
        _eos(model, tokenizer, args.ignore_eos),
        policies,
        None if helper is None else helper.model,
        ablate=args.ablate,
        threads=args.threads,
        tree_ablation=args.tree_ablation,
        sampling=sampling,
        seed=args.seed,
        generation=args.generation,
        gguf=gguf,
        tokenizers=None if helper is None else (tokenizer, helper.tokenizer),
        lookup_tokens=LOOKUP_TOKENS,
    )
    config = BenchConfig(args.max_new_tokens, progress=not args.no_progress, sampling=sampling)
    with busy_processes(args.busy_processes):
        rows = run_benchmark(model, methods, prompts, prompt_ids, config, tokenizer=tokenizer)
    memory = measure_memory(methods, prompt_ids, args.max_new_tokens, device, loaded_mb)  # untimed, after the runs
    env = environment(device)
    results = {
        "command": command,
        "device": env["device"],
        "device_name": env["device_name"],  # the GPU's name, or the CPU model
        "dtype": args.dtype,
        "versions": env["versions"],
        "model": loaded.name,
        "max_new_tokens": args.max_new_tokens,
        # None: greedy, every output compared with HF generate's; else how every method sampled.
        "sampled": None if sampling is None else {**asdict(sampling), "seed": args.seed},
        "generation": args.generation,  # generate arguments every method got (logits processors)
        "ignore_eos": args.ignore_eos,
        "threads": list(args.threads),
        "busy_processes": args.busy_processes,
        "prompts": {"source": args.prompts, "n": len(prompts), "categories": sorted({p.category for p in prompts})},
        # The file llama.cpp's methods ran, by name: a result file holds no path of the machine that made it.
        **({"gguf": gguf.path.name} if gguf is not None else {}),
        "policies": {label: policy.to_dict() for label, policy in policies.items()},
        "draft_memory_mb": {m.name: m.draft_memory_mb for m in methods if m.draft_memory_mb is not None},
        "memory": memory,
        "methods": summarise(
            rows, {m.name: cats for m in methods if (cats := tuning_categories(m.policy)) is not None}
        ),
        "per_prompt": rows_as_dicts(rows),
        "environment": env,
    }
    _report(write_outputs(results, args.out), markdown_report(results))
    slower = [n for n, f in results["methods"].items() if n != "hf-ar" and (f["overall"]["speedup"] or 0) < 1.0]
    if slower:
        print(f"\nslower than HF generate here: {', '.join(slower)}")
    return 0


LOOKUP_TOKENS = 10  # tokens a prompt-lookup draft proposes: hf-pld, self-spec-lookup and llama.cpp-lookup alike


def _gguf_peer(args: argparse.Namespace, names: list[str], prompt_ids: list[list[int]]) -> llamacpp.GGUFPeer | None:
    """The GGUF file and KV cache size of the llama.cpp methods (None: none was asked for). The
    context holds the longest prompt, the new tokens (or the warm-up's, if more) and one draft more."""
    if not llamacpp.wanted(names):
        return None
    new_tokens = max(args.max_new_tokens, BenchConfig.warmup_tokens)
    context = max(len(ids) for ids in prompt_ids) + new_tokens + LOOKUP_TOKENS + 1
    return llamacpp.GGUFPeer(llamacpp.gguf_path(args.model, args.gguf), context)


def _sampling(args: argparse.Namespace) -> Sampling | None:
    """``--temperature`` turns sampling on; ``--top-p`` / ``--top-k`` without it would be ignored, so
    they are refused. Values are checked here, before any model loads."""
    if args.temperature is None:
        given = [flag for flag, value in (("--top-p", args.top_p), ("--top-k", args.top_k)) if value is not None]
        if given:
            raise LayerskipError(f"{', '.join(given)} shape sampled decoding, which --temperature turns on")
        return None
    top_p = 1.0 if args.top_p is None else args.top_p
    return Sampling(args.temperature, args.top_k or 0, top_p)


# generate arguments the bench gives every method alike, and what each must be.
_GENERATION_FLAGS = {
    "min_new_tokens": ("--min-new-tokens", lambda v: type(v) is int and v >= 0, "a whole number >= 0"),
    "repetition_penalty": ("--repetition-penalty", lambda v: type(v) in (int, float) and v > 0, "a number > 0"),
    "no_repeat_ngram_size": ("--no-repeat-ngram-size", lambda v: type(v) is int and v > 0, "a whole number > 0"),
    "suppress_tokens": ("--suppress-tokens", lambda v: bool(v), "one token id or more"),
}
# Keys of a --generation-config file that the bench sets itself (or that are not logits processors).
_GENERATION_OWN = {"max_new_tokens", "max_length", "do_sample", "temperature", "top_p", "top_k", "eos_token_id"}


def _generation(args: argparse.Namespace) -> dict[str, Any]:
    """The generate arguments every method gets: --generation-config's, then the flags'; checked
    before any model loads."""
    generation: dict[str, Any] = {}
    if args.generation_config:
        config = load_json(args.generation_config, "--generation-config", "pass a JSON object of generate arguments")
        generation = {key: value for key, value in config.items() if key not in _GENERATION_OWN}
    generation.update({key: getattr(args, key) for key in _GENERATION_FLAGS if getattr(args, key) is not None})
    if isinstance(generation.get("suppress_tokens"), (list, tuple)):  # the flag's text, or a file's list
        try:
            generation["suppress_tokens"] = [int(t) for t in generation["suppress_tokens"]]
        except (TypeError, ValueError):
            raise LayerskipError(
                f"--suppress-tokens must be token ids (got {generation['suppress_tokens']!r})"
            ) from None
    for key, (flag, valid, what) in _GENERATION_FLAGS.items():
        if key in generation and not valid(generation[key]):
            raise LayerskipError(f"{flag} must be {what} (got {generation[key]!r})")
    if "repetition_penalty" in generation:
        generation["repetition_penalty"] = float(generation["repetition_penalty"])  # HF's processor takes a float
    return generation


def _eos(model: Any, tokenizer: Any, ignore: bool) -> tuple[int, ...]:
    """The EOS ids every method stops at; none with ``ignore``. HF's ``generate`` falls back to the
    model's generation config when given none, so the loaded model's own is cleared too (the bench
    loaded it, and nothing else uses it)."""
    if not ignore:
        return eos_token_ids(model, tokenizer)
    model.generation_config.eos_token_id = None
    return ()


def run_batch_bench(args: argparse.Namespace, command: str) -> int:
    """``--batch-size``: HF batched against the plug-in on the same batches (``measure.batches``)."""
    sizes = _batch_sizes(args.batch_size)
    if not args.batch_layouts:
        raise LayerskipError("--batch-layouts names no layout; pass similar, mixed or similar,mixed")
    for layout in args.batch_layouts:
        if layout not in LAYOUTS:
            raise LayerskipError(f"unknown --batch-layouts value '{layout}'; use {', '.join(LAYOUTS)}")
    if args.batch_repeats < 1:
        raise LayerskipError(f"--batch-repeats must be >= 1 (got {args.batch_repeats})")
    check_output_dir(args.out, "--out", BATCH_FILES)
    prompts = prompts_selected_by(args.prompts, args)
    if len(prompts) < max(sizes):
        raise LayerskipError(f"--batch-size {max(sizes)} needs as many prompts; --prompts gave {len(prompts)}")
    policy = args.policy[0] if args.policy else "auto"
    policies = load_policies([policy], resolve_device(args.device))
    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    model, tokenizer = loaded.model, loaded.tokenizer
    check_policies(policies, model)
    prompt_ids = encode_prompts(loaded, args, [p.text for p in prompts], [f"prompt {p.id}" for p in prompts])
    eos = _eos(model, tokenizer, args.ignore_eos)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    figures = run_batches(
        model,
        prompt_ids,
        [p.id for p in prompts],
        sizes,
        args.batch_layouts,
        args.max_new_tokens,
        eos,
        pad,
        next(iter(policies.values())),
        repeats=args.batch_repeats,
        progress=not args.no_progress,
        generation=args.generation,
    )
    env = environment(next(model.parameters()).device)
    results = {
        "command": command,
        "device": env["device"],
        "device_name": env["device_name"],
        "dtype": args.dtype,
        "model": loaded.name,
        "policy": policy,
        "max_new_tokens": args.max_new_tokens,
        "generation": args.generation,
        "ignore_eos": args.ignore_eos,
        "prompts": {"source": args.prompts, "n": len(prompts)},
        "batches": summarise_batches(figures),
        "runs": figures_as_dicts(figures),
        "environment": env,
    }
    return _report(write_batch_outputs(results, args.out), batch_markdown(results))


def _report(written: list[Path], markdown: str) -> int:
    for path in written:
        print(f"wrote {path}", file=sys.stderr)
    print(markdown)
    return 0


def _batch_sizes(values: tuple[str, ...]) -> list[int]:
    if not values:
        raise LayerskipError("--batch-size names no batch size; pass sizes such as 1,2,4,8")
    try:
        sizes = [int(v) for v in values]
    except ValueError:
        raise LayerskipError(f"--batch-size takes whole numbers, e.g. 1,2,4,8 (got {','.join(values)})") from None
    if any(size < 1 for size in sizes):
        raise LayerskipError(f"--batch-size values must be >= 1 (got {','.join(values)})")
    return sizes


def main(argv: list[str] | None = None) -> int:
    return run_cli(_main, argv)


if __name__ == "__main__":
    raise SystemExit(main())
