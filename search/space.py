"""The search space: one on/off switch per attention and per MLP sublayer, plus draft settings.

Parameter names are stable (``attn_07``, ``mlp_07``, ``max_draft_tokens`` ...) so a study can
be resumed, shared between workers and warm-started with enqueued candidates. The policy a
trial evaluated is stored on the trial itself (``POLICY_ATTR``) and read back from there by
confirmation, export, summaries, plots and the proxy check: nothing rebuilds it from the
parameters, so a knob with a single choice (not an Optuna parameter) is never lost.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import optuna
from optuna.trial import FrozenTrial

from layerskip.drafts.policy.skip_policy import DraftSettings, ExitSettings, SkipPolicy
from layerskip.errors import LayerskipError


@dataclass(frozen=True)
class ExitChoice:
    """One trained exit adapter a study may choose (trained once, before the study: trials only load it)."""

    label: str  # e.g. "L12-linear"
    layer: int
    kind: str
    adapter: str  # absolute path of the safetensors file
    sha256: str


@dataclass(frozen=True)
class SearchSpace:
    num_layers: int
    never_skip: tuple[int, ...] = ()  # layers whose sublayers are never bypassed
    min_fraction: float = 0.0  # of all 2 * num_layers sublayers, bypassed
    max_fraction: float = 1.0
    draft_token_choices: tuple[int, ...] = (2, 3, 4, 6, 8)
    tune_adaptive: bool = True
    target_acceptance_choices: tuple[float, ...] = (0.6, 0.7, 0.8, 0.9)
    draft_vocab_choices: tuple[int, ...] = (0,)  # truncated draft head sizes (0 = full head)
    lookup_ngram_choices: tuple[int, ...] = (0,)  # prompt-lookup max n-gram (0 = off)
    # Longest lookup run per step; empty = tie it to the draft length k (one length knob).
    lookup_token_choices: tuple[int, ...] = ()
    lookup_confidence_choices: tuple[float, ...] = (0.0,)  # cut runs below this chance (0 = never)
    lookup_min_ngram_choices: tuple[int, ...] = (2,)  # shortest n-gram a lookup may match
    verify_pad_choices: tuple[int, ...] = (0,)  # pad short verify blocks to this length (0 = never)
    precision_choices: tuple[str, ...] = ("model",)  # the draft's weight precision (drafts/model/precision.py)
    # Token trees: lookup continuations per verify (1 = a chain) and the draft's siblings (0 = none).
    # The cheap score replays chains; trees are told apart by the confirmation's real generation.
    tree_match_choices: tuple[int, ...] = (1,)
    tree_sibling_choices: tuple[int, ...] = (0,)
    # Ranked space: sublayers ordered from the least to the most needed (single-sublayer
    # agreement); a trial bypasses the first ``skip_count`` of them. Empty: one switch per sublayer.
    sublayer_order: tuple[tuple[int, str], ...] = ()
    require_skip_draft: bool = False  # never try lookup-only drafting (lookup may still lead)
    # Trained exit adapters a trial may draft through (``ExitChoice``s, from layerskip-train-exit
    # runs): the draft then runs layers 0..exit, the adapter and the head. Empty: no exit knob.
    exit_choices: tuple[ExitChoice, ...] = ()
    exit_threshold_choices: tuple[float, ...] = (0.5,)  # an exit draft's starting confidence threshold

    def __post_init__(self) -> None:
        """What needs the model's layer count; every choice was checked before it loaded (``check_arguments``)."""
        if self.num_layers < 1:
            raise LayerskipError("the model has no decoder layers to search over")
        bad = [i for i in self.never_skip if not 0 <= i < self.num_layers]
        if bad:
            raise LayerskipError(f"--never-skip {bad} is out of range for a {self.num_layers}-layer model")

    @property
    def searchable_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if i not in set(self.never_skip)]

    @property
    def ranked(self) -> list[tuple[int, str]]:
        """The ranked space's order, never-skip layers left out."""
        return [(i, kind) for i, kind in self.sublayer_order if i not in set(self.never_skip)]

    @property
    def skip_count_range(self) -> tuple[int, int]:
        total = 2 * self.num_layers
        low = math.ceil(self.min_fraction * total - 1e-9)
        high = min(len(self.ranked), math.floor(self.max_fraction * total + 1e-9), total - 1)
        return low, high

    # -- Optuna ---------------------------------------------------------------------------
    def suggest(self, trial: optuna.Trial) -> SkipPolicy:
        """Sample a policy; prunes a trial whose skipped fraction breaks the user's rules.

        An exit draft (a trained exit adapter chosen) bypasses every layer after its exit and no
        sublayer before it: it samples no sublayer switches, and the fraction limits, which bound
        those switches, do not apply to it.
        """
        draft = self._suggest_draft(trial)
        exits = {choice.label: choice for choice in self.exit_choices} if draft.use_skip_draft else {}
        choice = exits.get(trial.suggest_categorical("exit", ["none", *exits])) if exits else None
        if choice is not None:
            # It stops below a confidence threshold (Kangaroo's rule), which then adapts.
            threshold = _pick(trial, "exit_threshold", self.exit_threshold_choices)
            draft = replace(draft, adaptive=True, length_by_cost=False, initial_threshold=threshold)
            exit = ExitSettings(choice.adapter, choice.sha256, choice.layer, choice.kind)
            policy = SkipPolicy.early_exit(self.num_layers, choice.layer + 1, draft=draft, exit=exit)
            trial.set_user_attr("skip_fraction", len(policy.skip_attention) / self.num_layers)
            return policy
        if self.sublayer_order:
            chosen = self.ranked[: trial.suggest_int("skip_count", *self.skip_count_range)]
            attention = [i for i, kind in chosen if kind == "attention"]
            mlp = [i for i, kind in chosen if kind == "mlp"]
        else:
            attention = [i for i in self.searchable_layers if trial.suggest_categorical(f"attn_{i:02d}", [False, True])]
            mlp = [i for i in self.searchable_layers if trial.suggest_categorical(f"mlp_{i:02d}", [False, True])]
        fraction = (len(attention) + len(mlp)) / (2 * self.num_layers)
        trial.set_user_attr("skip_fraction", fraction)
        if not self.min_fraction <= fraction <= self.max_fraction:
            raise optuna.TrialPruned(
                f"skips {fraction:.2f} of sublayers, outside [{self.min_fraction}, {self.max_fraction}]"
            )
        if len(attention) == self.num_layers and len(mlp) == self.num_layers:
            raise optuna.TrialPruned("bypasses every sublayer")
        if not draft.use_skip_draft:
            attention, mlp = [], []  # lookup-only drafting: the skip switches are unused
        return SkipPolicy(skip_attention=tuple(attention), skip_mlp=tuple(mlp), draft=draft)

    def _suggest_draft(self, trial: optuna.Trial) -> DraftSettings:
        k = trial.suggest_categorical("max_draft_tokens", list(self.draft_token_choices))
        # How a skip draft ends: at k, below a confidence threshold (adaptive), or by measured cost.
        adaptive = trial.suggest_categorical("adaptive", [False, True]) if self.tune_adaptive else False
        target = 0.7
        by_cost = False
        if adaptive:
            target = trial.suggest_categorical("target_acceptance", list(self.target_acceptance_choices))
        elif self.tune_adaptive:
            by_cost = trial.suggest_categorical("length_by_cost", [False, True])
        vocab = trial.suggest_categorical("draft_vocab_size", list(self.draft_vocab_choices))
        lookup = trial.suggest_categorical("lookup_max_ngram", list(self.lookup_ngram_choices))
        lookup_tokens = k  # without its own choice, k caps skip drafts and lookup runs alike
        confidence, min_ngram = 0.0, 2
        if lookup:
            if self.lookup_token_choices:  # empty: runs tied to k, so nothing to suggest
                lookup_tokens = trial.suggest_categorical("lookup_max_tokens", list(self.lookup_token_choices))
            confidence = _pick(trial, "lookup_confidence", self.lookup_confidence_choices)
            min_ngram = min(_pick(trial, "lookup_min_ngram", self.lookup_min_ngram_choices), lookup)
        # With lookup on, the skip draft may be dropped entirely (lookup-only drafting).
        use_skip = True
        if lookup and not self.require_skip_draft:
            use_skip = trial.suggest_categorical("use_skip_draft", [True, False])
        return DraftSettings(
            max_draft_tokens=k,
            adaptive=adaptive,
            length_by_cost=by_cost,
            target_acceptance=target,
            draft_vocab_size=vocab,
            lookup_max_ngram=lookup,
            lookup_min_ngram=min_ngram,
            lookup_max_tokens=lookup_tokens,
            lookup_confidence=confidence,
            min_verify_block=_pick(trial, "min_verify_block", self.verify_pad_choices),
            use_skip_draft=use_skip,
            precision=_pick(trial, "precision", self.precision_choices) if use_skip else "model",
            tree_matches=_pick(trial, "tree_matches", self.tree_match_choices) if lookup else 1,
            tree_siblings=_pick(trial, "tree_siblings", self.tree_sibling_choices) if use_skip else 0,
        )

    def with_leading(self, sublayers: Sequence[tuple[int, str]]) -> SearchSpace:
        """The ranked space with ``sublayers`` first, in the order given, then the rest in its own
        order: a warm-start policy's bypassed set becomes the ranked prefix of its size."""
        lead = [s for s in dict.fromkeys(sublayers) if s in set(self.sublayer_order)]
        order = lead + [s for s in self.sublayer_order if s not in set(lead)]
        return replace(self, sublayer_order=tuple(order))

    def params_for_policy(
        self, policy: SkipPolicy, label: str = "warm-start policy"
    ) -> tuple[dict[str, Any], list[str]]:
        """Optuna parameters for which ``suggest`` rebuilds ``policy`` (a warm start), and a note for
        every knob whose value is not among this space's choices (the nearest choice is used).

        Raises LayerskipError when the space cannot hold the policy's skip sets: a never-skip layer,
        a bypassed fraction outside the limits, (ranked space) a set that is not a ranked prefix, or
        an exit adapter that is not among ``exit_choices``.
        """
        exit = self._exit_choice_of(policy, label)
        if exit is None:
            self._check_switches(policy, label)
        trial = _Nearest(policy, exit)
        evaluated = self.suggest(trial)  # what a trial with these parameters evaluates
        if evaluated.draft.use_skip_draft:
            assert (evaluated.skip_attention, evaluated.skip_mlp) == (policy.skip_attention, policy.skip_mlp)
        return trial.params, _differences(label, policy.draft, evaluated.draft)

    def _candidate(
        self,
        attention: list[int],
        mlp: list[int],
        lookup: int = 0,
        use_skip_draft: bool = True,
        exit: ExitChoice | None = None,
    ) -> dict[str, Any]:
        """The parameters of a hand-picked warm start: k 4 (else the first choice), the cheapest
        precision listed, the longest lookup runs and n-grams, the middle exit threshold, and the
        first choice of every other knob."""
        thresholds = sorted(self.exit_threshold_choices)
        draft = DraftSettings(
            max_draft_tokens=4 if 4 in self.draft_token_choices else self.draft_token_choices[0],
            draft_vocab_size=self.draft_vocab_choices[0],
            lookup_max_ngram=lookup if lookup in self.lookup_ngram_choices else self.lookup_ngram_choices[0],
            lookup_max_tokens=max(self.lookup_token_choices, default=4),
            lookup_confidence=self.lookup_confidence_choices[0],
            lookup_min_ngram=max(self.lookup_min_ngram_choices),
            min_verify_block=self.verify_pad_choices[0],
            use_skip_draft=use_skip_draft,
            precision=self.precision_choices[-1],
            tree_matches=self.tree_match_choices[0],
            tree_siblings=self.tree_sibling_choices[0],
            initial_threshold=thresholds[len(thresholds) // 2],
        )
        trial = _Nearest(SkipPolicy(skip_attention=tuple(attention), skip_mlp=tuple(mlp), draft=draft), exit)
        with contextlib.suppress(optuna.TrialPruned):  # outside the fraction limits: Optuna prunes it when it runs
            self.suggest(trial)
        return trial.params

    def _exit_choice_of(self, policy: SkipPolicy, label: str) -> ExitChoice | None:
        """The exit choice a warm-start policy drafts through (None: a plain skip draft)."""
        if policy.exit is None:
            return None
        choice = next((c for c in self.exit_choices if c.sha256 == policy.exit.sha256), None)
        if choice is None:
            raise LayerskipError(
                f"{label} drafts through exit adapter {policy.exit.adapter}, which is not among this search's "
                "--exit-adapters; pass the layerskip-train-exit directory that holds it"
            )
        whole = SkipPolicy.early_exit(self.num_layers, choice.layer + 1)
        if (policy.skip_attention, policy.skip_mlp) != (whole.skip_attention, whole.skip_mlp):
            raise LayerskipError(
                f"{label} bypasses sublayers before its exit after layer {choice.layer}; the search's exit "
                f"drafts keep layers 0..{choice.layer} whole: drop those sublayers from the policy"
            )
        return choice

    def _check_switches(self, policy: SkipPolicy, label: str) -> None:
        """Refuse a warm start whose skip sets this space's sublayer switches cannot hold."""
        bypassed = policy.bypassed_sublayers
        banned = sorted({i for i, _ in bypassed} & set(self.never_skip))
        if banned:
            raise LayerskipError(f"{label} bypasses sublayers of --never-skip layers {banned}; drop them from one")
        fraction = len(bypassed) / (2 * self.num_layers)
        if not self.min_fraction <= fraction <= self.max_fraction:
            raise LayerskipError(
                f"{label} bypasses {fraction:.2f} of sublayers, outside --min/--max-skip-fraction "
                f"[{self.min_fraction}, {self.max_fraction}]; widen them"
            )
        if self.sublayer_order and set(self.ranked[: len(bypassed)]) != set(bypassed):
            raise LayerskipError(
                f"{label}'s bypassed sublayers are not the first {len(bypassed)} of this study's ranked order; "
                "warm-start a new --study-name (its order then starts with them) or use --space switches"
            )

    def warm_starts(self) -> list[dict[str, Any]]:
        """Sensible first candidates. Switches: nothing skipped, early-exit prefixes, every other
        deep layer. Ranked: the first 0, 1, 2, 4 and 8 ranked sublayers. Then every trained exit
        (right after the first candidate: a few exits, each trained at a cost, all get scored)."""
        n = self.num_layers
        allowed = set(self.searchable_layers)
        candidates: list[tuple[list[int], list[int]]] = [([], [])]
        alternate = [i for i in range(n // 2, n) if i % 2 == 1 and i in allowed]
        if self.sublayer_order:
            low, high = self.skip_count_range
            counts = sorted({min(max(c, low), high) for c in (0, 1, 2, 4, 8)} - {0})
            candidates += [(list(range(count)), []) for count in counts]  # only the count matters here
            alternate = list(range(min(max(1, low), high)))
        else:
            for depth in (3 * n // 4, 2 * n // 3, n // 2):
                deep = [i for i in range(depth, n) if i in allowed]
                candidates.append((deep, deep))
            candidates.append((alternate, alternate))
            candidates.append((alternate, []))  # attention only: often the cheapest to lose
        params = []
        for attention, mlp in candidates:
            fraction = (len(attention) + len(mlp)) / (2 * n)
            if self.min_fraction <= fraction <= self.max_fraction:
                candidate = self._candidate(attention, mlp)
                if candidate not in params:
                    params.append(candidate)
        params[1:1] = [self._candidate([], [], exit=choice) for choice in self.exit_choices]
        lookups = [n for n in self.lookup_ngram_choices if n]
        if lookups:
            # Prompt lookup alone, and lookup in front of the lightest skip draft above.
            if not self.require_skip_draft:
                params.append(self._candidate([], [], lookups[-1], use_skip_draft=False))
            params.append(self._candidate(alternate, [], lookups[-1]))
        return params


def _differences(label: str, wanted: DraftSettings, evaluated: DraftSettings) -> list[str]:
    """One note per draft setting a warm start asked for that the space cannot give it (settings
    the evaluated draft does not use are left out: lookup's when lookup is off, and so on)."""
    unused: set[str] = set()
    if not evaluated.lookup_max_ngram:
        unused |= {"lookup_min_ngram", "lookup_max_tokens", "lookup_confidence", "tree_matches"}
    unused |= {"tree_margin", "tree_nodes"}  # not searched: a trial keeps the defaults
    if not evaluated.use_skip_draft:
        unused |= {"draft_vocab_size", "precision", "adaptive", "length_by_cost"}
        unused |= {"initial_threshold", "target_acceptance"}
    if not evaluated.adaptive:
        unused |= {"initial_threshold", "target_acceptance"}
    return [
        f"{label}: {name} {value} is not a choice of this search; the trial uses {getattr(evaluated, name)}"
        for name, value in asdict(wanted).items()
        if name not in unused and getattr(evaluated, name) != value
    ]


class _Nearest:
    """A trial that draws, of every choice ``suggest`` offers, the one nearest ``policy``'s value
    (with ``exit``, one of the space's ``exit_choices``, it drafts through that exit): ``params``
    are then the parameters of the point nearest ``policy``. In the ranked space it bypasses the
    first ``len(skip_attention) + len(skip_mlp)`` ranked sublayers."""

    def __init__(self, policy: SkipPolicy, exit: ExitChoice | None) -> None:
        self.wanted: dict[str, Any] = {
            **asdict(policy.draft),
            "exit": "none" if exit is None else exit.label,
            "exit_threshold": policy.draft.initial_threshold,
            "skip_count": len(policy.skip_attention) + len(policy.skip_mlp),
            **{f"attn_{i:02d}": True for i in policy.skip_attention},
            **{f"mlp_{i:02d}": True for i in policy.skip_mlp},
        }
        self.params: dict[str, Any] = {}

    def suggest_categorical(self, name: str, choices: Sequence[Any]) -> Any:
        value = self.wanted.get(name, False)  # a sublayer's switch is off unless the policy bypasses it
        if value not in choices:
            full = 1 << 40  # a full head (0) is as large as a head gets
            distance = {
                "draft_vocab_size": lambda c: abs((c or full) - (value or full)),
                "precision": lambda c: c != value,
            }.get(name, lambda c: abs(c - value))
            value = min(choices, key=distance)
        self.params[name] = value
        return value

    def suggest_int(self, name: str, low: int, high: int) -> int:
        self.params[name] = self.wanted[name]
        return self.wanted[name]

    def set_user_attr(self, key: str, value: Any) -> None:
        pass


def _pick(trial: optuna.Trial, name: str, choices: tuple[Any, ...]) -> Any:
    """A searched parameter when there is a choice; the single value otherwise (not stored on the trial)."""
    return trial.suggest_categorical(name, list(choices)) if len(choices) > 1 else choices[0]


POLICY_ATTR = "policy"
RANKING_ATTR = "draft_vocab_ranking"


def with_vocabulary(policy: SkipPolicy, ranking: Sequence[int]) -> SkipPolicy:
    """The policy with its truncated head's rows: the first ``draft_vocab_size`` of ``ranking``."""
    size = policy.draft.draft_vocab_size if policy.draft.use_skip_draft else 0
    return replace(policy, draft_vocabulary=tuple(ranking[:size]))


def policy_attr(policy: SkipPolicy) -> dict[str, Any]:
    """What a trial stores: the evaluated policy, less its head rows (the study's ranking, stored once)."""
    return {**policy.to_dict(), "draft_vocabulary": []}


def trial_policy(study: optuna.Study, trial: FrozenTrial) -> SkipPolicy:
    """The policy ``trial`` evaluated, head rows included."""
    data = trial.user_attrs.get(POLICY_ATTR)
    if data is None:
        raise LayerskipError(
            f"trial {trial.number} of study '{study.study_name}' stores no policy (made by an older layerskip); "
            "run the study anew under another --study-name"
        )
    return with_vocabulary(SkipPolicy.from_dict(data), study.user_attrs.get(RANKING_ATTR, ()))


def exportable(policy: SkipPolicy) -> bool:
    """A policy worth offering: lookup-only, or a skip draft that bypasses something.

    A skip draft that bypasses nothing is the full model drafting for itself: whatever its
    precision or head, it is not a skip policy, so the search never exports it (it can still
    be run by hand, and the benchmark's ``no-bypass`` ablation measures it).
    """
    return not policy.draft.use_skip_draft or policy.bypasses_anything
