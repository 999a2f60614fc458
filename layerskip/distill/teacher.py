"""The full model as teacher: one forward over chunks of text gives, at every position, the
hidden state after each candidate exit layer and the full model's next-token distribution.

Teacher forcing over text costs prefill time per position (tens of thousands of positions a
minute on a small model), where generating the same number of positions token by token would
take hours. The distribution kept is the top ``top_k`` of the full softmax (ids and
probabilities); that holds nearly all of the mass of a next-token distribution, and the exit's
job is to rank the top of it the same way.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch
from torch import nn
from tqdm.auto import tqdm

from layerskip.distill.corpus import CODE_DOMAIN, OWN_SUFFIX, Document
from layerskip.drafts.drafters.exit_draft import capturing_layer_output
from layerskip.hf import adapters
from layerskip.hf.forward import stack_forward


@dataclass
class TeacherData:
    """Chunks of ``T`` tokens with what the full model says at each position.

    ``ids [N, T]`` token ids; ``hidden[layer] [N, T, H]`` the residual stream after that layer;
    ``top_ids [N, T, k]`` / ``top_probs [N, T, k]`` the full model's top-k next-token
    distribution; ``domains[N]`` each chunk's domain.
    """

    ids: torch.Tensor
    hidden: dict[int, torch.Tensor]
    top_ids: torch.Tensor
    top_probs: torch.Tensor
    domains: list[str]

    @property
    def positions(self) -> int:
        return self.ids.numel()

    def select(self, chunks: Sequence[int]) -> TeacherData:
        index = torch.tensor(list(chunks), dtype=torch.long)
        return TeacherData(
            self.ids[index],
            {layer: h[index] for layer, h in self.hidden.items()},
            self.top_ids[index],
            self.top_probs[index],
            [self.domains[i] for i in chunks],
        )

    def state(self) -> dict[str, object]:
        """The fields by name, the tensors themselves (``torch.save`` writes them)."""
        return {field.name: getattr(self, field.name) for field in fields(self)}

    @classmethod
    def from_state(cls, state: dict) -> TeacherData:
        return cls(**{field.name: state[field.name] for field in fields(cls)} | {"domains": list(state["domains"])})


def chunk_documents(
    tokenizer: object, documents: Sequence[Document], chunk_tokens: int, max_positions: int
) -> list[tuple[str, list[int]]]:
    """(domain, ``chunk_tokens`` ids) chunks: each domain's documents packed end to end, split evenly.

    Documents of one domain are joined with the tokenizer's EOS (or a newline) between them; the
    last partial chunk of a domain is dropped. Domains share ``max_positions`` in proportion to
    their size but each keeps at least one chunk, so small domains are not lost.
    """
    separator = [tokenizer.eos_token_id] if getattr(tokenizer, "eos_token_id", None) is not None else []
    streams: dict[str, list[int]] = {}
    for document in documents:
        ids = list(document.ids) or list(tokenizer(document.text, add_special_tokens=False)["input_ids"])
        streams.setdefault(document.domain, []).extend(ids + separator)
    per_domain = {domain: len(ids) // chunk_tokens for domain, ids in streams.items()}
    total = sum(per_domain.values())
    budget = max_positions // chunk_tokens
    chunks: list[tuple[str, list[int]]] = []
    for domain, ids in streams.items():
        available = per_domain[domain]
        take = available if total <= budget else max(1, round(available * budget / total))
        take = min(take, available)
        step = max(1, available // max(take, 1))  # spread over the domain, not only its first documents
        for index in range(0, available, step)[:take]:
            chunks.append((domain, ids[index * chunk_tokens : (index + 1) * chunk_tokens]))
    return chunks


@torch.inference_mode()
def collect(
    model: nn.Module,
    chunks: Sequence[tuple[str, list[int]]],
    layers: Sequence[int],
    top_k: int = 32,
    batch_tokens: int = 1024,
    progress: bool = True,
) -> TeacherData:
    """Run the full model over every chunk once; keep candidate layers' outputs and the top-k law."""
    device = next(model.parameters()).device
    if not chunks:
        return TeacherData(torch.empty(0, 0, dtype=torch.long), {}, torch.empty(0), torch.empty(0), [])
    length = len(chunks[0][1])
    per_batch = max(1, batch_tokens // length)
    ids = torch.tensor([c[1] for c in chunks], dtype=torch.long)  # [N, T]
    hidden: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers}
    top_ids: list[torch.Tensor] = []
    top_probs: list[torch.Tensor] = []
    bar = tqdm(total=len(chunks) * length, desc="teacher positions", unit="tok", disable=not progress)
    for start in range(0, len(chunks), per_batch):
        batch = ids[start : start + per_batch].to(device)  # [B, T]
        captured: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers}
        with contextlib.ExitStack() as stack:
            for layer in layers:
                stack.enter_context(capturing_layer_output(model, layer, captured[layer]))
            last = stack_forward(model, batch)  # [B, T, H]
        for layer in layers:
            hidden[layer].append(captured[layer][-1].float().cpu())
        flat = last.reshape(-1, last.shape[-1])  # [B*T, H]
        rows = max(1, (1 << 26) // adapters.lm_head(model).weight.shape[0])  # a [rows, V] slice: ~256 MB in fp32
        ids_part, probs_part = [], []
        for begin in range(0, flat.shape[0], rows):
            logits = adapters.logits_from_hidden(model, flat[begin : begin + rows]).float()  # [rows, V]
            top = torch.topk(logits.softmax(-1), top_k, dim=-1)
            ids_part.append(top.indices.to(torch.int32).cpu())
            probs_part.append(top.values.cpu())
        top_ids.append(torch.cat(ids_part).reshape(*batch.shape, top_k))
        top_probs.append(torch.cat(probs_part).reshape(*batch.shape, top_k))
        bar.update(batch.numel())
    bar.close()
    return TeacherData(
        ids,
        {layer: torch.cat(parts) for layer, parts in hidden.items()},
        torch.cat(top_ids),
        torch.cat(top_probs),
        [c[0] for c in chunks],
    )


@torch.inference_mode()
def own_continuations(
    model: nn.Module,
    tokenizer: object,
    documents: Sequence[Document],
    count: int,
    new_tokens: int,
    chat: bool,
    temperature: float = 0.0,
    max_prompt_tokens: int = 320,
    seed: int = 0,
    progress: bool = False,
    batch_size: int = 16,
) -> list[Document]:
    """The model's own continuations of up to ``count`` prompt documents (code files are not
    prompts), as tokenised documents in domain ``<domain>:own``: prompt (its last
    ``max_prompt_tokens`` tokens, chat template applied where ``chat``) plus ``new_tokens``."""
    from layerskip.hf.prompting import encode_prompt
    from layerskip.measure.batches import left_padded

    prompts = [d for d in documents if d.domain != CODE_DOMAIN and not d.ids]
    if not prompts or count <= 0:
        return []
    step = max(1, len(prompts) // count)
    chosen = prompts[::step][:count]
    encoded = [encode_prompt(tokenizer, d.text, chat)[-max_prompt_tokens:] for d in chosen]
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))  # similar lengths batch with little padding
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    # Greedy, or sampled at ``temperature``, batch_size prompts at a time (left-padded: many times faster
    # than one at a time); no EOS stop, so every continuation is full length.
    sampled = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else {}
    device = next(model.parameters()).device
    torch.manual_seed(seed)
    continued: list[list[int]] = []
    batches = tqdm(range(0, len(order), batch_size), desc="own continuations", unit="batch", disable=not progress)
    for start in batches:
        ids, mask = left_padded([encoded[i] for i in order[start : start + batch_size]], pad, device)
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=pad,
            eos_token_id=None,
            **({"do_sample": False, "temperature": None, "top_p": None, "top_k": None} | sampled),
        )
        continued += out[:, ids.shape[1] :].tolist()
    return [Document(chosen[i].domain + OWN_SUFFIX, "", tuple(encoded[i] + c)) for i, c in zip(order, continued)]


def cache_key(fingerprint: str, documents: Sequence[tuple[str, str]], layers: Sequence[int], settings: dict) -> str:
    """What the teacher's data depends on: the model, the documents, the layers and the settings."""
    digest = hashlib.sha256(json.dumps([fingerprint, sorted(layers), settings], sort_keys=True).encode())
    for domain, text in documents:
        digest.update(domain.encode() + b"\0" + text.encode("utf-8", "replace") + b"\0")
    return digest.hexdigest()[:16]
