"""SkipPolicy: which sublayers the draft bypasses, how it drafts, and where the policy came from.

A policy file is JSON:

    {"format": "layerskip-policy", "version": 1,
     "skip_attention": [..], "skip_mlp": [..],
     "draft": {"max_draft_tokens": 4, "adaptive": true, ...},
     "model": {"name": .., "architecture": .., "num_layers": .., "fingerprint": .., "weights_sample": ..},
     "provenance": {..., "machine": {..}},   # how it was found, and on which machine
     "measured": {...},
     "draft_vocabulary": [..],   # ranked rows of a truncated draft head (optional)
     "on_the_fly": {..},         # optional: re-choose the bypassed sublayers while generating
     "exit": {..}}               # optional: a trained exit adapter after the draft's last layer

Whole-layer skips are a layer index in both lists; an early-exit draft of depth d skips
both sublayers of every layer >= d.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from layerskip.drafts.model.exit_adapter import KINDS
from layerskip.drafts.model.precision import PRECISIONS
from layerskip.errors import LayerskipError, few
from layerskip.fileio import load_json, read_json_file, write_json_atomic
from layerskip.hf import adapters
from layerskip.machine import Machine

# Names of SkipPolicy.ablations() (which of them a policy has depends on what it uses).
ABLATIONS = (
    "no-lookup",
    "lookup-only",
    "full-head",
    "model-precision",
    "fixed",
    "no-adapter",
    "no-kv-reuse",
    "no-bypass",
    "chain",
    "lookup-branches",
    "draft-branches",
)
FORMAT = "layerskip-policy"
# provenance["machine"]: the device, CPU model and kernel flags it was tuned on (layerskip.machine)
MACHINE_KEY = "machine"
VERSION = 1
# Upper bounds on a policy's sizes. A verify block holds k + 1 tokens; past a few dozen its cost
# grows with k while a longer draft is almost never accepted whole, and a huge k (or lookup run,
# or padding) asks the model for one absurd block. No model's vocabulary comes near the head
# bound; it catches values that are not a row count at all.
MAX_DRAFT_TOKENS = 64
MAX_HEAD_ROWS = 2**24


@dataclass(frozen=True)
class DraftSettings:
    """How the draft proposes tokens each step."""

    max_draft_tokens: int = 4
    # Draft & Verify style early stop: stop drafting when the draft's top-1 probability falls
    # below a threshold that moves toward ``target_acceptance`` after every verify.
    adaptive: bool = False
    initial_threshold: float = 0.6
    target_acceptance: float = 0.7
    # Draft length by cost: after each drafted token, draft another only if its expected
    # tokens beat what its draft and verify time earns at the rate so far (measured in this
    # generation; drafts/rules/draft_length.py). ``max_draft_tokens`` caps it. Excludes ``adaptive``.
    length_by_cost: bool = False
    # Truncated draft head: the draft scores only this many most frequent tokens (0 = full).
    draft_vocab_size: int = 0
    # Prompt lookup: propose the continuation of an earlier matching n-gram (0 = off).
    lookup_max_ngram: int = 0
    lookup_min_ngram: int = 2
    lookup_max_tokens: int = 8
    # Cut a lookup run where the estimated chance that all of it is accepted falls below this
    # (learned per generation, see lookup.LookupRunLength); 0 = always propose the whole run.
    lookup_confidence: float = 0.0
    # When both are on: use lookup if it finds a match, else the skip draft.
    use_skip_draft: bool = True
    # Pad a verify block of 2..N-1 tokens to N with filler tokens whose outputs are ignored
    # (0 = never). Pays where a few-row matmul is slower than a larger one: on some CPUs a 2- or
    # 3-row block costs more than a 4-row one (docs/floor.md#the-verify-curve).
    min_verify_block: int = 0
    # The draft's kept projections (and its head) run from a copy in this precision: "model"
    # (the model's own weights), "bfloat16", or on CPU "int8" / "int4" (drafts/model/precision.py).
    # The verify always uses the model's own weights, so the output does not change.
    precision: str = "model"
    # Token trees (one verify over several candidate continuations; 1 and 0 = a chain): prompt
    # lookup proposes up to ``tree_matches`` distinct continuations of the last n-gram; the skip
    # draft adds up to ``tree_siblings`` of its next choices where its top-2 confidence is below
    # ``tree_margin``. At most ``tree_nodes`` nodes per verify (0: twice the longest draft); with
    # measured costs (``auto``) the tree holds only the nodes expected to pay for their verify.
    tree_matches: int = 1
    tree_siblings: int = 0
    tree_margin: float = 0.5
    tree_nodes: int = 0

    @property
    def uses_trees(self) -> bool:
        return self.tree_matches > 1 or self.tree_siblings > 0

    @property
    def node_budget(self) -> int:
        return self.tree_nodes or 2 * max(self.max_draft_tokens, self.lookup_max_tokens)

    @property
    def ending(self) -> str:
        """How a skip draft ends besides at ``max_draft_tokens``: "adaptive", "by cost" or ""."""
        return "adaptive" if self.adaptive else "by cost" if self.length_by_cost else ""

    def validate(self) -> None:
        if not 1 <= self.max_draft_tokens <= MAX_DRAFT_TOKENS:
            raise LayerskipError(
                f"draft.max_draft_tokens must be between 1 and {MAX_DRAFT_TOKENS} (got {self.max_draft_tokens}); "
                "set it in the policy file"
            )
        if not 0.0 <= self.initial_threshold <= 1.0 or not 0.0 < self.target_acceptance <= 1.0:
            raise LayerskipError("draft.initial_threshold must be in [0, 1] and target_acceptance in (0, 1]")
        if self.adaptive and self.length_by_cost:
            raise LayerskipError(
                "draft.adaptive and draft.length_by_cost are two ways to end a draft; set one of them to false"
            )
        if self.draft_vocab_size < 0 or self.lookup_max_ngram < 0 or self.lookup_max_tokens < 0:
            raise LayerskipError("draft sizes must be >= 0; fix the policy file")
        if self.draft_vocab_size > MAX_HEAD_ROWS:
            raise LayerskipError(
                f"draft.draft_vocab_size {self.draft_vocab_size} is more rows than any model's vocabulary; "
                "use 0 (the full head) or a size below the model's vocabulary"
            )
        if self.lookup_max_tokens > MAX_DRAFT_TOKENS:
            raise LayerskipError(
                f"draft.lookup_max_tokens must be at most {MAX_DRAFT_TOKENS} (got {self.lookup_max_tokens}); "
                "fix the policy file"
            )
        if not 0 <= self.min_verify_block <= MAX_DRAFT_TOKENS + 1:
            raise LayerskipError(
                f"draft.min_verify_block must be between 0 (no padding) and {MAX_DRAFT_TOKENS + 1} "
                f"(got {self.min_verify_block}); fix the policy file"
            )
        if not 0.0 <= self.lookup_confidence < 1.0:
            raise LayerskipError("draft.lookup_confidence must be in [0, 1); fix the policy file")
        if self.lookup_max_ngram and not 1 <= self.lookup_min_ngram <= self.lookup_max_ngram:
            raise LayerskipError("draft.lookup_min_ngram must be between 1 and lookup_max_ngram")
        if not self.use_skip_draft and not self.lookup_max_ngram:
            raise LayerskipError("a policy with use_skip_draft false needs lookup_max_ngram > 0")
        if self.precision not in PRECISIONS:
            raise LayerskipError(f"draft.precision must be one of {', '.join(PRECISIONS)}; fix the policy file")
        if not 1 <= self.tree_matches <= 16 or not 0 <= self.tree_siblings <= 8:
            raise LayerskipError(
                "draft.tree_matches must be 1 (a chain) to 16 and draft.tree_siblings 0 (none) to 8; "
                "fix the policy file"
            )
        if not 0.0 <= self.tree_margin <= 1.0 or not 0 <= self.tree_nodes <= 4 * MAX_DRAFT_TOKENS:
            raise LayerskipError(
                f"draft.tree_margin must be in [0, 1] and draft.tree_nodes between 0 (by the draft's length) and "
                f"{4 * MAX_DRAFT_TOKENS}; fix the policy file"
            )


@dataclass(frozen=True)
class OnTheFlySettings:
    """On-the-fly selection: the bypassed sublayers are re-chosen while generating (drafts/drafters/onthefly.py).

    Every ``refresh_every`` verify steps the full model's forward also measures how much each
    sublayer changes the residual stream at the accepted positions (``|delta h| / |h|``, averaged
    with ``momentum``); the draft bypasses the ``count`` sublayers that change it least. A chosen
    sublayer is swapped out only for one that scores ``swap_margin`` lower, so noise in the
    scores does not churn the set. The count is priced by measured speed: each count's tokens
    per second of skip-drafted steps is recorded; after ``min_steps`` steps at a count the
    selection tries an untried neighbour (one more bypassed first), moves to a neighbour that was
    ``gain_margin`` faster, and settles when neither neighbour is. It starts at the policy's own
    skip sets (or ``start_fraction`` of all sublayers) and never passes ``max_fraction``.
    """

    max_fraction: float = 0.5
    start_fraction: float = 0.0
    refresh_every: int = 4
    momentum: float = 0.7
    min_steps: int = 24
    gain_margin: float = 0.05
    swap_margin: float = 0.2

    def validate(self) -> None:
        if not 0.0 <= self.start_fraction <= self.max_fraction < 1.0:
            raise LayerskipError("on_the_fly needs 0 <= start_fraction <= max_fraction < 1; fix the policy file")
        if self.refresh_every < 1 or not 0.0 <= self.momentum < 1.0:
            raise LayerskipError("on_the_fly needs refresh_every >= 1 and momentum in [0, 1); fix the policy file")
        if self.min_steps < 1 or self.gain_margin < 0.0 or not 0.0 <= self.swap_margin < 1.0:
            raise LayerskipError(
                "on_the_fly needs min_steps >= 1, gain_margin >= 0 and swap_margin in [0, 1); fix the policy file"
            )


@dataclass(frozen=True)
class AutoSettings:
    """``auto``: the draft's kind, length, verify padding and head size chosen while generating,
    from costs measured on the machine at hand (drafts/drafters/auto.py; the calibration is
    engine/calibration.py, cached per model, dtype, device and machine).

    The calibration times a truncated draft head of ``min_head_rows``, twice that, and so on up
    to ``max_head_rows`` (each below the model's vocabulary), and the full head. With
    ``choose_precision``, an int4 draft is priced against an int8 one on the model at hand, and
    int8 replaces it where priced faster (engine/precision_choice.py).
    """

    min_head_rows: int = 2048
    max_head_rows: int = 32768
    choose_precision: bool = True

    def validate(self) -> None:
        if not 1 <= self.min_head_rows <= self.max_head_rows <= MAX_HEAD_ROWS:
            raise LayerskipError(
                f"auto needs 1 <= min_head_rows <= max_head_rows <= {MAX_HEAD_ROWS}; fix the policy file"
            )

    def head_sizes(self, vocab_size: int) -> tuple[int, ...]:
        """The head sizes the calibration times (0: the full head)."""
        sizes = []
        rows = self.min_head_rows
        while rows <= self.max_head_rows and rows < vocab_size:
            sizes.append(rows)
            rows *= 2
        return (*sizes, 0)


@dataclass(frozen=True)
class ExitSettings:
    """A trained exit adapter (drafts/model/exit_adapter.py) applied after layer ``layer`` in every draft.

    The policy's skip sets bypass every layer after ``layer``. ``adapter`` is the safetensors
    file, relative to the policy file, and ``sha256`` its hash (a changed file is refused).
    ``reuse_kv``: the verify does not recompute layers 0..layer for drafted tokens but reuses the
    draft's K/V and hidden states (needs the model's own weights and no bypass up to the exit).
    """

    adapter: str = ""
    sha256: str = ""
    layer: int = 0
    kind: str = "linear"
    reuse_kv: bool = False

    def validate(self) -> None:
        if not self.adapter:
            raise LayerskipError("exit.adapter must name the adapter's safetensors file; fix the policy file")
        if self.layer < 0:
            raise LayerskipError("exit.layer must be >= 0; fix the policy file")
        if self.kind not in KINDS:
            raise LayerskipError(f"exit.kind '{self.kind}' is not an adapter kind; use one of {', '.join(KINDS)}")


@dataclass(frozen=True)
class ModelIdentity:
    """The model a policy was made for; an empty field (a hand-written or older file) is not checked."""

    name: str = ""
    architecture: str = ""
    num_layers: int = 0
    fingerprint: str = ""  # parameter names and shapes (adapters.weights_fingerprint)
    weights_sample: str = ""  # a sample of the weights' values: tells a fine-tune of the same shape apart

    @classmethod
    def of(cls, model: nn.Module, name: str = "") -> ModelIdentity:
        return cls(
            name=name or str(getattr(model, "layerskip_name", "")),
            architecture=adapters.architecture_of(model),
            num_layers=adapters.num_layers(model),
            fingerprint=adapters.weights_fingerprint(model),
            weights_sample=adapters.weights_sample_digest(model),
        )


# A policy's optional settings sections, in file order, and the dataclass each is read into.
OPTIONAL_SECTIONS = {"on_the_fly": OnTheFlySettings, "exit": ExitSettings, "auto": AutoSettings}


@dataclass(frozen=True)
class SkipPolicy:
    skip_attention: tuple[int, ...] = ()
    skip_mlp: tuple[int, ...] = ()
    draft: DraftSettings = field(default_factory=DraftSettings)
    model: ModelIdentity = field(default_factory=ModelIdentity)
    provenance: dict[str, Any] = field(default_factory=dict)  # how it was found
    measured: dict[str, Any] = field(default_factory=dict)  # figures measured for it
    # The truncated draft head's rows, most useful first (the search ranks them on its
    # calibration text); the head scores the first ``draft.draft_vocab_size``. Empty: the
    # lowest token ids, which BPE vocabularies assign to their most frequent merges.
    draft_vocabulary: tuple[int, ...] = ()
    # Set: the skip sets above are only the starting point; they change while generating.
    on_the_fly: OnTheFlySettings | None = None
    exit: ExitSettings | None = None
    # Set: lookup or skip draft, lengths, padding and head size are chosen while generating
    # (``auto``); the draft settings above are its caps and the skip set is chosen on the fly.
    auto: AutoSettings | None = None
    # The directory a relative ``exit.adapter`` path is resolved against (the policy file's,
    # set on load; not saved).
    root: str = field(default="", compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "skip_attention", tuple(sorted(set(int(i) for i in self.skip_attention))))
        object.__setattr__(self, "skip_mlp", tuple(sorted(set(int(i) for i in self.skip_mlp))))
        object.__setattr__(self, "draft_vocabulary", tuple(int(i) for i in self.draft_vocabulary))

    # -- constructors -------------------------------------------------------------------
    @classmethod
    def early_exit(cls, num_layers: int, depth: int, **kwargs: Any) -> SkipPolicy:
        """Draft with the first ``depth`` layers only."""
        return cls.skip_layers(list(range(depth, num_layers)), **kwargs)

    @classmethod
    def skip_layers(cls, layers: list[int], **kwargs: Any) -> SkipPolicy:
        return cls(skip_attention=tuple(layers), skip_mlp=tuple(layers), **kwargs)

    def with_model(self, model: nn.Module, name: str = "") -> SkipPolicy:
        """This policy made for ``model``: its identity recorded, and a head size that covers the
        model's whole vocabulary (on-the-fly's device default can) written as 0, the full head it
        means there, so the policy validates as a fixed one."""
        draft = self.draft
        if draft.draft_vocab_size >= adapters.lm_head(model).weight.shape[0]:
            draft = replace(draft, draft_vocab_size=0)
        return replace(self, model=ModelIdentity.of(model, name), draft=draft)

    def with_machine(self, machine: Machine) -> SkipPolicy:
        """The same policy, recording ``machine`` as the one it was tuned on (``provenance["machine"]``)."""
        return replace(self, provenance={**self.provenance, MACHINE_KEY: machine.to_dict()})

    @property
    def tuned_machine(self) -> Machine | None:
        """The machine this policy was tuned on; None where its file records none (older files)."""
        return Machine.from_dict(self.provenance.get(MACHINE_KEY))

    @classmethod
    def adaptive_selection(
        cls, draft: DraftSettings | None = None, device: str | torch.device = "cpu", **kwargs: Any
    ) -> SkipPolicy:
        """On-the-fly selection from nothing bypassed, adaptive draft length (``--policy on-the-fly``).

        Without ``draft``, a CPU draft runs its kept sublayers from an int4 copy and scores an
        8192-row head that grows with the prompt and the text (no study needed for either): on
        the project's CPU a draft from the model's own fp32 weights costs half a step per token,
        so no bypass the selection can find makes it pay. Other devices draft from the model's own
        weights and full head.
        """
        if draft is None:
            cheap = {"precision": "int4", "draft_vocab_size": 8192} if torch.device(device).type == "cpu" else {}
            draft = DraftSettings(max_draft_tokens=6, adaptive=True, **cheap)
        return cls(draft=draft, on_the_fly=OnTheFlySettings(**kwargs), provenance={"source": "on-the-fly"})

    @classmethod
    def auto_choice(cls, device: str | torch.device = "cpu") -> SkipPolicy:
        """``--policy auto``: no study and no file. Prompt lookup (n-grams of 2-3, runs up to 16) or
        the skip draft (up to 10 tokens, its length by cost, its skip set chosen on the fly from
        nothing bypassed), whichever is expected to give more tokens per second at each step,
        with the verify padding and the draft head's size priced by a calibration of this
        machine. On a CPU the draft runs from an int4 copy, or an int8 one where the calibration
        prices it faster on this model (weights int4 rounds badly); elsewhere from the
        model's own weights. Every draft is a chain: token trees cost more verify and drafting time than they
        returned on the CPUs measured (``auto_trees`` turns them on, shaped by the same costs)."""
        precision = "int4" if torch.device(device).type == "cpu" else "model"
        draft = DraftSettings(
            max_draft_tokens=10,
            length_by_cost=True,
            lookup_max_ngram=3,
            lookup_min_ngram=2,
            lookup_max_tokens=16,
            precision=precision,
            tree_nodes=24,
        )
        return cls(draft=draft, on_the_fly=OnTheFlySettings(), auto=AutoSettings(), provenance={"source": "auto"})

    @classmethod
    def auto_trees(cls, device: str | torch.device = "cpu") -> SkipPolicy:
        """``auto`` drafting token trees: up to 4 lookup matches per verify, the skip draft's next
        choice where it hesitates, each branch added only where its expected tokens pay for it."""
        auto = cls.auto_choice(device)
        return replace(auto, draft=replace(auto.draft, tree_matches=4, tree_siblings=1))

    # -- checks -------------------------------------------------------------------------
    def ablations(self) -> dict[str, SkipPolicy]:
        """The same policy with each drafting ingredient it uses turned off, by a short label.

        ``no-lookup``: the skip draft alone; ``lookup-only``: prompt lookup alone; ``full-head``:
        the skip draft scores the whole vocabulary; ``model-precision``: the draft uses the model's
        own weights; ``no-bypass``: the same draft precision and head with nothing bypassed;
        ``chain``: token trees off; ``lookup-branches`` / ``draft-branches``: trees of lookup
        matches only / of the draft's siblings only. Used to show what each ingredient contributes.
        """
        d = self.draft
        variants: dict[str, SkipPolicy] = {}
        if d.lookup_max_ngram and d.use_skip_draft:
            variants["no-lookup"] = replace(self, draft=replace(d, lookup_max_ngram=0))
            variants["lookup-only"] = replace(
                self, skip_attention=(), skip_mlp=(), draft=replace(d, use_skip_draft=False, draft_vocab_size=0)
            )
        if d.draft_vocab_size and d.use_skip_draft:
            variants["full-head"] = replace(self, draft=replace(d, draft_vocab_size=0))
        if d.precision != "model" and d.use_skip_draft:
            variants["model-precision"] = replace(self, draft=replace(d, precision="model"))
        if self.on_the_fly is not None:
            variants["fixed"] = replace(self, on_the_fly=None)  # its starting skip sets, never changed
        if self.exit is not None:
            variants["no-adapter"] = replace(self, exit=None)  # the same depth as a plain early exit
            if self.exit.reuse_kv:
                variants["no-kv-reuse"] = replace(self, exit=replace(self.exit, reuse_kv=False))
        if self.bypasses_anything and d.use_skip_draft and (d.precision != "model" or d.draft_vocab_size):
            # The same cheap draft with nothing bypassed: what skipping itself adds.
            variants["no-bypass"] = replace(self, skip_attention=(), skip_mlp=())
        if d.uses_trees:
            variants["chain"] = self.chain()  # every draft a chain
            if d.tree_matches > 1 and d.tree_siblings and d.use_skip_draft and d.lookup_max_ngram:
                variants["lookup-branches"] = replace(self, draft=replace(d, tree_siblings=0))
                variants["draft-branches"] = replace(self, draft=replace(d, tree_matches=1))
        return variants

    def chain(self) -> SkipPolicy:
        """The same policy with token trees off: one lookup match and no siblings per step."""
        return replace(self, draft=replace(self.draft, tree_matches=1, tree_siblings=0))

    @property
    def bypassed_sublayers(self) -> list[tuple[int, str]]:
        """``(layer, "attention" | "mlp")`` for every bypassed sublayer, attention first."""
        return [(i, "attention") for i in self.skip_attention] + [(i, "mlp") for i in self.skip_mlp]

    @property
    def bypasses_anything(self) -> bool:
        return bool(self.skip_attention or self.skip_mlp)

    def exit_adapter_path(self) -> Path:
        """Where the exit adapter file is (``exit.adapter`` resolved against the policy's directory)."""
        assert self.exit is not None
        path = Path(self.exit.adapter).expanduser()
        return path if path.is_absolute() or not self.root else Path(self.root) / path

    def fraction_bypassed(self, model: nn.Module) -> float:
        """Fraction of the model's parameters in bypassed sublayers (the head and embeddings count)."""
        attn, mlp, total = adapters.sublayer_parameter_counts(model)
        skipped = sum(attn[i] for i in self.skip_attention) + sum(mlp[i] for i in self.skip_mlp)
        return skipped / total

    def describe(self) -> str:
        d = self.draft
        if self.auto is not None:
            return (
                f"auto: prompt lookup (runs up to {d.lookup_max_tokens}) or an {d.precision} skip draft "
                f"(up to {d.max_draft_tokens} tokens, skip set chosen on the fly), chosen each step by measured cost"
            )
        if d.use_skip_draft and self.exit is not None:
            deep = set(range(self.exit.layer + 1, self.model.num_layers or self.exit.layer + 1))
            reuse = ", K/V reused" if self.exit.reuse_kv else ""
            parts = [f"exit after layer {self.exit.layer} through a {self.exit.kind} adapter{reuse}"]
            inside = [i for i in self.skip_attention if i not in deep], [i for i in self.skip_mlp if i not in deep]
            if inside[0] or inside[1]:
                parts.append(f"attn skip {inside[0]}, mlp skip {inside[1]} before it")
        elif d.use_skip_draft:
            parts = [f"attn skip {list(self.skip_attention)}", f"mlp skip {list(self.skip_mlp)}"]
        else:
            parts = ["lookup-only draft"]
        parts.append(f"k<={d.max_draft_tokens} {d.ending}".rstrip())
        if d.draft_vocab_size:
            parts.append(f"draft vocab {d.draft_vocab_size}")
        if d.lookup_max_ngram:
            cut = f", cut below {d.lookup_confidence:g}" if d.lookup_confidence else ""
            parts.append(f"lookup n={d.lookup_min_ngram}..{d.lookup_max_ngram} up to {d.lookup_max_tokens}{cut}")
        if d.min_verify_block:
            parts.append(f"verify padded to {d.min_verify_block}")
        if d.precision != "model" and d.use_skip_draft:
            parts.append(f"draft in {d.precision}")
        if self.on_the_fly is not None:
            parts.append(f"skip sets chosen on the fly (at most {self.on_the_fly.max_fraction:.0%} of sublayers)")
        return ", ".join(parts)

    # -- JSON -----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "skip_attention": list(self.skip_attention),
            "skip_mlp": list(self.skip_mlp),
            "draft": asdict(self.draft),
            "model": asdict(self.model),
            "provenance": self.provenance,
            "measured": self.measured,
            "draft_vocabulary": list(self.draft_vocabulary),
            **{name: asdict(getattr(self, name)) for name in OPTIONAL_SECTIONS if getattr(self, name) is not None},
        }

    @classmethod
    def from_dict(cls, data: Any, source: str = "policy") -> SkipPolicy:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise LayerskipError(f'{source} is not a layerskip policy (missing "format": "{FORMAT}")')
        if data.get("version") != VERSION:
            raise LayerskipError(f"{source} has policy version {data.get('version')!r}; this layerskip reads {VERSION}")
        # A misspelt key would be ignored and its setting silently lost: refused, as inside "draft".
        known = {"format", "version"} | {f.name for f in fields(cls) if f.name != "root"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise LayerskipError(f"{source} has unknown key(s) {unknown}; known keys are {sorted(known)}")
        try:
            draft = _dataclass_from(DraftSettings, data.get("draft", {}))
            model = _dataclass_from(ModelIdentity, data.get("model", {}))
            given = {name: data.get(name) for name in OPTIONAL_SECTIONS}  # absent or null: not used
            sections = {name: _dataclass_from(OPTIONAL_SECTIONS[name], v) for name, v in given.items() if v is not None}
            attention, mlp, vocabulary = (data.get(k, []) for k in ("skip_attention", "skip_mlp", "draft_vocabulary"))
            if not all(isinstance(i, int) and not isinstance(i, bool) for i in [*attention, *mlp, *vocabulary]):
                raise TypeError("skip lists and draft_vocabulary must hold integers")
            negative = [i for i in vocabulary if i < 0]
            if negative:
                raise ValueError(f"draft_vocabulary must hold token ids >= 0, not {few(negative)}")
            policy = cls(
                skip_attention=tuple(attention),
                skip_mlp=tuple(mlp),
                provenance=dict(data.get("provenance", {})),
                measured=dict(data.get("measured", {})),
                draft=draft,
                model=model,
                draft_vocabulary=tuple(vocabulary),
                **sections,
            )
        except (TypeError, ValueError) as exc:
            raise LayerskipError(
                f"{source} has the wrong schema ({exc}); regenerate it with layerskip-search"
            ) from None
        try:
            policy.draft.validate()
            check_vocabulary_ids(policy.draft_vocabulary)
            for section in (getattr(policy, name) for name in OPTIONAL_SECTIONS):
                if section is not None:
                    section.validate()
        except LayerskipError as exc:
            raise LayerskipError(f"{source}: {exc}") from None
        return policy

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the policy as JSON (atomically); a relative exit adapter path is rewritten to stay
        right from the new file's directory."""
        data = self.to_dict()
        if self.exit is not None:
            target = Path(path).expanduser().resolve().parent
            data["exit"]["adapter"] = os.path.relpath(self.exit_adapter_path().resolve(), target)
        return write_json_atomic(path, data)

    @classmethod
    def load(cls, path: str | os.PathLike[str], flag: str = "--policy") -> SkipPolicy:
        """The policy file at ``path``; ``flag`` is the option that named it, for the fix a refusal
        suggests (``--warm-start`` names its own)."""
        path = Path(path)
        # A key given twice is refused: json would keep the last copy and silently lose the other.
        data = load_json(path, "policy file", f"pass an existing policy JSON file to {flag}", unique_keys=True)
        policy = cls.from_dict(data, source=f"policy file {path}")
        return replace(policy, root=str(path.resolve().parent)) if policy.exit is not None else policy


def is_policy_file(path: Path) -> bool:
    """Whether ``path`` holds a layerskip policy (by its format marker; the values may be anything)."""
    data = read_json_file(path)
    return isinstance(data, dict) and data.get("format") == FORMAT


def _dataclass_from(cls: type, data: Any) -> Any:
    if not isinstance(data, dict):
        raise TypeError(f"'{cls.__name__}' must be an object")
    known = {f.name: f for f in fields(cls)}
    unknown = set(data) - set(known)
    if unknown:
        raise TypeError(f"unknown field(s) {sorted(unknown)} in {cls.__name__}")
    for key, value in data.items():
        expected = type(known[key].default)
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            continue
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            raise TypeError(f"{cls.__name__}.{key} must be {expected.__name__}")
    return cls(**data)


def check_vocabulary_ids(vocabulary: tuple[int, ...]) -> None:
    """Each ranked head row once: a repeated id would take a row of the head twice."""
    seen: set[int] = set()
    repeated = []
    for token in vocabulary:
        if token in seen:
            repeated.append(token)
        seen.add(token)
    if repeated:
        raise LayerskipError(
            f"draft_vocabulary repeats token id(s) {few(repeated)}; list each id once (the search writes it "
            "ranked, most useful first)"
        )
