"""layerskip-generate: generate text plainly or self-speculatively, optionally against HF generate."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from layerskip.cli.common import (
    THREADS_HELP,
    add_chat_argument,
    check_seed,
    encode_prompts,
    load_policy,
    model_parser,
    read_prompt,
    run_cli,
    thread_setting,
    warn_if_tuned_elsewhere,
)
from layerskip.data import load_prompts
from layerskip.drafts.policy.skip_policy import SkipPolicy, is_policy_file
from layerskip.drafts.policy.spec import AUTO, PLAIN
from layerskip.engine.decoding import Decoder, DecodeSettings
from layerskip.errors import LayerskipError
from layerskip.fileio import check_output_file, check_replaceable
from layerskip.hf.models import LoadedModel, load_model, resolve_device
from layerskip.hf.prompting import eos_token_ids
from layerskip.integration.baselines import hf_generate
from layerskip.machine import this_machine
from layerskip.measure.batches import batch_runner, left_padded, new_tokens
from layerskip.measure.bench import auto_choices
from layerskip.measure.divergence import DivergenceCheck
from layerskip.measure.timing import Runner, aggregate_throughput, run_interleaved, speedup, throughput
from layerskip.sampling import Sampling
from layerskip.stats import DeviceClock, GenerationStats


def build_parser() -> argparse.ArgumentParser:
    parser = model_parser(__doc__, prog="layerskip-generate")
    parser.add_argument(
        "--policy",
        default=AUTO,
        help="'auto' (the default: every drafting choice made while generating, priced by a calibration of "
        "this machine), 'auto-trees' (the same, verifying token trees), a skip policy JSON, 'on-the-fly' "
        "(skip sets chosen while generating), 'on-the-fly:PATH' (chosen while generating, starting from "
        "PATH), or 'plain' (no draft)",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--prompt", help="prompt text")
    source.add_argument(
        "--prompt-file",
        help="read the prompt from this file; with --batch-size, many prompts: one per line, or a JSONL / "
        "Spec-Bench file",
    )
    add_chat_argument(parser)
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most")
    parser.add_argument("--threads", type=thread_setting, default="auto", help=THREADS_HELP)
    parser.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument("--temperature", type=float, default=1.0, help="with --sample: softmax temperature")
    parser.add_argument(
        "--top-p", type=float, default=1.0, help="with --sample: nucleus mass kept (1 = all, 0 = the most likely token)"
    )
    parser.add_argument("--top-k", type=int, default=0, help="with --sample: most likely tokens kept (0 = all)")
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="with --sample: seed of the draws (it repeats plain decoding's text; with a draft, whose choices "
        "follow measured timings, the text can differ from run to run, drawn from the same distribution)",
    )
    parser.add_argument(
        "--compare",
        action="store_true",
        help="also run HF generate on the same prompt: speedup, and whether tokens are identical (if not: where "
        "they first differ, the two tokens, and whether that is rounding or a defect, checked in fp32)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    parser.add_argument(
        "--batch-size",
        type=int,
        metavar="N",
        help="decode --prompt-file's prompts N at a time, each batch together (with --compare: against HF's "
        "batched generate on the same batch)",
    )
    parser.add_argument(
        "--save-policy",
        metavar="PATH",
        help="with auto or an on-the-fly policy: write what it chose (skip sets, and auto's head size and "
        "padding) as a fixed policy JSON (reuse it, or seed a study with search.py --warm-start PATH)",
    )
    parser.add_argument("--force", action="store_true", help="let --save-policy replace a file that is not a policy")
    return parser


class _TextStreamer:
    """Prints newly accepted text; decodes the whole output each time so multi-byte tokens print whole."""

    def __init__(self, tokenizer: object) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.printed = 0

    def __call__(self, new_tokens: list[int]) -> None:
        self.tokens.extend(new_tokens)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return
        sys.stdout.write(text[self.printed :])
        sys.stdout.flush()
        self.printed = len(text)


def _head(stats: GenerationStats) -> str:
    """The draft head size auto drafted with most ("full" for every row)."""
    if not stats.head_rows:
        return "unused"
    rows = max(stats.head_rows, key=stats.head_rows.__getitem__)
    return "full" if rows == 0 else f"{rows} rows"


# GenerationStats figures the report copies as they are
REPORTED_STATS = "steps mean_accepted acceptance_rate draft_seconds verify_seconds thread_runs paths head_fallback_rows"
SAMPLING_DEFAULTS = {"--temperature": 1.0, "--top-p": 1.0, "--top-k": 0}
# Sampled text differs from run to run by design: token identity is a property of greedy decoding.
SAMPLED_NOT_COMPARED = "sampled: not compared token for token"


def _check_decoding_options(args: argparse.Namespace) -> Sampling | None:
    """--max-new-tokens and --seed, and the sampling to decode with (None: greedy). Sampling options
    given without --sample would be ignored by greedy decoding, so they are refused rather than
    dropped; with it, their values are checked before the model loads."""
    if args.max_new_tokens <= 0:
        raise LayerskipError(f"--max-new-tokens must be > 0 (got {args.max_new_tokens})")
    check_seed(args.seed)
    given = {"--temperature": args.temperature, "--top-p": args.top_p, "--top-k": args.top_k}
    changed = [flag for flag, value in given.items() if value != SAMPLING_DEFAULTS[flag]]
    if changed and not args.sample:
        raise LayerskipError(
            f"{', '.join(changed)} shape{'s' if len(changed) == 1 else ''} sampled decoding, which --sample turns on; "
            "add --sample, or drop them for greedy decoding"
        )
    return Sampling(args.temperature, args.top_k, args.top_p) if args.sample else None


def _policy(args: argparse.Namespace) -> SkipPolicy | None:
    return None if args.policy == PLAIN else load_policy(args.policy, resolve_device(args.device))[1]


def _load(
    args: argparse.Namespace, policy: SkipPolicy | None, texts: list[str], labels: list[str]
) -> tuple[LoadedModel, list[list[int]], Decoder, tuple[int, ...]]:
    """The model, the prompts' ids, the decoder for ``policy`` and the EOS ids. Preparing the decoder
    checks the policy against the model and builds its draft once (auto: calibrated, or read from the cache)."""
    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    ids = encode_prompts(loaded, args, texts, labels)
    decoder = Decoder.for_policy(loaded.model, policy, threads=args.threads, progress=not args.json)
    return loaded, ids, decoder, eos_token_ids(loaded.model, loaded.tokenizer)


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if args.batch_size is not None:
        return _main_batches(args)
    sampling = _check_decoding_options(args)
    if args.save_policy is not None:  # "" included: refused as empty, never skipped
        check_output_file(args.save_policy, "--save-policy")
        check_replaceable(args.save_policy, "--save-policy", is_policy_file, "a layerskip policy", args.force)
    prompt = read_prompt(args.prompt, args.prompt_file)
    policy = _policy(args)
    if args.save_policy is not None and (policy is None or (policy.on_the_fly is None and policy.auto is None)):
        raise LayerskipError(
            "--save-policy needs a policy that chooses while generating (--policy auto, on-the-fly or on-the-fly:PATH)"
        )
    loaded, [ids], decoder, eos = _load(args, policy, [prompt], ["the prompt"])
    model, tokenizer = loaded.model, loaded.tokenizer
    warn_if_tuned_elsewhere({args.policy: policy}, decoder.device, args)

    def settings(max_new: int) -> DecodeSettings:
        return DecodeSettings(max_new, sampling, args.seed, eos)

    if args.compare:
        # Both sides timed alike after a warm-up (measure.timing); nothing streams while timed.
        runners: dict[str, Runner] = {
            "ours": lambda prompt_ids, n: decoder.decode(prompt_ids, settings(n), tokenizer=tokenizer),
            "hf": lambda prompt_ids, n: (hf_generate(model, prompt_ids, n, eos, sampling, args.seed), None),
        }
        runs = run_interleaved(runners, [ids], args.max_new_tokens, decoder.device, warmup_tokens=4)[0]
        ours, base = runs["ours"], runs["hf"]
        tokens, stats, seconds = ours.tokens, ours.stats, ours.seconds
        if not args.json:
            print(tokenizer.decode(tokens, skip_special_tokens=True), end="")
    else:
        stream = None if args.json else _TextStreamer(tokenizer)
        tokens, stats = decoder.decode(ids, settings(args.max_new_tokens), tokenizer=tokenizer, on_tokens=stream)
        seconds = stats.total_seconds
    report = {
        "model": loaded.name,
        "policy": args.policy,
        "text": tokenizer.decode(tokens, skip_special_tokens=True),
        "new_tokens": len(tokens),
        "seconds": seconds,
        "tokens_per_second": throughput(len(tokens), seconds),
        # thread_runs: "draft:1" -> runs of that phase on 1 CPU thread (--threads); paths: how the draft
        # step and the verify head ran (lean / HF, compiled, certified)
        **{name: getattr(stats, name) for name in REPORTED_STATS.split()},
        "draft_lengths": stats.draft_histogram,  # tokens drafted per step -> steps
    }
    if policy is not None and policy.on_the_fly is not None:
        # Skip-drafted steps per bypassed set ("a<attention layers>|m<MLP layers>"), and how often it changed.
        report["skip_changes"] = stats.skip_changes
        report["skip_sets"] = stats.skip_sets
        assert decoder.selection is not None
        report["selection"] = decoder.selection.summary()
    if policy is not None and policy.auto is not None:
        report["auto"] = auto_choices(stats)
    if args.compare:
        report["baseline_tokens_per_second"] = aggregate_throughput([base])
        report["speedup"] = speedup([ours], [base])
        # Sampled outputs differ run to run by design; identity is a greedy property.
        report["identical"] = tokens == base.tokens if sampling is None else None
        divergence = None
        if report["identical"] is False:  # where, the two tokens, and rounding or defect (measure.divergence)
            with DivergenceCheck(model, tokenizer) as check:
                rerun = {"method": lambda: runners["ours"](ids, args.max_new_tokens)[0]}  # a defect is rechecked
                divergence = check.classify_many(ids, base.tokens, {"method": tokens}, rerun)["method"]
        report["divergence"] = None if divergence is None else divergence.to_dict()
    if args.save_policy is not None:
        assert decoder.draft is not None
        # Its choices were priced by speeds measured here: the policy records this machine.
        fixed = decoder.draft.fixed_policy().with_model(model, loaded.name).with_machine(this_machine(decoder.device))
        report["saved_policy"] = str(fixed.save(args.save_policy))
    if args.json:
        print(json.dumps(report))
        return 0
    print(file=sys.stdout)
    line = (
        f"[{report['new_tokens']} tokens in {seconds:.2f} s, {report['tokens_per_second']:.1f} tok/s; "
        f"{stats.steps} steps, mean accepted {stats.mean_accepted:.2f}"
    )
    if policy is not None:
        line += f", acceptance {stats.acceptance_rate:.2f}"
        if policy.auto is not None:
            steps = max(1, stats.steps - 1)
            line += f", lookup {stats.lookup_steps / steps:.0%} of steps, head {_head(stats)}"
        if policy.on_the_fly is not None:
            line += f", skip set changed {stats.skip_changes}x over {len(stats.skip_sets)} sets"
            if args.save_policy is not None:
                line += f"; saved the set it ended on to {report['saved_policy']}"
    if args.compare:
        line += f"; HF generate {report['baseline_tokens_per_second']:.1f} tok/s, speedup {report['speedup']:.2f}x, "
        line += f"identical: {report['identical']}" if sampling is None else SAMPLED_NOT_COMPARED
        if divergence is not None:
            line += f" ({divergence.describe('ours', 'HF')})"
    print(line + "]", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(_main, argv)


def _batch_prompts(path: str) -> list[str]:
    """``--prompt-file`` with ``--batch-size``: a JSONL / Spec-Bench (or json, csv, parquet) file
    through the prompt loader, else one prompt per non-empty line."""
    if Path(path).suffix.lower() in (".jsonl", ".json", ".csv", ".parquet"):
        return [prompt.text for prompt in load_prompts(path)]
    lines = [line for line in read_prompt(None, path).splitlines() if line.strip()]
    if not lines:
        raise LayerskipError(f"--prompt-file {path} holds no prompt (one per line with --batch-size)")
    return lines


def _main_batches(args: argparse.Namespace) -> int:
    """``--batch-size N``: the file's prompts, N at a time, each batch decoded together; with
    ``--compare``, HF's batched ``generate`` on the same left-padded batch beside it."""
    if args.batch_size < 1:
        raise LayerskipError(f"--batch-size must be >= 1 (got {args.batch_size})")
    if args.prompt_file is None:
        raise LayerskipError("--batch-size reads many prompts: pass --prompt-file PATH (one prompt per line)")
    if args.save_policy is not None:
        raise LayerskipError("--save-policy takes one prompt; drop --batch-size to save what auto chose")
    sampling = _check_decoding_options(args)
    texts = _batch_prompts(args.prompt_file)
    labels = [f"prompt {index + 1}" for index in range(len(texts))]
    loaded, ids, decoder, eos = _load(args, _policy(args), texts, labels)
    model, tokenizer = loaded.model, loaded.tokenizer
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    settings = DecodeSettings(args.max_new_tokens, sampling, args.seed, eos)
    hf_run = batch_runner(model, args.max_new_tokens, eos, pad, None, sampling, args.seed) if args.compare else None
    clock = DeviceClock(decoder.device)
    for first in range(0, len(ids), args.batch_size):
        group = ids[first : first + args.batch_size]
        start = clock.now()
        results = decoder.decode_batch(group, settings, tokenizer=tokenizer)
        seconds = clock.now() - start
        made = sum(len(tokens) for tokens, _ in results)
        report: dict[str, object] = {
            "batch": first // args.batch_size,
            "rows": len(group),
            "new_tokens": made,
            "seconds": seconds,
            "tokens_per_second": throughput(made, seconds),
            "steps": results[0][1].batch_steps,
        }
        if hf_run is not None:
            padded, mask = left_padded(group, pad, decoder.device)
            start = clock.now()
            reference = new_tokens(hf_run(padded, mask)[0], padded.shape[1], eos)
            hf_seconds = clock.now() - start
            report["baseline_tokens_per_second"] = throughput(sum(map(len, reference)), hf_seconds)
            report["speedup"] = hf_seconds / seconds if seconds > 0 else None
            same = sum(tokens == ref for (tokens, _), ref in zip(results, reference, strict=True))
            report["identical_rows"] = same if sampling is None else None
        for row, (tokens, _) in enumerate(results):
            text = tokenizer.decode(tokens, skip_special_tokens=True)
            if args.json:
                print(json.dumps({"prompt": first + row, "text": text, "new_tokens": len(tokens)}))
            else:
                print(f"--- prompt {first + row + 1} ({len(tokens)} tokens)\n{text}")
        if args.json:
            print(json.dumps(report))
        else:
            line = f"[batch of {len(group)}: {made} tokens in {seconds:.2f} s, {report['tokens_per_second']:.1f} tok/s"
            if hf_run is not None:
                line += f"; HF batched generate {report['baseline_tokens_per_second']:.1f} tok/s, "
                line += f"speedup {report['speedup']:.2f}x, "
                line += f"identical rows {same}/{len(group)}" if sampling is None else SAMPLED_NOT_COMPARED
            print(line + "]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
