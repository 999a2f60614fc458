"""Prompt sets: the built-in set, Spec-Bench-style JSONL, or any local file ``datasets`` loads.

Spec-Bench-style rows are ``{"question_id", "category", "turns": [..]}``; the first turn is the
prompt. Spec-Bench files MT-bench questions under eight small sub-categories; they are grouped
as ``mt_bench`` (as Spec-Bench reports them) so the six categories have comparable sizes.
"""

from __future__ import annotations

import json
import random
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.resources import files
from itertools import zip_longest
from pathlib import Path
from typing import Any

from layerskip.errors import LayerskipError, first_line
from layerskip.fileio import MAX_JSON_BYTES, JsonProblem, check_regular_file, parse_json, read_text

MT_BENCH_CATEGORIES = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
DATASETS_SUFFIXES = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str


def _from_spec_bench_rows(rows: list[dict], source: str) -> list[Prompt]:
    prompts = []
    for number, row in enumerate(rows, 1):
        turns = row.get("turns")
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str) or not turns[0].strip():
            raise LayerskipError(f"{source} line {number}: 'turns' must be a non-empty list of strings")
        category = str(row.get("category", "default"))
        if category in MT_BENCH_CATEGORIES:
            category = "mt_bench"
        prompts.append(Prompt(str(row.get("question_id", number)), category, turns[0]))
    return prompts


# Names ``--prompts`` takes besides a path, and what messages call them. "builtin": the project's
# own 18 prompts, three in each Spec-Bench category; "code": its own 12 code-continuation prompts
# (Python, C, JavaScript, SQL), text no study here was tuned on, to check a policy away from its
# calibration prompts.
PACKAGED_PROMPTS = {"builtin": "built-in prompts", "code": "code prompts"}


def packaged_prompts(name: str) -> list[Prompt]:
    """The packaged prompt set ``name`` (a key of ``PACKAGED_PROMPTS``)."""
    text = files("layerskip").joinpath(f"prompts/{name}.jsonl").read_text(encoding="utf-8")
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return _from_spec_bench_rows(rows, PACKAGED_PROMPTS[name])


def builtin_prompts() -> list[Prompt]:
    return packaged_prompts("builtin")


def _read_jsonl(path: Path, text: str) -> list[dict] | None:
    """Rows of a JSONL file if it is one whose rows have 'turns'; None if it is another format."""
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = parse_json(line, expect=None)
        except JsonProblem as problem:
            if number == 1 and _is_json_document(text):
                return None  # one JSON document (e.g. a pretty-printed list) named .jsonl: datasets reads it
            reason = "is not valid JSON" if problem.reason.startswith("not valid JSON") else problem.reason
            raise LayerskipError(f"{path} line {number} {reason}; fix or remove that line") from None
        if not isinstance(row, dict):
            raise LayerskipError(f"{path} line {number} is not a JSON object")
        rows.append((number, row))
    with_turns = [number for number, row in rows if "turns" in row]
    if with_turns and len(with_turns) < len(rows):
        # A Spec-Bench file with a broken row: say which, rather than falling back to another format.
        missing = next(number for number, row in rows if "turns" not in row)
        raise LayerskipError(f"{path} line {missing} has no 'turns' (a list of strings) as the other rows do")
    return [row for _, row in rows] if with_turns else None


def _is_json_document(text: str) -> bool:
    try:
        parse_json(text, expect=None)
    except JsonProblem:
        return False
    return True


def _read_with_datasets(path: Path, text_field: str | None) -> list[Prompt]:
    builder = DATASETS_SUFFIXES.get(path.suffix.lower())
    if builder is None:
        raise LayerskipError(f"cannot read prompts from {path}: use .jsonl, .json, .parquet or .csv")
    import datasets

    # A local file needs no network, but online datasets pings its download counter for the
    # builder (a request to S3): switched off for this call, then restored.
    counting = datasets.config.HF_UPDATE_DOWNLOAD_COUNTS
    datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = False
    try:
        table = datasets.load_dataset(builder, data_files=str(path), split="train")
    except Exception as exc:  # datasets raises many types for malformed files
        raise LayerskipError(f"cannot read prompts from {path}: {first_line(exc)}") from None
    finally:
        datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = counting
    field = text_field or next((name for name in ("text", "prompt", "question") if name in table.column_names), None)
    if text_field is not None and text_field not in table.column_names:
        raise LayerskipError(f"{path} has no text field '{text_field}'; pass --text-field, one of {table.column_names}")
    if field is None:
        raise LayerskipError(
            f"{path} has no 'turns' (Spec-Bench rows) and no 'text', 'prompt' or 'question' column; "
            f"pass --text-field, one of {table.column_names}"
        )
    return [
        Prompt(str(index), str(row.get("category", "default")), row[field])
        for index, row in enumerate(table)
        if isinstance(row[field], str) and row[field].strip()
    ]


def load_prompts(
    source: str = "builtin",
    *,
    n: int | None = None,
    per_category: int | None = None,
    text_field: str | None = None,
    seed: int = 0,
    categories: Sequence[str] = (),
) -> list[Prompt]:
    """Prompts from ``builtin``, ``code`` or a path; ``categories`` keeps only those (e.g. to tune on some
    and report the others), ``per_category`` takes that many from each category (a seeded random
    sample), then ``n`` caps the total, spread over categories."""
    if per_category is not None and per_category <= 0:
        raise LayerskipError(f"--per-category must be > 0 (got {per_category})")
    if n is not None and n <= 0:
        raise LayerskipError(f"the number of prompts must be > 0 (got {n})")
    if source in PACKAGED_PROMPTS:
        prompts = packaged_prompts(source)
    else:
        fix = "pass an existing path, 'builtin' or 'code'"
        path = Path(source).expanduser()
        parquet = path.suffix.lower() == ".parquet"
        # A regular file only: a FIFO would hang the reader, /dev/zero would never end. Text is read
        # here (at most fileio's size cap); a parquet file is datasets' to read, whatever its size.
        check_regular_file(path, "prompts file", fix, limit=sys.maxsize if parquet else MAX_JSON_BYTES)
        if path.stat().st_size == 0:
            raise LayerskipError(f"prompts file {path} is empty")
        text = None if parquet else read_text(path, "prompts file", fix)  # UTF-8, the bad line named
        jsonl = text is not None and path.suffix.lower() == ".jsonl" and text_field is None
        rows = _read_jsonl(path, text) if jsonl else None
        prompts = _from_spec_bench_rows(rows, str(path)) if rows is not None else _read_with_datasets(path, text_field)
        if not prompts:
            raise LayerskipError(f"prompts file {path} holds no non-empty prompt")
    if categories:
        known = sorted({p.category for p in prompts})
        unknown = sorted(set(categories) - set(known))
        if unknown:
            raise LayerskipError(
                f"no prompts in categor{'y' if len(unknown) == 1 else 'ies'} {', '.join(unknown)}; "
                f"choose from {', '.join(known)}"
            )
        prompts = [p for p in prompts if p.category in set(categories)]
    by_category: dict[str, list[Prompt]] = defaultdict(list)
    for prompt in prompts:
        by_category[prompt.category].append(prompt)
    rng = random.Random(seed)
    if per_category is not None:
        for category, items in by_category.items():
            by_category[category] = sorted(rng.sample(items, min(per_category, len(items))), key=prompts.index)
    # Interleave categories so a cap of n keeps them balanced.
    ordered = [p for round_ in zip_longest(*by_category.values()) for p in round_ if p is not None]
    return ordered[:n] if n is not None else ordered


def prompts_selected_by(source: str, options: Any) -> list[Prompt]:
    """The prompts of ``source`` that a run's options select: ``options`` (a CLI namespace or a
    search's settings) carries ``n_prompts``, ``per_category``, ``text_field``, ``seed`` and
    ``categories``."""
    return load_prompts(
        source,
        n=options.n_prompts,
        per_category=options.per_category,
        text_field=options.text_field,
        seed=options.seed,
        categories=options.categories,
    )
