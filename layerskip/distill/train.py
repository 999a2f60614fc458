"""Training an exit adapter by self-distillation, with early stopping and resumable checkpoints.

The student is the draft as it will run: the exit layer's output (from the teacher's forward)
goes through the adapter, the model's own final norm and the draft's head rows; its log-softmax
over those rows is fitted to the teacher's top-k distribution (cross-entropy to the teacher's
probabilities renormalised over the rows the head scores, i.e. the KL up to a constant). Only
the adapter learns; the model is frozen and restored as it was.

The student forward is the decoder stack itself with every layer bypassed but the exit layer,
whose output is replaced by the stored hidden states and passed through the adapter: the stack
supplies the masks and rotary embeddings a ``layer`` adapter needs, for any architecture.
"""

from __future__ import annotations

import contextlib
import copy
import io
import math
import os
import pickle
import random
import sys
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from layerskip.distill.teacher import TeacherData
from layerskip.drafts.model.exit_adapter import ExitAdapter
from layerskip.fileio import write_bytes_atomic
from layerskip.hf import adapters
from layerskip.hf.forward import stack_forward


@dataclass(frozen=True)
class TrainSettings:
    epochs: int = 8
    batch_chunks: int = 8
    learning_rate: float = 1e-3
    weight_decay: float = 0.01
    evals_per_epoch: int = 2
    patience: int = 3  # evaluations without a better validation loss before stopping
    # Weight of the cross-entropy to the teacher's top-1 token, added to the soft one: greedy
    # drafts are accepted on top-1 agreement, which the soft term alone can trade away for a
    # better fit of the tail.
    hard_weight: float = 1.0
    seed: int = 0


@dataclass
class Scores:
    """Agreement (draft top-1 == teacher top-1) and KL over some positions."""

    positions: int = 0
    agreement: float = 0.0
    kl: float = 0.0


@dataclass
class TrainResult:
    best_loss: float
    steps: int
    evaluations: list[dict[str, float]] = field(default_factory=list)
    stopped_early: bool = False


@contextlib.contextmanager
def frozen(model: nn.Module) -> Iterator[None]:
    """The model's parameters do not require grad inside the block; their flags are restored after."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        for p, _ in flags:
            p.requires_grad_(False)
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


class Student:
    """Runs hidden states at the exit layer through an adapter, the final norm and the head rows."""

    def __init__(self, model: nn.Module, layer: int, rows: torch.Tensor) -> None:
        self.model = model
        self.layer = layer
        self.rows = rows  # [K] vocabulary ids the draft head scores
        head = adapters.lm_head(model)
        self.weight = head.weight.detach()[rows]  # [K, H]
        self.bias = None if head.bias is None else head.bias.detach()[rows]
        self.softcap = adapters.final_logit_softcap(model)
        self.row_of = torch.full((head.weight.shape[0],), -1, dtype=torch.long)  # vocabulary id -> row
        self.row_of[rows.cpu()] = torch.arange(len(rows))
        count = adapters.num_layers(model)
        self._others = [i for i in range(count) if i != layer]

    def logits(self, module: nn.Module | None, ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """``[B, T, K]`` draft logits for chunks ``ids [B, T]`` whose exit-layer outputs are ``hidden``.

        ``module`` None: no adapter (the plain early exit)."""
        transform = module if module is not None else (lambda output, *a, **k: output)
        replacements = adapters.bypass_replacements(self.model, self._others, self._others)
        replacements.append(adapters.layer_output_replacement(self.model, self.layer, transform, lambda: hidden))
        with adapters.patched_forwards(replacements):
            final = stack_forward(self.model, ids)
        logits = nn.functional.linear(final, self.weight, self.bias)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def targets(self, top_ids: torch.Tensor, top_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher top-k mapped to head rows: (row index, renormalised weight), 0 weight off the head."""
        rows = self.row_of[top_ids.long()]  # [..., k]
        weight = torch.where(rows >= 0, top_probs, torch.zeros_like(top_probs))
        weight = weight / weight.sum(-1, keepdim=True).clamp_min(1e-12)
        return rows.clamp_min(0), weight

    def loss(
        self,
        module: nn.Module | None,
        ids: torch.Tensor,
        hidden: torch.Tensor,
        top_ids: torch.Tensor,
        top_probs: torch.Tensor,
        hard_weight: float = 0.0,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(training loss, per-position KL ``[B, T]``, per-position top-1 match ``[B, T]``).

        The loss is the cross-entropy to the teacher's (renormalised) top-k law plus
        ``hard_weight`` times the cross-entropy to its top-1 token (where the head scores it)."""
        logits = self.logits(module, ids, hidden).float()
        log_q = logits.log_softmax(-1)
        rows, weight = self.targets(top_ids, top_probs)
        cross = -(weight * log_q.gather(-1, rows)).sum(-1)  # [B, T]
        entropy = -(weight * weight.clamp_min(1e-12).log()).sum(-1)
        loss = cross.mean()
        if hard_weight:
            top_row = self.row_of[top_ids[..., 0].long()]  # [B, T], -1 where the head lacks it
            scored = top_row >= 0
            hard = -log_q.gather(-1, top_row.clamp_min(0)[..., None])[..., 0]
            loss = loss + hard_weight * (hard * scored).sum() / scored.sum().clamp_min(1)
        predicted = self.rows[logits.argmax(-1)]
        match = predicted == top_ids[..., 0].long()
        return loss, (cross - entropy).detach(), match


@torch.no_grad()
def evaluate(
    student: Student, module: nn.Module | None, data: TeacherData, batch_chunks: int = 16
) -> dict[str, Scores]:
    """Scores per domain, and over everything as ``"all"``."""
    sums: dict[str, list[float]] = {}
    for start in range(0, len(data.domains), batch_chunks):
        part = slice(start, start + batch_chunks)
        _, kl, match = student.loss(
            module, data.ids[part], data.hidden[student.layer][part], data.top_ids[part], data.top_probs[part]
        )
        for row, domain in enumerate(data.domains[part]):
            for key in (domain, "all"):
                total = sums.setdefault(key, [0.0, 0.0, 0.0])
                total[0] += match[row].numel()
                total[1] += float(match[row].sum())
                total[2] += float(kl[row].sum())
    return {key: Scores(int(n), right / n, kl / n) for key, (n, right, kl) in sums.items()}


def save_state(path: str | os.PathLike[str], state: dict, owned: bool = False) -> None:
    """``state`` (what ``load_state`` reads back) written atomically; ``owned`` as ``write_bytes_atomic``."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    write_bytes_atomic(path, buffer.getvalue(), owned=owned)


def load_state(path: str | os.PathLike[str]) -> dict:
    """A checkpoint or teacher cache written by this package: tensors in dicts, lists and plain values.

    Read with torch's weights-only unpickler: these files live in the user's --out folder, where
    anyone who can write there could plant a pickle, and a full unpickle runs whatever code the
    file names. A file holding anything else raises ``pickle.UnpicklingError`` unread."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's notes about foreign pickle protocols: the caller reports
        state = torch.load(path, weights_only=True)
    if not isinstance(state, dict):
        raise ValueError(f"expected a dict, found {type(state).__name__}")
    return state


def unreadable_reason(exc: Exception) -> str:
    """Why ``load_state`` (or fitting what it read) failed, in a few words for a one-line warning."""
    if isinstance(exc, pickle.UnpicklingError) and "weights only" in str(exc).lower():
        return "it holds Python objects, not only tensors; refused unread, as loading it could run code"
    detail = (str(exc).strip().splitlines() or [""])[0].split(". ")[0][:160]  # torch's first sentence
    return f"{type(exc).__name__}: {detail}"


# A checkpoint: the state of each of a run's parts (module, optimizer, scheduler), its counters, and its settings.
COUNTERS = ("step", "finished", "best_loss", "best_state", "waited", "evaluations")


def _resume(path: Path, parts: dict[str, Any]) -> dict | None:
    """Load a run's checkpoint into its ``parts`` (module, optimizer, scheduler by name); returns its counters.

    A checkpoint that cannot be read or does not fit (truncated by a kill, written by another
    version) is warned about and None returned, with every part as it was: the adapter is
    trained again from the start, as a damaged teacher cache is collected again."""
    before = {name: copy.deepcopy(part.state_dict()) for name, part in parts.items()}
    try:
        state = load_state(path)
        if state["best_state"] is not None:
            parts["module"].load_state_dict(state["best_state"])  # it is loaded at the end: it must fit too
        for name, part in parts.items():
            part.load_state_dict(state[name])
        counters = {name: state[name] for name in COUNTERS}
        if not isinstance(counters["step"], int) or counters["step"] < 0:
            raise ValueError(f"step {counters['step']!r}")
    except Exception as exc:  # torch.load and load_state_dict raise many types for a damaged file
        for name, part in parts.items():
            part.load_state_dict(before[name])
        print(
            f"warning: checkpoint {path} is unreadable ({unreadable_reason(exc)}); training this adapter "
            "again from the start",
            file=sys.stderr,
        )
        return None
    return counters


def _validation_kl(student: Student, module: nn.Module, validation: TeacherData) -> float:
    """The mean KL over ``validation`` of ``module`` in eval mode; it is left training."""
    module.eval()
    kl = evaluate(student, module, validation)["all"].kl
    module.train()
    return kl


def _copied_state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def train_adapter(
    model: nn.Module,
    adapter: ExitAdapter,
    rows: torch.Tensor,
    train: TeacherData,
    validation: TeacherData,
    settings: TrainSettings,
    checkpoint: str | os.PathLike[str] | None = None,
    progress: bool = True,
) -> TrainResult:
    """Fit ``adapter.module`` in place; it ends holding the weights with the best validation loss.

    With ``checkpoint``, the run's state is saved there after every evaluation (atomically) and a
    run that finds one continues from it: same batches, same optimizer state.
    """
    layer = adapter.spec.layer
    student = Student(model, layer, rows)
    module = adapter.module
    module.train()
    module.requires_grad_(True)
    optimizer = torch.optim.AdamW(module.parameters(), lr=settings.learning_rate, weight_decay=settings.weight_decay)
    chunks = len(train.domains)
    per_epoch = max(1, math.ceil(chunks / settings.batch_chunks))
    total_steps = per_epoch * settings.epochs
    eval_every = max(1, per_epoch // max(1, settings.evals_per_epoch))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * min(step, total_steps) / total_steps))
    )
    step, best_loss, best_state, waited, finished = 0, math.inf, None, 0, False
    evaluations: list[dict[str, float]] = []
    parts = {"module": module, "optimizer": optimizer, "scheduler": scheduler}
    path = Path(checkpoint) if checkpoint is not None else None
    resumed = _resume(path, parts) if path is not None and path.is_file() else None
    if resumed is not None:
        step, finished, best_loss, best_state, waited, evaluations = (resumed[name] for name in COUNTERS)
    elif validation.domains:
        # The starting adapter is a candidate too (for a linear one: the plain exit), so the
        # result is never worse on validation than where it started.
        best_loss = _validation_kl(student, module, validation)
        best_state = _copied_state(module)
        evaluations.append({"step": 0, "validation_kl": best_loss, "train_loss": math.nan})
    order_rng = random.Random(settings.seed)
    orders = [order_rng.sample(range(chunks), chunks) for _ in range(settings.epochs)]  # fixed: a resume replays them
    bar = tqdm(total=total_steps, initial=step, desc=f"train exit L{layer} {adapter.spec.kind}", disable=not progress)
    stopped_early = False
    with frozen(model), torch.enable_grad():
        while step < total_steps and not finished:
            epoch, index = divmod(step, per_epoch)
            batch = orders[epoch][index * settings.batch_chunks : (index + 1) * settings.batch_chunks]
            if batch:
                part = train.select(batch)
                loss, _, _ = student.loss(
                    module, part.ids, part.hidden[layer], part.top_ids, part.top_probs, settings.hard_weight
                )
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
                optimizer.step()
            scheduler.step()
            step += 1
            bar.update(1)
            if step % eval_every == 0 or step == total_steps:
                val = _validation_kl(student, module, validation) if validation.domains else float(loss.detach())
                evaluations.append({"step": step, "validation_kl": val, "train_loss": float(loss.detach())})
                if val < best_loss - 1e-4:
                    best_loss, waited = val, 0
                    best_state = _copied_state(module)
                else:
                    waited += 1
                bar.set_postfix(val_kl=f"{val:.3f}", best=f"{best_loss:.3f}")
                stopped_early = waited >= settings.patience
                finished = stopped_early or step == total_steps
                if path is not None:
                    counters = (step, finished, best_loss, best_state, waited, evaluations)
                    state = {name: part.state_dict() for name, part in parts.items()} | dict(zip(COUNTERS, counters))
                    save_state(path, state | {"settings": asdict(settings)})
                if stopped_early:
                    break
    bar.close()
    if best_state is not None:
        module.load_state_dict(best_state)
    module.eval().requires_grad_(False)
    return TrainResult(best_loss, step, evaluations, stopped_early or (finished and step < total_steps))


def rank_rows(data: TeacherData, vocab_size: int, count: int) -> torch.Tensor:
    """The ``count`` vocabulary ids the teacher ranks first most often, then the lowest ids (BPE's
    most frequent merges) to fill up: the draft head's rows, most useful first."""
    if count <= 0 or count >= vocab_size:
        return torch.arange(vocab_size)
    counts = torch.bincount(data.top_ids[..., 0].reshape(-1).long(), minlength=vocab_size).float()
    counts += torch.bincount(data.ids.reshape(-1), minlength=vocab_size).float() * 0.1  # text tokens, lightly
    order = torch.argsort(-counts - torch.arange(vocab_size) * 1e-9, stable=True)  # ties: lower id first
    return order[:count]
