"""layerskip-train-exit: self-distil exit adapters for one model, at several exit layers in one pass.

The full model runs once over the corpus (teacher forcing: every position's next-token law and
every candidate layer's hidden state from the same forward); then an adapter of each kind is
trained per exit layer, with early stopping on in-domain validation documents. Agreement is
reported with and without the adapter, per domain, on validation documents and on held-out
domains the adapters never saw. Writes, under --out: one safetensors adapter and one policy
per (layer, kind), report.json / report.csv, agreement.png, and checkpoints/ (a re-run of the
same command resumes from them).
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from layerskip.cli.common import csv_text, int_list, model_parser, run_cli, str_list
from layerskip.data import load_prompts
from layerskip.distill.corpus import (
    CODE_DOMAIN,
    OWN_SUFFIX,
    Document,
    code_documents,
    split_documents,
)
from layerskip.distill.teacher import TeacherData, cache_key, chunk_documents, collect, own_continuations
from layerskip.distill.train import (
    Student,
    TrainSettings,
    evaluate,
    load_state,
    rank_rows,
    save_state,
    train_adapter,
    unreadable_reason,
)
from layerskip.drafts.model.exit_adapter import KINDS, ExitAdapter, ExitSpec
from layerskip.drafts.model.precision import PRECISIONS
from layerskip.drafts.policy.skip_policy import MAX_DRAFT_TOKENS, DraftSettings, ExitSettings, SkipPolicy
from layerskip.errors import LayerskipError
from layerskip.fileio import check_output_dir, replace_file, write_json_atomic, write_text_atomic
from layerskip.hf import adapters
from layerskip.machine import code_version, this_machine

SPEC_BENCH = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "spec_bench" / "question.jsonl"
STDLIB = "stdlib"


REPORT_FILES = ("report.json", "report.csv", "agreement.png")  # what write_report writes into --out


def build_parser() -> argparse.ArgumentParser:
    parser = model_parser(__doc__, prog="layerskip-train-exit")
    parser.add_argument(
        "--data",
        action="append",
        help="prompt/text file (Spec-Bench JSONL, json/jsonl/csv/parquet); repeatable "
        "(default: ../shared/data/spec_bench/question.jsonl if present, else the built-in prompts)",
    )
    parser.add_argument("--text-field", help="column holding the text (json/csv/parquet)")
    parser.add_argument(
        "--code-dir",
        action="append",
        default=[],
        help=f"directory of source code ('{STDLIB}': Python's own); repeatable",
    )
    parser.add_argument("--code-files", type=int, default=200, help="at most this many files per code directory")
    parser.add_argument("--holdout", type=str_list, default=(), help="domains (categories, 'code') never trained on")
    parser.add_argument(
        "--categories",
        type=str_list,
        default=(),
        help="train on these prompt categories only (as search's --categories); the other categories are held out",
    )
    parser.add_argument("--layers", type=int_list, required=True, help="candidate exit layers, e.g. 6,9,12")
    parser.add_argument("--kinds", type=str_list, default=("linear",), help=f"adapter kinds: {', '.join(KINDS)}")
    parser.add_argument("--rank", type=int, default=64, help="linear adapter rank (0 = full square map)")
    parser.add_argument("--positions", type=int, default=60_000, help="teacher-forced positions to collect")
    parser.add_argument("--chunk-tokens", type=int, default=128, help="tokens per teacher-forced chunk")
    parser.add_argument("--top-k", type=int, default=32, help="teacher probabilities kept per position")
    parser.add_argument(
        "--continuations",
        type=int,
        default=64,
        help="prompts the model continues itself (its own text: what a draft faces); 0 = corpus text only",
    )
    parser.add_argument("--continuation-tokens", type=int, default=96, help="tokens per own continuation")
    parser.add_argument("--temperature", type=float, default=0.0, help="own continuations: 0 greedy, else sampled")
    parser.add_argument("--draft-vocab", type=int, default=8192, help="draft head rows (0 = full vocabulary)")
    parser.add_argument("--epochs", type=int, default=8, help="at most; training stops early on validation KL")
    parser.add_argument("--batch-chunks", type=int, default=8, help="chunks per training batch")
    parser.add_argument("--lr", type=float, default=None, help="learning rate (default: 2e-3 linear, 2e-4 layer)")
    parser.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    parser.add_argument("--precision", default=None, choices=PRECISIONS, help="the policies' draft precision")
    parser.add_argument("--max-draft-tokens", type=int, default=6, help="the policies' draft length cap k")
    parser.add_argument("--threshold", type=float, default=0.5, help="the policies' adaptive confidence threshold")
    parser.add_argument("--reuse-kv", action="store_true", help="policies reuse the draft's K/V (precision 'model')")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data split, continuations and training")
    parser.add_argument("--out", required=True, help="directory for adapters, policies, report and checkpoints")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.add_argument(
        "--no-cost", action="store_true", help="skip timing each exit's draft step (the frontier's cost side)"
    )
    return parser


def check_arguments(args: argparse.Namespace) -> None:
    """Everything that can be wrong with the arguments, before any model is loaded."""
    for kind in args.kinds:
        if kind not in KINDS:
            raise LayerskipError(f"unknown adapter kind '{kind}' in --kinds; use {', '.join(KINDS)}")
    if not args.layers or any(layer < 0 for layer in args.layers):
        raise LayerskipError("--layers must list exit layers >= 0, e.g. --layers 6,9,12")
    positive = "positions chunk_tokens top_k epochs batch_chunks max_draft_tokens code_files continuation_tokens"
    for name in positive.split():
        if (value := getattr(args, name)) <= 0:
            raise LayerskipError(f"--{name.replace('_', '-')} must be > 0 (got {value})")
    if args.max_draft_tokens > MAX_DRAFT_TOKENS:
        raise LayerskipError(f"--max-draft-tokens must be at most {MAX_DRAFT_TOKENS} (got {args.max_draft_tokens})")
    if args.continuations < 0 or not 0 <= args.temperature <= 5:
        raise LayerskipError("--continuations must be >= 0 and --temperature in [0, 5]")
    if args.rank < 0 or args.draft_vocab < 0:
        raise LayerskipError("--rank and --draft-vocab must be >= 0 (0 = full)")
    if args.lr is not None and not args.lr > 0:
        raise LayerskipError(f"--lr must be > 0 (got {args.lr})")
    if not 0 <= args.weight_decay < 1 or not 0 <= args.threshold <= 1:
        raise LayerskipError("--weight-decay must be in [0, 1) and --threshold in [0, 1]")
    if not 0 <= args.seed < 2**32:
        raise LayerskipError(f"--seed must be in 0..{2**32 - 1} (got {args.seed})")
    if args.reuse_kv and args.precision not in (None, "model"):
        raise LayerskipError("--reuse-kv needs the draft in the model's own weights; drop --precision or --reuse-kv")
    # a file, a path under a file, /proc, a FIFO where a report goes: one line before the model loads
    check_output_dir(args.out, "--out", REPORT_FILES)
    for path in [*(args.data or []), *(d for d in args.code_dir if d != STDLIB)]:
        if not Path(path).expanduser().exists():
            raise LayerskipError(f"{path} not found; pass an existing --data file or --code-dir directory")


def gather(args: argparse.Namespace) -> list[Document]:
    sources = args.data or ([str(SPEC_BENCH)] if SPEC_BENCH.is_file() else ["builtin"])
    documents: list[Document] = []
    for source in sources:  # one document per prompt
        documents += [Document(p.category, p.text) for p in load_prompts(source, text_field=args.text_field)]
    for directory in args.code_dir:
        root = sysconfig.get_paths()["stdlib"] if directory == STDLIB else directory
        documents += code_documents(root, args.code_files, seed=args.seed)
    return documents


def held_out_domains(documents: list[Document], args: argparse.Namespace) -> list[str]:
    """--holdout, plus with --categories every prompt category not listed (code stays in training)."""
    held = set(args.holdout)
    if args.categories:
        known = {d.domain for d in documents}
        unknown = sorted(set(args.categories) - known)
        if unknown:
            raise LayerskipError(
                f"no documents in categor{'y' if len(unknown) == 1 else 'ies'} {', '.join(unknown)}; "
                f"choose from {', '.join(sorted(known))}"
            )
        held |= {d for d in known if d not in set(args.categories) and d != CODE_DOMAIN}
    return sorted(held)


def teacher_data(
    model: torch.nn.Module,
    tokenizer: object,
    documents: list[Document],
    held: list[str],
    args: argparse.Namespace,
    chat: bool,
) -> tuple[TeacherData, dict[str, int], list[str]]:
    """Collect (or reuse from --out) the teacher's data for every split, ``held`` domains held out;
    returns it with chunk counts per split and the training domains. Everything it depends on keys
    the cache, so a re-run of the same command (after an interruption, say) skips the continuations
    and the teacher's forward."""
    split = split_documents(documents, held, seed=args.seed)
    settings = {
        k: getattr(args, k)
        for k in ("positions", "chunk_tokens", "continuations", "continuation_tokens", "temperature", "seed", "top_k")
    }
    key = cache_key(
        adapters.weights_fingerprint(model),
        [(d.domain, d.text) for d in documents],
        sorted(set(args.layers)),
        {**settings, "holdout": held, "chat": chat},
    )
    cached = Path(args.out) / "checkpoints" / f"teacher-{key}.pt"
    if cached.is_file():
        try:
            state = load_state(cached)
            return TeacherData.from_state(state["data"]), state["counts"], split.domains()["train"]
        except Exception as exc:  # a damaged (or planted) cache: collect again, and overwrite it
            print(
                f"warning: {cached} is unreadable ({unreadable_reason(exc)}); collecting the teacher's data again",
                file=sys.stderr,
            )
    shares = {"train": 0.8, "validation": 0.1, "held_out": 0.1}
    wanted = {"train": args.continuations, "validation": args.continuations // 4, "held_out": args.continuations // 4}
    chunks: list[tuple[str, list[int]]] = []
    counts: dict[str, int] = {}
    for name in ("train", "validation", "held_out"):
        docs = list(getattr(split, name))
        own = (wanted[name], args.continuation_tokens, chat, args.temperature)
        docs += own_continuations(model, tokenizer, docs, *own, seed=args.seed, progress=not args.quiet)
        part = chunk_documents(tokenizer, docs, args.chunk_tokens, int(args.positions * shares[name])) if docs else []
        counts[name] = len(part)
        chunks += part
    if counts["train"] == 0:
        raise LayerskipError(
            "the training documents hold fewer tokens than one chunk; add --data or lower --chunk-tokens"
        )
    data = collect(model, chunks, sorted(set(args.layers)), args.top_k, progress=not args.quiet)
    # The checkpoint cache is the project's folder: a link there is replaced, never written through.
    save_state(cached, {"data": data.state(), "counts": counts}, owned=True)
    return data, counts, split.domains()["train"]


def _agreement(
    student: Student, module: torch.nn.Module | None, validation: TeacherData, held_out: TeacherData
) -> dict[str, dict[str, dict[str, float]]]:
    """Per split and domain, the student's agreement and KL (with the adapter ``module``, or none);
    nothing held out: no held-out figures."""
    splits = {"validation": evaluate(student, module, validation)}
    splits["held_out"] = evaluate(student, module, held_out) if held_out.domains else {}
    return {
        split: {d: {"positions": s.positions, "agreement": s.agreement, "kl": s.kl} for d, s in scores.items()}
        for split, scores in splits.items()
    }


def _main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_arguments(args)
    from layerskip.hf.models import load_model

    started = time.perf_counter()
    out = Path(args.out)
    lm = load_model(args.model, args.dtype, args.device)
    model, count = lm.model, adapters.num_layers(lm.model)
    for layer in args.layers:
        ExitSpec(layer=layer, rank=args.rank).validate(count)
    precision = args.precision or ("model" if args.reuse_kv or model.device.type != "cpu" else "int4")
    documents = gather(args)
    held = held_out_domains(documents, args)
    data, counts, trained_domains = teacher_data(model, lm.tokenizer, documents, held, args, lm.instruct)
    teacher_seconds = time.perf_counter() - started
    train = data.select(range(counts["train"]))
    validation = data.select(range(counts["train"], counts["train"] + counts["validation"]))
    held_out = data.select(range(counts["train"] + counts["validation"], len(data.domains)))
    splits = {"train": train, "validation": validation, "held_out": held_out}
    vocab_size = adapters.lm_head(model).weight.shape[0]
    rows = rank_rows(train, vocab_size, args.draft_vocab).to(model.device)
    report: dict[str, object] = {
        "model": lm.name,
        "fingerprint": adapters.weights_fingerprint(model),
        **code_version(),  # "commit", "dirty": the code that trained
        "positions": {name: split.positions for name, split in splits.items()},
        "domains": {name: sorted(set(split.domains)) for name, split in splits.items()},
        "draft_vocab": len(rows),
        "teacher_seconds": teacher_seconds,
        "exits": [],
    }
    table: list[dict[str, object]] = []
    for layer in sorted(set(args.layers)):
        student = Student(model, layer, rows)
        plain = _agreement(student, None, validation, held_out)
        for kind in args.kinds:
            name = f"exit-L{layer}-{kind}"
            spec = ExitSpec(layer=layer, kind=kind, rank=args.rank)
            settings = TrainSettings(
                epochs=args.epochs,
                batch_chunks=args.batch_chunks,
                learning_rate=args.lr or (2e-3 if kind == "linear" else 2e-4),
                weight_decay=args.weight_decay,
                seed=args.seed,
            )
            provenance = {
                "trained_by": "layerskip-train-exit",
                "command": " ".join(sys.argv[1:]) if argv is None else " ".join(argv),
                "train_domains": trained_domains,
                "held_out_domains": held,
                "positions": train.positions,
                "settings": asdict(settings),
            }
            adapter = ExitAdapter.fresh(model, spec, provenance)
            began = time.perf_counter()
            checkpoint = out / "checkpoints" / f"{name}.pt"
            result = train_adapter(
                model, adapter, rows, train, validation, settings, checkpoint=checkpoint, progress=not args.quiet
            )
            seconds = time.perf_counter() - began
            trained = _agreement(student, adapter.module, validation, held_out)
            adapter.provenance["train_seconds"] = seconds
            sha = adapter.save(out / f"{name}.safetensors")
            policy = make_policy(
                model, lm.name, adapter, sha, f"{name}.safetensors", rows, precision, args, trained_domains
            )
            policy = replace(policy, root=str(out.resolve()))
            policy.save(out / f"{name}.json")
            frontier = {}
            if not args.no_cost:
                frontier = exit_frontier(model, policy, adapter, lm.tokenizer, trained, plain, vocab_size)
            entry = {
                "layer": layer,
                "kind": kind,
                "frontier": frontier,
                "parameters": sum(p.numel() for p in adapter.module.parameters()),
                "train_seconds": seconds,
                "steps": result.steps,
                "stopped_early": result.stopped_early,
                "adapter": f"{name}.safetensors",
                "policy": f"{name}.json",
                "sha256": sha,
                "without_adapter": plain,
                "with_adapter": trained,
                "evaluations": result.evaluations,
            }
            report["exits"].append(entry)
            for split_name in ("validation", "held_out"):
                for domain, figures in trained[split_name].items():
                    row = {"layer": layer, "kind": kind, "split": split_name, "domain": domain}
                    row["positions"] = figures["positions"]
                    for name in ("agreement", "kl"):
                        row |= {f"{name}_without": plain[split_name][domain][name], f"{name}_with": figures[name]}
                    table.append(row)
            print(
                f"layer {layer} {kind}: {_agreement_change(plain, trained)} ({seconds:.0f} s)"
                + (f"; projected {frontier['projected_speedup']:.2f}x" if frontier else ""),
                file=sys.stderr,
            )
            report["total_seconds"] = time.perf_counter() - started
            write_report(report, table, out)  # after every exit: a long run's finished part is readable
    print(json.dumps({"out": str(out), "total_seconds": round(report["total_seconds"], 1)}))
    return 0


def _agreement_change(plain: dict, trained: dict) -> str:
    """``held-out agreement A -> B, validation C -> D``; a split with no documents is said to be empty,
    not shown as an agreement of 0."""
    parts = []
    for split, label, empty in (
        ("held_out", "held-out", "nothing held out (--holdout, --categories)"),
        ("validation", "validation", "no validation documents"),
    ):
        if plain[split].get("all") is None:
            parts.append(empty)
        else:
            before, after = plain[split]["all"]["agreement"], trained[split]["all"]["agreement"]
            parts.append(f"{label} agreement {before:.3f} -> {after:.3f}")
    return ", ".join(parts)


def make_policy(
    model: torch.nn.Module,
    name: str,
    adapter: ExitAdapter,
    sha: str,
    relative: str,
    rows: torch.Tensor,
    precision: str,
    args: argparse.Namespace,
    trained_domains: list[str],
) -> SkipPolicy:
    """The policy an exit adapter drafts with: deep layers bypassed, adaptive length, the ranked head rows."""
    count = adapters.num_layers(model)
    draft = DraftSettings(
        max_draft_tokens=args.max_draft_tokens,
        adaptive=True,
        initial_threshold=args.threshold,
        target_acceptance=0.8,
        draft_vocab_size=args.draft_vocab if args.draft_vocab < len(adapters.lm_head(model).weight) else 0,
        precision=precision,
    )
    policy = SkipPolicy.early_exit(
        count,
        adapter.spec.layer + 1,
        draft=draft,
        draft_vocabulary=tuple(rows.tolist()) if draft.draft_vocab_size else (),
        provenance={
            "source": "layerskip-train-exit",
            "calibration": {"categories": trained_domains},
            "adapter": adapter.provenance,
        },
    )
    exit_settings = ExitSettings(relative, sha, adapter.spec.layer, adapter.spec.kind, args.reuse_kv)
    # Its draft precision and the exit's measured cost are this machine's.
    return replace(policy, exit=exit_settings).with_model(model, name).with_machine(this_machine(model.device))


def exit_frontier(
    model: torch.nn.Module,
    policy: SkipPolicy,
    adapter: ExitAdapter,
    tokenizer: object,
    trained: dict,
    plain: dict,
    vocab_size: int,
) -> dict[str, float]:
    """The exit's measured draft cost and the speedup its acceptance would project to, with the
    adapter and without it (the plain early exit at the same depth). Acceptance is the top-1
    agreement on the model's own continuations of held-out prompts (validation ones if none)."""
    from layerskip.data import builtin_prompts
    from layerskip.drafts.builder import DraftModels
    from layerskip.hf.prompting import encode_prompt
    from layerskip.measure.frontier import measure_exit_cost, projected_speedup

    context = encode_prompt(tokenizer, builtin_prompts()[6].text, False)[:128]
    models = DraftModels(model)
    with_adapter = models.get(policy.draft.precision, exit=adapter)
    without = models.get(policy.draft.precision)
    cost = measure_exit_cost(with_adapter, policy, context, vocab_size)
    plain_cost = measure_exit_cost(without, replace(policy, exit=None), context, vocab_size)

    def acceptance(scores: dict) -> tuple[float, str]:
        for split in ("held_out", "validation"):
            own = [v for d, v in scores[split].items() if d.endswith(OWN_SUFFIX)]
            if own:
                total = sum(v["positions"] for v in own)
                return sum(v["agreement"] * v["positions"] for v in own) / total, f"{split} own continuations"
            if scores[split]:
                return scores[split]["all"]["agreement"], f"{split} text"
        return 0.0, "none"

    a_with, source = acceptance(trained)
    a_without, _ = acceptance(plain)
    verify = lambda n: cost.verify_cost.get(n, cost.verify_cost[9])  # noqa: E731
    best, k = projected_speedup(a_with, cost.draft_cost, verify)
    best_plain, k_plain = projected_speedup(a_without, plain_cost.draft_cost, verify)
    return {
        "acceptance_source": source,
        "agreement_with": a_with,
        "agreement_without": a_without,
        "plain_step_ms": cost.plain_ms,
        "draft_cost": cost.draft_cost,
        "draft_cost_without_adapter": plain_cost.draft_cost,
        "verify_cost_k_plus_1": verify(k + 1),
        "projected_speedup": best,
        "projected_k": k,
        "projected_speedup_without_adapter": best_plain,
        "projected_k_without_adapter": k_plain,
    }


def write_report(report: dict, table: list[dict[str, object]], out: Path) -> None:
    """report.json, report.csv (one row per exit, split and domain) and agreement.png, each atomically."""
    from layerskip.measure.plots import exit_agreement_plot

    write_json_atomic(out / REPORT_FILES[0], report)
    write_text_atomic(out / REPORT_FILES[1], csv_text(table))
    staged = out / ".agreement.png.tmp"
    exit_agreement_plot(report, staged)
    replace_file(staged, out / REPORT_FILES[2])


def main(argv: list[str] | None = None) -> int:
    return run_cli(_main, argv)


if __name__ == "__main__":
    raise SystemExit(main())
