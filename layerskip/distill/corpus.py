"""Text to self-distil an exit adapter on: prompt files (any format ``datasets`` reads) and source code.

Every document carries a domain (a prompt category, or ``code``), so training can hold whole
domains out and report agreement per domain. Nothing here is downloaded: prompt files are local
(Spec-Bench's JSONL, a user's own json/jsonl/csv/parquet), and code comes from directories on the
machine (the Python standard library, say).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path

from layerskip.errors import LayerskipError

CODE_DOMAIN = "code"
CODE_SUFFIXES = (".py",)
OWN_SUFFIX = ":own"  # the domain of the model's own continuations of a domain's prompts


@dataclass(frozen=True)
class Document:
    domain: str
    text: str
    ids: tuple[int, ...] = ()  # token ids, when the document is already tokenised (own continuations)


def code_documents(directory: str | Path, max_files: int, seed: int = 0, max_chars: int = 20_000) -> list[Document]:
    """Up to ``max_files`` source files under ``directory`` (a seeded sample), each cut to ``max_chars``."""
    root = Path(directory).expanduser()
    if not root.is_dir():
        raise LayerskipError(f"code directory {root} not found; pass an existing directory to --code-dir")
    files = sorted(p for p in root.rglob("*") if p.suffix in CODE_SUFFIXES and p.is_file())
    if not files:
        raise LayerskipError(f"no {', '.join(CODE_SUFFIXES)} files under {root}")
    random.Random(seed).shuffle(files)
    documents = []
    for path in files:
        if len(documents) >= max_files:
            break
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a binary or unreadable file is not code to learn from
        if text.strip():
            documents.append(Document(CODE_DOMAIN, text[:max_chars]))
    return documents


@dataclass(frozen=True)
class Split:
    """Training documents, in-domain validation documents (early stopping), held-out domains (report only)."""

    train: list[Document]
    validation: list[Document]
    held_out: list[Document]

    def domains(self) -> dict[str, list[str]]:
        return {part.name: sorted({d.domain for d in getattr(self, part.name)}) for part in fields(self)}


def split_documents(
    documents: Sequence[Document], held_out_domains: Sequence[str], validation_fraction: float = 0.1, seed: int = 0
) -> Split:
    """Hold out whole domains, then a seeded fraction of every other domain's documents for validation."""
    known = {d.domain for d in documents}
    unknown = sorted(set(held_out_domains) - known)
    if unknown:
        raise LayerskipError(
            f"no documents in held-out domain(s) {', '.join(unknown)}; choose from {', '.join(sorted(known))}"
        )
    held = [d for d in documents if d.domain in set(held_out_domains)]
    rest = [d for d in documents if d.domain not in set(held_out_domains)]
    if not rest:
        raise LayerskipError("every document is held out; keep at least one domain for training")
    rng = random.Random(seed)
    by_domain: dict[str, list[Document]] = {}
    for document in rest:
        by_domain.setdefault(document.domain, []).append(document)
    train: list[Document] = []
    validation: list[Document] = []
    for items in by_domain.values():
        items = list(items)
        rng.shuffle(items)
        count = max(1, round(validation_fraction * len(items))) if len(items) > 1 else 0
        validation += items[:count]
        train += items[count:]
    return Split(train, validation, held)
