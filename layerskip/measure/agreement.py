"""Teacher-forced agreement and an exact-as-possible replay of decoding: the search's cheap proxy.

The full model writes a greedy reference continuation for each prompt once. A candidate draft
(some sublayers bypassed, its precision, its head) then runs once, in parallel, over prompt +
reference. Its top-1 token at each reference position, among the rows its head scores at that
point of a generation, estimates what it would propose while decoding; the fraction that
equals the reference estimates the per-token acceptance alpha. ``simulate_greedy`` replays
greedy self-speculative decoding step by step with the engine's own rules (draft length,
adaptive stop, lookup with its learned cut, padding) over those predictions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm

from layerskip.drafts.builder import DraftModels
from layerskip.drafts.drafters.lookup import LookupRunLength, match_lookup
from layerskip.drafts.drafters.skip import AdaptiveStop, top2_confidence
from layerskip.drafts.model.draft_model import DraftModel
from layerskip.drafts.policy.skip_policy import DraftSettings
from layerskip.drafts.rules.draft_length import DraftLengthByCost
from layerskip.engine.decoding import Decoder, DecodeSettings
from layerskip.hf import adapters

# (start, stop, known) -> the draft's tokens and confidences at continuation positions start..stop-1
# when its head has been given the first ``known`` continuation tokens.
Predictor = Callable[[int, int, int], tuple[list[int], list[float]]]


@dataclass(frozen=True)
class Reference:
    prompt: tuple[int, ...]
    continuation: tuple[int, ...]  # the full model's greedy tokens after the prompt


def build_references(
    model: nn.Module, prompts: Sequence[Sequence[int]], new_tokens: int, progress: bool = False
) -> list[Reference]:
    """Greedy continuations of the full model (no EOS stop: every position is a sample)."""
    references = []
    decoder = Decoder(model)  # plain decoding
    settings = DecodeSettings(max_new_tokens=new_tokens, eos_token_ids=())
    for prompt in tqdm(prompts, desc="references", disable=not progress):
        tokens, _ = decoder.decode(prompt, settings)
        references.append(Reference(tuple(prompt), tuple(tokens)))
    return references


class TeacherForcedDraft:
    """The draft's logits at every position of one reference, from one parallel forward.

    ``head_rows`` None: the full head. Otherwise the head starts from ``head_rows`` plus the
    prompt and learns each continuation token once it has been emitted, as in the engine; the
    logits are kept over the union of every row it could ever score, ``[C, |U|]``.
    """

    def __init__(
        self,
        draft_model: DraftModel,
        reference: Reference,
        attention: Sequence[int] = (),
        mlp: Sequence[int] = (),
        head_rows: Sequence[int] | None = None,
    ) -> None:
        device = draft_model.device
        self.continuation = torch.tensor(reference.continuation, device=device)  # [C]
        ids = torch.tensor([[*reference.prompt, *reference.continuation[:-1]]], device=device)  # [1, P+C-1]
        with torch.inference_mode(), draft_model.active(attention, mlp):
            # Position P-1 predicts continuation[0]; the last position predicts continuation[-1].
            hidden = draft_model.hidden(ids, None)[0, len(reference.prompt) - 1 :]  # [C, hidden]
            if head_rows is None:
                self.rows = None
                logits = draft_model.head(None)(hidden).float()  # [C, V]
                top = torch.topk(logits, 2, dim=-1)
                self.tokens = top.indices[:, 0]
                self.confidence = top2_confidence(logits)
                return
            base = torch.tensor(sorted({*head_rows, *reference.prompt}), dtype=torch.long, device=device)
            self.rows = torch.unique(torch.cat([base, self.continuation]))  # U, sorted
            self.logits = draft_model.head(self.rows)(hidden).float()  # [C, |U|]
        # When each row becomes scorable: 0 for the base rows, else 1 + its first continuation index.
        count = len(reference.continuation)
        first_seen = torch.full((len(self.rows),), count + 1, dtype=torch.long, device=device)  # never
        seen_at = torch.arange(1, count + 1, device=device)
        first_seen.scatter_reduce_(0, torch.searchsorted(self.rows, self.continuation), seen_at, reduce="amin")
        first_seen[torch.isin(self.rows, base)] = 0
        self.first_seen = first_seen

    def predict(self, start: int, stop: int, known: int) -> tuple[list[int], list[float]]:
        if self.rows is None:
            return self.tokens[start:stop].tolist(), self.confidence[start:stop].tolist()
        allowed = self.first_seen <= known  # [|U|]
        logits = self.logits[start:stop].masked_fill(~allowed, float("-inf"))
        top = torch.topk(logits, min(2, int(allowed.sum())), dim=-1)
        tokens = self.rows[top.indices[:, 0]].tolist()
        if top.values.shape[-1] < 2:  # one row known: nothing competes with it
            return tokens, [1.0] * len(tokens)
        return tokens, torch.tanh((top.values[:, 0] - top.values[:, 1]) / 2).tolist()  # as skip.top2_confidence

    def agreement(self) -> tuple[int, int]:
        """(matches, positions): top-1 equal to the reference, each position with the rows known before it."""
        if self.rows is None:
            return int((self.tokens == self.continuation).sum()), len(self.continuation)
        count = len(self.continuation)
        known = torch.arange(count, device=self.rows.device)[:, None]  # position j knows continuation[:j]
        allowed = self.first_seen[None, :] <= known  # [C, |U|]
        predicted = self.rows[self.logits.masked_fill(~allowed, float("-inf")).argmax(dim=-1)]
        return int((predicted == self.continuation).sum()), count


def single_sublayer_agreement(
    model: nn.Module, references: Sequence[Reference], progress: bool = False
) -> dict[str, list[float]]:
    """Agreement with exactly one sublayer bypassed: {"attention": [per layer], "mlp": [per layer]},
    the fraction of reference positions where the draft's full head's top-1 is the full model's token."""
    draft_model = DraftModels(model).get()
    count = adapters.num_layers(model)
    result: dict[str, list[float]] = {"attention": [], "mlp": []}
    bar = tqdm(total=2 * count, desc="single-sublayer agreement", disable=not progress)
    for i in range(count):
        for kind, values in result.items():
            counts = [TeacherForcedDraft(draft_model, ref, **{kind: [i]}).agreement() for ref in references]
            total = sum(n for _, n in counts)
            values.append(sum(m for m, _ in counts) / total if total else 0.0)
            bar.update()
    bar.close()
    return result


def sublayer_order(model: nn.Module, references: Sequence[Reference], progress: bool = False) -> list[tuple[int, str]]:
    """Every sublayer ``(layer, "attention" | "mlp")``, from the one whose bypass alone keeps the
    most agreement to the one that keeps the least (ties: attention first, then by layer)."""
    agreement = single_sublayer_agreement(model, references, progress)
    items = [(value, i, kind) for kind, values in agreement.items() for i, value in enumerate(values)]
    items.sort(key=lambda item: (-item[0], item[2] != "attention", item[1]))
    return [(i, kind) for _, i, kind in items]


@dataclass
class SimulatedRun:
    """Greedy self-speculative decoding of one reference, replayed from teacher-forced predictions."""

    tokens: int = 0
    blocks: list[int] = field(default_factory=list)  # verify block length (k + 1) of each step
    draft_forwards: int = 0  # skip-draft model calls (lookup steps cost none)
    drafted: int = 0
    accepted: int = 0

    def predicted_cost(self, draft_cost: float, verify_cost: Callable[[int], float]) -> float:
        """Time in units of one plain decoding step."""
        return self.draft_forwards * draft_cost + sum(verify_cost(block) for block in self.blocks)


def simulate_greedy(
    reference: Reference,
    draft: DraftSettings,
    predictor: Predictor | None = None,
    prices: tuple[float, Callable[[int], float]] | None = None,
) -> SimulatedRun:
    """Replay greedy self-speculative decoding over a reference continuation.

    While the draft's earlier tokens are accepted, its autoregressive proposal at a position is
    its teacher-forced prediction there (``predictor``; needed when the policy has a skip
    draft), so the accepted count of each step is the run of matching predictions, capped at k
    and cut by the same adaptive rule as the engine's. Draft length by cost runs the engine's
    rule on ``prices`` = (draft step cost, verify cost of a block length), in plain steps, in
    place of the engine's clock. Prompt lookup, its learned cut and padding are replayed
    exactly. Approximate only in the K/V the draft reads (full-model K/V here, the draft's own
    in real decoding), which favours the replay.
    """
    run = SimulatedRun()
    continuation = list(reference.continuation)
    if not continuation:
        return run
    # As in the engine, the prompt's forward (one step, no draft) gives the first token.
    history = [*reference.prompt, continuation[0]]
    run.tokens, run.blocks = 1, [1]
    position = 1
    run_length = LookupRunLength(draft.lookup_confidence)
    stop = AdaptiveStop(draft.initial_threshold, draft.target_acceptance) if draft.adaptive else None
    length = None
    if draft.length_by_cost and draft.use_skip_draft:
        if prices is None:
            raise ValueError("replaying draft length by cost needs prices=(draft cost, verify cost)")
        draft_cost, verify_cost = prices
        length = DraftLengthByCost.priced(draft.max_draft_tokens, draft.min_verify_block, draft_cost, verify_cost)
    while position < len(continuation):
        budget = len(continuation) - position - 1  # the verify adds one token of its own
        proposal: list[int] = []
        drafted = accepted = 0
        if draft.lookup_max_ngram and budget > 0:
            run_length.observe(history)
            match = match_lookup(
                history, draft.lookup_min_ngram, draft.lookup_max_ngram, min(draft.lookup_max_tokens, budget)
            )
            run_length.track(match, len(history))
            proposal = run_length.cut(match)
        if proposal:
            drafted = len(proposal)
            while accepted < drafted and proposal[accepted] == continuation[position + accepted]:
                accepted += 1
        elif draft.use_skip_draft and budget > 0:
            assert predictor is not None, "a skip draft needs the draft's predictions"
            limit = min(draft.max_draft_tokens, budget)
            tokens, confidence = predictor(position, position + limit, position)
            # Draft forwards continue past a wrong token until k or a low-confidence stop.
            while drafted < limit:
                index = drafted
                drafted += 1
                if accepted == index and tokens[index] == continuation[position + index]:
                    accepted += 1
                if stop is not None and stop.stop(confidence[index]):
                    break
                if length is not None and not length.draft_more(confidence[:drafted]):
                    break
            run.draft_forwards += drafted
            if stop is not None:
                stop.update(drafted, accepted)
            if length is not None:
                block = max(drafted + 1, draft.min_verify_block)
                length.observe_step(confidence[:drafted], accepted, drafted * draft_cost + verify_cost(block))
        step = accepted + 1
        run.tokens += step
        run.blocks.append(max(drafted + 1, draft.min_verify_block) if drafted else 1)
        run.drafted += drafted
        run.accepted += accepted
        history.extend(continuation[position : position + step])
        position += step
    return run


@dataclass
class ExitPoint:
    """Early exit with confidence at one depth and threshold, teacher-forced over references.

    The draft exits after ``depth`` layers when its top-2 confidence there (final norm and head
    applied to that layer's output) is at least ``threshold``, else runs its whole stack.
    ``coverage`` is the fraction of positions that exit early; ``agreement`` the draft's top-1
    agreement with the full model over all positions; ``agreement_when_exiting`` over the
    positions that exit.
    """

    depth: int
    threshold: float
    coverage: float
    agreement: float
    agreement_when_exiting: float | None


def early_exit_frontier(
    draft_model: DraftModel,
    references: Sequence[Reference],
    depths: Sequence[int],
    thresholds: Sequence[float],
) -> tuple[float, list[ExitPoint]]:
    """The whole draft's agreement, and an ``ExitPoint`` per (depth, threshold) (full head)."""
    layers = adapters.num_layers(draft_model.model)

    def predictions(depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        deep = range(depth, layers)
        views = [TeacherForcedDraft(draft_model, ref, deep, deep) for ref in references]
        return torch.cat([v.tokens for v in views]), torch.cat([v.confidence for v in views])

    target = torch.cat([torch.tensor(ref.continuation) for ref in references])  # [positions]
    whole, _ = predictions(layers)
    whole_right = whole == target
    points = []
    for depth in depths:
        early, confidence = predictions(depth)
        for threshold in thresholds:
            exits = confidence >= threshold
            right = torch.where(exits, early == target, whole_right)
            covered = int(exits.sum())
            when_exiting = float((early == target)[exits].float().mean()) if covered else None
            points.append(ExitPoint(depth, threshold, covered / len(target), float(right.float().mean()), when_exiting))
    return float(whole_right.float().mean()), points
