"""Benchmark outputs: results.json, results.csv, a Markdown table and speedup.png."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from layerskip.errors import LayerskipError
from layerskip.fileio import read_json_file, write_file_set
from layerskip.measure.labels import decoding_label

OUTPUT_FILES = ("results.json", "results.csv", "results.md", "speedup.png")
COLUMNS = (
    "tokens_per_second",
    "speedup",
    "mean_accepted",
    "acceptance_rate",
    "identical_fraction",
    "n_prompts",
    # Outputs identical to hf-ar's, then divergences by class (measure.divergence).
    "n_identical",
    "n_rounding",
    "n_defect",
)


def fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def table(header: Sequence[object], rows: Iterable[Sequence[object]]) -> str:
    """A Markdown table: ``header``'s cells, the rule under them, then a line per row of cells."""
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(map(str, cells)) + " |" for cells in rows])


def markdown_table(results: dict[str, Any]) -> str:
    """Methods as rows: overall figures, then speedup by category."""
    methods = results["methods"]
    categories = sorted({c for m in methods.values() for c in m["by_category"]})
    memory = (results.get("memory") or {}).get("methods") or {}  # measure.memory; runs before it have none
    header = ["method", "tok/s", "speedup", "tau", "acceptance", "identical / rounding / defect"]
    header += [*(["peak memory, MiB"] if memory else []), *categories]
    rows = []
    for name, figures in methods.items():
        o = figures["overall"]
        cells = [name, fmt(o["tokens_per_second"], 1), f"{fmt(o['speedup'])}x", fmt(o["mean_accepted"])]
        cells += [fmt(o["acceptance_rate"]), _identity(o)]
        if memory:
            cells.append(fmt((memory.get(name) or {}).get("peak_mb"), 0))
        by_category = figures["by_category"]
        cells += [f"{fmt(by_category[c]['speedup'])}x" if by_category.get(c) else "-" for c in categories]
        rows.append(cells)
    return table(header, rows)


def _identity(figures: dict[str, Any]) -> str:
    """``identical / rounding / defect`` counts; older results (no classes) show the fraction identical.
    A method with its own arithmetic (llama.cpp on a quantised GGUF) shows how many outputs equal hf-ar's."""
    if figures.get("computes_with") and figures.get("identical_fraction") is not None:
        equal = round(figures["identical_fraction"] * figures["n_prompts"])
        return f"{equal} of {figures['n_prompts']} equal, not classed"
    if "n_identical" not in figures:
        # A sampled run compares no draws: its fraction is None.
        fraction = figures.get("identical_fraction")
        return "n/a (sampled)" if fraction is None else fmt(fraction)
    cell = f"{figures['n_identical']} / {figures['n_rounding']} / {figures['n_defect']}"
    unclassified = figures.get("n_unclassified")
    return f"{cell} (+{unclassified} unclassified)" if unclassified else cell


def divergences_by_prompt(results: dict[str, Any]) -> str:
    """Every divergence from hf-ar, a row each: where, the two tokens, the fp32 gap against the error
    bound, the class ('' if none)."""
    rows = [(row, d) for row in results.get("per_prompt", []) if (d := row.get("divergence"))]
    if not rows:
        return ""
    header = ["method", "prompt", "position", "method token", "hf-ar token", "fp32 gap", "error bound", "class"]
    cells = [
        [
            row["method"],
            str(row["prompt_id"]),
            str(d.get("position")),
            _token(d, "method"),
            _token(d, "reference"),
            fmt(d.get("fp32_gap"), 4),
            fmt(d.get("error_bound"), 4),
            d.get("class") or "unclassified",
        ]
        for row, d in rows
    ]
    return table(header, cells)


def _token(divergence: dict[str, Any], side: str) -> str:
    if f"{side}_token" not in divergence:
        return "-"  # saved before divergences were classed
    token_id, text = divergence[f"{side}_token"], divergence.get(f"{side}_text")
    if token_id is None:
        return "(ended)"
    if text is None:
        return str(token_id)
    shown = repr(text).replace("|", "\\|")  # a pipe would end the Markdown cell
    return f"{shown} ({token_id})"


def profile_table(results: dict[str, Any]) -> str:
    """Where our engine's time went per method, in ms per generated token ('' if no method has it)."""
    profiles = {name: p for name, f in results["methods"].items() if (p := f["overall"].get("profile"))}
    if not profiles:
        return ""
    header = ["method", "ms/token", "prefill", "draft", "verify", "other", "verify ms/step", "lookup steps"]
    parts = ("total_ms", "prefill_ms", "draft_ms", "verify_ms", "other_ms", "verify_ms_per_step")
    rows = [
        [name, *(fmt(p.get(part), 1) for part in parts), percent(p.get("lookup_share"))] for name, p in profiles.items()
    ]
    return table(header, rows)


def percent(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.0f}%"


def held_out_table(results: dict[str, Any]) -> str:
    """Speedup on the categories each policy was tuned on vs the others ('' if no policy says)."""
    rows = [(name, f["split"]) for name, f in results["methods"].items() if f.get("split")]
    if not rows:
        return ""
    header = ["method", "tuned on", "speedup (tuned)", "speedup (held out)"]
    header += ["acceptance (tuned)", "acceptance (held out)"]
    cells = []
    for name, split in rows:
        tuned, held = split["tuned"] or {}, split["held_out"] or {}
        cells.append(
            [
                name,
                ", ".join(split["tuned_categories"]),
                f"{fmt(tuned.get('speedup'))}x" if tuned else "-",
                f"{fmt(held.get('speedup'))}x" if held else "- (no other category)",
                fmt(tuned.get("acceptance_rate")),
                fmt(held.get("acceptance_rate")),
            ]
        )
    return table(header, cells)


def markdown_report(results: dict[str, Any]) -> str:
    """The figures table, the divergences, the held-out check, then the time profile of our engine's methods."""
    divergences = (
        "Divergences from hf-ar (first differing token; `rounding`: the fp32 gap between the two tokens is "
        "within the measured rounding error of the two paths, `defect`: it is not):"
    )
    sampled = results.get("sampled")
    note = f"Sampled ({decoding_label(sampled)}), every method alike: draws are not compared token for token."
    parts = [
        *([note] if sampled else []),
        markdown_table(results),
        *own_arithmetic_note(results),
        *section(divergences, divergences_by_prompt(results)),
        *section("Held-out check (categories the policy was not tuned on):", held_out_table(results)),
        *section("Time per generated token (ms):", profile_table(results)),
    ]
    return "\n\n".join(parts)


def own_arithmetic_note(results: dict[str, Any]) -> list[str]:
    """The note under the table for methods that run another program's model (llama.cpp): their
    outputs are not the HF model's, so their equal outputs are counted and nothing more is claimed."""
    groups: dict[str, list[str]] = {}
    for name, figures in results["methods"].items():
        if what := figures["overall"].get("computes_with"):
            groups.setdefault(what, []).append(name)
    if not groups:
        return []
    methods = "; ".join(f"{', '.join(names)} ({what})" for what, names in groups.items())
    return [
        f"Not compared token for token: {methods} compute with the GGUF's own weight type (a "
        "quantised GGUF's weights against 8-bit activations), not as HF computes the model, so their outputs are "
        "not expected to equal hf-ar's; the table counts those that do and classes none of their divergences. "
        "Their speedup is over a different computation, not a lossless one."
    ]


def section(lead: str, table: str) -> list[str]:
    """A part of a report: its lead-in, then its table; none where the table is empty."""
    return [f"{lead}\n\n{table}"] if table else []


def csv_table(rows: list[dict[str, Any]], columns: tuple[str, ...], lineterminator: str = "\r\n") -> str:
    """``rows`` as CSV text, the ``columns`` in order (a value missing or None: an empty cell)."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, extrasaction="ignore", lineterminator=lineterminator)
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def csv_text(results: dict[str, Any]) -> str:
    """results.csv: the figures of each method, overall and by category."""
    rows = [
        {**values, "method": name, "category": category}
        for name, figures in results["methods"].items()
        for category, values in [("overall", figures["overall"]), *figures["by_category"].items()]
    ]
    return csv_table(rows, ("method", "category", *COLUMNS))


def speedup_png(results: dict[str, Any]) -> bytes:
    import numpy as np

    from layerskip.measure.plots import PNG, figure

    methods = [m for m in results["methods"] if m != "hf-ar"] or list(results["methods"])
    categories = sorted({c for m in results["methods"].values() for c in m["by_category"]}) + ["overall"]
    fig, ax = figure(max(6, 1.1 * len(categories) * max(1, len(methods)) / 2), 4)
    width = 0.8 / len(methods)
    x = np.arange(len(categories))
    for i, name in enumerate(methods):
        figures = results["methods"][name]
        values = [
            (figures["overall"] if c == "overall" else figures["by_category"].get(c, {})).get("speedup") or 0.0
            for c in categories
        ]
        ax.bar(x + i * width - 0.4 + width / 2, values, width, label=name)
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_xticks(x, categories, rotation=20)
    ax.set_ylabel("speedup vs HF generate (greedy)")
    ax.set_title(f"{results['model']} · {results['dtype']} · {results['device']}")
    ax.legend(fontsize=8)
    return PNG(fig, dpi=100).data


def is_bench_results(path: Path) -> bool:
    """Whether ``path`` is a results.json a layerskip-bench run wrote (its summary and its rows)."""
    data = read_json_file(path)
    return isinstance(data, dict) and {"methods", "per_prompt", "model"} <= data.keys()


def check_outputs_replaceable(directory: str | Path, force: bool = False) -> None:
    """Refuse a directory holding one of the report files that no bench run wrote (unless ``force``):
    they are replaced as a set, and a set is recognised by its results.json."""
    directory = Path(directory).expanduser()
    present = [name for name in OUTPUT_FILES if (directory / name).exists()]
    if force or not present or is_bench_results(directory / "results.json"):
        return
    why = "" if present[0] == "results.json" else " (no bench results.json beside it)"
    raise LayerskipError(
        f"--out {directory} holds {present[0]}, which no layerskip-bench run wrote{why}, and a run would "
        "replace it; pass --force to replace it, or choose another directory"
    )


def write_outputs(results: dict[str, Any], directory: str | Path) -> list[Path]:
    """A run's four files, written as a set: all rendered first (a figure that fails to draw
    changes nothing), then staged and moved into ``directory`` together, so an earlier run's
    files there are never half replaced."""
    payloads = {
        "results.json": (json.dumps(results, indent=2) + "\n").encode(),
        "results.csv": csv_text(results).encode(),
        "results.md": (markdown_report(results) + "\n").encode(),
        "speedup.png": speedup_png(results),
    }
    return write_file_set(directory, payloads)


BATCH_FILES = ("batches.json", "batches.csv", "batches.md")
BATCH_COLUMNS = (
    "batch_size",
    "layout",
    "hf_tokens_per_second",
    "ours_tokens_per_second",
    "speedup",
    "plain_tokens_per_second",
    "vs_plain",
    "row_latency_hf_s",
    "row_latency_ours_s",
    "identical_rows",
    "rows",
    "alone_tokens_per_second",
    "vs_alone",
    "row_latency_alone_s",
)


def batch_table(results: dict[str, Any]) -> str:
    """The batches table (bench's batches.md, and each batch run on the results page): per layout and
    batch size, the tokens/s of HF's batched generate, of our plain decoding and ours, ours over each,
    a row's latency, the rows identical to HF's and the kinds of step the batch chose; where the run
    also decoded the batch's prompts one at a time, that throughput and a row's latency alone."""
    alone = any("alone_tokens_per_second" in row for row in results["batches"])
    header = ["batch", "layout", "HF batched tok/s", "our plain tok/s", "ours tok/s", "vs HF", "vs our plain"]
    header += ["row latency HF / ours (s)"]
    header += ["ours one at a time tok/s (row latency s)"] if alone else []
    header += ["identical rows", "steps chosen"]
    steps = {
        (run["size"], run["layout"]): run.get("steps") or {}
        for run in results.get("runs", [])
        if isinstance(run, dict) and run.get("method") == "self-spec-batched"
    }
    rows = []
    for row in sorted(results["batches"], key=lambda r: (r["layout"], r["batch_size"])):
        chosen = steps.get((row["batch_size"], row["layout"]), {})
        kinds = ", ".join(f"{kind} {count}" for kind, count in chosen.items() if isinstance(count, int))
        plain, vs_plain = row.get("plain_tokens_per_second"), row.get("vs_plain")
        rows.append(
            [
                str(row["batch_size"]),
                row["layout"],
                f"{row['hf_tokens_per_second']:.1f}",
                "-" if plain is None else f"{plain:.1f}",
                f"{row['ours_tokens_per_second']:.1f}",
                f"{row['speedup']:.2f}×",
                "-" if vs_plain is None else f"{vs_plain:.2f}×",
                f"{row['row_latency_hf_s']:.2f} / {row['row_latency_ours_s']:.2f}",
                *([_alone_cell(row)] if alone else []),
                f"{row['identical_rows']}/{row['rows']}",
                kinds or "one prompt: no batch",
            ]
        )
    return table(header, rows)


def _alone_cell(row: dict[str, Any]) -> str:
    if "alone_tokens_per_second" not in row:
        return "-"
    return f"{row['alone_tokens_per_second']:.1f} ({row['row_latency_alone_s']:.2f})"


def batch_markdown(results: dict[str, Any]) -> str:
    """A batch run's report: what ran where, then its table."""
    title = (
        f"{results['model']} ({results['dtype']}, {results['max_new_tokens']} new tokens, policy "
        f"{results['policy']}) on {results['device_name']}"
    )
    return f"{title}\n\n{batch_table(results)}"


def write_batch_outputs(results: dict[str, Any], directory: str | Path) -> list[Path]:
    """A batch run's three files, written as a set."""
    payloads = {
        "batches.json": (json.dumps(results, indent=2) + "\n").encode(),
        "batches.csv": csv_table(results["batches"], BATCH_COLUMNS).encode(),
        "batches.md": (batch_markdown(results) + "\n").encode(),
    }
    return write_file_set(directory, payloads)
