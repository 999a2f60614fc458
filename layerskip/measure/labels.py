"""Labels every results table shares: a CPU as tables name it, the code that ran, greedy or sampled
decoding, and a generated block between markers."""

from __future__ import annotations

import re
from typing import Any

from layerskip.errors import LayerskipError

FLAG_LABELS = (("amx_bf16", "AMX"), ("avx512_bf16", "avx512_bf16"), ("avx512f", "AVX-512"), ("avx2", "AVX2"))


def decoding_label(sampled: dict[str, Any] | None) -> str:
    """``greedy``, or a sampled run's settings (a result file's ``sampled``) as tables show them:
    ``T 0.7, top-p 1.0``."""
    if not sampled:
        return "greedy"
    label = f"T {float(sampled['temperature'])}, top-p {float(sampled.get('top_p', 1.0))}"
    return label + (f", top-k {sampled['top_k']}" if sampled.get("top_k") else "")


def cpu_name(model: str) -> str:
    """A CPU model name as a table shows it: ``Intel(R) Xeon(R) Processor`` -> ``Intel Xeon``."""
    name = re.sub(r"\((?:R|TM|tm)\)", "", model)
    name = re.sub(r"\b(?:CPU|Processor)\b", "", name)
    return " ".join(name.split()) or model


def cpu_label(model: str, flags: list[str] | tuple[str, ...] | None) -> str:
    """CPU model and the features that decide what a draft costs, e.g. ``AMD EPYC (AVX2, AVX-512,
    avx512_bf16)`` or ``AMD EPYC (AVX2 only)``; the model alone when no flags were recorded."""
    if flags is None:
        return cpu_name(model)
    present = set(flags)
    features = [label for flag, label in reversed(FLAG_LABELS) if flag in present]
    if features == ["AVX2"]:
        features = ["AVX2 only"]
    return f"{cpu_name(model)} ({', '.join(features) or 'no AVX2'})"


def commit_label(record: dict[str, Any]) -> str:
    """The code a run measured with, from the ``commit`` and ``dirty`` a result file records
    (``layerskip.machine.code_version``): ``abc1234``, ``abc1234 + uncommitted changes``, or
    ``not recorded`` (a file older than the fields, or a run outside a git checkout)."""
    commit = record.get("commit")
    if not isinstance(commit, str) or not commit:
        return "not recorded"
    return f"{commit} + uncommitted changes" if record.get("dirty") else commit


def replace_between_markers(text: str, block: str, start: str, end: str, where: str = "README.md") -> str:
    """``text`` with what lies between the ``start`` and ``end`` markers replaced by ``block``."""
    first, last = text.find(start), text.find(end)
    if first < 0 or last < first:
        raise LayerskipError(f"{where} has no '{start}' ... '{end}' markers; put them back around the table")
    return text[: first + len(start)] + "\n" + block + "\n" + text[last:]
